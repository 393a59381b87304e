"""eyas' DVC pipelines: which ``dvc.yaml`` files there are, their stages, and their lock files.

- ``dvc.yaml`` (the root): the default DAG, what ``dvc repro`` runs: a drafter trained from scratch,
  served and evaluated.
- ``published/dvc.yaml``: ``stand-in-drafter``, a stand-in for a published drafter.
- ``finetune/dvc.yaml``: ``remap``, ``train-finetune`` and its export and eval: a published drafter
  (``remap.source``) fine-tuned on the same data, to compare with scratch.

DVC runs the stages of a ``dvc.yaml`` in a subdirectory only when they are targeted (``dvc repro
finetune/dvc.yaml``) or upstream of a target: it links stages across files by outputs and deps, so
``remap`` pulls in ``stand-in-drafter`` only when its dep ``${remap.source}`` is ``models/stand_in``.
Each file keeps its lock beside it (``finetune/dvc.lock``). Every stage runs in the repository
root (``wdir: ..`` in the subdirectories), so the paths a stage declares, in its ``dvc.yaml`` and
its lock, are relative to the root; :func:`stages` checks it.
"""

from __future__ import annotations

import json
import os
import posixpath
from pathlib import Path, PurePosixPath

PIPELINES = ("dvc.yaml", "published/dvc.yaml", "finetune/dvc.yaml")
"""Every ``dvc.yaml`` of the repository, the default DAG first, then in the order their stages run."""

LOCKS = tuple(str(PurePosixPath(f).with_suffix(".lock")) for f in PIPELINES)
"""The lock file DVC writes beside each of :data:`PIPELINES`."""


def expand(doc: dict) -> dict[str, dict]:
    """Stage name -> definition of one ``dvc.yaml`` document, in file order, ``foreach`` stages
    expanded (``eval-accept-len@scratch``, ``${item}`` substituted)."""
    out = {}
    for name, st in (doc.get("stages") or {}).items():
        if "foreach" in st:
            for item in st["foreach"]:
                out[f"{name}@{item}"] = json.loads(json.dumps(st["do"]).replace("${item}", str(item)))
        else:
            out[name] = st
    return out


def stages(root: str | Path = ".", files: tuple[str, ...] = PIPELINES) -> dict[str, dict]:
    """Stage name -> definition over every file of ``files`` under ``root`` (one that is not there
    is skipped), in file order, ``foreach`` expanded.

    Raises:
        ValueError: two files define one stage name, or a stage's ``wdir`` is not the root (its
            paths would not be root-relative), naming the file and the stage.
    """
    import yaml

    out: dict[str, dict] = {}
    for f in files:
        path = Path(root) / f
        if not path.is_file():
            continue
        for name, st in expand(yaml.safe_load(path.read_text()) or {}).items():
            wdir = posixpath.normpath(posixpath.join(posixpath.dirname(f), st.get("wdir", ".")))
            if wdir != ".":
                raise ValueError(f"{f}: stage {name!r} runs in {wdir}, not in the repository root (wdir)")
            if name in out:
                raise ValueError(f"{f}: stage {name!r} is defined twice (DVC addresses it by file; eyas by name)")
            out[name] = st
    return out


def running_stage() -> str | None:
    """The stage DVC is running, by name (``$DVC_STAGE`` without its file), or None outside DVC.

    DVC addresses a stage of a ``dvc.yaml`` in a subdirectory with the file (``DVC_STAGE`` is
    ``finetune/dvc.yaml:remap``; ``dvc/stage/__init__.py``, ``PipelineStage.addressing``); eyas names
    a stage by its name alone (one name per stage over :data:`PIPELINES`), in MLflow tags too.
    """
    env = os.environ.get("DVC_STAGE")
    return env.rpartition(":")[2] if env else None
