"""One benchmark's acceptance metrics for a drafter and the n-gram floor, from real decoding of
a timed subset and the exact chain oracle over every prompt.

Real speculative decoding is the ground truth (lossless, wall-clock speedup), but it costs one target
forward per verify step and per greedy token, batch 1 (replayed from CUDA graphs on a GPU,
eyas/target/graphed.py; transformers' own forward is launch-bound there, whatever the batch), so
decoding every prompt one at a time, twice, dominates the eval.
Under greedy verification the acceptance of a chain drafter is a function of the target's greedy
output alone (eyas/eval/oracle.py), and greedy outputs can be made for many prompts in one
batched ``generate`` (:func:`eyas.data.distill.generate_batch`, which equals unbatched greedy token for
token on CPU, tests/data/test_distill.py). So :func:`evaluate_benchmark`:

1. decodes the first ``timed_prompts`` prompts for real (:func:`eyas.eval.speculative.evaluate_prompts`:
   greedy and speculative interleaved, timed, checked token for token: ``lossless``, ``speedup``,
   ``timing``), and checks the oracle against those runs (``oracle_matches_real``);
2. makes the other prompts' greedy outputs in batches of ``batch_size``;
3. reports acceptance over EVERY prompt from the oracle (:func:`eyas.eval.oracle.walk_metrics`,
   :func:`~eyas.eval.oracle.chain_report`): the same keys a real run reports.

``timed_prompts`` 0 decodes every prompt for real (the CPU default: no batched reference at all).
On a GPU, batched and unbatched greedy can differ on a near-tie (other kernels, other rounding);
such a prompt's acceptance is still that of a target whose greedy output it is.
"""

from __future__ import annotations

from typing import Sequence

from eyas.data.distill import generate_batch
from eyas.eval.oracle import accepted_draft_counts, chain_report, per_prompt_walks, walk_metrics
from eyas.eval.speculative import NgramProposer, evaluate_prompts

__all__ = ["evaluate_benchmark", "k_sweep"]

# the keys of a real run's metrics that describe decoding, replaced by the oracle's over all prompts
_DECODING_KEYS = ("accept_len", "accept_len_per_prompt_mean", "per_position_accept_rate", "accepted_histogram",
                  "num_prompts", "num_verify_steps", "new_tokens")


def evaluate_benchmark(target, drafter, prompts: list[list[int]], *, num_draft_tokens: int, max_new_tokens: int,
                       stop_ids: Sequence[int], aux_layer_ids: list[int], timed_prompts: int,
                       timing_repeats: int, batch_size: int) -> tuple[dict, dict]:
    """Acceptance metrics of ``drafter`` and of the n-gram floor on one benchmark's prompts.

    Args:
        target: ``eyas.target.model.Target``. drafter: an Eagle3Drafter on the target's device.
        prompts: rendered prompts (token ids), >= 1.
        num_draft_tokens: k. max_new_tokens: reply budget. stop_ids: ``Target.stop_ids``.
        aux_layer_ids: the drafter's aux layers (HF hidden_states indices).
        timed_prompts: how many prompts (the first ones) are decoded for real; 0 = all.
        timing_repeats: >= 1, timed runs per real prompt (:func:`evaluate_prompts`).
        batch_size: prompts per batched greedy ``generate`` for the rest.
    Returns:
        ``(eagle, ngram)`` metric dicts. ``eagle`` holds :func:`evaluate_prompts`' keys, with the
        decoding keys (``accept_len``, ``per_position_accept_rate``, ``accepted_histogram``,
        counts) taken from the oracle over all prompts, plus ``accept_len_by_chain_length``,
        ``repetition``, ``oracle_matches_real`` (on the real runs), ``per_prompt`` (each prompt's
        walk, eyas.eval.oracle.per_prompt_walks), ``real_run`` (the real runs'
        own ``accept_len``, ``num_prompts``, ``num_verify_steps``) and ``settings.timed_prompts`` /
        ``settings.reference``. ``ngram`` holds the same decoding keys for prompt lookup.
    """
    k = num_draft_tokens
    n_real = len(prompts) if timed_prompts == 0 else min(timed_prompts, len(prompts))
    fed: list = []     # the features each real run fed the drafter: the oracle reuses them
    greedy: list = []  # the greedy reference outputs (from the timed greedy runs)
    real = evaluate_prompts(target, drafter, prompts[:n_real], num_draft_tokens=k, max_new_tokens=max_new_tokens,
                            stop_ids=stop_ids, aux_layer_ids=aux_layer_ids, timing_repeats=timing_repeats,
                            features_out=fed, greedy_out=greedy)
    rest = prompts[n_real:]
    for b in range(0, len(rest), batch_size):
        greedy += generate_batch(target.model, rest[b:b + batch_size], max_new_tokens,
                                 getattr(target.tokenizer, "pad_token_id", None) or 0, stop_ids)
    fed += [None] * len(rest)  # the oracle runs its own target forward for these
    counts = [accepted_draft_counts(target, drafter, p, y, num_draft_tokens=k, aux_layer_ids=aux_layer_ids,
                                    features=f) for p, y, f in zip(prompts, greedy, fed)]
    check = chain_report(counts[:n_real], greedy[:n_real], k, real)["oracle_matches_real"]
    eagle = {**real, **walk_metrics(counts, greedy, k), **chain_report(counts, greedy, k, None),
             "oracle_matches_real": check, "per_prompt": per_prompt_walks(counts, greedy, k),
             "real_run": {key: real[key] for key in ("accept_len", "num_prompts", "num_verify_steps")}}
    eagle["settings"] = {**real["settings"], "num_prompts": len(prompts), "timed_prompts": n_real,
                         "reference": "unbatched greedy (timed runs)" if n_real == len(prompts) else
                         f"unbatched greedy for the {n_real} timed prompts, batched greedy generate for the rest"}
    # the n-gram floor, exact from the oracle: its walk is a real n-gram run's verify steps
    # (tests/eval/test_chain_oracle.py), without that run's minutes of decoding
    counts = [accepted_draft_counts(target, NgramProposer(), p, y, num_draft_tokens=k, aux_layer_ids=None)
              for p, y in zip(prompts, greedy)]
    eagle["k_sweep"] = k_sweep(eagle)
    ngram = {**walk_metrics(counts, greedy, k), **chain_report(counts, greedy, k, None)}
    ngram["settings"] = {**eagle["settings"], "proposer": "NgramProposer",
                         "method": "exact chain oracle on the greedy outputs (no wall-clock run)"}
    return eagle, ngram


def k_sweep(metrics: dict) -> dict:
    """Predicted speedup of every chain length j = 1..k, and the j to serve with.

    ``predicted_speedup(j) = a_j * plain / (verify + drafter * j / k)``: a_j the acceptance
    length at chain length j (``accept_len_by_chain_length``), ``plain``, ``verify`` and
    ``drafter`` the measured median step costs (``timing.step_ms``, at k). The verify forward is
    taken as costing the same for j + 1 and k + 1 tokens (true where the target's decode step is
    bound by launches or weight reads, as on a GPU at batch 1) and the drafter's cost as linear
    in the drafts.

    Returns:
        ``{"predicted_speedup": {"1".."k": float | None}, "recommended_k": int | None}`` (None
        without timing, e.g. ``timing_repeats`` 0).
    """
    a = metrics["accept_len_by_chain_length"]
    k = len(a)
    ms = (metrics.get("timing") or {}).get("step_ms") or {}
    plain, verify, draft = ms.get("plain_decode"), ms.get("target_verify"), ms.get("drafter")
    if None in (plain, verify, draft):
        return {"predicted_speedup": {j: None for j in a}, "recommended_k": None}
    pred = {j: (a[j] * plain / (verify + draft * int(j) / k) if a[j] is not None else None) for j in a}
    best = max((j for j in pred if pred[j] is not None), key=lambda j: pred[j], default=None)
    return {"predicted_speedup": pred, "recommended_k": None if best is None else int(best)}
