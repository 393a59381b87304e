"""TTT attention: the dense reference and the block-sparse flex_attention path for CUDA.

At TTT step k of a packed batch the keys are [step-0 keys | step-1 keys | ... | step-k keys]
(each T long); query t may see step-0 key j when j <= t in the same document, and key t of every
later step (the diagonal: the keys a chain draft would have at serving time).
:func:`dense_ttt_attention` scores all of them (the reference, and what the CPU tests check);
:func:`flex_ttt_attention` covers the step-0 part with one block-sparse ``flex_attention`` call
(every all-masked 128x128 tile skipped: no [T, T] score matrix) and :func:`merge_diagonal` adds
the diagonal keys through the log-sum-exp. Which one runs is the :class:`eyas.drafter.backend.Backend`'s
choice (:meth:`~eyas.drafter.backend.Backend.flex_attention`).
"""

from __future__ import annotations

import math

import torch

from eyas.drafter.backend import Backend
from eyas.drafter.compiling import compiled


def expand_kv(t: torch.Tensor, rep: int) -> torch.Tensor:
    """Grouped-query attention: kv heads [B, nkv, T, hd] -> [B, nkv * rep, T, hd]."""
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def dense_ttt_attention(q: torch.Tensor, cache: list, doc_ids: torch.Tensor) -> torch.Tensor:
    """TTT attention of q [B, nh, T, hd] over the cached (k, v) [B, nkv, T, hd] of steps 0..n, by
    scoring every allowed key (module docstring): [B, nh, T, hd] in q's dtype, softmax in float32.
    ``doc_ids`` [B, T] int64: attention never crosses packed documents."""
    rep = q.shape[1] // cache[0][0].shape[1]
    k0, v0 = expand_kv(cache[0][0], rep), expand_kv(cache[0][1], rep)
    scale = 1.0 / math.sqrt(q.shape[-1])
    T = q.shape[2]
    s0 = torch.matmul(q, k0.transpose(-1, -2)) * scale  # [B, nh, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    allowed = causal[None] & (doc_ids[:, :, None] == doc_ids[:, None, :])
    s0 = s0.masked_fill(~allowed[:, None], float("-inf"))
    diag = [(q * expand_kv(kj, rep)).sum(-1, keepdim=True) * scale for kj, _ in cache[1:]]
    scores = torch.cat([s0, *diag], dim=-1).float().softmax(-1).to(q.dtype)
    o = torch.matmul(scores[..., :T], v0)
    for j, (_, vj) in enumerate(cache[1:]):
        o = o + scores[..., T + j : T + j + 1] * expand_kv(vj, rep)
    return o


_mask_memo: tuple | None = None  # (weakref to doc_ids, its _version, BlockMask)


def doc_causal_block_mask(doc_ids: torch.Tensor, backend: Backend):
    """The flex_attention BlockMask of causal attention inside packed documents: query t sees
    key j <= t when ``doc_ids[b, t] == doc_ids[b, j]`` (doc_ids [B, T] int64); built by a
    compiled function on CUDA when ``backend.compile`` is on. Memoised on the tensor and its
    version: every TTT step of a batch shares one mask, and ``copy_`` into ``doc_ids`` (as
    eyas.training.loop.GraphedTTT does, inside its graph) builds a new one."""
    global _mask_memo
    import weakref

    from torch.nn.attention.flex_attention import create_block_mask

    m = _mask_memo
    if m is not None and m[0]() is doc_ids and m[1] == doc_ids._version:
        return m[2]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    B, T = doc_ids.shape
    mask = create_block_mask(mask_mod, B, None, T, T, device=doc_ids.device,
                             _compile=backend.compile and doc_ids.device.type == "cuda")
    _mask_memo = (weakref.ref(doc_ids), doc_ids._version, mask)
    return mask


def merge_diagonal(q: torch.Tensor, o0: torch.Tensor, lse0: torch.Tensor, kd: torch.Tensor,
                   vd: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Add the diagonal keys of TTT steps 1..n to attention over the step-0 keys, exactly.

    Args:
        q: [B, nh, T, hd] queries; o0 [B, nh, T, hd] their attention output over the step-0 keys
            and lse0 [B, nh, T] float32 its log-sum-exp of scaled scores (natural log).
        kd, vd: [B, nkv, T, W, hd] the keys/values of steps 1..n stacked (W >= n; query t sees only
            index t of each; grouped-query: head h uses kv head h // (nh / nkv)).
        valid: [W] bool, True for the n real entries of kd/vd (the rest is padding, never seen).
    Returns:
        [B, nh, T, hd] in q's dtype: softmax attention over the union of the step-0 keys and the n
        diagonal keys, the two parts weighted by their log-sum-exps (computed in float32).
    """
    B, nh, T, hd = q.shape
    nkv = kd.shape[1]
    qg = q.float().view(B, nkv, nh // nkv, T, 1, hd)
    s = (qg * kd.float()[:, :, None]).sum(-1) / math.sqrt(hd)  # [B, nkv, rep, T, W]
    s = s.masked_fill(~valid, float("-inf"))
    lse0 = lse0.view(B, nkv, nh // nkv, T)
    lse = torch.logaddexp(lse0, torch.logsumexp(s, dim=-1))
    o = o0.float().view(B, nkv, nh // nkv, T, hd) * torch.exp(lse0 - lse)[..., None]
    o = o + (torch.exp(s - lse[..., None])[..., None] * vd.float()[:, :, None]).sum(-2)
    return o.view(B, nh, T, hd).to(q.dtype)


def flex_ttt_attention(q: torch.Tensor, cache: list, doc_ids: torch.Tensor, backend: Backend) -> torch.Tensor:
    """TTT attention of q [B, nh, T, hd] over the cached (k, v) of steps 0..n: [B, nh, T, hd].

    The step-0 keys go through one block-sparse flex_attention call with the causal same-document
    mask (:func:`doc_causal_block_mask`, the same at every step), which also returns its
    log-sum-exp; the keys of steps 1..n are one per query (its own index), so
    :func:`merge_diagonal` adds them with per-row dot products. No n*T key set is concatenated
    and no kernel tile is spent on a diagonal key. The stacked diagonal keys are one compiled
    graph for every n >= 2 (their count is marked dynamic); n = 1 is padded to 2. ``backend``
    decides what is compiled and whether the merge is the Triton kernel
    (:class:`eyas.drafter.kernels.DiagonalMerge`)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    k0, v0 = cache[0]
    o0, aux = compiled(backend, "flex", flex_attention, dynamic=None)(
        q, k0.to(q.dtype), v0.to(q.dtype), block_mask=doc_causal_block_mask(doc_ids, backend),
        enable_gqa=q.shape[1] != k0.shape[1], return_aux=AuxRequest(lse=True))
    n = len(cache) - 1
    if n == 0:
        return o0
    if backend.triton_kernels(q):
        from eyas.drafter.kernels import DiagonalMerge

        kd = torch.stack([k for k, _ in cache[1:]])
        vd = torch.stack([v for _, v in cache[1:]])
        return DiagonalMerge.apply(q, o0, aux.lse, kd, vd)
    pad = [torch.zeros_like(k0)] * (n == 1)  # a size-1 dim would be specialised, not dynamic
    kd = torch.stack([k for k, _ in cache[1:]] + pad, dim=3)
    vd = torch.stack([v for _, v in cache[1:]] + pad, dim=3)
    valid = torch.arange(kd.shape[3], device=q.device) < n
    for t in (kd, vd, valid):
        torch._dynamo.maybe_mark_dynamic(t, t.dim() - 2 if t.dim() > 1 else 0)
    return compiled(backend, "merge", merge_diagonal)(q, o0, aux.lse, kd, vd, valid)


