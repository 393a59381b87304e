"""The drafter head's loss: lm_head logits scored against the teacher, gradient made in the forward.

Per position t, with student logits ``z = x[t] @ W.T`` over the draft vocab and the teacher
``p = exp(teacher_logits[t] - teacher_lse[t])`` (the target's distribution restricted to the draft
vocab, eyas.training.unroll.teacher_logits), the token loss is the soft cross-entropy

    loss[t] = -sum_v p[v] * log_softmax(z)[v]

and a TTT step's loss is ``sum_t weight[t] * loss[t]`` (the weight holds the step mask, the
step's normaliser and its decay). Its gradient with respect to the logits is known in closed form,

    d/dz[t] = weight[t] * (softmax(z[t]) * sum_v p[v] - p)

so :class:`HeadLoss` computes it in the same pass over the [N, V] logits that computes the loss
(one read of the student and teacher logits, one bf16 write), keeps it instead of the logits,
and its backward is just the two GEMMs of the lm_head. Autograd through ``log_softmax`` would
read the [N, V] logits again in a second kernel and keep fp32 intermediates (the same fusion as
Liger-Kernel's fused linear cross-entropy, written with torch.compile instead of a hand kernel).
"""

from __future__ import annotations

import torch

from eyas.drafter.backend import REFERENCE, Backend
from eyas.drafter.compiling import compiled


def soft_cross_entropy(logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_lse: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token losses and draft argmax, computed in float32.

    Args:
        logits: [..., V] student logits (any float dtype).
        teacher_logits: [..., V] and teacher_lse [...]: the teacher is
            ``exp(teacher_logits - teacher_lse)``.
    Returns:
        (loss [...] float32, argmax [...] int64 of ``logits``).
    """
    z = logits.float()
    logp = z - z.logsumexp(-1, keepdim=True)
    p = torch.exp(teacher_logits.float() - teacher_lse[..., None])
    return -(p * logp).sum(-1), z.argmax(-1)


def soft_cross_entropy_grad(logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_lse: torch.Tensor,
                            weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`soft_cross_entropy` plus the gradient of ``sum(weight * loss)`` with respect to
    ``logits``: ``weight[..., None] * (softmax(logits) * p.sum(-1) - p)`` (float32 math), returned
    in ``logits.dtype`` (bf16 on CUDA: the dtype autograd would hand the lm_head GEMMs).

    Args:
        weight: [...] float32 per-position weight of the loss (0 where unsupervised).
    Returns:
        (loss [...] float32, argmax [...] int64, grad [..., V] in logits.dtype).
    """
    z = logits.float()
    lse = z.logsumexp(-1, keepdim=True)
    logp = z - lse
    p = torch.exp(teacher_logits.float() - teacher_lse[..., None])
    grad = weight[..., None] * (torch.exp(logp) * p.sum(-1, keepdim=True) - p)
    return -(p * logp).sum(-1), z.argmax(-1), grad.to(logits.dtype)


class HeadLoss(torch.autograd.Function):
    """``sum(weight * soft_cross_entropy(x @ W.T, teacher))`` with the logits' gradient made in
    the forward (module docstring). Use :func:`head_loss`."""

    @staticmethod
    def forward(ctx, x, head_weight, teacher_logits, teacher_lse, weight, backend):
        logits = torch.matmul(x, head_weight.T)
        loss, argmax, grad = _loss_fn(x, True, backend)(logits, teacher_logits, teacher_lse, weight)
        del logits
        ctx.save_for_backward(x, head_weight, grad)
        ctx.backend = backend
        ctx.mark_non_differentiable(loss, argmax)
        return (weight * loss).sum(), loss, argmax

    @staticmethod
    def backward(ctx, g, _loss, _argmax):
        x, head_weight, grad = ctx.saved_tensors
        gx = gw = None
        scale = _scale if grad.device.type != "cuda" else compiled(ctx.backend, "scale", _scale)
        if ctx.needs_input_grad[0]:
            gx = scale(torch.matmul(grad, head_weight), g)
        if ctx.needs_input_grad[1]:
            gw = scale(torch.matmul(grad.flatten(0, -2).T, x.flatten(0, -2)), g)
        return gx, gw, None, None, None, None


def _scale(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``x * g`` computed in float32 (the upstream gradient ``g`` is not rounded to bf16 first)."""
    return (x.float() * g).to(x.dtype)


def head_loss(x: torch.Tensor, head_weight: torch.Tensor, teacher_logits: torch.Tensor,
              teacher_lse: torch.Tensor, weight: torch.Tensor, backend: Backend = REFERENCE
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weighted head loss of normed hidden states.

    Args:
        x: [B, T, H] the final-normed drafter hidden states, in the lm_head's dtype.
        head_weight: [V, H] the lm_head weight (V = draft vocab).
        teacher_logits: [B, T, V]; teacher_lse: [B, T] float32 (eyas.training.unroll.teacher_logits).
        weight: [B, T] float32 per-position loss weight (0 where unsupervised).
    Returns:
        (``sum(weight * loss)``: scalar float32 with grad to ``x`` and ``head_weight``, the token
        losses [B, T] float32 and the draft argmax [B, T] int64, both without grad). Without grad
        mode (evaluation) no gradient is made. On CUDA the loss pass is the Triton kernel of
        :mod:`eyas.drafter.kernels` when ``backend`` says so (:meth:`eyas.drafter.backend.Backend.triton_kernels`),
        else the torch definition, compiled (static shapes) when ``backend.compile`` is on.
    """
    if torch.is_grad_enabled() and (x.requires_grad or head_weight.requires_grad):
        return HeadLoss.apply(x, head_weight, teacher_logits, teacher_lse, weight, backend)
    loss, argmax = _loss_fn(x, False, backend)(torch.matmul(x, head_weight.T), teacher_logits, teacher_lse)
    return (weight * loss).sum(), loss, argmax


def _loss_fn(x: torch.Tensor, with_grad: bool, backend: Backend):
    """The loss pass for ``x``'s device: the Triton kernel on CUDA when ``backend`` allows, else the
    torch definition, through :func:`eyas.drafter.compiling.compiled` on CUDA."""
    if backend.triton_kernels(x):
        from eyas.drafter import kernels as triton_ttt

        if with_grad:
            return triton_ttt.soft_cross_entropy_grad
        return lambda z, t, lse: triton_ttt.soft_cross_entropy_grad(z, t, lse, None)[:2]
    fn = soft_cross_entropy_grad if with_grad else soft_cross_entropy
    return fn if x.device.type != "cuda" else compiled(backend, fn.__name__, fn)
