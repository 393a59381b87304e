"""``extract``: the target's aux hidden states captured into feature shards (stage extract,
eyas/features.py)."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.params.schema import FLOAT_DTYPES

NAME = "extract"

# feature storage adds fp8: aux hidden states in e4m3 with per-token, per-layer scales (eyas/features.py)
STORAGE_DTYPES = FLOAT_DTYPES + ("float8_e4m3fn",)


@dataclass(kw_only=True)
class ExtractParams:
    max_length: int
    aux_layers: list[int] | None
    dtype: str
    batch_size: int
    shard_samples: int


SCHEMA = ExtractParams
RANGES = [
    ("extract.max_length", lambda v: v >= 8, ">= 8"),
    ("extract.dtype", lambda v: v in STORAGE_DTYPES,
     f"one of {STORAGE_DTYPES} (hidden states are stored in it; float8_e4m3fn: aux states in fp8 with "
     f"per-token scales, final state bfloat16)"),
    ("extract.batch_size", lambda v: v >= 1, ">= 1"),
    ("extract.shard_samples", lambda v: v >= 1, ">= 1"),
    ("extract.aux_layers", lambda v: v is None or (len(v) > 0 and min(v) >= 1 and v == sorted(set(v))),
     "null or HF hidden_states indices >= 1, unique and ascending"),
]
