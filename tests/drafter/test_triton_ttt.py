"""The Triton kernels of eyas/drafter/kernels.py against their torch definitions (CUDA only): the head
loss pass (loss, argmax, logits' gradient, rows of zero weight, a strided teacher window) and the
diagonal merge forward and backward, grouped-query and not, head counts and head dims that are
not powers of two; the SwiGLU gating forward and backward, alone and inside the compiled layer."""

import pytest
import torch

from eyas.drafter.attention import merge_diagonal
from eyas.drafter.head_loss import soft_cross_entropy_grad

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels run on CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_loss_kernel_equals_torch(dtype):
    from eyas.drafter import kernels as triton_ttt

    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, V, pad = 2, 33, 3001, 3  # V not a multiple of the block
    z = (3 * torch.randn(B, T, V, generator=g, device="cuda")).to(dtype)
    teacher = (2 * torch.randn(B, T + pad, V, generator=g, device="cuda")).to(dtype)
    window, lse = teacher[:, 1:1 + T], teacher.float().logsumexp(-1)[:, 1:1 + T]
    weight = torch.rand(B, T, generator=g, device="cuda") * (torch.rand(B, T, generator=g, device="cuda") > 0.3)
    loss, argmax, grad = triton_ttt.soft_cross_entropy_grad(z, window, lse, weight)
    loss_ref, argmax_ref, grad_ref = soft_cross_entropy_grad(z, window, lse, weight)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=2e-5)
    assert torch.equal(argmax, argmax_ref)
    torch.testing.assert_close(grad.float(), grad_ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-7)
    assert grad[weight == 0].abs().max() == 0
    # without a weight (eval) the kernel is another specialisation, autotuned on its own: its
    # blocks may sum the row in another order, so equal within fp32 rounding, not bit for bit
    loss2, argmax2, none = triton_ttt.soft_cross_entropy_grad(z, window, lse, None)
    assert none is None and torch.equal(argmax2, argmax)
    torch.testing.assert_close(loss2, loss, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("nh,nkv,hd,n", [(4, 2, 16, 1), (8, 2, 64, 3), (6, 2, 24, 2), (4, 4, 128, 6)])
def test_diagonal_merge_kernel_equals_torch(nh, nkv, hd, n):
    from eyas.drafter.kernels import DiagonalMerge

    g = torch.Generator(device="cuda").manual_seed(1)
    B, T = 2, 37

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda").requires_grad_()

    # q in layer_pre's layout (a transposed view of [B, T, nh, hd]), as the TTT step passes it
    q = torch.randn(B, T, nh, hd, generator=g, device="cuda").transpose(1, 2).requires_grad_()
    o0, lse0 = r(B, nh, T, hd), r(B, nh, T)
    kd, vd = r(n, B, nkv, T, hd), r(n, B, nkv, T, hd)  # the kernel's layout: stacked on dim 0
    do = torch.randn(B, nh, T, hd, generator=g, device="cuda")
    inputs = (q, o0, lse0, kd, vd)
    out = DiagonalMerge.apply(*inputs)
    assert out.transpose(1, 2).is_contiguous()  # o_proj's layout: its reshape copies nothing
    grads = torch.autograd.grad(out, inputs, do)
    ref = merge_diagonal(q, o0, lse0, kd.permute(1, 2, 3, 0, 4), vd.permute(1, 2, 3, 0, 4),
                         torch.ones(n, dtype=torch.bool, device="cuda"))
    grads_ref = torch.autograd.grad(ref, inputs, do)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("q", "o0", "lse0", "kd", "vd"), grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_diagonal_merge_non_dense_inputs_and_bad_shapes():
    """q cut from a wider tensor (a fused qkv output) is copied, not read with strides its
    gradient would not share; shapes that do not fit together are refused."""
    from eyas.drafter.kernels import DiagonalMerge

    g = torch.Generator(device="cuda").manual_seed(2)
    B, nh, nkv, T, hd, n = 1, 4, 2, 9, 16, 2
    wide = torch.randn(B, nh, T, 3 * hd, generator=g, device="cuda")
    q = wide[..., :hd].requires_grad_()  # not dense: empty_like(q) would not share its strides
    o0, lse0 = torch.randn(B, nh, T, hd, generator=g, device="cuda"), torch.randn(B, nh, T, generator=g, device="cuda")
    kd, vd = (torch.randn(n, B, nkv, T, hd, generator=g, device="cuda") for _ in range(2))
    do = torch.randn(B, nh, T, hd, generator=g, device="cuda")
    (dq,) = torch.autograd.grad(DiagonalMerge.apply(q, o0, lse0, kd, vd), q, do)
    ref = merge_diagonal(q, o0, lse0, kd.permute(1, 2, 3, 0, 4), vd.permute(1, 2, 3, 0, 4),
                         torch.ones(n, dtype=torch.bool, device="cuda"))
    (dq_ref,) = torch.autograd.grad(ref, q, do)
    torch.testing.assert_close(dq, dq_ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="nkv dividing nh"):
        DiagonalMerge.apply(q[:, :3], o0[:, :3], lse0[:, :3], kd, vd)  # 3 heads over 2 kv heads


@pytest.mark.parametrize("shape,dtype", [((2, 37, 2 * 1500), torch.bfloat16), ((5, 2 * 64), torch.float32),
                                         ((3, 11, 2 * 1024), torch.float32)])
def test_swiglu_kernel_equals_torch(shape, dtype):
    """The SwiGLU op's forward and backward against autograd through eyas.drafter.model.swiglu in
    float64 (I = 1500 and 64: not multiples of the kernel's block; 1024: exactly one block)."""
    from eyas.drafter.kernels import swiglu
    from eyas.drafter.model import swiglu as reference

    g = torch.Generator(device="cuda").manual_seed(2)
    gu = (3 * torch.randn(*shape, generator=g, device="cuda")).to(dtype).requires_grad_()
    dout = torch.randn(*shape[:-1], shape[-1] // 2, generator=g, device="cuda").to(dtype)
    out = swiglu(gu)
    (dgu,) = torch.autograd.grad(out, gu, dout)
    ref_in = gu.detach().double().requires_grad_()
    ref = reference(ref_in)
    (ref_dgu,) = torch.autograd.grad(ref, ref_in, dout.double())
    assert out.dtype == dtype and out.shape == ref.shape and dgu.shape == gu.shape
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(dgu.double(), ref_dgu, **tol)
    # a non-contiguous input (a column slice) is read as its values
    wide = torch.randn(4, 2 * 64 + 8, generator=g, device="cuda")[:, :2 * 64]
    torch.testing.assert_close(swiglu(wide), reference(wide), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="2I"):
        swiglu(torch.zeros(3, 5, device="cuda"))


def test_swiglu_kernel_in_compiled_layer_equals_eager():
    """layer_post compiled with the SwiGLU op inside (one graph, no break) equals the eager layer
    with the torch gating: output and every weight's gradient."""
    from eyas.drafter.kernels import swiglu
    from eyas.drafter.model import DrafterConfig, Eagle3Drafter, layer_post

    torch.manual_seed(3)
    c = DrafterConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, vocab_size=100, draft_vocab_size=50, target_hidden_size=64, num_target_layers=8)
    d = Eagle3Drafter(c).cuda()
    hidden = torch.randn(2, 9, 64, device="cuda")
    o = torch.randn(2, 4, 9, 16, device="cuda")
    compiled = torch.compile(layer_post, dynamic=False, fullgraph=True)
    outs = []
    for fn, gating in ((layer_post, None), (compiled, swiglu)):
        d.zero_grad(set_to_none=True)
        w = d.midlayer.weights()
        out = fn(w, c, hidden, o) if gating is None else fn(w, c, hidden, o, gating)
        out.square().sum().backward()
        outs.append((out.detach(), [p.grad.clone() for p in d.midlayer.parameters() if p.grad is not None]))
    (ref, ref_grads), (got, got_grads) = outs
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert len(got_grads) == len(ref_grads) == 5  # o_proj, the post-attention norm, gate, up, down
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
