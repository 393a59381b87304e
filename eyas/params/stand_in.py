"""``stand_in``: the stand-in for a published drafter (stage stand-in-drafter, published/dvc.yaml)."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.params.schema import EPOCHS_RANGE, MAX_EPOCHS

NAME = "stand_in"


@dataclass(kw_only=True)
class StandInParams:
    draft_vocab_size: int
    order: str
    lr: float
    epochs: int


SCHEMA = StandInParams
RANGES = [
    ("stand_in.draft_vocab_size", lambda v: v >= 1, ">= 1"),
    ("stand_in.order", lambda v: v in ("target_id", "frequency"), "'target_id' or 'frequency'"),
    ("stand_in.lr", lambda v: 0 < v < 1, "in (0, 1)"),
    ("stand_in.epochs", lambda v: 1 <= v <= MAX_EPOCHS, EPOCHS_RANGE),
]
