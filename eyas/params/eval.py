"""``eval``: acceptance length and the decoding-modes table (stage eval-accept-len, eyas/eval/)."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.params.schema import SEED_MAX, ParamsError, loaded

NAME = "eval"


@dataclass(kw_only=True)
class EvalParams:
    num_draft_tokens: int
    max_new_tokens: int
    chat_prompts: int
    humaneval_prompts: int
    timing_repeats: int  # timed greedy + speculative runs per prompt (eyas.eval.speculative.evaluate_prompts)
    max_prompt_tokens: int  # chat: earliest turns of a longer prompt dropped (eyas.data.distill.fit_prompt); 0 = none
    timed_prompts: int  # prompts per benchmark decoded for real (timed, lossless check); 0 = all
    batch_size: int  # prompts per batched greedy call for the untimed prompts' reference
    # the decoding-modes table (eyas/eval/modes.py): chain vs tree vs sampled on the first served_prompts prompts,
    # by eyas' own loops (no engine serves them: `served_*` names the modes engines serve with)
    served_prompts: int  # prompts per benchmark decoded for the table; 0 = no table
    served_max_new_tokens: int
    temperatures: list[float]  # 0 = greedy
    top_p: float
    seeds: list[int]  # sampled runs per prompt at each temperature > 0
    tree_topk: int  # SGLang --speculative-eagle-topk (its default: 4)
    tree_num_steps: int  # SGLang --speculative-num-steps (tree depth; its default: 5)
    tree_num_draft_tokens: int  # SGLang --speculative-num-draft-tokens (root counted; its default: 8)


SCHEMA = EvalParams
RANGES = [
    ("eval.num_draft_tokens", lambda v: v >= 1, ">= 1"),
    ("eval.max_new_tokens", lambda v: v >= 2, ">= 2 (the first token comes from the prefill, not a verify step)"),
    ("eval.chat_prompts", lambda v: v >= 1, ">= 1"),
    ("eval.humaneval_prompts", lambda v: 1 <= v <= 164, "in [1, 164] (HumanEval has 164 problems)"),
    ("eval.max_prompt_tokens", lambda v: v >= 0, ">= 0 (0 = no prompt budget)"),
    ("eval.timed_prompts", lambda v: v >= 0, ">= 0 (0 = every prompt is decoded for real)"),
    ("eval.batch_size", lambda v: v >= 1, ">= 1"),
    ("eval.timing_repeats", lambda v: v >= 1, ">= 1 (each prompt's greedy and speculative runs are timed this often)"),
    ("eval.served_prompts", lambda v: v >= 0, ">= 0 (0 = no decoding-modes table)"),
    ("eval.served_max_new_tokens", lambda v: v >= 2, ">= 2"),
    ("eval.temperatures", lambda v: len(v) > 0 and len(set(v)) == len(v) and all(t >= 0 for t in v),
     "a non-empty list of distinct numbers >= 0 (0 = greedy; a repeat would decode every prompt twice)"),
    ("eval.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("eval.seeds", lambda v: len(v) > 0 and len(set(v)) == len(v) and all(0 <= s < SEED_MAX for s in v),
     "a non-empty list of distinct integers in [0, 2**63)"),
    ("eval.tree_topk", lambda v: v >= 1, ">= 1"),
    ("eval.tree_num_steps", lambda v: v >= 1, ">= 1"),
]


def check(p, source: str) -> None:
    """The tree's shape; with ``vocab`` loaded too, its top-k within the draft vocabulary.

    Raises:
        ParamsError: ``tree_topk`` > ``vocab.draft_vocab_size``; ``tree_num_draft_tokens`` outside
            what the tree can hold.
    """
    e = p.eval
    if loaded(p, "vocab") and e.tree_topk > p.vocab.draft_vocab_size:
        raise ParamsError(f"{source}: 'eval.tree_topk' ({e.tree_topk}) must be <= 'vocab.draft_vocab_size' "
                          f"({p.vocab.draft_vocab_size}): each tree node expands the drafter's top-k draft tokens")
    most = e.tree_topk + (e.tree_num_steps - 1) * e.tree_topk ** 2
    if not 2 <= e.tree_num_draft_tokens <= most + 1:
        raise ParamsError(f"{source}: 'eval.tree_num_draft_tokens' must be in [2, {most + 1}] (the root and up to "
                          f"tree_topk + (tree_num_steps - 1) * tree_topk**2 candidates), got {e.tree_num_draft_tokens}")
