"""The one reader of HF config fields (eyas/target/hf_config.py); import cycles: tests/test_import_graph.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig

from eyas.target import hf_config, rope

ROOT = Path(__file__).resolve().parents[2]


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
