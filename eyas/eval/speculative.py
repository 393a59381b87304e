"""Speculative decoding with the target: chain drafting, greedy verification, acceptance length.

One number matters here, and every engine counts it the same way:
**acceptance length = tokens committed per target verify step, the bonus token counted**
(SGLang ``(num_accepted + bs) / forward_ct`` in
``python/sglang/srt/managers/scheduler_metrics_mixin.py`` ``update_spec_metrics``; vLLM
``1 + accepted / num_drafts`` in ``vllm/v1/spec_decode/metrics.py``; EAGLE ``accept_length + 1``
per cycle in ``eagle/model/utils.py`` ``update_inference_inputs``). Its ceiling is ``k + 1`` for
``k`` draft tokens per step.

The loop (:func:`speculative_generate`, batch size 1, temperature 0) reads top to bottom, after
gpt-fast: the target prefills the prompt and emits the first token (a generated token, not a verify
step); then, until a stop token or ``max_new_tokens``, a :class:`Proposer` drafts ``k`` tokens, the target
verifies ``[x_last, d1..dk]`` in one forward, :func:`verify_chain` applies the greedy accept rule, and
both caches roll back to what is still valid. Greedy speculative output must equal plain greedy
output (:func:`greedy_generate`) token for token; :func:`evaluate_prompts` checks that on every prompt.

Stop set: every decoder here stops at the first generated token in ``stop_ids`` (the token is
kept), a set rather than one EOS id, because chat targets end a turn with tokens other than the
tokenizer's EOS (Llama-3 ``<|eot_id|>``); :func:`eyas.target.model.stop_token_ids` builds it the way HF
``generate`` and vLLM do.

Proposers are pluggable: :class:`EagleProposer` (an EAGLE-3 drafter fed the target's aux hidden
states) and :class:`NgramProposer` (prompt lookup, no training).

One module past 500 lines: the accept rule, the proposers, the target's cache and its roll-back,
the chain loop and its timed, checked run over prompts are one mechanism read top to bottom (each
step of the loop calls the pieces above it), and eyas/eval/tree.py and eyas/eval/sampling.py build
on the same cache and proposers.
"""

from __future__ import annotations

import functools
import inspect
import statistics
import time
from collections.abc import Collection, Sequence
from typing import Protocol, runtime_checkable

import torch
from transformers import DynamicCache

from eyas.drafter.model import Eagle3Drafter, KVCache
from eyas.target import graphed, layers

# --- the accept rule and the one acceptance-length function ---------------------------------

def verify_chain(draft_tokens: list[int], target_greedy: list[int],
                 stop_ids: Collection[int]) -> tuple[int, list[int]]:
    """Greedy verification of one chain of draft tokens.

    Args:
        draft_tokens: ``k`` proposed target ids ``[d1..dk]`` (k may be 0).
        target_greedy: ``k + 1`` target argmax ids: ``target_greedy[i]`` is the target's greedy
            token after it has read ``x_last, d1..di`` (the verify forward's logits at position i).
        stop_ids: the ids that end the sequence (may be empty; :func:`eyas.target.model.stop_token_ids`).
    Returns:
        ``(accepted, committed)``: how many draft tokens were accepted, and the tokens to append
        (the accepted prefix, then the bonus token unless an accepted stop token ended the sequence).
    Raises:
        ValueError: ``len(target_greedy) != len(draft_tokens) + 1``.
    """
    if len(target_greedy) != len(draft_tokens) + 1:
        raise ValueError(f"verify_chain: {len(draft_tokens)} draft tokens need "
                         f"{len(draft_tokens) + 1} target tokens, got {len(target_greedy)}")
    committed: list[int] = []
    for d, t in zip(draft_tokens, target_greedy):
        if d != t:           # first mismatch: reject this draft token and every one after it
            break
        committed.append(d)  # accept: the target would have produced exactly this token
        if d in stop_ids:    # an accepted stop token ends the sequence: no bonus token after it
            return len(committed), committed
    accepted = len(committed)
    # bonus: the target's own token at the first mismatch (or after all k); always correct
    committed.append(target_greedy[accepted])
    return accepted, committed


def stop_set(stop_ids: Sequence[int]) -> frozenset[int]:
    """``stop_ids`` as a frozenset, checked: a bare int or None (the old single ``eos_id``) is
    refused, so a caller cannot silently stop at nothing or at the tokenizer's EOS only.

    Raises:
        TypeError: ``stop_ids`` is not an iterable of ints.
    """
    if stop_ids is None or isinstance(stop_ids, (int, str, bytes)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in stop_ids):
        raise TypeError(f"stop_ids must be a sequence of token ids (eyas.target.model.stop_token_ids; [] for "
                        f"none), got {stop_ids!r}")
    return frozenset(stop_ids)


def acceptance_length(committed_per_step: list[int]) -> float:
    """Mean tokens committed per target verify step, bonus token included (the SGLang / vLLM / EAGLE
    convention; sources in the module docstring). Pooled over the steps given; 1.0 means every draft
    was rejected, ``k + 1`` that every draft was accepted.

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
    ``x_{t+1}`` (same alignment as training, eyas/training/batches.py); the output hidden state predicts
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
        # draft ids stay on the device between draft steps (no host round trip, so no stream sync
        # per draft token on CUDA); one transfer at the end
        h, drafts = self.h, []  # h [1, 1, H]: output at the last real position
        pos = torch.arange(self.n_real, self.n_real + k, device=self.device)
        for i in range(k):
            d = self.drafter.draft_to_target(self.drafter.logits(h[:, -1]).argmax(-1))  # [1] int64
            drafts.append(d)
            if i + 1 < k:  # feed (own hidden, d) one position further to draft the next token
                h = self.drafter.decode(h, d.view(1, 1), pos[i:i + 1].view(1, 1), self.kv, self.weights)
        return torch.cat(drafts).tolist() if drafts else []

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
    """An ``eyas.target.model.Target`` or a bare transformers causal LM -> the model."""
    from eyas.target.model import Target

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


def _select(cache: DynamicCache, n_done: int, rows: list[int]) -> None:
    """Keep the cache's first ``n_done`` positions, then ``n_done + rows`` (in that order)."""
    layers_ = getattr(cache, "layers", None)
    if layers_ is None:
        raise TypeError("tree verification needs a transformers DynamicCache with .layers (transformers >= 4.56)")
    for layer in layers_:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        idx = torch.cat([torch.arange(n_done), n_done + torch.tensor(rows, dtype=torch.long)]).to(layer.keys.device)
        layer.keys, layer.values = layer.keys.index_select(-2, idx), layer.values.index_select(-2, idx)


def _sync(model) -> None:
    """Wait for the model's device (CUDA work is asynchronous; host clocks need it finished)."""
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


class TargetCache:
    """The target's KV cache in the eval's loops (batch 1), run and rolled back the same way
    whichever decode holds it (:func:`eyas.target.graphed.choose`):

    - ``"dynamic"``: transformers' ``DynamicCache`` (the CPU path); a roll-back crops it;
    - ``"static"`` / ``"graphed"``: one row of a :class:`eyas.target.graphed.StaticDecoder` for
      ``max_len`` positions; a roll-back moves the write column (the mask hides what lies past it,
      the next step overwrites it); ``"graphed"`` replays every step but the prefill from a CUDA graph.

    A step may verify a draft tree in one forward (``tree``, eyas.eval.tree): each token sees the
    cached prefix, its ancestors and itself, at the position of its depth; :meth:`keep` with
    ``rows`` then keeps the accepted path (``DynamicCache`` rows selected, or static columns moved).

    Args:
        model: a transformers causal LM. decode: ``"dynamic"``, ``"static"`` or ``"graphed"``.
        max_len: the most positions the sequence will hold (the static cache's length).
    """

    def __init__(self, model, decode: str, max_len: int):
        self.model, self.decode, self.n = model, decode, 0
        if decode == "dynamic":
            self.cache = DynamicCache()
        else:
            self.dec = graphed.decoder(model, 1, max_len, graphs=decode == "graphed")
            self.dec.reset()

    def __call__(self, ids: list[int], aux_ids: list[int] | None = None, last_only: bool = False, tree=None):
        """Run ``ids`` at the next positions: -> (logits [1, T', V], argmax [1, T'] int64, aux
        [1, T, n_aux*H] or None), T' = 1 with ``last_only`` else ``len(ids)``, on the model's device.
        ``tree``: None, or ``(visible [T, T] bool, depth [T] ints)``
        (:meth:`eyas.target.graphed.StaticDecoder.forward`).
        A graphed step's outputs are overwritten by the next step: clone what is kept."""
        first, self.n = self.n, self.n + len(ids)
        if self.decode != "dynamic":  # the prefill (first call) eager: prompts differ in length
            return self.dec.forward([ids], first, aux_ids=aux_ids, last_only=last_only, graph=first > 0, tree=tree)
        kw = {}
        if tree is not None:
            device, dtype = next(self.model.parameters()).device, next(self.model.parameters()).dtype
            visible = torch.cat([torch.ones(len(ids), first, dtype=torch.bool), torch.as_tensor(tree[0])], dim=1)
            kw = {"attention_mask": graphed.additive_mask(visible, dtype)[None, None].to(device),
                  "position_ids": (first + torch.as_tensor(tree[1]))[None].to(device)}
        with layers.capture_aux(self.model, aux_ids) as aux_of:  # id L: the pre-norm residual
            out = _forward(self.model, ids, self.cache, last_only, output_hidden_states=bool(aux_ids), **kw)
        return out.logits, out.logits.argmax(-1), aux_of(out.hidden_states) if aux_ids else None

    def keep(self, n: int, rows: list[int] | None = None) -> None:
        """Keep the first ``n`` positions (drop the entries of rejected drafts); with ``rows``, then
        the last step's tokens ``rows`` (indices into that step, which started at ``n``), in order."""
        if rows is None:
            if self.decode == "dynamic":
                _crop(self.cache, n)
            self.n = n
            return
        if self.decode == "dynamic":
            _select(self.cache, n, rows)
        else:
            self.dec.move_columns(n, rows)
        self.n = n + len(rows)


def target_cache(model, decode: str, max_len: int) -> TargetCache:
    """:class:`TargetCache` of the decode :func:`eyas.target.graphed.choose` picks for ``decode``."""
    return TargetCache(model, graphed.choose(model, decode), max_len)


def _target_step(cache: TargetCache, ids: list[int], aux_ids: list[int] | None,
                 last_only: bool = False) -> tuple[list[int], torch.Tensor | None]:
    """Run ``ids`` through the target at the next positions of ``cache``: -> (argmax ids
    [len(ids)] (only the last with ``last_only``), aux [1, len(ids), n_aux*H] or None). The ids
    come to the host (``tolist``), so the call returns once the device has finished the forward."""
    _, greedy, aux = cache(ids, aux_ids, last_only)
    return greedy[0].tolist(), aux


def _prefill(cache: TargetCache, proposer: Proposer, prompt_ids: list[int],
             aux_ids: list[int] | None) -> tuple[int, torch.Tensor | None]:
    """Steps 1 and 2 of the loop: the target reads the prompt (n ids) and emits the first new token
    x_n (generated, not a verify step); the proposer starts on prompt + x_n, fed the target's aux
    states at the prompt's positions (pairs (g_t, x_{t+1})). Returns (x_n, aux [1, n, n_aux*H] or None)."""
    greedy, aux = _target_step(cache, prompt_ids, aux_ids, last_only=True)
    x = greedy[-1]
    proposer.prefill(prompt_ids + [x], aux)
    return x, aux


def _roll_back(cache: TargetCache, proposer: Proposer, n_done: int, committed: list[int],
               aux: torch.Tensor | None) -> int:
    """After a verify step over ``[x_last, d1..dk]`` that committed ``committed`` (m ids): the
    target's cache entries for x_last, d1..d_{m-1} are valid (it read exactly these tokens), those
    of rejected drafts are not; the last committed token (the bonus) has not been read yet, it is
    the next x_last. Keeps the first ``n_done + m`` positions, feeds the proposer ``committed`` with
    the aux states [1, m, n_aux*H] of those positions (None for a proposer without features), and
    returns ``n_done + m``."""
    n_done += len(committed)
    cache.keep(n_done)
    proposer.accept(committed, None if aux is None else aux[:, : len(committed)])
    return n_done


@torch.no_grad()
def speculative_generate(target_model, drafter, prompt_ids: list[int], *, num_draft_tokens: int,
                         max_new_tokens: int, stop_ids: Sequence[int],
                         aux_layer_ids: list[int] | None, return_features: bool = False,
                         decode: str = "auto") -> dict:
    """Greedy speculative decoding, chain drafts of ``num_draft_tokens`` (k), batch size 1.

    Args:
        target_model: a transformers causal LM (or ``eyas.target.model.Target``), any device/dtype.
        drafter: an :class:`Eagle3Drafter` (on the target's device) or any :class:`Proposer`.
        prompt_ids: at least one token id.
        stop_ids: ids that end the output (kept as its last token); [] = run to ``max_new_tokens``.
        aux_layer_ids: HF ``hidden_states`` indices (ascending) whose concatenation feeds the
            drafter, [1, T, n_aux*H]; None = the drafter's own (or the EAGLE-3 default).
        decode: the target's KV cache and step (:class:`TargetCache`, :func:`eyas.target.graphed.choose`):
            ``"auto"`` replays the verify step from a CUDA graph on CUDA, transformers' dynamic
            cache elsewhere.
    Returns:
        ``{"tokens": generated ids (prompt excluded, the stop token included if hit),
        "committed_per_step", "accepted_per_step": per verify step (an accepted count never
        exceeds what was committed after a ``max_new_tokens`` cut), "num_verify_steps",
        "seconds"}``. The first token, from the prefill, is generated but is not a verify step
        (so ``len(tokens) == 1 + sum(committed_per_step)``). ``seconds`` (host wall clock, s):
        ``prefill`` (target and drafter prefill), ``verify`` (per verify step: the target forward
        over ``[x_last, d1..dk]`` and its argmax on the host), ``drafter`` (per verify step: the
        roll-back and feed of the previous step's committed tokens, then drafting k); the phases
        end where the host already waits for the device (``tolist``), so on CUDA they need no
        extra synchronisation, except one after the drafter prefill; the last step's feed is in
        no phase. With ``return_features`` (a drafter that reads target features), also
        ``"features"``: the aux states the drafter was fed, on the CPU, [1, len(prompt) +
        len(tokens) - 1, n_aux*H] (every position the target read: the prompt and all generated
        tokens but the last), as :mod:`eyas.eval.oracle` can reuse them.
    Raises:
        ValueError: empty prompt. TypeError: ``stop_ids`` not a sequence of ints (:func:`stop_set`).
        eyas.target.layers.LayerIdError: aux ids disagree with the drafter's.
        eyas.target.graphed.GraphCaptureError: the CUDA graph capture failed.
    """
    model, proposer, k = _model(target_model), as_proposer(drafter), num_draft_tokens
    stop = stop_set(stop_ids)
    if not prompt_ids:
        raise ValueError("speculative_generate: empty prompt")
    result = {"tokens": [], "committed_per_step": [], "accepted_per_step": [], "num_verify_steps": 0,
              "seconds": {"prefill": 0.0, "verify": [], "drafter": []}}
    if max_new_tokens <= 0:
        return result
    hs = proposer.needs_features
    aux_ids = _aux_layers(model, proposer, aux_layer_ids) if hs else None

    # the verify step writes k + 1 positions past the committed ones
    cache = target_cache(model, decode, len(prompt_ids) + max_new_tokens + k + 1)

    clock = time.perf_counter
    t_start = clock()
    x, aux = _prefill(cache, proposer, prompt_ids, aux_ids)  # 1. target prefill, x_n; 2. drafter prefill
    tokens, n_done = [x], len(prompt_ids)  # n_done: positions the target's cache holds
    _sync(model)
    t_prev = clock()
    result["seconds"]["prefill"] = t_prev - t_start
    verify_s, drafter_s = result["seconds"]["verify"], result["seconds"]["drafter"]
    fed = [aux] if return_features and hs else None  # kept on the device, one copy at the end
    committed_per_step, accepted_per_step = [], []
    while len(tokens) < max_new_tokens and x not in stop:
        drafts = proposer.propose(k)                     # [d1..dk] (a proposer may return fewer)
        t_drafted = clock()
        drafter_s.append(t_drafted - t_prev)
        # 3. verify: one target forward over [x_last, d1..dk]; greedy[i] follows x_last, d1..di
        greedy, aux = _target_step(cache, [x] + drafts, aux_ids)
        t_prev = clock()
        verify_s.append(t_prev - t_drafted)
        accepted, committed = verify_chain(drafts, greedy, stop)
        committed = committed[: max_new_tokens - len(tokens)]   # 4. never exceed the budget
        tokens += committed
        committed_per_step.append(len(committed))
        accepted_per_step.append(min(accepted, len(committed)))
        n_done = _roll_back(cache, proposer, n_done, committed, aux if hs else None)  # 5. roll back
        x = committed[-1]
        if fed is not None:  # a copy: a graphed step's aux buffer is rewritten by the next step
            fed.append(aux[:, : len(committed)].clone())
    result.update(tokens=tokens, committed_per_step=committed_per_step,
                  accepted_per_step=accepted_per_step, num_verify_steps=len(committed_per_step))
    if fed is not None:
        result["features"] = torch.cat(fed, dim=1).cpu()
    return result


def _greedy_timed(model, prompt_ids: list[int], max_new_tokens: int,
                  stop: frozenset[int], decode: str = "auto") -> tuple[list[int], list[float]]:
    """Plain greedy decoding -> (generated ids, host seconds per forward: [0] the prefill, then
    one per decode step). Each forward ends with its argmax on the host (``int``), so the times
    are the device's too. ``decode``: :class:`TargetCache`."""
    cache, out, ids, seconds = target_cache(model, decode, len(prompt_ids) + max_new_tokens), [], list(prompt_ids), []
    clock = time.perf_counter
    while len(out) < max_new_tokens:
        t0 = clock()
        ids = [int(cache(ids, last_only=True)[1][0, -1])]
        seconds.append(clock() - t0)
        out += ids
        if ids[0] in stop:
            break
    return out, seconds


@torch.no_grad()
def greedy_generate(target_model, prompt_ids: list[int], *, max_new_tokens: int,
                    stop_ids: Sequence[int], decode: str = "auto") -> list[int]:
    """Plain greedy decoding with the target, one token per forward (on the CPU over a
    ``DynamicCache``; ``decode``: :class:`TargetCache`): the independent reference speculative
    output must equal. Stops after the first generated id in ``stop_ids`` (as HF ``generate`` with
    ``generation_config.eos_token_id`` a list does) or at ``max_new_tokens``. Returns the
    generated ids (the stop token included).

    Raises:
        TypeError: ``stop_ids`` not a sequence of ints (:func:`stop_set`).
        ValueError: a ``decode`` :func:`eyas.target.graphed.choose` refuses.
    """
    return _greedy_timed(_model(target_model), prompt_ids, max_new_tokens, stop_set(stop_ids), decode)[0]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _timing_report(greedy_s, spec_s, greedy_steps, spec_runs, outputs, model, repeats) -> dict:
    """The wall-clock keys of :func:`evaluate_prompts` from the timed runs.

    ``greedy_s[i][r]`` / ``spec_s[i][r]``: seconds of prompt i's repeat r; ``greedy_steps[i][r]``:
    :func:`_greedy_timed`'s per-forward seconds; ``spec_runs[i][r]``: the run's ``seconds``;
    ``outputs[i]``: the greedy output; its length and the speculative run's verify steps enter
    the model.
    """
    ratios = [g / s for gi, si in zip(greedy_s, spec_s) for g, s in zip(gi, si) if s > 0]
    if not ratios:
        return {"speedup": None, "speedup_iqr": None, "speedup_predicted": None, "speedup_flagged": None}
    q1, med, q3 = (statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1
                   else (ratios[0],) * 3)
    c_dec = _median([t for per in greedy_steps for steps in per for t in steps[1:]])
    c_ver = _median([t for per in spec_runs for r in per for t in r["verify"]])
    c_dft = _median([t for per in spec_runs for r in per for t in r["drafter"]])
    predicted = None
    if None not in (c_dec, c_ver, c_dft):
        per_prompt = []
        for y, steps, runs in zip(outputs, greedy_steps, spec_runs):
            p_g = statistics.median(s[0] for s in steps)
            p_s = statistics.median(r["prefill"] for r in runs)
            n = len(runs[0]["verify"])  # verify steps = (len(y) - 1) / acceptance length
            per_prompt.append((p_g + (len(y) - 1) * c_dec) / (p_s + n * (c_ver + c_dft)))
        predicted = statistics.median(per_prompt)
    dev = next(model.parameters()).device
    return {
        "speedup": med,
        "speedup_iqr": [q1, q3],
        "speedup_predicted": predicted,
        "speedup_flagged": None if predicted is None else abs(med - predicted) > q3 - q1,
        "timing": {
            "scheme": "per prompt, greedy and speculative back to back, order alternating over "
                      "prompts and repeats, after an untimed warm-up",
            "repeats": repeats, "num_ratios": len(ratios),
            "device": dev.type, "torch_threads": torch.get_num_threads(),
            "speedup_total_time": sum(map(sum, greedy_s)) / sum(map(sum, spec_s)),
            "step_ms": {"plain_decode": None if c_dec is None else 1e3 * c_dec,
                        "target_verify": None if c_ver is None else 1e3 * c_ver,
                        "drafter": None if c_dft is None else 1e3 * c_dft},
        },
    }


def _check_repeats_and_baseline(prompts: list[list[int]], timing_repeats: int,
                                baseline: list[list[int]] | None) -> None:
    """:func:`evaluate_prompts`' argument checks.

    Raises:
        ValueError: ``timing_repeats`` < 0, a baseline with ``timing_repeats`` >= 1 (timing runs
            greedy anyway), or a baseline whose length differs from the prompts'."""
    if timing_repeats < 0:
        raise ValueError(f"timing_repeats must be >= 0, got {timing_repeats}")
    if baseline is not None and timing_repeats:
        raise ValueError("evaluate_prompts: a baseline replaces the greedy runs, which timing needs; "
                         "pass timing_repeats=0 with it")
    if baseline is not None and len(baseline) != len(prompts):
        raise ValueError(f"baseline has {len(baseline)} outputs for {len(prompts)} prompts")


def _interleaved_runs(model, proposer: Proposer, prompts: list[list[int]], skw: dict, stop: frozenset[int],
                      timing_repeats: int, baseline: list[list[int]] | None, with_features: bool) -> dict:
    """The timing scheme of :func:`evaluate_prompts`: each prompt decoded greedily and
    speculatively back to back, greedy first iff prompt index + repeat is even, ``max(timing_repeats,
    1)`` times, each run timed between two device syncs (host seconds). Greedy runs are skipped
    where ``baseline`` gives the reference.

    Args:
        skw: :func:`speculative_generate`'s keyword arguments (k, budget, stop set, aux ids, decode).
        with_features: keep repeat 0's ``features`` of every speculative run.
    Returns:
        ``{"runs": repeat 0's speculative_generate result per prompt (without ``features``),
        "greedy": the greedy reference output per prompt (repeat 0's, or ``baseline``),
        "features": per prompt, in order, when ``with_features``, else [],
        "greedy_s" / "spec_s": per prompt, the seconds of each repeat,
        "greedy_steps": per prompt and repeat, :func:`_greedy_timed`'s per-forward seconds,
        "spec_steps": per prompt and repeat, the run's ``seconds``}``.
    """
    mode, max_new_tokens = skw["decode"], skw["max_new_tokens"]
    n = len(prompts)
    runs: list = [None] * n
    greedy: list = list(baseline) if baseline is not None else [None] * n
    features: list = []
    greedy_s, spec_s = [[] for _ in prompts], [[] for _ in prompts]
    greedy_steps, spec_steps = [[] for _ in prompts], [[] for _ in prompts]
    for r in range(max(timing_repeats, 1)):
        for i, p in enumerate(prompts):
            for method in (("greedy", "spec") if (i + r) % 2 == 0 else ("spec", "greedy")):
                if method == "greedy" and baseline is not None:
                    continue
                _sync(model)
                t0 = time.perf_counter()
                if method == "greedy":
                    out, steps = _greedy_timed(model, p, max_new_tokens, stop, mode)
                else:
                    run = speculative_generate(model, proposer, p, **skw, return_features=with_features and r == 0)
                _sync(model)
                dt = time.perf_counter() - t0
                if method == "greedy":
                    greedy_s[i].append(dt)
                    greedy_steps[i].append(steps)
                    if r == 0:
                        greedy[i] = out
                else:
                    spec_s[i].append(dt)
                    spec_steps[i].append(run["seconds"])
                    if r == 0:
                        runs[i] = run
                        if "features" in run:
                            features.append(run.pop("features"))
    return {"runs": runs, "greedy": greedy, "features": features, "greedy_s": greedy_s, "spec_s": spec_s,
            "greedy_steps": greedy_steps, "spec_steps": spec_steps}


def _decoding_metrics(runs: list[dict], greedy: list[list[int]], k: int) -> dict:
    """The decoding keys of :func:`evaluate_prompts` from one speculative run per prompt and the
    greedy reference outputs: ``accept_len`` (pooled over every verify step), its per-prompt mean,
    ``per_position_accept_rate``, ``accepted_histogram``, ``upper_bound`` (k + 1), ``lossless`` /
    ``mismatches`` (runs whose tokens differ from the reference), ``num_prompts``,
    ``num_verify_steps``, ``new_tokens`` (conventions and sources: :func:`evaluate_prompts`)."""
    committed = [c for r in runs for c in r["committed_per_step"]]
    accepted = [a for r in runs for a in r["accepted_per_step"]]
    steps = len(committed)
    mismatches = sum(r["tokens"] != list(b) for r, b in zip(runs, greedy))
    per_prompt = [acceptance_length(r["committed_per_step"]) for r in runs if r["num_verify_steps"]]
    return {
        "accept_len": acceptance_length(committed) if steps else None,
        "accept_len_per_prompt_mean": statistics.fmean(per_prompt) if per_prompt else None,
        "per_position_accept_rate": [sum(a > i for a in accepted) / steps if steps else 0.0 for i in range(k)],
        "accepted_histogram": [sum(a == j for a in accepted) for j in range(k + 1)],
        "upper_bound": k + 1,
        "lossless": mismatches == 0,
        "mismatches": mismatches,
        "num_prompts": len(runs),
        "num_verify_steps": steps,
        "new_tokens": sum(len(r["tokens"]) for r in runs),
    }


def evaluate_prompts(target, drafter, prompts: list[list[int]], *, num_draft_tokens: int,
                     max_new_tokens: int, stop_ids: Sequence[int], aux_layer_ids: list[int] | None,
                     timing_repeats: int = 1, baseline: list[list[int]] | None = None,
                     features_out: list | None = None, greedy_out: list | None = None,
                     decode: str = "auto") -> dict:
    """Speculative decoding over ``prompts`` (token ids), checked against plain greedy decoding,
    and its wall-clock speedup measured so that load on the machine cannot fake it.

    Timing (``timing_repeats`` R >= 1): after an untimed warm-up of both decoders on the first
    prompt (lazy kernel init, allocator), each prompt is decoded greedily and speculatively back
    to back, the order alternating over prompts and repeats (prompt i, repeat r: greedy first iff
    i + r is even), R times; every (prompt, repeat) gives a ratio greedy seconds / speculative
    seconds. Load that comes and goes then hits both methods of a few prompts, or one method of
    a few ratios, instead of one method's whole pass (the old scheme: all greedy, then all
    speculative, one ratio of sums). ``speedup`` is the median ratio, ``speedup_iqr`` its
    [25th, 75th] percentiles. ``speedup_predicted`` is a model from the median step costs (robust
    to a minority of slowed steps): per prompt, (greedy prefill + (M - 1) x plain decode step) /
    (speculative prefill + (M - 1) / accept_len x (verify step + drafter step)), M the output
    length, prefills the prompt's medians over repeats; the median over prompts.
    ``speedup_flagged`` is True when the measured and predicted ratios differ by more than the
    IQR's width (something the medians of the steps do not explain, e.g. load during one
    method's turns). ``timing`` records the scheme, R, the device type, torch's thread count,
    ``speedup_total_time`` (total greedy / total speculative seconds, the old definition) and
    ``step_ms`` (medians, milliseconds): ``plain_decode`` (one greedy decode forward),
    ``target_verify`` (one verify forward over k + 1 tokens), ``drafter`` (the drafter's work per
    verify step: feeding the committed tokens, then k drafts). Each timed run waits for the
    device before and after (CUDA). With R = 0 nothing is timed and the four ``speedup*`` keys are
    None. The speculative runs of repeat 0 also give the decoding metrics (and ``features_out``).

    Args:
        target: ``eyas.target.model.Target`` or a causal LM. drafter: Eagle3Drafter or a Proposer.
        stop_ids: ids that end a reply (``Target.stop_ids``; [] = none), for both decoders.
        timing_repeats: R >= 0 (above).
        baseline: precomputed greedy outputs per prompt, the reference instead of greedy runs
            (only with R = 0: timing runs greedy anyway).
        features_out: a list to extend with each prompt's ``features``
            (:func:`speculative_generate` ``return_features``), in prompt order.
        greedy_out: a list to extend with the greedy reference outputs, in prompt order.
        decode: the target's KV cache and step for both decoders (:class:`TargetCache`); ``"auto"``:
            CUDA graphs on CUDA where the target allows them, transformers' dynamic cache elsewhere
            (:func:`eyas.target.graphed.choose`); the choice is ``settings.target_decode``.
    Returns: the metrics dict; ``accept_len`` pools every verify step (sum committed / sum
        steps, as SGLang's ``update_spec_metrics`` accumulates it: module docstring);
        ``per_position_accept_rate[i]`` is the fraction of verify steps whose draft token i+1 was
        accepted (vLLM's per-position rate, ``vllm/v1/spec_decode/metrics.py``);
        ``accepted_histogram[j]`` counts steps with exactly j accepted (``pytorch-labs/gpt-fast:
        generate.py`` ``accept_counts``);
        ``lossless`` is True iff every speculative output equals the greedy one; the timing keys
        above; ``greedy_seconds`` / ``speculative_seconds``: totals over all timed runs (None
        without timing).
    Raises:
        ValueError: ``timing_repeats`` < 0, a baseline with R >= 1, or a baseline whose length
        differs from the prompts'. TypeError: ``stop_ids`` not a sequence of ints.
    """
    model, proposer, k = _model(target), as_proposer(drafter), num_draft_tokens
    stop = stop_set(stop_ids)
    _check_repeats_and_baseline(prompts, timing_repeats, baseline)
    mode = graphed.choose(model, decode)
    if mode != "dynamic" and prompts:  # one static cache long enough for every prompt: captured once
        graphed.decoder(model, 1, max(map(len, prompts)) + max_new_tokens + k + 1, graphs=mode == "graphed")
    skw = dict(num_draft_tokens=k, max_new_tokens=max_new_tokens, stop_ids=stop, aux_layer_ids=aux_layer_ids,
               decode=mode)
    timed = timing_repeats > 0
    if prompts and timed:  # warm-up: one verify step and one drafter cycle, a few decode steps
        speculative_generate(model, proposer, prompts[0], **dict(skw, max_new_tokens=k + 2))
        _greedy_timed(model, prompts[0], k + 2, stop, mode)

    t = _interleaved_runs(model, proposer, prompts, skw, stop, timing_repeats, baseline, features_out is not None)
    runs, greedy = t["runs"], t["greedy"]
    if features_out is not None:
        features_out.extend(t["features"])
    if greedy_out is not None:
        greedy_out.extend(greedy)
    timing = (_timing_report(t["greedy_s"], t["spec_s"], t["greedy_steps"], t["spec_steps"], greedy, model,
                             timing_repeats)
              if timed and prompts else
              {"speedup": None, "speedup_iqr": None, "speedup_predicted": None, "speedup_flagged": None})
    return {
        **_decoding_metrics(runs, greedy, k),
        "speculative_seconds": sum(map(sum, t["spec_s"])) if timed else None,
        "greedy_seconds": sum(map(sum, t["greedy_s"])) if timed else None,
        **timing,
        "settings": {"mode": "chain", "target_decode": mode, "num_draft_tokens": k, "temperature": 0.0,
                     "max_new_tokens": max_new_tokens, "num_prompts": len(prompts),
                     "proposer": type(proposer).__name__, "stop_ids": sorted(stop)},
    }
