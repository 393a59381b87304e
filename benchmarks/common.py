"""Shared bits of the benchmark scripts (torch/transformers/safetensors only: they run on bare
GPU machines without eyas' pipeline dependencies). Each script writes its result, with the command,
the device and the library versions, to the file its ``--out`` names."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from eyas.io import write_text

# the dense bf16 GEMM peak assumed for an H200 in every MFU figure (an 8192^3 bf16 matmul ran at ~760
# TFLOP/s on the lent H200s); the peer's figures use the same constant
PEAK_BF16_TFLOPS = 790.0


def env() -> dict:
    import transformers

    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "python": sys.version.split()[0]}


def device_tag() -> str:
    """``h100``/``h200``/... from the GPU's name (the first letter-and-digits word), ``cuda`` when it has
    none, ``cpu`` without a GPU."""
    if not torch.cuda.is_available():
        return "cpu"
    m = re.search(r"\b([A-Z]\d{2,4})\b", torch.cuda.get_device_name())
    return m.group(1).lower() if m else "cuda"


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


def count_host_syncs(fn) -> dict | None:
    """The host-device synchronisations while ``fn()`` runs (None off CUDA): ``explicit``, the calls
    of ``torch.cuda.synchronize`` / ``torch.accelerator.synchronize``, and ``implicit``, the
    operations CUDA's sync debug mode flags (``.item()``, ``.cpu()``, a tensor's truth value, a
    blocking host-to-device copy such as ``torch.tensor(x, device="cuda")``), with the source lines
    (file:line) that made them, most frequent first."""
    if not torch.cuda.is_available():
        return None
    import collections
    import warnings

    sites: collections.Counter = collections.Counter()
    originals = (torch.cuda.synchronize, torch.accelerator.synchronize)

    def counting(f):
        def g(*args, **kwargs):
            caller = sys._getframe(1)
            sites[f"synchronize {Path(caller.f_code.co_filename).name}:{caller.f_lineno}"] += 1
            return f(*args, **kwargs)
        return g

    torch.cuda.synchronize, torch.accelerator.synchronize = (counting(f) for f in originals)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize, torch.accelerator.synchronize = originals
    explicit = sum(sites.values())
    implicit = [w for w in caught if "synchronizing" in str(w.message)]
    for w in implicit:
        sites[f"implicit {Path(w.filename).name}:{w.lineno}"] += 1
    return {"explicit": explicit, "implicit": len(implicit), "sites": dict(sites.most_common(16))}


def median(xs):
    return statistics.median(xs)


def write_result(out: str | Path, doc: dict) -> Path:
    """Write ``doc`` with the command line and :func:`env` to the JSON file ``out`` (its directory
    made if missing), atomically (eyas.io.write_text: a killed run leaves no partial file); returns the
    path written."""
    doc = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "env": env(), **doc}
    out = Path(out)
    write_text(out, json.dumps(doc, indent=1, default=str))
    return out
