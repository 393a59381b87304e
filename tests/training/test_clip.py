"""eyas.training.loop.clip_in_step: the clip left to the fused AdamW kernel equals clip_grad_norm_ then the
step, with the clip active and not, over several steps and two param groups (CPU fused AdamW;
CUDA's too on a GPU)."""

import math

import pytest
import torch

from eyas.training.loop import clip_in_step

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_in_step_equals_clip_then_step(device, max_norm):
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(40, 24, generator=g), torch.randn(24, generator=g), torch.randn(3, 5, generator=g)]
    ours = [p.clone().to(device).requires_grad_() for p in init]
    ref = [p.clone().to(device).requires_grad_() for p in init]
    frozen = torch.zeros(4, device=device, requires_grad=True)  # no gradient: skipped, not updated

    def groups(ps, extra=()):  # two groups, as a trainer with decay / no-decay groups has
        return [{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:] + list(extra), "weight_decay": 0.0}]

    opt = torch.optim.AdamW(groups(ours, [frozen]), lr=1e-2, fused=True)
    opt_ref = torch.optim.AdamW(groups(ref), lr=1e-2, fused=True)
    for _ in range(3):
        grads = [3 * torch.randn(p.shape, generator=g).to(device) for p in init]
        for p, q, gr in zip(ours, ref, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        by_hand = math.sqrt(sum(float(gr.double().square().sum()) for gr in grads))
        norm = clip_in_step(opt, max_norm)
        norm_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        assert norm.dtype == torch.float32 and norm.shape == ()
        assert float(norm) == pytest.approx(by_hand, rel=1e-6)
        assert float(norm) == pytest.approx(float(norm_ref), rel=1e-6)
        opt.step()
        opt_ref.step()
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)  # left clipped, as clip_grad_norm_ does
        if max_norm < by_hand:  # the clip acted: the gradients now have norm max_norm
            clipped = math.sqrt(sum(float(p.grad.double().square().sum()) for p in ours))
            assert clipped == pytest.approx(max_norm, rel=1e-5)
    assert frozen.abs().max() == 0


def test_clip_in_step_rejects_a_threshold_that_is_not_positive():
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.ones(3)
    opt = torch.optim.AdamW([p], fused=True)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="max_norm must be > 0"):
            clip_in_step(opt, bad)


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps), lambda ps: torch.optim.RMSprop(ps)])
def test_clip_in_step_rejects_an_optimizer_that_would_not_clip(make):
    """Non-fused AdamW would fail at step() with an assertion; RMSprop would silently not clip."""
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.full((3,), 100.0)
    with pytest.raises(ValueError, match="does not apply grad_scale"):
        clip_in_step(make([p]), 1.0)
