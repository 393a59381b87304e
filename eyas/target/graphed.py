"""The target's decode over a static KV cache, each step shape replayed as one CUDA graph.

At batch 1, and at any batch for a small target, one decode step of the target is bound by kernel
launches, not by the GPU: a transformers forward issues a dozen kernels per layer, each behind
Python, and the dynamic KV cache grows by ``torch.cat`` every step. A static cache (transformers
``StaticCache``: keys and values preallocated for ``batch_size`` rows and ``max_len`` positions) gives
every step of one shape the same tensors at the same addresses, so the whole step can be recorded
once and replayed as one launch (PyTorch's "whole network capture",
https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs; gpt-fast decodes the same way,
``pytorch-labs/gpt-fast: generate.py``, with torch.compile's "reduce-overhead" mode).

:class:`StaticDecoder` holds the cache and one graph per step shape (tokens per row, the aux layers
read, whether only the last position's logits are kept, a tree step or not). A step runs ``T`` tokens per row at the
cache columns ``start .. start + T - 1``; its inputs are the token ids [B, T] and ``start``. Everything
else is computed INSIDE the step, on the device, from two persistent buffers, so a replay needs no
host work beyond copying the ids and the start column in:

- the write position: every cache layer's pointer (transformers ``StaticLayer.cumulative_length``,
  ``src/transformers/cache_utils.py``) is set to ``start`` at the top of the step (the layer adds
  ``T`` to it as it writes; the next step sets it again); transformers versions whose forward takes
  ``cache_position`` get it as a tensor as well;
- the positions: row ``b`` is left-padded by ``pad[b]`` columns (batched prompts of unequal
  length), so the token at column ``c`` has position ``c - pad[b]`` (HF ``generate``'s
  ``attention_mask.cumsum(-1) - 1``);
- the attention mask: a 4D additive float mask [B, 1, T, L] (0 where a query may attend,
  the dtype's minimum elsewhere): column ``c`` is visible to the query at column ``q`` iff
  ``pad[b] <= c <= q`` (a pad query sees its own column only, so no row of the softmax is empty).
  transformers uses a 4D mask as given and builds none of its own
  (``src/transformers/masking_utils.py``, ``_preprocess_mask_arguments``: "If the mask is already
  4D, simply return as-is"), so the step holds no host synchronisation.

Attention reads only the columns a step can see, once. ``L`` is ``start + T`` rounded up to a
multiple of :data:`LEN_QUANTUM` (part of the step's shape, so a graph is captured per such bucket),
and during a step the target's attention is :func:`grouped_attention`: the cache's first ``L``
columns, each key/value head read once by the query heads that share it (grouped-query attention
without transformers' ``repeat_kv`` copy, ``src/transformers/integrations/sdpa_attention.py``), in
one ``scaled_dot_product_attention``. transformers' own ``sdpa`` attends over all ``max_len``
columns with every key/value head copied per query head: at a self-distill batch of 1,024 rows
that copy, not the weights, is what a step reads.

Rolling back rejected draft tokens is moving ``start``: the columns past it are hidden by the mask
until a later step overwrites them. A draft tree verified in one step (eyas/eval/tree.py) passes two
more static inputs, which of the step's tokens each one sees ([T, T]) and their depths (positions
``start + depth``); its accepted path is then moved into consecutive columns (:meth:`StaticDecoder.move_columns`).
The step is a plain eager function; with ``graphs=False`` (the
``"static"`` decode, and the only one on a CPU) it runs as it is, so the CPU tests check the very code
the graphs record against transformers' dynamic-cache decoding. Capture warms up on a side stream
first (PyTorch's recipe); a capture that raises is re-raised as :class:`GraphCaptureError` naming the
shape (never a silent eager fallback).

Sampling is not part of the step: a batched sampled decode (:func:`decode_batch`, synthesized
prompts) reads the step's last-position logits after it ran (after the replay, from the graph's
static output) and draws each token eagerly, with its own generator, from :func:`target_probs`
(temperature and top-p as transformers' ``generate``), so one graph serves greedy and sampled
decoding and no random state is captured.

Which decode a caller gets is :func:`choose`: ``"auto"`` is ``"graphed"`` on CUDA for a target the
static step supports (:func:`unsupported`: full attention in every layer, an ``sdpa`` or ``eager``
attention implementation called through transformers' ``AttentionInterface``) and ``"dynamic"``
(transformers' own ``DynamicCache`` decoding, the CPU path, unchanged) otherwise; the eval and
self-distill record the choice.

One module past 500 lines: the step, its capture, the decoders kept per target and the batched decode
over them share the step's static buffers and one rule (a graph's outputs are valid until the next step;
sampling reads them after it); the sampling distribution sits beside the loop that draws from it.
"""

from __future__ import annotations

import contextlib
import inspect
import numbers
import weakref

import torch

from eyas.target import layers

__all__ = ["DECODES", "SEED_RANGE", "GraphCaptureError", "StaticDecoder", "additive_mask", "check_batch_args", "choose",
           "decode_batch", "decoder", "grouped_attention", "release", "target_probs", "unsupported"]

DECODES = ("auto", "dynamic", "static", "graphed")
# attention implementations that apply a 4D additive float mask as given (transformers
# integrations/sdpa_attention.py, modeling_llama.py eager_attention_forward)
_MASKED_ATTENTION = ("sdpa", "eager")
# cache lengths, and the columns a step attends over, are rounded up to a multiple of this, so that a few
# decoders cover prompts of every length and a few graphs every step of one
LEN_QUANTUM = 128
# the name the static step's attention is registered under (transformers AttentionInterface)
_GROUPED = "eyas_grouped"


class GraphCaptureError(RuntimeError):
    """Capturing the target's decode step in a CUDA graph failed (the message names the shape)."""


def _inner(model):
    """An ``eyas.target.model.Target`` or a transformers causal LM -> the causal LM."""
    return getattr(model, "model", model) if not isinstance(model, torch.nn.Module) else model


def unsupported(model) -> str | None:
    """Why the static-cache step cannot decode ``model`` (a transformers causal LM), or None.

    The step needs every layer to be a full-attention ``StaticLayer`` (no sliding window, no
    linear attention: transformers ``StaticCache`` builds the layers from the config), an attention
    implementation that applies a given 4D float mask (``sdpa``, ``eager``), modeling code that calls
    its attention through transformers' ``AttentionInterface`` and passes the mask to it as given (the
    step swaps in :func:`grouped_attention`; transformers ``PreTrainedModel.is_backend_compatible``,
    ``src/transformers/modeling_utils.py``: not so for ALiBi models such as Bloom, MPT or Falcon-RW, whose
    bias is built from a 2D mask or spans the whole cache), and a way to set the write position
    (``StaticLayer.cumulative_length``, or a forward taking ``cache_position``).
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in _MASKED_ATTENTION:
        return f"attention implementation {impl!r} (the static step needs one of {_MASKED_ATTENTION})"
    if not getattr(model, "is_backend_compatible", lambda: False)():
        return (f"{type(model).__name__} does not route its attention through transformers' AttentionInterface "
                f"(is_backend_compatible() is False)")
    try:
        cache = StaticCache(config=model.config, max_cache_len=8)
    except Exception as e:  # noqa: BLE001 - any refusal of the config is a reason to decode dynamically
        return f"transformers StaticCache refuses the config ({type(e).__name__}: {e})"
    kinds = sorted({type(x).__name__ for x in cache.layers if type(x) is not StaticLayer})
    if kinds:
        return f"cache layers {kinds} (sliding-window or linear attention; the static step needs full attention)"
    if not hasattr(cache.layers[0], "cumulative_length") and "cache_position" not in _forward_params(model):
        return "no way to set the cache's write position (neither StaticLayer.cumulative_length nor cache_position)"
    return None


def choose(model, decode: str = "auto") -> str:
    """The decode a target runs: ``decode`` itself, or for ``"auto"`` ``"graphed"`` on CUDA where
    :func:`unsupported` finds nothing, else ``"dynamic"``.

    Args:
        model: an ``eyas.target.model.Target`` or a transformers causal LM.
        decode: one of :data:`DECODES`: ``"dynamic"`` transformers' ``DynamicCache`` decoding (the CPU
            path); ``"static"`` the static-cache step run eagerly (any device); ``"graphed"`` the same
            step replayed from CUDA graphs (CUDA only); ``"auto"``.
    Raises:
        ValueError: an unknown ``decode``; ``"graphed"`` off CUDA; ``"static"``/``"graphed"`` for a
            target :func:`unsupported` refuses (naming why).
    """
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")
    model = _inner(model)
    cuda = next(model.parameters()).is_cuda
    if decode == "auto":
        return "graphed" if cuda and unsupported(model) is None else "dynamic"
    if decode == "graphed" and not cuda:
        raise ValueError("decode 'graphed' needs the target on CUDA (CUDA graphs); 'static' runs the same step "
                         "eagerly on any device")
    if decode in ("static", "graphed"):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"decode {decode!r}: {type(model).__name__} cannot use the static-cache step: {why}")
    return decode


def _forward_params(model) -> frozenset:
    return frozenset(inspect.signature(type(model).forward).parameters)


def grouped_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """The static step's attention, in transformers' attention-function signature
    (``src/transformers/modeling_utils.py``, ``AttentionInterface``): a query head attends over the
    first ``L`` cache columns of its key/value head, ``L`` the mask's last dimension.

    The query heads that share a key/value head (``h = kv * G + g``, the order of transformers'
    ``repeat_kv``) are stacked into one query block of ``G * T`` rows, so each key/value head is read
    once and never copied.

    Args:
        module: the attention module (unused; the interface passes it).
        query: [B, H, T, D]. key: [B, H_kv, max_len, D], value: [B, H_kv, max_len, D_v], the whole static
            cache (H divisible by H_kv; D_v may differ from D, as in multi-head latent attention).
        attention_mask: [B, 1, T, L] additive float mask (L <= max_len).
        scaling: the softmax scale (None: ``D ** -0.5``). dropout: must be 0 (a decode).
    Returns:
        ``(out [B, T, H, D_v], None)`` in the query's dtype, as transformers' ``sdpa_attention_forward``.
    Raises:
        ValueError: a dropout, a soft cap or attention sinks (this attention has none of them).
    """
    if dropout or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("the static step's attention has no dropout, soft cap or attention sinks")
    B, H, T, D = query.shape
    Hkv, L = key.shape[1], attention_mask.shape[-1]
    G = H // Hkv
    mask = attention_mask.expand(B, G, T, L).reshape(B, 1, G * T, L)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(B, Hkv, G * T, D), key[:, :, :L], value[:, :, :L], attn_mask=mask, scale=scaling)
    return out.reshape(B, H, T, value.shape[-1]).transpose(1, 2), None


@contextlib.contextmanager
def _grouped(model):
    """Within the block, ``model``'s attention is :func:`grouped_attention` (registered with
    transformers' ``AttentionInterface``); its own implementation is restored after."""
    from transformers import AttentionInterface

    AttentionInterface.register(_GROUPED, grouped_attention)
    was = model.config._attn_implementation
    model.config._attn_implementation = _GROUPED
    try:
        yield
    finally:
        model.config._attn_implementation = was


class _Graph:
    """One captured step: the graph, its static inputs (ids [B, T], and for a tree step its
    visibility [T, T] and depths [T]) and its outputs."""

    def __init__(self, graph, inputs, outputs):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the additive float mask transformers' attention adds to its
    scores: 0 where ``allowed``, the dtype's minimum elsewhere (same shape)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


class StaticDecoder:
    """A target's forward over a transformers ``StaticCache`` at the columns the caller names,
    optionally replayed from CUDA graphs (module docstring). The cache is allocated at construction,
    each layer's keys and values shaped as the target writes them (:meth:`_written_shapes`).

    Args:
        model: a transformers causal LM (its own device and dtype; weights not copied).
        batch_size: rows B. max_len: cache columns (prompt + every token a row may write).
        graphs: replay each step shape from a CUDA graph (CUDA only); False runs the step eagerly.
        warmup: eager runs of a new shape on a side stream before its capture.
    Raises:
        ValueError: ``graphs`` off CUDA, or a target :func:`unsupported` refuses.
    """

    def __init__(self, model, batch_size: int, max_len: int, *, graphs: bool, warmup: int = 2):
        from transformers import StaticCache

        why = unsupported(model)
        if why is not None:
            raise ValueError(f"StaticDecoder: {type(model).__name__}: {why}")
        p = next(model.parameters())
        if graphs and not p.is_cuda:
            raise ValueError("StaticDecoder: CUDA graphs need the target on CUDA")
        self._model = weakref.ref(model)  # the pool below is keyed by the model: no strong cycle
        self.batch_size, self.max_len, self.graphs, self.warmup = batch_size, max_len, graphs, warmup
        self.device, self.dtype = p.device, p.dtype
        c = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        self.cache = StaticCache(config=c, max_cache_len=max_len)
        params = _forward_params(model)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        if hasattr(self.cache.layers[0], "lazy_initialization"):  # allocated now, on the main stream (not in a warm-up)
            for layer, kv in zip(self.cache.layers, self._written_shapes(model)):
                layer.lazy_initialization(*(torch.zeros((batch_size, x[1], 0, x[3]), dtype=self.dtype,
                                                        device=self.device) for x in kv))
        self._cache_position = "cache_position" in params
        self._logits_to_keep = "logits_to_keep" in params
        self.pad = torch.zeros(batch_size, dtype=torch.int64, device=self.device)
        self.start = torch.zeros((), dtype=torch.int64, device=self.device)
        self._cols = torch.arange(max_len, device=self.device)
        self._steps: dict[tuple, _Graph] = {}
        self._pool = None
        self.captures = 0

    def _written_shapes(self, model) -> list[tuple[torch.Size, torch.Size]]:
        """Per layer, the shapes [1, heads, 1, head_dim] of the keys and of the values ``model`` writes to its
        cache, read off a one-token forward into a transformers ``DynamicCache``: not always the config's
        ``head_dim`` (DeepSeek-V3's multi-head latent attention writes keys of ``qk_nope_head_dim +
        qk_rope_head_dim`` and values of ``v_head_dim`` columns; its ``head_dim`` is the rope part)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 1), dtype=torch.int64, device=self.device), use_cache=True,
                  **{self._cache_kw: cache})
        return [(layer.keys.shape, layer.values.shape) for layer in cache.layers]

    @property
    def model(self):
        m = self._model()
        if m is None:
            raise RuntimeError("StaticDecoder: its target was freed")
        return m

    def reset(self, pad: list[int] | None = None) -> None:
        """Start new sequences: row ``b`` is left-padded by ``pad[b]`` columns (None: no padding).
        The cache is not cleared: every column a step reads was written by this sequence (mask)."""
        if pad is not None and len(pad) != self.batch_size:
            raise ValueError(f"StaticDecoder.reset: {len(pad)} pad counts for {self.batch_size} rows")
        self.pad.copy_(torch.tensor(pad or [0] * self.batch_size, dtype=torch.int64), non_blocking=True)

    def _positions(self, q: torch.Tensor) -> torch.Tensor:
        """Token positions [B, T] of the query columns ``q`` [T]: ``q - pad`` (0 on pad columns)."""
        return (q[None, :] - self.pad[:, None]).clamp_min(0)

    def visible(self, end: int) -> int:
        """The columns a step ending before column ``end`` attends over: ``end`` rounded up to a
        multiple of :data:`LEN_QUANTUM`, at most ``max_len``."""
        return min(self.max_len, -(-end // LEN_QUANTUM) * LEN_QUANTUM)

    def _mask(self, q: torch.Tensor, L: int) -> torch.Tensor:
        """The additive mask [B, 1, T, L] of the query columns ``q`` [T] (module docstring)."""
        c = self._cols[None, None, :L]
        qq = q[None, :, None]
        return additive_mask(((c <= qq) & (c >= self.pad[:, None, None])) | (c == qq), self.dtype)[:, None]

    def _tree_mask(self, visible: torch.Tensor, L: int) -> torch.Tensor:
        """The additive mask [B, 1, T, L] of a tree step: the columns before ``start`` (not
        pads), and among the step's own columns those ``visible`` [T, T] marks for each query."""
        T = visible.shape[0]
        cols = self._cols[:L]
        rel = cols - self.start                                                       # [L]
        own = visible.gather(1, rel.clamp(0, T - 1).expand(T, -1)) & (rel >= 0) & (rel < T)  # [T, L]
        prefix = (rel < 0)[None, None, :] & (cols[None, None, :] >= self.pad[:, None, None])
        return additive_mask(prefix | own[None], self.dtype)[:, None]

    def _step(self, ids: torch.Tensor, aux_ids: tuple | None, last_only: bool, L: int, tree=None):
        """The step (what a graph records): -> (logits [B, T or 1, V], argmax [B, T or 1], aux
        [B, T, n_aux*H] or None). ``L``: the columns attended over (:meth:`visible`). ``tree``:
        None, or (visible [T, T] bool, depth [T] int64), a tree step (:meth:`forward`)."""
        model = self.model
        q = self.start + torch.arange(ids.shape[1], device=self.device)
        mask, pos = (self._mask(q, L), self._positions(q)) if tree is None else \
            (self._tree_mask(tree[0], L), self._positions(self.start + tree[1]))
        for layer in self.cache.layers:  # looked up each step: a layer's first write may rebind it
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length.copy_(self.start)
        kw = {self._cache_kw: self.cache, "attention_mask": mask, "position_ids": pos, "use_cache": True}
        if self._cache_position:
            kw["cache_position"] = q
        if last_only and self._logits_to_keep:
            kw["logits_to_keep"] = 1
        with layers.capture_aux(model, list(aux_ids or ())) as aux_of, _grouped(model):
            out = model(input_ids=ids, output_hidden_states=bool(aux_ids), **kw)
        logits = out.logits[:, -1:] if last_only else out.logits
        return logits, logits.argmax(-1), (aux_of(out.hidden_states) if aux_ids else None)

    @torch.no_grad()
    def forward(self, ids, start: int, *, aux_ids=None, last_only: bool = False, graph: bool = True, tree=None):
        """Run ``ids`` at the cache columns ``start .. start + T - 1`` of every row.

        Args:
            ids: [B, T] int64 token ids (a tensor on any device, or nested lists).
            start: the column of the first token (the number of columns the rows hold before it).
            aux_ids: HF hidden-states indices to capture (:func:`eyas.target.layers.capture_aux`), or None.
            last_only: logits of the last column only.
            graph: replay (capturing on first use) the step's CUDA graph when the decoder has graphs;
                False runs it eagerly (a prompt's prefill, whose length varies).
            tree: None (a causal step: token t sees the columns before it), or ``(visible, depth)``
                for a draft tree verified in one step: ``visible`` [T, T] bool, which of the step's
                tokens each token sees (its ancestors and itself), ``depth`` [T] int64, each token's
                position after ``start`` (the tokens before ``start`` are visible to all).
        Returns:
            ``(logits [B, T', V] in the model's dtype, argmax [B, T'] int64, aux [B, T, n_aux*H] or
            None)``, T' = 1 with ``last_only`` else T, on the model's device. A graph's outputs are its
            static buffers: valid until the next step of the same decoder (clone what you keep).
        Raises:
            ValueError: ``ids`` not [B, T] for this decoder's B, or the columns run past ``max_len``.
            GraphCaptureError: the capture of a new step shape failed.
        """
        ids = torch.as_tensor(ids, dtype=torch.int64)
        if ids.ndim != 2 or ids.shape[0] != self.batch_size or ids.shape[1] < 1:
            raise ValueError(f"StaticDecoder: ids of shape {tuple(ids.shape)}, expected [{self.batch_size}, T >= 1]")
        if not 0 <= start or start + ids.shape[1] > self.max_len:
            raise ValueError(f"StaticDecoder: columns {start}..{start + ids.shape[1] - 1} outside the cache's "
                             f"{self.max_len}")
        inputs = [ids] if tree is None else [ids, torch.as_tensor(tree[0], dtype=torch.bool),
                                             torch.as_tensor(tree[1], dtype=torch.int64)]
        if tree is not None and (inputs[1].shape != (ids.shape[1],) * 2 or inputs[2].shape != (ids.shape[1],)):
            raise ValueError(f"StaticDecoder: a tree of visibility {tuple(inputs[1].shape)} and depths "
                             f"{tuple(inputs[2].shape)} for {ids.shape[1]} tokens")
        self.start.fill_(start)
        key = (ids.shape[1], tuple(aux_ids) if aux_ids else None, last_only, tree is not None,
               self.visible(start + ids.shape[1]))
        if not (self.graphs and graph):
            inputs = [x.to(self.device, non_blocking=True) for x in inputs]
            return self._step(inputs[0], key[1], last_only, key[4], None if tree is None else inputs[1:])
        g = self._steps.get(key)
        if g is None:
            g = self._steps[key] = self._capture(inputs, key)
        else:
            for static, x in zip(g.inputs, inputs):
                static.copy_(x, non_blocking=True)
        g.graph.replay()
        return g.outputs

    def _capture(self, inputs: list[torch.Tensor], key: tuple) -> _Graph:
        static = [x.to(self.device).clone() for x in inputs]
        args = (static[0], key[1], key[2], key[4], static[1:] or None)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(self.warmup):  # writes the same columns the step writes: harmless
                    self._step(*args)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA work of other threads (a stage's writer, a tracker) may go on meanwhile
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                outputs = self._step(*args)
        except Exception as e:
            raise GraphCaptureError(
                f"capturing the target's decode step in a CUDA graph failed (batch {self.batch_size}, "
                f"{key[0]} tokens per row, aux layers {key[1]}, last_only {key[2]}, tree {key[3]}, {key[4]} of the "
                f"cache's {self.max_len} columns): {type(e).__name__}: {e}. decode 'static' runs the same step without "
                f"graphs") from e
        # graphs share one memory pool; each graph's outputs stay referenced here, so no later
        # capture reuses their memory, and steps never run concurrently
        self._pool = graph.pool()
        self.captures += 1
        return _Graph(graph, static, outputs)

    @torch.no_grad()
    def move_columns(self, start: int, cols: list[int]) -> None:
        """After a tree step at ``start``: the keys and values of its columns ``start + cols[i]``
        move to ``start + i`` in every row and layer (the accepted path, in order), as
        ``DynamicCache`` rows are selected (eyas.eval.tree)."""
        if not cols:
            return
        src = torch.tensor([start + c for c in cols], dtype=torch.int64).to(self.device, non_blocking=True)
        for layer in self.cache.layers:
            for t in (layer.keys, layer.values):
                t[:, :, start:start + len(cols)] = t.index_select(2, src)


# per target and graphs flag, at most two decoders: one of batch 1 (the eval's loops) and one wider
# (batched greedy), kept while the target lives, so that the prompts of a stage reuse one cache and its
# captured graphs; a request that does not fit replaces the decoder of its kind (freed first)
_DECODERS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def decoder(model, batch_size: int, max_len: int, graphs: bool, *, more_rows: bool = False) -> StaticDecoder:
    """The :class:`StaticDecoder` of ``model`` for ``batch_size`` rows holding at least ``max_len``
    columns: the one kept from an earlier call when it fits (with ``more_rows``, one of more rows fits
    too: the caller pads its batch to ``decoder.batch_size``), else a new one of ``max_len`` rounded up to
    a multiple of :data:`LEN_QUANTUM`, replacing (and freeing before it allocates) the kept decoder of
    its kind: one of batch 1 and one wider are kept per target, for as long as the target lives
    (:func:`release` frees them sooner). A kept decoder of another device or dtype than the target's
    parameters now (a target moved or cast since) does not fit."""
    model = _inner(model)
    mine = _DECODERS.setdefault(model, {})
    slot = (batch_size == 1, graphs)
    d = mine.get(slot)
    p = next(model.parameters())
    if d is None or (d.device, d.dtype) != (p.device, p.dtype) or d.max_len < max_len \
            or not (d.batch_size == batch_size or more_rows and d.batch_size > batch_size):
        mine.pop(slot, None)
        d = None
        d = mine[slot] = StaticDecoder(model, batch_size, -(-max_len // LEN_QUANTUM) * LEN_QUANTUM, graphs=graphs)
    return d


def release(model) -> None:
    """Drop every decoder kept for ``model`` (its caches and graphs)."""
    _DECODERS.pop(_inner(model), None)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampling distribution of ``logits`` [..., V] at ``temperature`` > 0 and ``top_p`` in (0, 1]:
    float32 probabilities [..., V] (a new tensor; ``logits`` is only read), zero outside the nucleus.

    As transformers' ``generate`` samples (``src/transformers/generation/utils.py``, ``_sample``; the
    warpers in ``src/transformers/generation/logits_process.py``): the logits in float32 divided by the
    temperature (``TemperatureLogitsWarper``), then nucleus filtering (``TopPLogitsWarper``: sorted
    ascending, the tokens whose cumulative probability is <= ``1 - top_p`` removed, the most likely
    token always kept; skipped at ``top_p`` 1, as ``generate`` skips it), then the softmax.

    ``temperature`` may be an int (``2`` is ``2.0``).

    Raises:
        ValueError: ``temperature`` <= 0 (greedy has no distribution to sample) or ``top_p``
            outside (0, 1].
    """
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    if not temperature > 0:
        raise ValueError(f"target_probs: temperature must be > 0 (0 is greedy decoding), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"target_probs: top_p must be in (0, 1], got {top_p}")
    temperature = float(temperature)  # TemperatureLogitsWarper refuses an int
    shape = logits.shape
    scores = TemperatureLogitsWarper(temperature)(None, logits.reshape(-1, shape[-1]).float())
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1).reshape(shape)


# the seeds torch.Generator.manual_seed takes, [low, high)
SEED_RANGE = (-2 ** 63, 2 ** 64)


def check_batch_args(model, prompts_ids: list[list[int]], max_new_tokens: int, pad_id: int, stop_ids, *,
                     temperature: float, top_p: float, seed: int, caller: str) -> list[int]:
    """The arguments of a batched decode (:func:`decode_batch`, :func:`eyas.data.distill.generate_batch`)
    checked before any forward, so that a bad one is named instead of failing inside the target (an id
    outside the embedding is an ``IndexError`` on a CPU and a device-side assert on CUDA, after which the
    process can use CUDA no more).

    Args:
        model: a transformers causal LM (its input embeddings' rows are the vocabulary).
        prompts_ids, max_new_tokens, pad_id, stop_ids, temperature, top_p, seed: as :func:`decode_batch`
            takes them.
        caller: the function named at the start of each message.
    Returns:
        the stop ids as a list of ints (read once: a generator or a tensor of them is read here only).
    Raises:
        ValueError: ``stop_ids`` None (``[]`` is none), an empty prompt or one holding an id outside
            ``[0, vocabulary)`` (naming the prompt's index, the id and its position), ``pad_id`` outside it,
            ``max_new_tokens`` < 1, ``temperature`` < 0 or NaN, a sampled call's ``top_p`` outside (0, 1],
            ``seed`` not an int in :data:`SEED_RANGE` (``torch.Generator.manual_seed``'s range: negative
            seeds wrap to ``2**64 + seed``).
    """
    if stop_ids is None:
        raise ValueError(f"{caller}: stop_ids is None: pass the target's stop set (Target.stop_ids), or [] for none")
    V = _inner(model).get_input_embeddings().num_embeddings
    for i, p in enumerate(prompts_ids):
        if len(p) == 0:
            raise ValueError(f"{caller}: prompt {i} is empty")
        if not 0 <= min(p) <= max(p) < V:
            j = next(j for j, t in enumerate(p) if not 0 <= t < V)
            raise ValueError(f"{caller}: prompt {i} holds id {p[j]} at position {j}, outside the target's "
                             f"vocabulary [0, {V})")
    if not 0 <= pad_id < V:
        raise ValueError(f"{caller}: pad_id {pad_id} is outside the target's vocabulary [0, {V}) (every pad column "
                         f"is embedded, though masked)")
    if not max_new_tokens >= 1:
        raise ValueError(f"{caller}: max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0:  # a NaN too
        raise ValueError(f"{caller}: temperature must be >= 0 (0 = greedy), got {temperature}")
    if temperature > 0 and not 0 < top_p <= 1:
        raise ValueError(f"{caller}: top_p must be in (0, 1], got {top_p}")
    if not (isinstance(seed, numbers.Integral) and SEED_RANGE[0] <= seed < SEED_RANGE[1]):
        raise ValueError(f"{caller}: seed must be an int in [-2**63, 2**64), got {seed!r}")
    return [int(t) for t in stop_ids]


@torch.no_grad()
def decode_batch(model, prompts_ids: list[list[int]], max_new_tokens: int, pad_id: int, stop_ids, *,
                 graphs: bool, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 check_every: int = 8) -> list[list[int]]:
    """Greedy or sampled continuations of several prompts in one batch over the static cache: an
    eager prefill of the left-padded prompts, then one (graphed) one-token step per new token for
    every row, until every row has generated a stop id or ``max_new_tokens``.

    The batch is padded with one-token prompts to a power of two, or to the rows of a kept decoder
    that has more (:func:`decoder`: a stage's batches share one cache and its graphs). Whether every
    row has stopped is read every ``check_every`` steps (a host synchronisation); rows that stopped
    keep decoding and are cut at their stop id.

    Each new token is chosen from the step's last-position logits [B, V] (model dtype): greedy
    (``temperature`` 0) is their argmax, computed inside the step. Sampled (``temperature`` > 0),
    the prompts' rows draw it outside the step, eagerly from the logits the step (or its graph's
    static output) returned, as transformers' ``generate`` samples: ``torch.multinomial`` over
    :func:`target_probs` (temperature, then nucleus ``top_p``) of the ``n`` prompt rows [n, V], with
    a ``torch.Generator`` on the target's device seeded with ``seed`` (the global generator is
    neither read nor advanced). Each step draws for the ``n`` prompt rows only, so the tokens depend
    on the prompts, ``seed`` and the device, not on the padded batch or a kept decoder's rows; on a CPU
    they are those of ``generate`` after ``torch.manual_seed(seed)`` (the same draws from the same
    probabilities, up to the rounding of the logits). The pad rows take their argmax.

    Args:
        model: a transformers causal LM. prompts_ids: non-empty lists of ids in the target's vocabulary
            (none: no reply). max_new_tokens: >= 1.
        pad_id: the id at pad columns (masked; in the vocabulary). stop_ids: ids that end a row (any
            iterable of ints, read once; may be empty).
        graphs: replay the decode step from CUDA graphs.
        temperature: 0 greedy, > 0 sampled (an int is its float). top_p: the nucleus, in (0, 1] (read when
            sampled). seed: the sampling generator's seed, an int in :data:`SEED_RANGE`.
        check_every: steps between the reads of whether every row has stopped (>= 1).
    Returns:
        per prompt, the generated ids up to and including the first stop id
        (:func:`eyas.data.distill.generate_batch`'s contract).
    Raises:
        ValueError: a bad argument (:func:`check_batch_args`, naming it and its value), ``check_every``
            < 1, ``stop_ids`` None (``[]`` is none), before any forward.
        GraphCaptureError: the capture of a step shape failed.
    """
    model = _inner(model)
    stop_ids = check_batch_args(model, prompts_ids, max_new_tokens, pad_id, stop_ids, temperature=temperature,
                                top_p=top_p, seed=seed, caller="decode_batch")
    if not check_every >= 1:
        raise ValueError(f"decode_batch: check_every must be >= 1, got {check_every}")
    if not prompts_ids:
        return []
    sampled = temperature > 0
    n, T0 = len(prompts_ids), max(len(p) for p in prompts_ids)
    dec = decoder(model, _pow2(n), T0 + max_new_tokens, graphs, more_rows=True)
    B = dec.batch_size
    gen = torch.Generator(device=dec.device).manual_seed(int(seed)) if sampled else None

    def pick(step: int, logits: torch.Tensor, argmax: torch.Tensor) -> None:
        """Column ``step`` of ``out``: the argmax [B, 1]; sampled, the prompt rows drawn from the
        logits [B, 1, V] (read here, after the step: the graph records no sampling)."""
        out[:, step] = argmax[:, 0]
        if sampled:
            probs = target_probs(logits[:n, -1], temperature, top_p)                     # [n, V] float32
            out[:n, step] = torch.multinomial(probs, 1, generator=gen)[:, 0]

    rows = list(prompts_ids) + [[pad_id]] * (B - n)
    ids = torch.full((B, T0), pad_id, dtype=torch.int64)
    for i, p in enumerate(rows):
        ids[i, T0 - len(p):] = torch.tensor(p, dtype=torch.int64)
    dec.reset([T0 - len(p) for p in rows])
    out = torch.empty((B, max_new_tokens), dtype=torch.int64, device=dec.device)
    pick(0, *dec.forward(ids, 0, last_only=True, graph=False)[:2])
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.int64, device=dec.device)
    done = torch.isin(out[:n, 0], stop)
    steps = 1
    while steps < max_new_tokens:
        if steps % check_every == 0 and bool(done.all()):
            break
        pick(steps, *dec.forward(out[:, steps - 1:steps], T0 + steps - 1, last_only=True)[:2])
        done |= torch.isin(out[:n, steps], stop)
        steps += 1
    stop_set = set(stop_ids)
    result = []
    for g in out[:n, :steps].tolist():
        j = next((j for j, t in enumerate(g) if t in stop_set), None)
        result.append(g if j is None else g[:j + 1])
    return result
