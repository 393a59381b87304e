"""The kernel choices as one explicit object: eyas/drafter/backend.py, read from params.yaml's
``train.backend`` and passed down; nothing in eyas/stages/benchmarks reads or writes an
environment variable for them."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from eyas.drafter.backend import REFERENCE, Backend, BackendError
from eyas.params.full import ParamsError, load_params, parse_params

ROOT = Path(__file__).resolve().parents[2]
FAST = Backend(attention="auto", compile=True, compile_layers=True, triton=True, cuda_graphs=True)


def on(kind: str):
    """An input on a device of ``kind``: the choices read only ``x.device`` (no CUDA needed)."""
    return SimpleNamespace(device=torch.device(kind))


def test_params_yaml_section_is_the_training_backend():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]["backend"]
    got = Backend.of(load_params(ROOT / "params.yaml").train.backend)
    assert isinstance(got, Backend) and dataclasses.asdict(got) == raw
    assert {f.name for f in dataclasses.fields(Backend)} == set(raw)  # every field has its params key
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.attention = "dense"
    with pytest.raises(dataclasses.FrozenInstanceError):  # the schema's choices are frozen too
        load_params(ROOT / "params.yaml").train.backend.attention = "dense"


def test_bad_values_name_the_key():
    with pytest.raises(ParamsError, match=r"'train\.backend\.attention': attention must be one of .*'Flex'"):
        parse_params({"train": {"backend": {**dataclasses.asdict(FAST), "attention": "Flex"}}})
    with pytest.raises(ParamsError, match=r"train\.backend\.atention"):
        parse_params({"train": {"backend": {"atention": "flex"}}})
    with pytest.raises(ParamsError, match=r"'train\.backend\.triton' must be true or false"):
        parse_params({"train": {"backend": {"triton": "no"}}})
    with pytest.raises(BackendError, match="attention must be one of"):
        Backend(attention="sdpa", compile=True, compile_layers=True, triton=True, cuda_graphs=True)


def test_cpu_always_runs_the_reference():
    for b in (FAST, REFERENCE, dataclasses.replace(FAST, attention="flex")):
        assert not b.flex_attention(on("cpu"), 64)
        assert not b.triton_kernels(on("cpu"))
        assert not b.graphs("cpu") and not b.graphs(torch.device("cpu"))


def test_cuda_choices_follow_the_fields():
    cuda = on("cuda")
    assert FAST.flex_attention(cuda, 64) and not FAST.flex_attention(cuda, 8)  # flex needs head_dim >= 16
    assert not dataclasses.replace(FAST, attention="dense").flex_attention(cuda, 64)
    with pytest.raises(BackendError, match="head_dim 8 < 16"):
        dataclasses.replace(FAST, attention="flex").flex_attention(cuda, 8)
    assert FAST.graphs("cuda:0") and FAST.graphs(torch.device("cuda", 1))
    assert not FAST.graphs("cuda", world=2)  # DDP/FSDP hooks are not captured
    assert not dataclasses.replace(FAST, cuda_graphs=False).graphs("cuda")
    assert not dataclasses.replace(FAST, compile=False).graphs("cuda")  # compile off: plain eager torch
    assert not dataclasses.replace(FAST, compile=False).triton_kernels(cuda)
    assert not dataclasses.replace(FAST, triton=False).triton_kernels(cuda)
    assert not REFERENCE.flex_attention(cuda, 64) and not REFERENCE.graphs("cuda")


def test_compile_registry_follows_the_backend():
    from eyas.drafter.compiling import compiled

    def f(x):
        return x + 1

    assert compiled(REFERENCE, "test_piece", f) is f
    assert compiled(dataclasses.replace(FAST, compile_layers=False), "pre", f) is f  # a layer half stays eager
    assert compiled(FAST, "test_piece", f) is not f  # compiled lazily: nothing runs here


def test_no_environment_switches_for_backends():
    """The issue's check: no environment writes in eyas/stages/benchmarks/dev, and no EYAS_* kernel
    switch read anywhere in the code."""
    write = re.compile(r"os\.environ\[.*\]\s*=")
    switch = re.compile(r"EYAS_(ATTN|COMPILE|COMPILE_LAYER|TRITON|CUDA_GRAPHS)\b")
    bad = []
    for d in ("eyas", "stages", "benchmarks", "dev"):
        for f in sorted((ROOT / d).rglob("*")):
            if f.suffix not in (".py", ".sh") or not f.is_file():
                continue
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if write.search(line) or switch.search(line):
                    bad.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_the_schema_and_the_backend_name_the_same_choices():
    """train.backend's schema (eyas/params/train.py KernelChoices) and the Backend built from it
    (eyas/drafter/backend.py) are kept apart so that the schema is a dep of the training stages only;
    they must name the same choices, and Backend.of carries every one across."""
    import dataclasses

    from eyas.drafter import backend
    from eyas.params import train as kernels

    assert [f.name for f in dataclasses.fields(kernels.KernelChoices)] == [
        f.name for f in dataclasses.fields(backend.Backend)]
    assert kernels.ATTENTION == backend.ATTENTION
    choices = kernels.KernelChoices(attention="dense", compile=False, compile_layers=True, triton=False,
                                    cuda_graphs=True)
    b = backend.Backend.of(choices)
    assert dataclasses.asdict(b) == dataclasses.asdict(choices) and backend.Backend.of(b) is b
