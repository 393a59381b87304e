"""Acceptance length for every chain length 1..k from one greedy output, without decoding again.

Under greedy verification the speculative output IS the target's greedy output ``y`` (lossless,
eyas/eval/speculative.py). A verify step that starts with ``p`` output tokens committed drafts a chain
for ``y[p], y[p+1], ...``; it accepts the common prefix of that chain and ``y[p:p+k]``. For a
proposer whose chain at ``p`` depends only on the prefix ``prompt + y[:p]`` (an EAGLE-3 drafter
whose cache holds only entries built from target features, :class:`eyas.eval.speculative.EagleProposer`;
n-gram prompt lookup), that count is a function of ``p`` alone (:func:`accepted_draft_counts`),
and the decoder's path is the walk ``p -> p + min(counts[p], j) + 1`` from ``p = 1`` (``y[0]``
comes from the prefill, not from a verify step), cut at the output end as
:func:`eyas.eval.speculative.speculative_generate` cuts at ``max_new_tokens`` or at a stop token (the
output ends at the first id of the decoder's stop set, so the walk needs no stop set of its own)
(:func:`chain_acceptance_length`). A chain of ``j`` drafts is the first ``j`` of a chain of ``k``
(both proposers draft left to right), so one set of counts gives every ``j <= k``.

For the EAGLE drafter, up to the first mismatch the drafted tokens equal ``y``, so every chain is
computed at once: one target forward over ``prompt + y`` (aux hidden states; or the features a
real speculative run already fed the drafter, which the eval stage reuses) and ``k`` TTT steps
fed ground-truth tokens (eyas/training/batches.py; ``tests/training/test_ttt.py`` checks TTT steps equal incremental
decoding). Index ``t = len(prompt) + p - 2`` of that unroll is the drafter's state when ``p``
tokens are committed: its step ``i`` predicts ``y[p + i]``.

:func:`repetition_loop_period` defines when a greedy output has fallen into a repetition loop
(such outputs inflate every drafter's acceptance length; the eval stage reports them apart).
"""

from __future__ import annotations

import hashlib
import json
import statistics

import torch

from eyas.drafter.backend import REFERENCE
from eyas.drafter.model import Eagle3Drafter
from eyas.eval.speculative import (
    EagleProposer,
    NgramProposer,
    _aux_layers,
    _forward_params,
    _model,
    acceptance_length,
    ngram_propose,
)
from eyas.target import layers
from eyas.training.batches import shift_left


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@torch.no_grad()
def _eagle_counts(model, proposer: EagleProposer, aux_ids: list[int], prompt_ids: list[int],
                  output_ids: list[int], k: int, features: torch.Tensor | None) -> list[int]:
    drafter, n = proposer.drafter, len(prompt_ids)
    seq = torch.tensor([prompt_ids + output_ids], device=proposer.device)  # [1, T]
    T = seq.shape[1]
    if features is None:
        kw = {"logits_to_keep": 1} if "logits_to_keep" in _forward_params(type(model)) else {}
        with layers.capture_aux(model, aux_ids) as aux_of:  # id L: the pre-norm residual
            hs = model(input_ids=seq, output_hidden_states=True, use_cache=False, **kw).hidden_states
        aux = aux_of(hs)                                                     # [1, T, n_aux*H]
    else:  # the decoder's own: every position but the last, whose drafts are never matched
        width = drafter.config.hidden_size * len(aux_ids)
        if not isinstance(features, torch.Tensor) or features.dim() != 3 or features.shape[0] != 1 \
                or features.shape[2] != width or not features.is_floating_point():
            raise ValueError(f"accepted_draft_counts: features must be a float tensor [1, positions, {width}] "
                             f"(n_aux x hidden), got {getattr(features, 'dtype', type(features).__name__)} "
                             f"{list(getattr(features, 'shape', []))}")
        if features.shape[1] != T - 1:
            raise ValueError(f"accepted_draft_counts: features cover {features.shape[1]} positions, "
                             f"expected len(prompt) + len(output) - 1 = {T - 1}")
        if not torch.isfinite(features).all():
            raise ValueError("accepted_draft_counts: features hold NaN or inf")
        aux = torch.cat([features, features[:, -1:]], dim=1).to(seq.device)
    pos = torch.arange(T, device=seq.device)[None]
    docs = torch.zeros_like(seq)
    lo = max(n - 2, 0)  # the first index that drafts output tokens: draft logits from here only
    ok = torch.ones(T - lo, dtype=torch.bool, device=seq.device)   # chain at index t still matches
    counts = torch.zeros(T - lo, dtype=torch.int64, device=seq.device)
    cache: list = []
    # the reference attention: on CUDA flex attention and the compiled layers would recompile for
    # every sequence length (eyas/drafter/backend.py)
    hidden = drafter.project(aux.to(proposer.dtype))
    for i in range(k):
        hidden = drafter.ttt_step(hidden, shift_left(seq, 1 + i, 0), pos + i, docs, cache, backend=REFERENCE)
        draft = drafter.draft_to_target(drafter.logits(hidden[0, lo:]).argmax(-1))  # predicts seq[t+2+i]
        ok &= draft == shift_left(seq, 2 + i, -1)[0, lo:]    # -1 past the end: never matched
        counts += ok
    c = counts.tolist()
    return [c[n + p - 2 - lo] if n + p >= 2 else 0 for p in range(len(output_ids))]


def accepted_draft_counts(target, proposer, prompt_ids: list[int], output_ids: list[int], *,
                          num_draft_tokens: int, aux_layer_ids: list[int] | None,
                          features: torch.Tensor | None = None) -> list[int]:
    """Drafts a greedy verifier accepts at every output position (module docstring).

    Args:
        target: ``eyas.target.model.Target`` or a transformers causal LM (as
            :func:`eyas.eval.speculative.evaluate_prompts` takes it).
        proposer: an :class:`Eagle3Drafter` (or :class:`EagleProposer`) on the target's device, or
            an :class:`NgramProposer`.
        prompt_ids: the prompt (n >= 1 ids); output_ids: the target's greedy output ``y`` for it
            (M ids, the stop token included if hit), e.g. from :func:`eyas.eval.speculative.greedy_generate`
            with the same ``stop_ids`` as the speculative run.
        num_draft_tokens: k, the longest chain considered.
        aux_layer_ids: HF ``hidden_states`` indices for an EAGLE drafter (None = its own); must
            agree with the drafter's config (ignored for n-gram).
        features: optional, for an EAGLE drafter: the aux states a real speculative run over the
            same prompt fed the drafter ([1, n + M - 1, n_aux*H], ``speculative_generate(...,
            return_features=True)``); they replace the oracle's own target forward over
            ``prompt + y`` (the eval's largest extra cost on long prompts).
    Returns:
        M ints in [0, k]: ``counts[p]`` = length of the common prefix of the k-chain drafted with
        ``prompt + y[:p]`` committed and ``y[p:p+k]`` (cut at the end of y). ``counts[0]`` (the
        chain after the prompt alone) is never drafted by the decoder, which takes ``y[0]`` from
        the prefill; it is 0 for an EAGLE drafter on a one-token prompt.
    Raises:
        ValueError: empty prompt or k < 1. TypeError: any other proposer (its chain may depend on
        more than the prefix). eyas.target.layers.LayerIdError: aux ids disagree with the drafter's.
    """
    if not prompt_ids:
        raise ValueError("accepted_draft_counts: empty prompt")
    if num_draft_tokens < 1:
        raise ValueError(f"accepted_draft_counts: num_draft_tokens must be >= 1, got {num_draft_tokens}")
    k, y = num_draft_tokens, list(output_ids)
    if isinstance(proposer, Eagle3Drafter):
        proposer = EagleProposer(proposer)
    if isinstance(proposer, EagleProposer):
        model = _model(target)
        return _eagle_counts(model, proposer, _aux_layers(model, proposer, aux_layer_ids),
                             list(prompt_ids), y, k, features)
    if isinstance(proposer, NgramProposer):
        seq = list(prompt_ids) + y
        n = len(prompt_ids)
        return [_common_prefix(ngram_propose(seq[:n + p], k, proposer.max_ngram, proposer.min_ngram),
                               y[p:p + k]) for p in range(len(y))]
    raise TypeError(f"accepted_draft_counts: no exact oracle for {type(proposer).__name__} "
                    "(only Eagle3Drafter/EagleProposer and NgramProposer)")


def chain_walk(counts: list[int], num_tokens: int, chain_length: int) -> list[tuple[int, int]]:
    """The verify steps of greedy chain decoding with ``chain_length`` (j) drafts per step.

    Starting at ``p = 1`` (``y[0]`` is the prefill's token), each step accepts
    ``a = min(counts[p], j)`` drafts and commits ``min(a + 1, num_tokens - p)`` tokens (the
    bonus token, cut at the output end as speculative_generate cuts at ``max_new_tokens``; an
    accepted stop token is the last output token, so the same cut drops the bonus after it).
    Returns ``[(accepted, committed)]`` per step, with ``accepted = min(a, committed)`` as
    speculative_generate's ``accepted_per_step``.

    Raises:
        ValueError: ``chain_length < 1``, ``num_tokens > len(counts)`` or a negative count.
    """
    if chain_length < 1:
        raise ValueError(f"chain_length must be >= 1, got {chain_length}")
    if num_tokens > len(counts):
        raise ValueError(f"num_tokens {num_tokens} exceeds the {len(counts)} counts given")
    if any(c < 0 for c in counts):
        raise ValueError(f"counts must be >= 0, got {min(counts)}")
    steps, p = [], 1
    while p < num_tokens:
        a = min(counts[p], chain_length)
        committed = min(a + 1, num_tokens - p)
        steps.append((min(a, committed), committed))
        p += committed
    return steps


def chain_acceptance_length(counts: list[int], num_tokens: int, chain_length: int) -> tuple[float, int]:
    """Acceptance length (tokens committed per verify step, bonus counted; eyas/eval/speculative.py)
    and the number of verify steps of the :func:`chain_walk` over the first ``num_tokens`` output
    tokens with ``chain_length`` drafts per step. ``(nan, 0)`` when there is no verify step
    (``num_tokens <= 1``); pool prompts as ``sum(num_tokens - 1) / sum(steps)``.

    Raises:
        ValueError: as :func:`chain_walk`.
    """
    steps = chain_walk(counts, num_tokens, chain_length)
    if not steps:
        return float("nan"), 0
    return acceptance_length([c for _, c in steps]), len(steps)


def walk_metrics(counts: list[list[int]], outputs: list[list[int]], num_draft_tokens: int) -> dict:
    """The decoding metrics of :func:`eyas.eval.speculative.evaluate_prompts` (same keys and pooling:
    ``accept_len``, ``accept_len_per_prompt_mean``, ``per_position_accept_rate``,
    ``accepted_histogram``, ``upper_bound``, ``num_prompts``, ``num_verify_steps``,
    ``new_tokens``) of greedy chain decoding with k = ``num_draft_tokens``, from the per-prompt
    :func:`accepted_draft_counts` on the greedy ``outputs``: what a real run reports, without its
    wall time (tests/eval/test_chain_oracle.py checks them equal for the n-gram proposer)."""
    if len(counts) != len(outputs):
        raise ValueError(f"walk_metrics: {len(counts)} count lists for {len(outputs)} outputs")
    k = num_draft_tokens
    walks = [chain_walk(c, len(y), k) for c, y in zip(counts, outputs)]
    steps = [s for w in walks for s in w]
    n = len(steps)
    per_prompt = [acceptance_length([c for _, c in w]) for w in walks if w]
    return {
        "accept_len": acceptance_length([c for _, c in steps]) if n else None,
        "accept_len_per_prompt_mean": statistics.fmean(per_prompt) if per_prompt else None,
        "per_position_accept_rate": [sum(a > i for a, _ in steps) / n if n else 0.0 for i in range(k)],
        "accepted_histogram": [sum(a == j for a, _ in steps) for j in range(k + 1)],
        "upper_bound": k + 1,
        "num_prompts": len(outputs),
        "num_verify_steps": n,
        "new_tokens": sum(len(y) for y in outputs),
    }


def repetition_loop_period(tokens: list[int], *, min_span: int = 16, max_period: int = 16,
                           min_repeats: int = 3) -> int | None:
    """The period of the repetition loop ``tokens`` ends in, or None.

    ``tokens`` ends in a loop of period P iff its last ``L`` tokens satisfy ``y[t] == y[t - P]``
    for every t in them but their first P, with ``L >= max(min_span, min_repeats * P)`` and
    ``P <= max_period``: the tail is periodic, long enough, and holds at least ``min_repeats``
    periods. Returns the smallest such P. An output that ends in a stop token after a loop is not
    looping unless that token itself recurs with the period (the decoder left the loop).
    """
    M = len(tokens)
    for P in range(1, max_period + 1):
        L = P  # the longest periodic tail with period P: P tokens plus every matching one before
        while L < M and tokens[M - L - 1] == tokens[M - L - 1 + P]:
            L += 1
        if L <= M and L >= max(min_span, min_repeats * P):
            return P
    return None


def per_prompt_walks(counts: list[list[int]], outputs: list[list[int]], num_draft_tokens: int) -> list[dict]:
    """Each prompt's greedy chain walk at k = ``num_draft_tokens`` (:func:`chain_walk`), what an
    engine's per-request counters are compared with (eyas.eval.llamacpp.agreement).

    Returns:
        one dict per prompt: ``verify_steps``, ``accepted`` (drafts accepted, summed),
        ``new_tokens`` (``len(y)``, the stop token included) and ``output_sha256`` (of the output
        ids as a JSON list: equal outputs have equal digests).
    """
    out = []
    for c, y in zip(counts, outputs, strict=True):
        walk = chain_walk(c, len(y), num_draft_tokens)
        out.append({"verify_steps": len(walk), "accepted": sum(a for a, _ in walk), "new_tokens": len(y),
                    "output_sha256": hashlib.sha256(json.dumps(list(y)).encode()).hexdigest()})
    return out


def chain_report(counts: list[list[int]], outputs: list[list[int]], num_draft_tokens: int,
                 real: dict | None) -> dict:
    """Eval-stage keys for one proposer on one benchmark, from per-prompt counts.

    Args:
        counts: per prompt, :func:`accepted_draft_counts` for k = ``num_draft_tokens``.
        outputs: the greedy outputs they were computed on (same order).
        real: :func:`eyas.eval.speculative.evaluate_prompts`' metrics for the same prompts and k, or
            None (no real run: ``oracle_matches_real`` is None).
    Returns:
        ``accept_len_by_chain_length`` {"1".."k": pooled acceptance length, None without verify
        steps}; ``oracle_matches_real``: the j = k walk has exactly the real run's verify steps,
        new tokens and accepted histogram; ``repetition``: ``looping_prompts`` (how many outputs
        :func:`repetition_loop_period` flags), ``looping_prompt_indices``, and the pooled
        ``accept_len_looping`` / ``accept_len_non_looping`` at j = k (None when a group is empty).
    """
    if len(counts) != len(outputs):
        raise ValueError(f"chain_report: {len(counts)} count lists for {len(outputs)} outputs")
    k = num_draft_tokens
    lengths = [len(y) for y in outputs]

    def pooled(j: int, which: list[int]) -> float | None:
        steps = sum(chain_acceptance_length(counts[i], lengths[i], j)[1] for i in which)
        return sum(lengths[i] - 1 for i in which) / steps if steps else None

    everyone = list(range(len(outputs)))
    walks = [chain_walk(c, m, k) for c, m in zip(counts, lengths)]
    hist = [sum(a == j for w in walks for a, _ in w) for j in range(k + 1)]
    matches = None if real is None else (
        sum(map(len, walks)) == real["num_verify_steps"] and sum(lengths) == real["new_tokens"]
        and hist == real["accepted_histogram"])
    looping = [i for i in everyone if repetition_loop_period(outputs[i]) is not None]
    return {
        "accept_len_by_chain_length": {str(j): pooled(j, everyone) for j in range(1, k + 1)},
        "oracle_matches_real": matches,
        "repetition": {"looping_prompts": len(looping), "looping_prompt_indices": looping,
                       "accept_len_looping": pooled(k, looping),
                       "accept_len_non_looping": pooled(k, [i for i in everyone if i not in looping])},
    }
