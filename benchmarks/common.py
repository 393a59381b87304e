"""Shared bits of the benchmark scripts (torch/transformers/safetensors only: they run on bare
GPU machines without eyas' pipeline dependencies)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

# the dense bf16 GEMM peak assumed for an H200 in every MFU figure (an 8192^3 bf16 matmul ran at ~760
# TFLOP/s on the lent H200s); the peer's figures use the same constant
PEAK_BF16_TFLOPS = 790.0
RESULTS = Path(__file__).resolve().parent / "results"


def env() -> dict:
    import transformers

    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "python": sys.version.split()[0]}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """(warm-up seconds, timed seconds) of ``fn()`` with a device sync around each call."""
    w, t = [], []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        (w if i < warmup else t).append(time.perf_counter() - t0)
    return w, t


def median(xs):
    return statistics.median(xs)


def write_result(name: str, doc: dict) -> Path:
    doc = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "env": env(), **doc}
    out_dirs = [RESULTS] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    for d in out_dirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(json.dumps(doc, indent=1, default=str))
    return RESULTS / name
