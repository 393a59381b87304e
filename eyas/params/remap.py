"""``remap``: a published drafter's lm_head moved onto the new vocab (stage remap, eyas/vocab/remap.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eyas.params.schema import ParamsError

NAME = "remap"

STAND_IN = "models/stand_in"
"""What published/dvc.yaml's stand-in-drafter writes: the one ``remap.source`` that need not exist yet
(DVC runs the stand-in before remap). Any other ``remap.source`` must be a directory already, relative
to the repository root, where the stages run."""


@dataclass(kw_only=True)
class RemapParams:
    source: str  # a local drafter directory: a dependency DVC hashes (finetune/dvc.yaml)
    min_shared_fraction: float


SCHEMA = RemapParams
RANGES = [("remap.min_shared_fraction", lambda v: 0 <= v <= 1, "in [0, 1]")]


def check(p, source: str) -> None:
    """``remap.source`` names a directory (or the stand-in's, made later).

    Raises:
        ParamsError: no such directory, with how to fetch a hub drafter instead.
    """
    src = p.remap.source
    if not (src == STAND_IN or (src.strip() and Path(src).is_dir())):
        raise ParamsError(
            f"{source}: 'remap.source' must be a local drafter directory (finetune/dvc.yaml's remap depends on it: "
            f"DVC hashes it and reruns remap when it changes) or {STAND_IN!r} (the stand-in, published/dvc.yaml), "
            f"got {src!r}: no such directory. A drafter on the Hugging Face Hub is not a path DVC can hash: "
            f"download it first, `hf download ORG/NAME --revision <commit sha> --local-dir models/published` "
            f"(and `dvc add models/published`, so DVC keeps it and queued experiments see it), then set "
            f"'remap.source: models/published'")
