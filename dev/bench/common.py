"""The lab's result files: a benchmark run here writes ``dev/results/<name>`` and, on a GPU machine
whose recipe sets ``OUT`` (dev/gpu/device.sh), a copy under ``$OUT``, the folder that comes back."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks import common

RESULTS = Path(__file__).resolve().parents[1] / "results"


def write_result(name: str, doc: dict) -> Path:
    """:func:`benchmarks.common.write_result` to ``dev/results/<name>`` (and ``$OUT/<name>`` when
    ``OUT`` is set); returns the path under dev/results."""
    for d in [RESULTS] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
        common.write_result(d / name, doc)
    return RESULTS / name
