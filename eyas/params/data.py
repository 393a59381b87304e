"""``data``: the conversation source and its splits (stage prepare-data, eyas/data/)."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.params.schema import SEED_MAX, ParamsError, loaded

NAME = "data"


@dataclass(kw_only=True)
class SynthParams:
    """``data.synth``: prompts the target writes itself (eyas.data.synth, stage synthesize-prompts)."""
    prompts: int  # conversations synthesized (as many as survive the filters); 0 = off
    mode: str  # 'add': joined to the source's train + val; 'only': train + val are synthesized alone
    seed: int
    temperature: float  # sampling of the user turns
    top_p: float
    min_prompt_tokens: int  # a shorter user turn is dropped
    max_prompt_tokens: int  # a user turn's budget: one without its end-of-turn token by then is dropped
    turns: int  # user turns per conversation (the target answers in between, greedy)
    system_prompts: list[str]  # drawn per chat conversation; "" = none (the template's default)
    code_system_prompts: list[str]  # drawn per code conversation
    code_share: float  # share of conversations drawn as code
    topics: list[str]  # when set, one per conversation ends its system prompt (eyas.data.synth.TOPIC_SENTENCE)
    near_dup: float  # word-3-gram Jaccard at which a prompt is a near-duplicate of a kept one
    overlap: float  # share of word 3-grams from one eval prompt at which a prompt is dropped
    min_ascii_letters: float  # language filter: the least share of a prompt's letters that are ASCII
    max_rounds: int  # generation rounds before the stage gives up


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
    synth: SynthParams  # prompts the target writes itself (stage synthesize-prompts); prompts 0 = off


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
    ("data.synth.prompts", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("data.synth.mode", lambda v: v in ("add", "only"),
     "'add' (joined to the source's train + val) or 'only' (train + val are synthesized alone)"),
    ("data.synth.seed", lambda v: 0 <= v < SEED_MAX, "in [0, 2**63)"),
    ("data.synth.temperature", lambda v: 0 < v <= 10,
     "in (0, 10] (prompts are sampled: greedy decoding writes one prompt per system prompt)"),
    ("data.synth.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("data.synth.min_prompt_tokens", lambda v: v >= 1, ">= 1"),
    ("data.synth.max_prompt_tokens", lambda v: v >= 1, ">= 1"),
    ("data.synth.turns", lambda v: v >= 1, ">= 1"),
    ("data.synth.system_prompts", lambda v: len(v) > 0 and len(set(v)) == len(v),
     "a non-empty list of distinct strings (\"\" = no system turn: the template's default)"),
    ("data.synth.code_system_prompts", lambda v: len(set(v)) == len(v) and all(x.strip() for x in v),
     "a list of distinct non-empty strings"),
    ("data.synth.code_share", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("data.synth.topics", lambda v: len(set(v)) == len(v) and all(x.strip() for x in v),
     "a list of distinct non-empty strings ([] = none)"),
    ("data.synth.near_dup", lambda v: 0 < v <= 1, "in (0, 1] (word-3-gram Jaccard; 1 = exact duplicates only)"),
    ("data.synth.overlap", lambda v: 0 < v <= 1, "in (0, 1] (share of word 3-grams from one eval prompt)"),
    ("data.synth.min_ascii_letters", lambda v: 0 <= v <= 1, "in [0, 1] (0 = no language filter)"),
    ("data.synth.max_rounds", lambda v: v >= 1, ">= 1"),
]


def check(p, source: str) -> None:
    """Checks across the keys of ``data`` (and :func:`check_synth`).

    Raises:
        ParamsError: the held-out splits leave no conversation to train on.
    """
    data = p.data
    held_out = data.val + data.test + data.publish
    if data.max_conversations and held_out >= data.max_conversations:
        raise ParamsError(f"{source}: 'data.max_conversations' ({data.max_conversations}) must be > 'data.val' + "
                          f"'data.test' + 'data.publish' ({data.val} + {data.test} + {data.publish} = {held_out}): "
                          f"no conversation would be left to train on")
    check_synth(p, source)


def check_synth(p, source: str) -> None:
    """``data.synth``'s checks across keys, only when it is on; with ``distill`` loaded too, that
    self-distill writes the replies of train and val.

    Raises:
        ParamsError: naming the keys (``data.synth.min_prompt_tokens`` > ``max_prompt_tokens``, code
            shares without code system prompts, ``mode: only`` with no more prompts than ``data.val``,
            self-distill off or not regenerating train and val).
    """
    s, data = p.data.synth, p.data
    if not s.prompts:
        return
    if s.min_prompt_tokens > s.max_prompt_tokens:
        raise ParamsError(f"{source}: 'data.synth.min_prompt_tokens' ({s.min_prompt_tokens}) must be <= "
                          f"'data.synth.max_prompt_tokens' ({s.max_prompt_tokens})")
    if s.code_share > 0 and not s.code_system_prompts:
        raise ParamsError(f"{source}: 'data.synth.code_system_prompts' must not be empty when "
                          f"'data.synth.code_share' ({s.code_share}) > 0")
    if s.mode == "only" and s.prompts <= data.val:
        raise ParamsError(f"{source}: 'data.synth.prompts' ({s.prompts}) must be > 'data.val' ({data.val}) with "
                          f"'data.synth.mode' only: val takes the first data.val of them, train the rest")
    if loaded(p, "distill"):
        d = p.distill
        if not d.enabled or not {"train", "val"} <= set(d.splits):
            raise ParamsError(f"{source}: 'data.synth.prompts' ({s.prompts}) > 0 needs 'distill.enabled' true and "
                              f"'distill.splits' holding train and val (now {d.enabled}, {d.splits}): synthesized "
                              f"conversations have no replies until self-distill writes them")
