"""``data``: the conversation source and its splits (stage prepare-data, eyas/data/)."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.params.schema import ParamsError

NAME = "data"


@dataclass(kw_only=True)
class DataParams:
    source: str
    max_conversations: int
    val: int
    test: int
    publish: int
    on_bad_line: str
    code_prompts: int  # code conversations added to train + val (eyas.data.code); 0 = off
    code_packages: list[str]  # the pinned packages they come from (import names of eyas.data.code.PACKAGES)


SCHEMA = DataParams
RANGES = [
    ("data.source", lambda v: v.strip() != "", "a non-empty string"),
    ("data.max_conversations", lambda v: v >= 0, ">= 0 (0 = all)"),
    ("data.val", lambda v: v >= 1, ">= 1 (val features drive the step-0 gate and val metrics)"),
    ("data.test", lambda v: v >= 1, ">= 1 (eval prompts come from it)"),
    ("data.publish", lambda v: v >= 1, ">= 1 (the stand-in drafter trains on it)"),
    ("data.on_bad_line", lambda v: v in ("error", "skip"), "'error' or 'skip'"),
    ("data.code_prompts", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("data.code_packages", lambda v: len(v) > 0 and len(set(v)) == len(v),
     "a non-empty list of distinct import names (prepare-data checks them against eyas/data/code.py PACKAGES)"),
]


def check(p, source: str) -> None:
    """Checks across the keys of ``data``.

    Raises:
        ParamsError: the held-out splits leave no conversation to train on.
    """
    data = p.data
    held_out = data.val + data.test + data.publish
    if data.max_conversations and held_out >= data.max_conversations:
        raise ParamsError(f"{source}: 'data.max_conversations' ({data.max_conversations}) must be > 'data.val' + "
                          f"'data.test' + 'data.publish' ({data.val} + {data.test} + {data.publish} = {held_out}): "
                          f"no conversation would be left to train on")
