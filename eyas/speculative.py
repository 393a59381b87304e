"""Speculative decoding with the target: chain drafting, greedy verification, acceptance length.

One number matters here, and every engine counts it the same way (eagle3-facts.md §5):
**acceptance length = tokens committed per target verify step, the bonus token counted**
(SGLang ``(num_accepted + bs) / forward_ct``; vLLM ``1 + accepted / num_drafts``; EAGLE
``accept_length + 1`` per cycle). Its ceiling is ``k + 1`` for ``k`` draft tokens per step.

The loop (:func:`speculative_generate`, batch size 1, temperature 0) reads top to bottom, after
gpt-fast: the target prefills the prompt and emits the first token (a generated token, not a verify
step); then, until EOS or ``max_new_tokens``, a :class:`Proposer` drafts ``k`` tokens, the target
verifies ``[x_last, d1..dk]`` in one forward, :func:`verify_chain` applies the greedy accept rule, and
both caches roll back to what is still valid. Greedy speculative output must equal plain greedy
output (:func:`greedy_generate`) token for token; :func:`evaluate_prompts` checks that on every prompt.

Proposers are pluggable: :class:`EagleProposer` (an EAGLE-3 drafter fed the target's aux hidden
states) and :class:`NgramProposer` (prompt lookup, no training).
"""

from __future__ import annotations

import functools
import inspect
import statistics
import time
from typing import Protocol, runtime_checkable

import torch
from transformers import DynamicCache

from eyas import layers
from eyas.drafter import Eagle3Drafter, KVCache


# --- the accept rule and the one acceptance-length function ---------------------------------

def verify_chain(draft_tokens: list[int], target_greedy: list[int],
                 eos_id: int | None) -> tuple[int, list[int]]:
    """Greedy verification of one chain of draft tokens.

    Args:
        draft_tokens: ``k`` proposed target ids ``[d1..dk]`` (k may be 0).
        target_greedy: ``k + 1`` target argmax ids: ``target_greedy[i]`` is the target's greedy
            token after it has read ``x_last, d1..di`` (the verify forward's logits at position i).
        eos_id: end-of-sequence id, or None.
    Returns:
        ``(accepted, committed)``: how many draft tokens were accepted, and the tokens to append
        (the accepted prefix, then the bonus token unless an accepted EOS ended the sequence).
    """
    if len(target_greedy) != len(draft_tokens) + 1:
        raise ValueError(f"verify_chain: {len(draft_tokens)} draft tokens need "
                         f"{len(draft_tokens) + 1} target tokens, got {len(target_greedy)}")
    committed: list[int] = []
    for d, t in zip(draft_tokens, target_greedy):
        if d != t:           # first mismatch: reject this draft token and every one after it
            break
        committed.append(d)  # accept: the target would have produced exactly this token
        if d == eos_id:      # an accepted EOS ends the sequence: no bonus token after it
            return len(committed), committed
    accepted = len(committed)
    # bonus: the target's own token at the first mismatch (or after all k); always correct
    committed.append(target_greedy[accepted])
    return accepted, committed


def acceptance_length(committed_per_step: list[int]) -> float:
    """Mean tokens committed per target verify step, bonus token included (SGLang / vLLM / EAGLE
    convention, eagle3-facts.md §5). Pooled over the steps given; 1.0 means every draft was
    rejected, ``k + 1`` that every draft was accepted.

    Raises:
        ValueError: no verify steps (the quantity is undefined).
    """
    if not committed_per_step:
        raise ValueError("acceptance_length: no verify steps")
    return sum(committed_per_step) / len(committed_per_step)


# --- proposers --------------------------------------------------------------------------------

@runtime_checkable
class Proposer(Protocol):
    """What the speculative loop needs from a drafter. ``needs_features``: whether the loop must
    run the target with ``output_hidden_states`` and pass aux features [1, T, n_aux*H]."""

    needs_features: bool

    def prefill(self, tokens: list[int], features: torch.Tensor | None) -> None:
        """Start a sequence. ``tokens``: prompt + the first generated token (n + 1 ids);
        ``features``: target aux hidden states at prompt positions 0..n-1, [1, n, n_aux*H]."""

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft target ids continuing the sequence (may be fewer, even none)."""

    def accept(self, committed: list[int], features: torch.Tensor | None) -> None:
        """Extend the sequence by ``committed`` (m ids); ``features`` [1, m, n_aux*H] are the
        target's aux states at the m positions whose next tokens these are (their inputs were
        ``x_last, d1..d_{m-1}``, all verified)."""


class EagleProposer:
    """An EAGLE-3 drafter as a chain proposer (SGLang/EAGLE decoding scheme).

    Drafter inputs at position t pair the target's aux features ``g_t`` with the NEXT token
    ``x_{t+1}`` (same alignment as training, eyas/ttt.py); the output hidden state predicts
    ``x_{t+2}``. Draft step i > 1 feeds back the drafter's own pre-norm hidden state (H wide;
    ``decode`` skips ``fc``). The KV cache keeps only entries built from real target features
    (``n_real``); speculative entries are dropped at every :meth:`accept`.
    """

    needs_features = True

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        p = next(drafter.parameters())
        self.device, self.dtype = p.device, p.dtype

    def _feed(self, features: torch.Tensor, next_ids: list[int]) -> None:
        """Run target features [1, m, n_aux*H] paired with ``next_ids`` (m) at the next m positions."""
        m = len(next_ids)
        pos = torch.arange(self.n_real, self.n_real + m, device=self.device)[None]
        ids = torch.tensor([next_ids], device=self.device)
        self.h = self.drafter.decode(features[:, :m].to(self.device, self.dtype), ids, pos, self.kv,
                                     self.weights)[:, -1:]
        self.n_real += m

    def prefill(self, tokens, features):
        self.kv, self.n_real = KVCache(), 0
        self.weights = self.drafter.midlayer.weights()  # built once per sequence, not per decode call
        self._feed(features, tokens[1:])  # pairs (g_t, x_{t+1}), t = 0..n-1

    def propose(self, k):
        h, drafts = self.h, []  # h [1, 1, H]: output at the last real position
        for i in range(k):
            d = int(self.drafter.draft_to_target(self.drafter.logits(h[:, -1]).argmax(-1)))
            drafts.append(d)
            if i + 1 < k:  # feed (own hidden, d) one position further to draft the next token
                pos = torch.tensor([[self.n_real + i]], device=self.device)
                h = self.drafter.decode(h, torch.tensor([[d]], device=self.device), pos, self.kv, self.weights)
        return drafts

    def accept(self, committed, features):
        self.kv.crop(self.n_real)  # drop the entries built from the drafter's own guesses
        self._feed(features, committed)


def ngram_propose(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (n = max_ngram
    down to min_ngram) and propose the k tokens that followed it. The copy extends itself, so a
    match just before the end still yields k tokens (period-p text continues with period p).
    Returns [] when no n-gram recurs."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(tokens) <= n:
            continue
        pattern = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == pattern:
                ext = list(tokens)
                for j in range(k):
                    ext.append(ext[start + n + j])
                return ext[len(tokens):]
    return []


class NgramProposer:
    """:func:`ngram_propose` over prompt + generated tokens as a :class:`Proposer`."""

    needs_features = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def prefill(self, tokens, features):
        self.tokens = list(tokens)

    def propose(self, k):
        return ngram_propose(self.tokens, k, self.max_ngram, self.min_ngram)

    def accept(self, committed, features):
        self.tokens.extend(committed)


def as_proposer(drafter) -> Proposer:
    """An :class:`Eagle3Drafter` wrapped in :class:`EagleProposer`; a Proposer as it is."""
    if isinstance(drafter, Eagle3Drafter):
        return EagleProposer(drafter)
    if isinstance(drafter, Proposer):
        return drafter
    raise TypeError(f"not a drafter or Proposer: {type(drafter).__name__}")


# --- generation -------------------------------------------------------------------------------

def _model(target):
    """An ``eyas.target.Target`` or a bare transformers causal LM -> the model."""
    from eyas.target import Target

    return target.model if isinstance(target, Target) else target


@functools.cache
def _forward_params(model_class) -> frozenset:
    return frozenset(inspect.signature(model_class.forward).parameters)


def _forward(model, ids: list[int], cache: DynamicCache, last_only: bool = False, **kw):
    """One cached forward of ``ids`` [1, len(ids)] at the cache's next positions. transformers
    5.x names the cache argument ``cache`` (``past_key_values`` is deprecated, kept by older
    and remote-code models); ``last_only`` computes logits for the last position only."""
    params = _forward_params(type(model))
    kw["cache" if "cache" in params else "past_key_values"] = cache
    if last_only and "logits_to_keep" in params:
        kw["logits_to_keep"] = 1
    device = next(model.parameters()).device
    return model(input_ids=torch.tensor([ids], device=device), use_cache=True, **kw)


def _aux_layers(target_model, proposer, aux_layer_ids) -> list[int]:
    """HF hidden_states indices to capture; must agree with an EAGLE drafter's config."""
    L = target_model.config.num_hidden_layers
    if isinstance(proposer, EagleProposer):
        own = proposer.drafter.config.resolved_aux_layers()
        ids = own if aux_layer_ids is None else layers.resolve(aux_layer_ids, L)
        if ids != own:
            raise layers.LayerIdError(f"aux_layer_ids {ids} disagree with the drafter's {own}")
        return ids
    return layers.resolve(aux_layer_ids, L)


def _crop(cache: DynamicCache, keep: int) -> None:
    """Keep the first ``keep`` positions of a transformers cache. transformers 5.x
    ``DynamicCache.crop`` takes minus the number of tokens to remove (4.x also accepted that)."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


@torch.no_grad()
def speculative_generate(target_model, drafter, prompt_ids: list[int], *, num_draft_tokens: int,
                         max_new_tokens: int, eos_id: int | None,
                         aux_layer_ids: list[int] | None, return_features: bool = False) -> dict:
    """Greedy speculative decoding, chain drafts of ``num_draft_tokens`` (k), batch size 1.

    Args:
        target_model: a transformers causal LM (or ``eyas.target.Target``), any device/dtype.
        drafter: an :class:`Eagle3Drafter` (on the target's device) or any :class:`Proposer`.
        prompt_ids: at least one token id.
        aux_layer_ids: HF ``hidden_states`` indices (ascending) whose concatenation feeds the
            drafter, [1, T, n_aux*H]; None = the drafter's own (or the EAGLE-3 default).
    Returns:
        ``{"tokens": generated ids (prompt excluded, EOS included if hit), "committed_per_step",
        "accepted_per_step": per verify step (an accepted count never exceeds what was
        committed after a ``max_new_tokens`` cut), "num_verify_steps"}``. The first token,
        from the prefill, is generated but is not a verify step (so ``len(tokens) ==
        1 + sum(committed_per_step)``). With ``return_features`` (a drafter that reads target
        features), also ``"features"``: the aux states the drafter was fed, on the CPU,
        [1, len(prompt) + len(tokens) - 1, n_aux*H] (every position the target read: the prompt
        and all generated tokens but the last), as :mod:`eyas.chain_oracle` can reuse them.
    """
    model, proposer, k = _model(target_model), as_proposer(drafter), num_draft_tokens
    if not prompt_ids:
        raise ValueError("speculative_generate: empty prompt")
    result = {"tokens": [], "committed_per_step": [], "accepted_per_step": [], "num_verify_steps": 0}
    if max_new_tokens <= 0:
        return result
    hs = proposer.needs_features
    aux_ids = _aux_layers(model, proposer, aux_layer_ids) if hs else None

    def target(ids: list[int], last_only: bool = False):
        """Run ``ids`` through the target at the next positions of ``cache``: -> (argmax ids
        [len(ids)] (only the last with ``last_only``), aux [1, len(ids), n_aux*H] or None)."""
        out = _forward(model, ids, cache, last_only, output_hidden_states=hs)
        aux = torch.cat([out.hidden_states[i] for i in aux_ids], dim=-1) if hs else None
        return out.logits[0].argmax(-1).tolist(), aux

    # 1. prefill: the target reads the prompt and emits the first new token x_n
    cache = DynamicCache()
    greedy, aux = target(prompt_ids, last_only=True)
    x = greedy[-1]
    tokens, n_done = [x], len(prompt_ids)  # n_done: positions the target's cache holds
    # 2. drafter prefill on pairs (g_t, x_{t+1}) of the prompt
    proposer.prefill(prompt_ids + [x], aux)
    fed = [aux.cpu()] if return_features and hs else None
    committed_per_step, accepted_per_step = [], []
    while len(tokens) < max_new_tokens and x != eos_id:
        drafts = proposer.propose(k)                     # [d1..dk] (a proposer may return fewer)
        # 3. verify: one target forward over [x_last, d1..dk]; greedy[i] follows x_last, d1..di
        greedy, aux = target([x] + drafts)
        accepted, committed = verify_chain(drafts, greedy, eos_id)
        committed = committed[: max_new_tokens - len(tokens)]   # 4. never exceed the budget
        tokens += committed
        committed_per_step.append(len(committed))
        accepted_per_step.append(min(accepted, len(committed)))
        # roll back: the target's entries for x_last, d1..d_accepted are valid (it read exactly
        # these tokens); the entries for rejected drafts are not. The last committed token
        # (bonus) has not been read yet: it is the next x_last.
        n_done += len(committed)
        _crop(cache, n_done)
        x = committed[-1]
        proposer.accept(committed, aux[:, : len(committed)] if hs else None)
        if fed is not None:
            fed.append(aux[:, : len(committed)].cpu())
    result.update(tokens=tokens, committed_per_step=committed_per_step,
                  accepted_per_step=accepted_per_step, num_verify_steps=len(committed_per_step))
    if fed is not None:
        result["features"] = torch.cat(fed, dim=1)
    return result


@torch.no_grad()
def greedy_generate(target_model, prompt_ids: list[int], *, max_new_tokens: int,
                    eos_id: int | None) -> list[int]:
    """Plain greedy decoding with the target, one token per forward over a ``DynamicCache``: the
    independent reference speculative output must equal. Returns generated ids (EOS included)."""
    model = _model(target_model)
    cache, out, ids = DynamicCache(), [], list(prompt_ids)
    while len(out) < max_new_tokens:
        logits = _forward(model, ids, cache, last_only=True).logits
        ids = [int(logits[0, -1].argmax())]
        out += ids
        if ids[0] == eos_id:
            break
    return out


def _sync(model) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def evaluate_prompts(target, drafter, prompts: list[list[int]], *, num_draft_tokens: int,
                     max_new_tokens: int, eos_id: int | None, aux_layer_ids: list[int] | None,
                     baseline: list[list[int]] | None = None,
                     baseline_seconds: float | None = None,
                     features_out: list | None = None) -> dict:
    """Speculative decoding over ``prompts`` (token ids), checked against plain greedy decoding.

    Args:
        target: ``eyas.target.Target`` or a causal LM. drafter: Eagle3Drafter or a Proposer.
        baseline: precomputed greedy outputs per prompt (then greedy is not re-run and
            ``speedup`` needs ``baseline_seconds``, their total wall time, else it is None).
    Returns: the metrics dict; ``accept_len`` pools every verify step (sum committed / sum
        steps, the SpecForge/SGLang benchmark convention); ``per_position_accept_rate[i]``
        is the fraction of verify steps whose draft token i+1 was accepted (vLLM's per-position
        rate); ``accepted_histogram[j]`` counts steps with exactly j accepted (gpt-fast);
        ``lossless`` is True iff every speculative output equals the greedy one. Wall times
        exclude a short untimed warm-up of both decoders on the first prompt.
    """
    model, proposer, k = _model(target), as_proposer(drafter), num_draft_tokens
    kw = dict(max_new_tokens=max_new_tokens, eos_id=eos_id)
    if baseline is not None and len(baseline) != len(prompts):
        raise ValueError(f"baseline has {len(baseline)} outputs for {len(prompts)} prompts")
    if prompts:  # warm-up (lazy kernel init, allocator) so neither side pays it in the timing
        speculative_generate(model, proposer, prompts[0], num_draft_tokens=k, max_new_tokens=2,
                             eos_id=eos_id, aux_layer_ids=aux_layer_ids)
        greedy_generate(model, prompts[0], max_new_tokens=2, eos_id=eos_id)

    runs, spec_s = [], 0.0
    for p in prompts:
        _sync(model)
        t0 = time.perf_counter()
        runs.append(speculative_generate(model, proposer, p, num_draft_tokens=k, aux_layer_ids=aux_layer_ids,
                                         return_features=features_out is not None, **kw))
        _sync(model)
        spec_s += time.perf_counter() - t0
        if "features" in runs[-1]:
            features_out.append(runs[-1].pop("features"))
    if baseline is None:
        baseline, greedy_s = [], 0.0
        for p in prompts:
            _sync(model)
            t0 = time.perf_counter()
            baseline.append(greedy_generate(model, p, **kw))
            _sync(model)
            greedy_s += time.perf_counter() - t0
    else:
        greedy_s = baseline_seconds

    committed = [c for r in runs for c in r["committed_per_step"]]
    accepted = [a for r in runs for a in r["accepted_per_step"]]
    steps = len(committed)
    mismatches = sum(r["tokens"] != list(b) for r, b in zip(runs, baseline))
    per_prompt = [acceptance_length(r["committed_per_step"]) for r in runs if r["num_verify_steps"]]
    return {
        "accept_len": acceptance_length(committed) if steps else None,
        "accept_len_per_prompt_mean": statistics.fmean(per_prompt) if per_prompt else None,
        "per_position_accept_rate": [sum(a > i for a in accepted) / steps if steps else 0.0 for i in range(k)],
        "accepted_histogram": [sum(a == j for a in accepted) for j in range(k + 1)],
        "upper_bound": k + 1,
        "lossless": mismatches == 0,
        "mismatches": mismatches,
        "num_prompts": len(prompts),
        "num_verify_steps": steps,
        "new_tokens": sum(len(r["tokens"]) for r in runs),
        "speculative_seconds": spec_s,
        "greedy_seconds": greedy_s,
        "speedup": greedy_s / spec_s if greedy_s is not None and spec_s > 0 else None,
        "settings": {"mode": "chain", "num_draft_tokens": k, "temperature": 0.0,
                     "max_new_tokens": max_new_tokens, "num_prompts": len(prompts),
                     "proposer": type(proposer).__name__},
    }
