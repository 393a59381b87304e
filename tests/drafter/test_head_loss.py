"""The head loss with its gradient made in the forward (eyas/drafter/head_loss.py): a hand-worked value and
gradient, gradients against autograd through torch's own soft-target cross-entropy in float64,
and a whole TTT unroll's loss and parameter gradients against the same unroll with that plain
autograd loss swapped in."""

import math

import pytest
import torch
import torch.nn.functional as F

import eyas.training.unroll as unroll
from eyas.drafter.backend import Backend
from eyas.drafter.head_loss import head_loss
from tests.training.test_ttt import make_batch, make_drafter


def approx(v):
    return pytest.approx(v, rel=1e-6, abs=1e-7)


def test_two_token_vocab_by_hand():
    # z = [0, ln 3]: softmax [1/4, 3/4]; teacher logits [0, 0] with lse ln 2: p = [1/2, 1/2]
    x = torch.tensor([[[1.0]]], requires_grad=True)          # [B=1, T=1, H=1]
    w = torch.tensor([[0.0], [math.log(3.0)]], requires_grad=True)  # [V=2, H=1]
    t_logits, t_lse = torch.zeros(1, 1, 2), torch.full((1, 1), math.log(2.0))
    total, tok, argmax = head_loss(x, w, t_logits, t_lse, torch.tensor([[0.5]]))
    want = -(0.5 * math.log(0.25) + 0.5 * math.log(0.75))  # 0.8369882...
    assert tok.item() == approx(want) and total.item() == approx(0.5 * want)
    assert argmax.tolist() == [[1]]
    total.backward()
    # d/dz = 0.5 * (softmax - p) = 0.5 * [-1/4, 1/4]; dz/dW = x = 1, dz/dx = W
    assert w.grad.flatten().tolist() == [approx(-0.125), approx(0.125)]
    assert x.grad.item() == approx(0.125 * math.log(3.0))


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                       pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")])])
def test_gradients_equal_autograd_through_soft_target_cross_entropy(device):
    # on CUDA the loss pass is the torch.compile'd graph (the Triton kernel: tests/drafter/test_triton_ttt.py)
    backend = Backend(attention="auto", compile=True, compile_layers=True, triton=False, cuda_graphs=False)
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 2, 5, 8, 11
    x0, w0 = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g)
    t_logits = 3 * torch.randn(B, T, V, generator=g)
    t_lse = t_logits.logsumexp(-1)
    weight = torch.rand(B, T, generator=g) * (torch.rand(B, T, generator=g) > 0.3)  # some zeros
    x0, w0, t_logits, t_lse, weight = (t.to(device) for t in (x0, w0, t_logits, t_lse, weight))

    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    total, tok, _ = head_loss(x, w, t_logits, t_lse, weight, backend)
    (2.5 * total).backward()  # a non-unit upstream gradient

    xr, wr = x0.double().requires_grad_(), w0.double().requires_grad_()
    p = torch.exp(t_logits.double() - t_lse.double()[..., None])
    tok_ref = F.cross_entropy((xr @ wr.T).flatten(0, 1), p.flatten(0, 1), reduction="none").view(B, T)
    (2.5 * (weight.double() * tok_ref).sum()).backward()

    torch.testing.assert_close(tok.double(), tok_ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total.double(), (weight.double() * tok_ref).sum().detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=1e-5, atol=1e-6)
    assert x.grad[weight == 0].abs().max() == 0  # unsupervised positions get no gradient


def _plain_autograd_head_loss(x, head_weight, teacher_logits, teacher_lse, weight, backend):
    z = (x @ head_weight.T).double()
    p = torch.exp(teacher_logits.double() - teacher_lse.double()[..., None])
    tok = F.cross_entropy(z.flatten(0, 1), p.flatten(0, 1), reduction="none").view(z.shape[:2])
    return (weight.double() * tok).sum().float(), tok.detach().float(), z.argmax(-1)


def test_ttt_unroll_gradients_equal_plain_autograd(monkeypatch):
    batch, head_rows = make_batch(), torch.randn(64, 32, generator=torch.Generator().manual_seed(3))

    def run():
        d = make_drafter().train()
        total, metrics, _ = unroll.ttt_forward(d, batch, head_rows, ttt_length=3, step_decay=0.8)
        total.backward()
        return total, metrics, {n: p.grad.clone() for n, p in d.named_parameters() if p.requires_grad}

    total, metrics, grads = run()
    monkeypatch.setattr(unroll, "head_loss", _plain_autograd_head_loss)
    total_ref, metrics_ref, grads_ref = run()
    torch.testing.assert_close(total, total_ref, rtol=1e-5, atol=1e-6)
    assert metrics.keys() == metrics_ref.keys()
    for k in metrics:
        assert metrics[k] == pytest.approx(metrics_ref[k], rel=1e-6, nan_ok=True), k
    assert grads.keys() == grads_ref.keys() and "lm_head.weight" in grads
    for n in grads:
        torch.testing.assert_close(grads[n], grads_ref[n], rtol=1e-4, atol=1e-6, msg=n)
        assert grads[n].abs().sum() > 0, n


def test_no_grad_path_gives_the_same_loss_and_argmax():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(1, 4, 6, generator=g), torch.randn(9, 6, generator=g, requires_grad=True)
    t_logits = torch.randn(1, 4, 9, generator=g)
    t_lse, weight = t_logits.logsumexp(-1), torch.ones(1, 4)
    with_grad = head_loss(x, w, t_logits, t_lse, weight)
    with torch.no_grad():
        without = head_loss(x, w, t_logits, t_lse, weight)
    assert with_grad[0].requires_grad and not without[0].requires_grad
    for a, b in zip(with_grad, without):
        assert torch.equal(a.detach(), b)


def test_upstream_gradient_is_not_rounded_to_bf16():
    """With bf16 logits the backward scales by the upstream gradient in float32: g = 1/3 gives a
    third of g = 1's gradient (bf16(1/3) * 3 would be 1.00195)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(40, 16, generator=g).bfloat16().requires_grad_()
    t_logits = torch.randn(2, 6, 40, generator=g).bfloat16()
    t_lse, weight = t_logits.float().logsumexp(-1), torch.full((2, 6), 1 / 12)
    grads = []
    for scale in (1.0, 1 / 3):
        x.grad = w.grad = None
        (scale * head_loss(x, w, t_logits, t_lse, weight)[0]).backward()
        grads.append((x.grad.double().sum(), w.grad.double().abs().sum()))
    for one, third in zip(*grads):
        assert (3 * third / one).item() == pytest.approx(1.0, abs=2e-4)
