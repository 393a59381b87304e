"""Triton kernels for the three memory-bound pieces of a TTT unroll on CUDA.

Each has a plain-torch definition that stays the reference (and the CPU path):
:func:`eyas.drafter.head_loss.soft_cross_entropy_grad`, :func:`eyas.drafter.attention.merge_diagonal` and
:func:`eyas.drafter.model.swiglu`. Under torch.compile, Inductor turns the first two into several passes
over their data (the diagonal merge: five kernels per step, fwd+bwd), and runs the SwiGLU backward
well under the memory bandwidth (the measurements: dev/results/kernels.json, profile_train.json,
train_8192.json). The kernels here read each input once per
pass they need and keep every intermediate in registers (math in float32, stored in the inputs'
dtype).

Importing this module needs Triton (shipped with CUDA builds of torch); nothing imports it on CPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# --- head loss: soft cross-entropy against the teacher, with the logits' gradient ---------------

@triton.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=w)
                          for b, w in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16))],
                 key=["V", "WITH_GRAD"])
@triton.jit
def _head_ce_kernel(z_ptr, t_ptr, tlse_ptr, w_ptr, loss_ptr, argmax_ptr, grad_ptr, V: tl.constexpr, T,
                    s_zb, s_zt, s_tb, s_tt, s_lb, s_lt, s_gb, s_gt,
                    BLOCK: tl.constexpr, WITH_GRAD: tl.constexpr):
    t_idx = tl.program_id(0).to(tl.int64)  # int64 offsets: B * T * V may exceed 2**31
    b_idx = tl.program_id(1).to(tl.int64)
    z_row = z_ptr + b_idx * s_zb + t_idx * s_zt
    t_row = t_ptr + b_idx * s_tb + t_idx * s_tt
    tlse = tl.load(tlse_ptr + b_idx * s_lb + t_idx * s_lt)
    offs = tl.arange(0, BLOCK)
    # pass 1: online log-sum-exp of z, sum(p), sum(p * z), first argmax
    m = -float("inf")
    s = 0.0
    psum = 0.0
    pz = 0.0
    best = -float("inf")
    best_idx = 0
    for start in range(0, V, BLOCK):
        idx = start + offs
        inb = idx < V
        z = tl.load(z_row + idx, mask=inb, other=-float("inf")).to(tl.float32)
        t = tl.load(t_row + idx, mask=inb, other=-float("inf")).to(tl.float32)
        p = tl.exp(t - tlse)
        bmax = tl.max(z, 0)
        bidx = tl.argmax(z, 0)
        new_m = tl.maximum(m, bmax)
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(z - new_m), 0)
        m = new_m
        psum += tl.sum(p, 0)
        pz += tl.sum(tl.where(inb, p * z, 0.0), 0)
        better = bmax > best
        best_idx = tl.where(better, start + bidx, best_idx)
        best = tl.where(better, bmax, best)
    lse = m + tl.log(s)
    row = b_idx * T + t_idx
    tl.store(loss_ptr + row, lse * psum - pz)
    tl.store(argmax_ptr + row, best_idx.to(tl.int64))
    if WITH_GRAD:
        # pass 2: grad = w * (softmax(z) * sum(p) - p); rows of weight 0 only write zeros
        wgt = tl.load(w_ptr + row)
        g_row = grad_ptr + b_idx * s_gb + t_idx * s_gt
        for start in range(0, V, BLOCK):
            idx = start + offs
            inb = idx < V
            if wgt != 0.0:
                z = tl.load(z_row + idx, mask=inb, other=0.0).to(tl.float32)
                t = tl.load(t_row + idx, mask=inb, other=0.0).to(tl.float32)
                g = wgt * (tl.exp(z - lse) * psum - tl.exp(t - tlse))
            else:
                g = tl.zeros([BLOCK], dtype=tl.float32)
            tl.store(g_row + idx, g.to(grad_ptr.dtype.element_ty), mask=inb)


def soft_cross_entropy_grad(logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_lse: torch.Tensor,
                            weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton version of :func:`eyas.drafter.head_loss.soft_cross_entropy_grad` (``weight=None``: loss and
    argmax only, as :func:`eyas.drafter.head_loss.soft_cross_entropy`). The vocab block and warp count are
    autotuned on first use per (V, with gradient), so before a CUDA graph capture.

    Args:
        logits: [B, T, V] contiguous on CUDA; teacher_logits [B, T, V] (rows may be strided: a
            window of a longer tensor); teacher_lse [B, T] float32; weight [B, T] float32.
    Returns:
        (loss [B, T] float32, argmax [B, T] int64, grad [B, T, V] in logits.dtype or None). The
        loss is computed as ``lse(z) * sum(p) - sum(p * z)`` in float32 (one pass).
    Raises:
        ValueError: shapes that do not match, or a vocab dim that is not contiguous.
    """
    B, T, V = logits.shape
    if teacher_logits.shape != logits.shape or teacher_lse.shape != (B, T) or (
            weight is not None and weight.shape != (B, T)):
        raise ValueError(f"head loss kernel: logits {tuple(logits.shape)} need teacher_logits of the same shape "
                         f"and teacher_lse/weight [B, T]; got {tuple(teacher_logits.shape)}, "
                         f"{tuple(teacher_lse.shape)}, {None if weight is None else tuple(weight.shape)}")
    if logits.stride(2) != 1 or teacher_logits.stride(2) != 1:
        raise ValueError("head loss kernel: the vocab dim of logits and teacher_logits must be contiguous")
    loss = torch.empty(B, T, device=logits.device, dtype=torch.float32)
    argmax = torch.empty(B, T, device=logits.device, dtype=torch.int64)
    grad = torch.empty_like(logits) if weight is not None else None
    w = weight.contiguous() if weight is not None else loss  # unread without the gradient
    g = grad if grad is not None else logits
    _head_ce_kernel[(T, B)](logits, teacher_logits, teacher_lse, w, loss, argmax, g, V, T,
                            logits.stride(0), logits.stride(1), teacher_logits.stride(0), teacher_logits.stride(1),
                            teacher_lse.stride(0), teacher_lse.stride(1), g.stride(0), g.stride(1),
                            WITH_GRAD=weight is not None)
    return loss, argmax, grad


# --- the diagonal merge of TTT attention ---------------------------------------------------------
# One program per (position t, batch, kv head): the REP query heads of that kv head at t, the n
# diagonal keys/values at t and the step-0 partial result (o0, lse0). Everything one program needs
# is [REP, n, hd]: no reduction crosses programs, so the backward needs no atomics. Strides are
# passed per tensor group, so no input is copied to a contiguous layout: q and dq share q's
# strides; o0 and do0 share o0's; o and its gradient share o's (o is laid out [B, T, nh, hd], the
# layout the o_proj GEMM reads); lse0, lse and dlse0 are [B, nh, T] contiguous; kd, vd, dkd and
# dvd are [n, B, nkv, T, hd] contiguous: stacked on a new FIRST dim, each step's keys are one
# contiguous copy, and the gradient of each is a contiguous slice.

_MERGE_CONFIGS = [triton.Config({}, num_warps=w) for w in (1, 2, 4)]


@triton.jit
def _merge_load(q_ptr, o0_ptr, lse0_ptr, kd_ptr, vd_ptr, n, REP, HD, T,
                s_qb, s_qh, s_qt, s_0b, s_0h, s_0t, s_kw, s_kb, s_kg, s_kt,
                REP_P: tl.constexpr, W_P: tl.constexpr, HD_P: tl.constexpr):
    # this program's (position, batch, kv head) and every input it reads, in float32
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    g = tl.program_id(2).to(tl.int64)
    r = tl.arange(0, REP_P)
    w = tl.arange(0, W_P)
    d = tl.arange(0, HD_P)
    h = g * REP + r
    rd = (r[:, None] < REP) & (d[None, :] < HD)
    wd = (w[:, None] < n) & (d[None, :] < HD)
    q = tl.load(q_ptr + b * s_qb + h[:, None] * s_qh + t * s_qt + d[None, :], mask=rd, other=0.0).to(tl.float32)
    o0 = tl.load(o0_ptr + b * s_0b + h[:, None] * s_0h + t * s_0t + d[None, :], mask=rd, other=0.0).to(tl.float32)
    l_off = (b * tl.num_programs(2) * REP + h) * T + t  # lse0 [B, nh, T] contiguous
    lse0 = tl.load(lse0_ptr + l_off, mask=r < REP, other=0.0)
    kv_off = w[:, None] * s_kw + b * s_kb + g * s_kg + t * s_kt + d[None, :]
    kd = tl.load(kd_ptr + kv_off, mask=wd, other=0.0).to(tl.float32)
    vd = tl.load(vd_ptr + kv_off, mask=wd, other=0.0).to(tl.float32)
    return t, b, q, o0, lse0, kd, vd, h, rd, wd, kv_off, l_off


@triton.autotune(configs=_MERGE_CONFIGS, key=["n", "REP", "HD"])
@triton.jit
def _merge_fwd_kernel(q_ptr, o0_ptr, lse0_ptr, kd_ptr, vd_ptr, o_ptr, lse_ptr, n, T, REP, HD, scale,
                      s_qb, s_qh, s_qt, s_0b, s_0h, s_0t, s_ob, s_oh, s_ot, s_kw, s_kb, s_kg, s_kt,
                      REP_P: tl.constexpr, W_P: tl.constexpr, HD_P: tl.constexpr):
    t, b, q, o0, lse0, kd, vd, h, rd, wd, kv_off, l_off = _merge_load(
        q_ptr, o0_ptr, lse0_ptr, kd_ptr, vd_ptr, n, REP, HD, T,
        s_qb, s_qh, s_qt, s_0b, s_0h, s_0t, s_kw, s_kb, s_kg, s_kt, REP_P, W_P, HD_P)
    w = tl.arange(0, W_P)
    s = tl.sum(q[:, None, :] * kd[None, :, :], 2) * scale            # [REP, W]
    s = tl.where(w[None, :] < n, s, -float("inf"))
    m = tl.maximum(tl.max(s, 1), lse0)
    e0 = tl.exp(lse0 - m)
    es = tl.exp(s - m[:, None])
    den = e0 + tl.sum(es, 1)
    o = (e0 / den)[:, None] * o0 + tl.sum((es / den[:, None])[:, :, None] * vd[None, :, :], 1)
    r = tl.arange(0, REP_P)
    d = tl.arange(0, HD_P)
    tl.store(o_ptr + b * s_ob + h[:, None] * s_oh + t * s_ot + d[None, :], o.to(o_ptr.dtype.element_ty), mask=rd)
    tl.store(lse_ptr + l_off, m + tl.log(den), mask=r < REP)


@triton.autotune(configs=_MERGE_CONFIGS, key=["n", "REP", "HD"])
@triton.jit
def _merge_bwd_kernel(q_ptr, o0_ptr, lse0_ptr, kd_ptr, vd_ptr, lse_ptr, do_ptr,
                      dq_ptr, do0_ptr, dlse0_ptr, dkd_ptr, dvd_ptr, n, T, REP, HD, scale,
                      s_qb, s_qh, s_qt, s_0b, s_0h, s_0t, s_ob, s_oh, s_ot, s_kw, s_kb, s_kg, s_kt,
                      REP_P: tl.constexpr, W_P: tl.constexpr, HD_P: tl.constexpr):
    t, b, q, o0, lse0, kd, vd, h, rd, wd, kv_off, l_off = _merge_load(
        q_ptr, o0_ptr, lse0_ptr, kd_ptr, vd_ptr, n, REP, HD, T,
        s_qb, s_qh, s_qt, s_0b, s_0h, s_0t, s_kw, s_kb, s_kg, s_kt, REP_P, W_P, HD_P)
    r = tl.arange(0, REP_P)
    w = tl.arange(0, W_P)
    d = tl.arange(0, HD_P)
    q_off = b * s_qb + h[:, None] * s_qh + t * s_qt + d[None, :]
    o0_off = b * s_0b + h[:, None] * s_0h + t * s_0t + d[None, :]
    lse = tl.load(lse_ptr + l_off, mask=r < REP, other=0.0)
    do = tl.load(do_ptr + b * s_ob + h[:, None] * s_oh + t * s_ot + d[None, :], mask=rd, other=0.0).to(tl.float32)
    s = tl.sum(q[:, None, :] * kd[None, :, :], 2) * scale
    pw = tl.where(w[None, :] < n, tl.exp(s - lse[:, None]), 0.0)      # [REP, W]
    a0 = tl.exp(lse0 - lse)                                           # [REP]
    pv = tl.sum(pw[:, :, None] * vd[None, :, :], 1)                   # [REP, HD]
    do_o0 = tl.sum(do * o0, 1)
    D = a0 * do_o0 + tl.sum(do * pv, 1)                               # sum_d do * o
    dpw = tl.sum(do[:, None, :] * vd[None, :, :], 2)                  # [REP, W]
    ds = pw * (dpw - D[:, None]) * scale
    dq = tl.sum(ds[:, :, None] * kd[None, :, :], 1)
    dkd = tl.sum(ds[:, :, None] * q[:, None, :], 0)                   # [W, HD]
    dvd = tl.sum(pw[:, :, None] * do[:, None, :], 0)
    tl.store(dq_ptr + q_off, dq.to(dq_ptr.dtype.element_ty), mask=rd)
    tl.store(do0_ptr + o0_off, (a0[:, None] * do).to(do0_ptr.dtype.element_ty), mask=rd)
    tl.store(dlse0_ptr + l_off, a0 * (do_o0 - D), mask=r < REP)
    tl.store(dkd_ptr + kv_off, dkd.to(dkd_ptr.dtype.element_ty), mask=wd)
    tl.store(dvd_ptr + kv_off, dvd.to(dvd_ptr.dtype.element_ty), mask=wd)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its layout is dense (``empty_like`` keeps its strides, so gradients
    allocated like it share them), else a contiguous copy (a slice of a wider tensor, an expand)."""
    return x if torch.empty_like(x, device="meta").stride() == x.stride() and x.stride(-1) == 1 else x.contiguous()


def _merge_launch(kernel, q, o0, o, kd, *tensors):
    B, nh, T, hd = q.shape
    n, nkv = kd.shape[0], kd.shape[2]
    kernel[(T, B, nkv)](*tensors, n, T, nh // nkv, hd, 1.0 / math.sqrt(hd), *q.stride()[:3], *o0.stride()[:3],
                        *o.stride()[:3], *kd.stride()[:4], REP_P=triton.next_power_of_2(nh // nkv),
                        W_P=triton.next_power_of_2(n), HD_P=triton.next_power_of_2(hd))


class DiagonalMerge(torch.autograd.Function):
    """Triton forward/backward of :func:`eyas.drafter.attention.merge_diagonal`, with kd and vd stacked on
    their FIRST dim, [n, B, nkv, T, hd], and without ``valid`` (all n entries are real). q and o0
    are read in place when their layout is dense (e.g. a transposed view; else copied); the output
    is [B, nh, T, hd] laid out as [B, T, nh, hd] (a transposed view), the layout o_proj reads, so
    reshaping it to [B, T, nh * hd] copies nothing.

    Raises:
        ValueError: shapes that do not fit together (``forward``)."""

    @staticmethod
    def forward(ctx, q, o0, lse0, kd, vd):
        B, nh, T, hd = q.shape
        n, _, nkv = kd.shape[:3]
        if nh % nkv or o0.shape != q.shape or lse0.shape != (B, nh, T) or kd.shape != (n, B, nkv, T, hd) \
                or vd.shape != kd.shape:
            raise ValueError(f"diagonal merge: q {tuple(q.shape)} needs o0 of its shape, lse0 [B, nh, T] and kd/vd "
                             f"[n, B, nkv, T, hd] with nkv dividing nh; got o0 {tuple(o0.shape)}, lse0 "
                             f"{tuple(lse0.shape)}, kd {tuple(kd.shape)}, vd {tuple(vd.shape)}")
        q, o0 = _dense(q), _dense(o0)
        lse0, kd, vd = lse0.contiguous(), kd.contiguous(), vd.contiguous()
        o = torch.empty(B, T, nh, hd, device=q.device, dtype=q.dtype).transpose(1, 2)
        lse = torch.empty_like(lse0)
        _merge_launch(_merge_fwd_kernel, q, o0, o, kd, q, o0, lse0, kd, vd, o, lse)
        ctx.save_for_backward(q, o0, lse0, kd, vd, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, o0, lse0, kd, vd, lse = ctx.saved_tensors
        if do.stride(3) != 1:
            do = do.contiguous()
        dq, do0, dkd, dvd = (torch.empty_like(x) for x in (q, o0, kd, vd))
        dlse0 = torch.empty_like(lse0)
        _merge_launch(_merge_bwd_kernel, q, o0, do, kd, q, o0, lse0, kd, vd, lse, do, dq, do0, dlse0, dkd, dvd)
        return dq, do0, dlse0, dkd, dvd


# --- SwiGLU: silu(gate) * up over the gate_up GEMM's output ------------------------------------
# One program per (row, block of I columns): a row of the [M, 2I] GEMM output holds the gate in
# its first I columns and up in its last I (eyas.drafter.model.LayerWeights.gate_up), so both halves are
# read in place, without the chunk's strided views. Inputs are made contiguous [M, 2I] / [M, I]
# (views of the GEMM's outputs: no copy); math in float32, stored in the input's dtype.

_SWIGLU_BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inb = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=inb, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=inb, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * I + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=inb)


@triton.jit
def _swiglu_bwd_kernel(gu_ptr, dout_ptr, dgu_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inb = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=inb, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=inb, other=0.0).to(tl.float32)
    d = tl.load(dout_ptr + row * I + cols, mask=inb, other=0.0).to(tl.float32)
    sg = tl.sigmoid(g)
    # d/dg silu(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    tl.store(dgu_ptr + row * 2 * I + cols, (d * u * sg * (1.0 + g * (1.0 - sg))).to(dgu_ptr.dtype.element_ty),
             mask=inb)
    tl.store(dgu_ptr + row * 2 * I + I + cols, (d * g * sg).to(dgu_ptr.dtype.element_ty), mask=inb)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous [M, last dim] matrix (a view when ``x`` is contiguous)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def _swiglu_grid(M: int, I: int):
    return M, triton.cdiv(I, _SWIGLU_BLOCK)


@torch.library.custom_op("eyas::swiglu", mutates_args=())
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`eyas.drafter.model.swiglu`: ``silu(gate) * up`` of ``gate_up``
    [..., 2I] (gate in the first I columns, up in the last I), as [..., I] in its dtype.

    A ``torch.library`` custom op with its backward registered (:func:`swiglu_backward`), so
    torch.compile keeps it as one node of the compiled layer (``torch.library.custom_op``,
    https://pytorch.org/docs/stable/library.html) and a CUDA graph captures it.

    Raises:
        ValueError: an odd last dim.
    """
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dim of gate_up {tuple(gate_up.shape)} must be 2I (gate, then up)")
    gu = _rows(gate_up)
    I = gu.shape[1] // 2
    out = torch.empty(gu.shape[0], I, device=gu.device, dtype=gu.dtype)
    _swiglu_fwd_kernel[_swiglu_grid(gu.shape[0], I)](gu, out, I, BLOCK=_SWIGLU_BLOCK)
    return out.reshape(*gate_up.shape[:-1], I)


@swiglu.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op("eyas::swiglu_backward", mutates_args=())
def swiglu_backward(gate_up: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`swiglu` with respect to ``gate_up`` [..., 2I], given ``grad_out``
    [..., I]: ``[grad * up * silu'(gate), grad * silu(gate)]`` in ``gate_up``'s dtype, laid out as
    ``gate_up`` (the gate_up GEMM's backward reads it as one [M, 2I] matrix)."""
    gu, d = _rows(gate_up), _rows(grad_out)
    I = gu.shape[1] // 2
    dgu = torch.empty_like(gu)
    _swiglu_bwd_kernel[_swiglu_grid(gu.shape[0], I)](gu, d, dgu, I, BLOCK=_SWIGLU_BLOCK)
    return dgu.reshape(gate_up.shape)


@swiglu_backward.register_fake
def _(gate_up, grad_out):
    return gate_up.new_empty(gate_up.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_grad(ctx, grad_out):
    (gate_up,) = ctx.saved_tensors
    return swiglu_backward(gate_up, grad_out)


swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)
