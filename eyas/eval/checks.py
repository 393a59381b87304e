"""Checks on a speculative-decoding evaluation that say when its numbers are not a result.

- :func:`position_check`: the run decodes past the drafter's ``max_position_embeddings``. The
  engines build the drafter's rotary table for that many positions (SGLang ``models/llama.py``,
  vLLM ``model_executor/models/llama.py``: ``get_rope(max_position=...)``); eyas' RoPE computes
  any position, so past the limit eyas measures a drafter the engines would not serve as is.
- :func:`misconfiguration`: whether low acceptance is a broken setup (aux hidden-state capture
  off, a zeroed or wrong d2t, the wrong algorithm name in the engine) or a drafter that learned
  little. With the drafter's own training figures (:func:`training_figures`) it tells them apart:
  a setup fault accepts position 0 far less often than the drafter's validation accuracy there, a
  weak drafter accepts it about as rarely as it validated. Without them, an acceptance length at or
  below 1.1 tokens per verify step (or a position-0 acceptance rate below 2%) is flagged, not
  reported as a drafter's quality.
- :func:`serving_verdict`: whether the drafter is worth serving at all: it must commit more tokens
  per verify step than prompt lookup, the training-free n-gram floor the engines ship, and decode
  faster than plain greedy on the device that measured it; :func:`sampled_verdict` makes the same
  comparison at each sampling temperature of the decoding-modes table, where users serve.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import NormalDist

SUSPECT_ACCEPT_LEN = 1.1
SUSPECT_POSITION0_RATE = 0.02
# the eval's position-0 rate, at its 95% upper bound, must reach this fraction of the drafter's
# validation acc_0 to be consistent with it (misconfiguration's docstring says why)
CONSISTENT_FRACTION = 0.5
CONFIDENCE = 0.95


def position_check(prompt_lengths: list[int], max_new_tokens: int, num_draft_tokens: int,
                   max_position_embeddings: int) -> dict:
    """The positions a run may reach against the drafter's limit.

    Args:
        prompt_lengths: tokens per prompt.
        max_new_tokens: the reply budget (tokens).
        num_draft_tokens: k; the drafter runs up to k positions past the last committed token.
        max_position_embeddings: the drafter's config value.
    Returns:
        ``{"max_position_embeddings", "max_position_reached"`` (0-based: longest prompt +
        max_new_tokens + k - 1), ``"prompts_past_limit"`` (how many prompts can pass it),
        ``"ok"`` (bool), ``"warning"`` (str or None)}.
    """
    reach = [n + max_new_tokens + num_draft_tokens - 1 for n in prompt_lengths]
    past = sum(r >= max_position_embeddings for r in reach)
    top = max(reach) if reach else 0
    warning = None
    if past:
        warning = (f"{past} of {len(reach)} prompts can decode up to position {top}, past the drafter's "
                   f"max_position_embeddings {max_position_embeddings} (positions 0..{max_position_embeddings - 1}): "
                   f"SGLang and vLLM size the drafter's rotary table by it, so these acceptance lengths are not "
                   f"what they would serve")
    return {"max_position_embeddings": max_position_embeddings, "max_position_reached": top,
            "prompts_past_limit": past, "ok": not past, "warning": warning}


def training_figures(metrics: dict, source: str | Path) -> dict | None:
    """The drafter's own validation figures, from the metrics its training stage wrote.

    Args:
        metrics: the content of ``metrics/train_<drafter>.json`` (stages/training.py
            ``finish_training``): ``val.acc_0`` (fraction of held-out reply tokens whose position-0
            draft, teacher-forced, is the target's token) and ``train_tokens`` (tokens trained on).
        source: the file's path, for messages.
    Returns:
        ``{"acc_0": float, "train_tokens": int}``, or None when the training measured no
        position-0 validation accuracy (no val split: ``val`` empty, or ``acc_0`` null or NaN).
    Raises:
        ValueError: ``val`` not an object, ``val.acc_0`` not a fraction in [0, 1], or
            ``train_tokens`` not a whole number >= 0 (the file and the key named).
    """
    val = metrics.get("val")
    if not isinstance(val, dict):
        raise ValueError(f"{source}: 'val' is {val!r}, not an object of validation metrics")
    acc, tokens = val.get("acc_0"), metrics.get("train_tokens")
    if acc is None or (isinstance(acc, float) and math.isnan(acc)):  # nothing validated
        return None
    if _finite(acc) is None or not 0 <= acc <= 1:
        raise ValueError(f"{source}: 'val.acc_0' is {acc!r}, not a fraction in [0, 1]")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ValueError(f"{source}: 'train_tokens' is {tokens!r}, not a whole number >= 0")
    return {"acc_0": float(acc), "train_tokens": tokens}


def misconfiguration(result: dict, trained: dict | None = None) -> dict:
    """Whether one benchmark's result looks like a misconfigured setup rather than a weak drafter.

    Without ``trained`` (a published or imported drafter, no training metrics): suspected when
    ``accept_len`` <= 1.1 or the position-0 acceptance rate < 0.02, what a broken setup gives, but
    also a drafter that learned nothing for these prompts; the check cannot tell them apart.

    With ``trained``, the eval's position-0 acceptance rate is held to the drafter's own validation
    accuracy at position 0. Both count the same event: the first draft token after a prefix the
    target wrote is the target's next token (teacher-forced in validation, at each verify step in
    the eval), so a drafter decoded as it was trained accepts position 0 about as often as it
    validated, less what the eval's other prompts (the held-out chat test, HumanEval) cost it. A
    setup fault (aux hidden states not captured or from other layers, a wrong d2t, another
    speculative algorithm, another embedding) feeds it inputs it was never trained on and drops
    position 0 towards chance, a factor of several below. The tolerance sits between the two: the
    rate is consistent when its Wilson upper bound at 95% (:func:`wilson_upper`, sound for few trials
    and rates near 0) reaches half of ``acc_0``. The bound,
    not the rate itself, because a small eval (a quick trial's few dozen verify steps) measures the
    rate too roughly to call a fault on.

    - far below (bound < half of ``acc_0``): suspected, the reason naming both figures;
    - consistent, and acceptance low by the thresholds above: not suspected; ``note`` says the
      drafter learned little (both figures, and: train on more data);
    - consistent and not low: nothing to say.

    Args:
        result: a benchmark dict of ``metrics/eval_<drafter>.json`` (``accept_len``: committed
            tokens per verify step, bonus included; ``per_position_accept_rate``: [k] fractions of
            verify steps; ``num_verify_steps``: their count).
        trained: :func:`training_figures` of the drafter (``acc_0``, ``train_tokens``), or None.
    Returns:
        ``{"suspected": bool, "reasons": [str], "note": str or None, "trained": trained}``. A figure
        that is missing or NaN (``accept_len``, the position-0 rate) is unknown: no check on it.
    Raises:
        ValueError: the position-0 rate outside [0, 1], or ``num_verify_steps`` not a whole
            number >= 0 (the key and its value named).
    """
    reasons = []
    a = _finite(result.get("accept_len"))
    if a is not None and a <= SUSPECT_ACCEPT_LEN:
        reasons.append(f"accept_len {a:.3f} <= {SUSPECT_ACCEPT_LEN}: typical of aux hidden-state capture off, a "
                       f"wrong/zeroed d2t or the wrong speculative algorithm (or of a drafter that learned nothing for "
                       f"these prompts)")
    rates = result.get("per_position_accept_rate") or [None]
    rate, steps = _finite(rates[0]), result.get("num_verify_steps") or 0
    if rate is not None and not 0 <= rate <= 1:
        raise ValueError(f"per_position_accept_rate[0] is {rates[0]!r}, not a fraction of verify steps in [0, 1]")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"num_verify_steps is {steps!r}, not a whole number >= 0")
    if rate is not None and rate < SUSPECT_POSITION0_RATE:
        reasons.append(f"position-0 acceptance rate {rate:.3f} < {SUSPECT_POSITION0_RATE}: the first draft "
                       f"token is almost never the target's")
    if trained is None or rate is None or not steps:  # nothing measured to compare with
        return {"suspected": bool(reasons), "reasons": reasons, "note": None, "trained": trained}
    acc, tokens = trained["acc_0"], trained["train_tokens"]
    upper = wilson_upper(round(rate * steps), steps, CONFIDENCE)
    measured = (f"the eval's position-0 acceptance {rate:.3f} over {steps} verify steps (at most {upper:.3f} at 95% "
                f"confidence{'' if a is None else f'; accept_len {a:.3f}'})")
    if upper < CONSISTENT_FRACTION * acc:
        return {"suspected": True, "note": None, "trained": trained, "reasons": [
            f"training reached {acc:.3f} at position 0 (validation, after {tokens:,} training tokens) but {measured} "
            f"is under half of it: the drafter is not decoded as it was trained: check aux hidden-state capture (the "
            f"drafter's aux layers), the d2t and the speculative algorithm (or these prompts are far from its "
            f"training data)"]}
    note = None
    if reasons:
        note = (f"the drafter learned little: its own validation accuracy at position 0 was {acc:.3f} after "
                f"{tokens:,} training tokens, and {measured} is consistent with it: a weak drafter, not a setup "
                f"fault (train on more data)")
    return {"suspected": False, "reasons": [], "note": note, "trained": trained}


def wilson_upper(successes: int, trials: int, confidence: float) -> float:
    """The upper end of the Wilson score interval of a binomial proportion (Wilson 1927, "Probable
    inference, the law of succession, and statistical inference", JASA 22: the interval scipy's
    ``binomtest(...).proportion_ci(method="wilson")`` gives) at two-sided ``confidence``.

    Raises:
        ValueError: ``trials`` < 1, ``successes`` outside 0..trials, or ``confidence`` outside (0, 1).
    """
    if trials < 1 or not 0 <= successes <= trials or not 0 < confidence < 1:
        raise ValueError(f"wilson_upper: {successes} of {trials} at confidence {confidence}")
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p, zz = successes / trials, z * z / trials
    return min(1.0, (p + zz / 2 + z * math.sqrt(p * (1 - p) / trials + zz / (4 * trials))) / (1 + zz))


def serving_verdict(result: dict, ngram: dict) -> dict:
    """Whether a drafter is worth serving on one benchmark, as a team choosing a proposer decides.

    Prompt lookup (the n-gram floor) needs no training and costs next to nothing per step; the
    engines ship it (vLLM ``--speculative-config '{"method": "ngram"}'``,
    ``vllm-project/vllm: vllm/v1/spec_decode/ngram_proposer.py``; SGLang
    ``--speculative-algorithm NGRAM``). A drafter that accepts no more tokens per verify step than
    it does, or that decodes slower than plain greedy, is not worth its training or its serving.

    Args:
        result: the drafter's benchmark dict of ``metrics/eval_<drafter>.json`` (``accept_len``:
            committed tokens per verify step, bonus included; ``speedup``: median over the timed
            prompts of greedy seconds / speculative seconds, or None).
        ngram: the n-gram floor's dict for the same prompts and k (``accept_len``).
    Returns:
        ``{"beats_ngram_floor", "faster_than_greedy", "worth_serving"}`` (bool, or None where a
        figure is missing or not finite; ``worth_serving`` is False when either is False, True
        when both are True, else None),
        ``"accept_len_over_ngram"`` (drafter minus floor, tokens per verify step, or None) and
        ``"reasons"`` ([str]: why it is not worth serving).
    """
    a, floor, speedup = (_finite(result.get("accept_len")), _finite(ngram.get("accept_len")),
                         _finite(result.get("speedup")))
    beats = None if a is None or floor is None else a > floor
    faster = None if speedup is None else speedup > 1.0
    reasons = []
    if beats is False:
        reasons.append(f"accept_len {a:.3f} <= the n-gram floor's {floor:.3f} (prompt lookup, no training): "
                       f"serve prompt lookup instead, or train on more data")
    if faster is False:
        reasons.append(f"median speedup {speedup:.3f} <= 1: slower than plain greedy decoding on this device")
    # one failed test settles it; unknown only while no test failed and one could not be made
    worth = False if False in (beats, faster) else None if None in (beats, faster) else True
    return {"beats_ngram_floor": beats, "faster_than_greedy": faster, "worth_serving": worth,
            "accept_len_over_ngram": None if beats is None else round(a - floor, 4), "reasons": reasons}


def _finite(x) -> float | None:
    """``x`` as a float when it is a finite number, else None (a missing or NaN figure is unknown)."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def sampled_verdict(rows: dict) -> dict:
    """The drafter against the n-gram floor at each sampling temperature of the decoding-modes table.

    Engines serve at temperature 0.6-1.0 with top-p, where prompt lookup's exact-match drafts are
    rejected far more often than at greedy, so a drafter below the floor greedily may be above it
    as served (and the other way round).

    Args:
        rows: ``served[bench]["rows"]`` of ``metrics/eval_<drafter>.json`` (eyas/eval/modes.py): keys
            ``<proposer>/chain/T<t>`` with ``accept_len`` (tokens per verify step) and ``ci95``
            (``[low, high]`` or None).
    Returns:
        per temperature > 0 present for both proposers, keyed ``T<t>`` as in the rows:
        ``{"accept_len", "ngram_accept_len", "beats_ngram_floor"`` (bool), ``"separated"``
        (True when the drafter's 95% interval lies wholly above the floor's, None when either
        has no interval)``}``.
    """
    out = {}
    for key, eagle in rows.items():
        proposer, mode, temp = key.split("/")
        ngram = rows.get(f"ngram/{mode}/{temp}")
        if proposer != "eagle" or mode != "chain" or temp == "T0" or ngram is None:
            continue
        a, b = eagle["accept_len"], ngram["accept_len"]
        lo, hi = (eagle.get("ci95") or [None])[0], (ngram.get("ci95") or [None, None])[1]
        out[temp] = {"accept_len": a, "ngram_accept_len": b, "beats_ngram_floor": a > b,
                     "separated": None if lo is None or hi is None else lo > hi}
    return out
