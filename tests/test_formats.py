"""The checkpoint-format package: one reader of HF config fields, and no import cycle in eyas."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig

from eyas.pipeline import stage_deps
from eyas.target import hf_config, rope

ROOT = Path(__file__).resolve().parents[1]


def _module(f: Path) -> str:
    name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def test_eyas_imports_have_no_cycle():
    """Every import (top level or inside a function) between eyas modules, as eyas/pipeline/stage_deps.py
    reads them: the graph is acyclic (it held eyas.export <-> eyas.speculators_format and
    eyas.drafter.model -> eyas.drafter.head_loss -> eyas.drafter.model)."""
    files = {_module(f): f for f in (ROOT / "eyas").rglob("*.py")}
    graph = {m: {d for d in stage_deps._imported_modules(f, m) if d in files and d != m} for m, f in files.items()}
    assert {"eyas.export.eagle", "eyas.export.speculators", "eyas.export.load", "eyas.target.hf_config"} <= set(graph)
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, "import cycle: " + " -> ".join(path[path.index(d):] + [d])
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_head_dim_and_kv_heads_from_dicts_and_transformers_configs():
    assert hf_config.head_dim({"hidden_size": 4096, "num_attention_heads": 32}) == 128
    assert hf_config.head_dim({"hidden_size": 2560, "num_attention_heads": 32, "head_dim": 128}) == 128
    assert hf_config.head_dim({"hidden_size": 64, "num_attention_heads": 4, "head_dim": None}) == 16
    assert hf_config.num_key_value_heads({"num_attention_heads": 32}) == 32
    assert hf_config.num_key_value_heads({"num_attention_heads": 32, "num_key_value_heads": 8}) == 8
    c = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    assert (hf_config.head_dim(c), hf_config.num_key_value_heads(c)) == (16, 2)
    with pytest.raises(KeyError, match="num_attention_heads"):
        hf_config.head_dim({"hidden_size": 64})


def test_rope_theta_precedence():
    assert hf_config.rope_theta({}) == 10000.0  # LlamaConfig's default
    assert hf_config.rope_theta({"rope_theta": 5e5}) == 5e5
    assert hf_config.rope_theta({"rope_scaling": {"rope_type": "llama3", "rope_theta": 2e5}}) == 2e5
    v5 = {"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert hf_config.rope_theta(v5) == 1e6
    c = LlamaConfig(rope_theta=250000.0)
    assert hf_config.rope_theta(c) == 250000.0  # transformers 4: rope_theta; 5: rope_parameters
    # eyas/target/rope.py's normal form takes its base from the same reader
    assert rope.normalise({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == (1e6, None)
