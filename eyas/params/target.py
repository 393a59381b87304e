"""``target``: the target model a drafter is trained for (eyas/target/model.py loads it)."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.params.schema import FLOAT_DTYPES, ParamsError, null_or_nonempty

NAME = "target"


@dataclass(kw_only=True)
class TargetParams:
    path: str
    gguf_file: str | None
    revision: str | None  # hub ids: the commit (or tag) to load; pins the target for DVC
    trust_remote_code: bool
    dtype: str


SCHEMA = TargetParams
RANGES = [
    ("target.path", lambda v: v.strip() != "", "a non-empty string ('embedded', a local HF directory or a hub id "
                                                "org/name)"),
    ("target.gguf_file", null_or_nonempty, "null or a non-empty file name"),
    ("target.revision", null_or_nonempty, "null (the hub's main) or a non-empty commit sha, branch or tag"),
    ("target.dtype", lambda v: v in FLOAT_DTYPES, f"one of {FLOAT_DTYPES}"),
]


def check(p, source: str) -> None:
    """Checks across the keys of ``target``.

    Raises:
        ParamsError: ``gguf_file`` set with the embedded target (which names its own GGUF file).
    """
    if p.target.path == "embedded" and p.target.gguf_file is not None:
        raise ParamsError(f"{source}: 'target.gguf_file' must be null when 'target.path' is 'embedded' (the "
                          f"embedded target names its own GGUF file), got {p.target.gguf_file!r}")
