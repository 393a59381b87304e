"""``vocab``: the draft vocabulary (stage build-vocab, eyas/vocab/mapping.py)."""

from __future__ import annotations

from dataclasses import dataclass

NAME = "vocab"


@dataclass(kw_only=True)
class VocabParams:
    draft_vocab_size: int


SCHEMA = VocabParams
RANGES = [("vocab.draft_vocab_size", lambda v: v >= 1, ">= 1")]
