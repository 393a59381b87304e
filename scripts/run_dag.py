"""Run dvc.yaml's stage commands in DAG order without DVC: for a machine where DVC is not
installed (a GPU machine without a package registry). Nothing is cached or locked: the stage
scripts read params.yaml and write their outputs and metrics exactly as under ``dvc repro``.

dvc.yaml lists its stages in an order where every stage comes after the stages whose outputs it
reads; this script runs them in that order (``foreach`` stages once per item, ``${item}``
substituted), optionally only some of them:

    python scripts/run_dag.py                      # every stage
    python scripts/run_dag.py self-distill extract # these, in DAG order
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml


def stage_commands(dvc_yaml: Path = Path("dvc.yaml")) -> list[tuple[str, str]]:
    """``[(stage name, command)]`` in file order; ``foreach`` stages expand to ``name@item``."""
    out = []
    for name, st in yaml.safe_load(dvc_yaml.read_text())["stages"].items():
        if "foreach" in st:
            for item in st["foreach"]:
                out.append((f"{name}@{item}", st["do"]["cmd"].replace("${item}", str(item))))
        else:
            out.append((name, st["cmd"]))
    return out


def main(argv: list[str]) -> int:
    stages = stage_commands()
    names = {n for n, _ in stages} | {n.split("@")[0] for n, _ in stages}
    unknown = sorted(set(argv) - names)
    if unknown:
        sys.stderr.write(f"run_dag: unknown stage(s) {unknown}; dvc.yaml has {[n for n, _ in stages]}\n")
        return 2
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
