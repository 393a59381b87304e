"""Run the pipelines' stage commands in DAG order without DVC: for a machine where DVC is not
installed (a GPU machine without a package registry). Nothing is cached or locked: the stage
scripts read params.yaml and write their outputs and metrics exactly as under ``dvc repro``.

The pipeline files (eyas.pipeline.dvcfiles.PIPELINES: dvc.yaml, then published/dvc.yaml and
finetune/dvc.yaml) list their stages in an order where every stage comes after the stages whose
outputs it reads; this script runs them in that order (``foreach`` stages once per item,
``${item}`` substituted), from the repository root:

    python scripts/run_dag.py                      # dvc.yaml's stages: what `dvc repro` runs
    python scripts/run_dag.py self-distill extract # these, in DAG order (any pipeline file's)
    python scripts/run_dag.py stand-in-drafter remap train-finetune   # the fine-tune comparison's
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # eyas from this checkout, installed or not
from eyas.pipeline import dvcfiles  # noqa: E402


def stage_commands(files: tuple[str, ...] = dvcfiles.PIPELINES) -> list[tuple[str, str]]:
    """``[(stage name, command)]`` of ``files`` (under the working directory) in file order;
    ``foreach`` stages expand to ``name@item``."""
    return [(name, st["cmd"]) for name, st in dvcfiles.stages(".", files).items()]


def main(argv: list[str]) -> int:
    stages = stage_commands()
    names = {n for n, _ in stages} | {n.split("@")[0] for n, _ in stages}
    unknown = sorted(set(argv) - names)
    if unknown:
        sys.stderr.write(f"run_dag: unknown stage(s) {unknown}; the pipeline files have {[n for n, _ in stages]}\n")
        return 2
    if not argv:
        stages = stage_commands(dvcfiles.PIPELINES[:1])
    for name, cmd in stages:
        if argv and name not in argv and name.split("@")[0] not in argv:
            continue
        t0 = time.time()
        print(f"=== {name}: {cmd}", flush=True)
        rc = subprocess.call([sys.executable if a == "python" else a for a in shlex.split(cmd)])
        print(f"=== {name}: exit {rc}, {time.time() - t0:.0f} s", flush=True)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
