"""``train_finetune``: the fine-tune of a remapped published drafter (stage train-finetune, with the
step-0 gate of eyas/training/loop.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from eyas.params.schema import ParamsError, loaded

NAME = "train_finetune"


@dataclass(kw_only=True)
class TrainFinetuneParams:
    lr: float  # the fine-tune's learning rate (the scratch drafter's is the top-level ``lr``)
    gate_margin: float
    gate_min_acc: float
    gate_override: bool


SCHEMA = TrainFinetuneParams
RANGES = [
    ("train_finetune.lr", lambda v: 0 < v < 1, "in (0, 1)"),
    ("train_finetune.gate_margin", lambda v: v >= 0, ">= 0 (a negative margin would not flag a loss above chance)"),
    ("train_finetune.gate_min_acc", lambda v: 0 <= v < 1, "in [0, 1) (a floor of 1 refuses every drafter)"),
]


def check(p, source: str) -> None:
    """With ``vocab`` loaded too: the gate's margin below chance level's loss.

    Raises:
        ParamsError: ``gate_margin`` >= ln(draft_vocab_size).
    """
    if not loaded(p, "vocab"):
        return
    f, v = p.train_finetune, p.vocab.draft_vocab_size
    if v >= 2 and f.gate_margin >= math.log(v):
        raise ParamsError(f"{source}: 'train_finetune.gate_margin' ({f.gate_margin}) must be < "
                          f"ln('vocab.draft_vocab_size') = ln({v}) = {math.log(v):.3f}: a margin past chance flags "
                          f"every drafter")
