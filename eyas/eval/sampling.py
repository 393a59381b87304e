"""Speculative sampling: chain drafts verified with the standard accept/reject rule at a
temperature and top-p, so the output is distributed exactly as the target's own samples.

The rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling", Algorithm 2; as vLLM applies it in ``vllm/v1/sample/rejection_sampler.py``): with the
target's distribution ``p_i`` and the proposal ``q_i`` at draft position i, draft token ``x`` is
accepted with probability ``min(1, p_i(x) / q_i(x))``; at the first rejection the token is
resampled from ``norm(max(p_i - q_i, 0))`` and the step ends; when all drafts are accepted a bonus
token is sampled from ``p_k``. Each committed token is then distributed as ``p`` (the test:
tests/eval/test_sampling.py, against the target's distribution computed by enumeration).

Proposals: the EAGLE drafter samples from its own distribution at the same temperature and top-p;
its ``q`` lives on the draft vocab and is mapped to target ids through ``d2t`` (zero on target ids
outside the draft vocab: those are never drafted, and the residual gives them their mass). A
deterministic proposer (n-gram prompt lookup) has a point mass ``q = 1[x]``: ``x`` is accepted with
probability ``p_i(x)`` and the residual is ``p_i`` without ``x`` (vLLM's rule for drafts without
draft probabilities).

``p`` and ``q`` are the softmax of the logits divided by the temperature, restricted to the top-p
nucleus and renormalised (:func:`eyas.target.graphed.target_probs`: transformers'
``TemperatureLogitsWarper`` and ``TopPLogitsWarper``, as HF ``generate`` samples, and as the batched
sampled decode of synthesized prompts draws). Temperature 0 is greedy decoding:
:func:`eyas.eval.speculative.speculative_generate`.
Randomness comes only from the ``torch.Generator`` passed in (CPU), so a seed reproduces a run.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from eyas.drafter.model import Eagle3Drafter
from eyas.eval.speculative import EagleProposer, _aux_layers, _model, as_proposer, stop_set, target_cache
from eyas.target.graphed import target_probs

__all__ = ["SampledEagleProposer", "sampled_generate", "target_probs", "verify_chain_sampled"]


def _sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One id from ``probs`` [V] (on any device; sampled on the CPU with ``generator``)."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def verify_chain_sampled(draft_tokens: list[int], draft_probs: torch.Tensor | None, probs: torch.Tensor,
                         stop_ids: Collection[int], generator: torch.Generator) -> tuple[int, list[int]]:
    """The speculative-sampling accept/reject rule over one chain (module docstring).

    Args:
        draft_tokens: ``k`` proposed target ids ``[d1..dk]`` (k may be 0).
        draft_probs: the proposal ``q`` [k, V] float on target ids, row i the distribution
            ``d_{i+1}`` was drawn from; None = a deterministic proposer (point masses).
        probs: the target's ``p`` [k + 1, V] float (:func:`target_probs` of the verify logits; row
            i follows ``x_last, d1..di``).
        stop_ids: ids that end the sequence (an accepted stop token gets no bonus after it).
        generator: CPU ``torch.Generator``: one uniform per tested draft, one sample per
            resampled or bonus token.
    Returns:
        ``(accepted, committed)``: the accepted draft count and the tokens to append (accepted
        drafts, then the resampled or bonus token unless an accepted stop token ended it).
    Raises:
        ValueError: ``probs`` or ``draft_probs`` rows do not match ``len(draft_tokens)``.
    """
    k = len(draft_tokens)
    if probs.shape[0] != k + 1 or (draft_probs is not None and draft_probs.shape[0] != k):
        raise ValueError(f"verify_chain_sampled: {k} drafts need {k + 1} target rows and {k} proposal rows, got "
                         f"{probs.shape[0]} and {None if draft_probs is None else draft_probs.shape[0]}")
    p, q = probs.float().cpu(), None if draft_probs is None else draft_probs.float().cpu()
    committed: list[int] = []
    for i, x in enumerate(draft_tokens):
        qx = 1.0 if q is None else float(q[i, x])
        px = float(p[i, x])
        u = float(torch.rand((), generator=generator))
        if qx > 0 and u * qx < px:   # accept with probability min(1, p(x)/q(x))
            committed.append(x)
            if x in stop_ids:
                return len(committed), committed
            continue
        if q is None:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = (p[i] - q[i]).clamp_min(0.0)
        # p == q up to rounding leaves no residual mass; rejection then had probability ~0: fall back to p
        committed.append(_sample(residual if residual.sum() > 0 else p[i], generator))
        return len(committed) - 1, committed
    committed.append(_sample(p[k], generator))  # every draft accepted: the bonus token from p_k
    return k, committed


class SampledEagleProposer(EagleProposer):
    """An EAGLE-3 drafter that samples its chain from its own distribution (temperature, top-p)
    and reports it: :meth:`propose_sampled`. Feeding and roll-back as :class:`EagleProposer`."""

    def propose_sampled(self, k: int, temperature: float, top_p: float,
                        generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
        """Up to ``k`` drafts sampled one by one -> (target ids, ``q`` [k, V] float32 on target ids:
        the draft-vocab distribution scattered through ``d2t``, zero elsewhere)."""
        d = self.drafter
        targets_of_draft = d.draft_to_target(torch.arange(d.config.draft_vocab_size, device=self.device))
        h, drafts, qs = self.h, [], []
        pos = torch.arange(self.n_real, self.n_real + k, device=self.device)
        for i in range(k):
            qd = target_probs(d.logits(h[:, -1])[0], temperature, top_p)         # [draft_vocab]
            x = _sample(qd, generator)
            q = torch.zeros(d.config.vocab_size, dtype=torch.float32, device=self.device)
            qs.append(q.index_copy_(0, targets_of_draft, qd))
            drafts.append(int(targets_of_draft[x]))
            if i + 1 < k:
                ids = torch.tensor([[drafts[-1]]], device=self.device)  # the drafter reads target ids
                h = d.decode(h, ids, pos[i:i + 1].view(1, 1), self.kv, self.weights)
        return drafts, torch.stack(qs) if qs else torch.zeros(0, d.config.vocab_size)


@torch.no_grad()
def sampled_generate(target_model, drafter, prompt_ids: list[int], *, num_draft_tokens: int,
                     max_new_tokens: int, stop_ids: Sequence[int], aux_layer_ids: list[int] | None,
                     temperature: float, top_p: float, generator: torch.Generator, decode: str = "auto") -> dict:
    """Speculative sampling, chain drafts of ``num_draft_tokens`` (k), batch size 1.

    The loop of :func:`eyas.eval.speculative.speculative_generate` with the first token sampled from the
    target's ``p`` and every verify step decided by :func:`verify_chain_sampled`.

    Args:
        target_model: a transformers causal LM (or ``eyas.target.model.Target``).
        drafter: an :class:`~eyas.drafter.model.Eagle3Drafter` (drafts sampled from its ``q``,
            :class:`SampledEagleProposer`) or a deterministic :class:`~eyas.eval.speculative.Proposer`
            (n-gram: point-mass ``q``).
        temperature: > 0. top_p: in (0, 1]. generator: CPU ``torch.Generator`` (the seed).
        decode: the target's KV cache and step (:class:`eyas.eval.speculative.TargetCache`): ``"auto"``
            replays the verify step from a CUDA graph on CUDA.
        Others as :func:`eyas.eval.speculative.speculative_generate`.
    Returns:
        ``{"tokens", "committed_per_step", "accepted_per_step", "num_verify_steps"}`` as
        :func:`~eyas.eval.speculative.speculative_generate` returns them (no timing).
    Raises:
        ValueError: empty prompt, ``temperature`` <= 0, ``top_p`` outside (0, 1].
    """
    model, k = _model(target_model), num_draft_tokens
    proposer = SampledEagleProposer(drafter) if isinstance(drafter, Eagle3Drafter) else as_proposer(drafter)
    stop = stop_set(stop_ids)
    if not prompt_ids:
        raise ValueError("sampled_generate: empty prompt")
    target_probs(torch.zeros(1), temperature, top_p)  # the argument checks, before any forward
    result = {"tokens": [], "committed_per_step": [], "accepted_per_step": [], "num_verify_steps": 0}
    if max_new_tokens <= 0:
        return result
    hs = proposer.needs_features
    aux_ids = _aux_layers(model, proposer, aux_layer_ids) if hs else None
    sampled = isinstance(proposer, SampledEagleProposer)

    cache = target_cache(model, decode, len(prompt_ids) + max_new_tokens + k + 1)

    def target(ids: list[int], last_only: bool = False):
        logits, _, aux = cache(ids, aux_ids, last_only)
        return target_probs(logits[0], temperature, top_p), aux

    p, aux = target(prompt_ids, last_only=True)
    x = _sample(p[-1], generator)
    tokens, n_done = [x], len(prompt_ids)
    proposer.prefill(prompt_ids + [x], aux)
    committed_per_step, accepted_per_step = [], []
    while len(tokens) < max_new_tokens and x not in stop:
        if sampled:
            drafts, q = proposer.propose_sampled(k, temperature, top_p, generator)
        else:
            drafts, q = proposer.propose(k), None
        p, aux = target([x] + drafts)
        accepted, committed = verify_chain_sampled(drafts, q, p, stop, generator)
        committed = committed[: max_new_tokens - len(tokens)]
        tokens += committed
        committed_per_step.append(len(committed))
        accepted_per_step.append(min(accepted, len(committed)))
        n_done += len(committed)
        cache.keep(n_done)  # the entries of x_last and the accepted drafts stay
        x = committed[-1]
        proposer.accept(committed, aux[:, : len(committed)] if hs else None)
    result.update(tokens=tokens, committed_per_step=committed_per_step,
                  accepted_per_step=accepted_per_step, num_verify_steps=len(committed_per_step))
    return result
