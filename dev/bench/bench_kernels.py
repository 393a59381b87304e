"""The two memory-bound pieces of a TTT step at the 8B drafter's 8192-token shape, Triton kernels
(eyas/drafter/kernels.py) against their torch definitions through torch.compile (what ran before):

- head loss pass over [4, 2048, 32000] bf16 logits and teacher logits (loss, argmax, gradient);
- diagonal merge forward + backward, q [4, 32, 2048, 128] bf16 over 8 kv heads, n = 1..6
  diagonal keys (one TTT unroll of 7 steps runs n = 1..6 once each); the torch timing includes
  the padding/stacking its path does, the Triton timing does not include the stack of the keys.

Per piece: median milliseconds over CUDA events, the bytes it must move at least and the
resulting bandwidth, and the max abs difference from the torch definition. Usage (on a GPU):
    python dev/bench/bench_kernels.py --out kernels.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from dev.bench.common import write_result  # noqa: E402
from eyas.drafter import kernels as triton_ttt  # noqa: E402
from eyas.drafter.attention import merge_diagonal  # noqa: E402
from eyas.drafter.head_loss import soft_cross_entropy_grad  # noqa: E402


def cuda_ms(fn, warmup=3, steps=20) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def bench_loss(B=4, T=2048, V=32000, pad=7) -> dict:
    z = torch.randn(B, T, V, device="cuda", dtype=torch.bfloat16) * 3
    teacher = torch.randn(B, T + pad, V, device="cuda", dtype=torch.bfloat16) * 3
    window, lse = teacher[:, 1:1 + T], teacher.float().logsumexp(-1)[:, 1:1 + T]
    weight = (torch.rand(B, T, device="cuda") > 0.2).float() / (B * T)
    compiled = torch.compile(soft_cross_entropy_grad)
    ref = compiled(z, window, lse, weight)
    out = triton_ttt.soft_cross_entropy_grad(z, window, lse, weight)
    floor = 3 * z.numel() * 2  # read logits and teacher once, write the bf16 gradient
    res = {"shape": [B, T, V], "min_bytes": floor,
           "max_abs_diff": {"loss": (out[0] - ref[0]).abs().max().item(),
                            "grad": (out[2].float() - ref[2].float()).abs().max().item(),
                            "argmax_equal": bool(torch.equal(out[1], ref[1]))}}
    for name, fn in (("torch_compile", lambda: compiled(z, window, lse, weight)),
                     ("triton", lambda: triton_ttt.soft_cross_entropy_grad(z, window, lse, weight))):
        ms = cuda_ms(fn)
        res[name] = {"ms": ms, "GB_per_s_at_floor": floor / ms / 1e6}
    return res


def bench_merge(n: int, B=4, nh=32, nkv=8, T=2048, hd=128) -> dict:
    def r(*s):
        return torch.randn(*s, device="cuda", dtype=torch.bfloat16).requires_grad_()

    # as a TTT step passes them: q a transposed view (layer_pre's layout), kd/vd stacked on dim 0
    q = torch.randn(B, T, nh, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    o0 = r(B, nh, T, hd)
    lse0 = torch.randn(B, nh, T, device="cuda").requires_grad_()
    kd, vd = r(n, B, nkv, T, hd), r(n, B, nkv, T, hd)
    do = torch.randn(B, nh, T, hd, device="cuda", dtype=torch.bfloat16)
    inputs = (q, o0, lse0, kd, vd)
    W = max(n, 2)  # the compiled torch path pads n = 1 to 2 and stacks on dim 3 (eyas.drafter.attention.flex_ttt_attention)

    def pad(t):
        t = t.permute(1, 2, 3, 0, 4)
        return torch.cat([t, t.new_zeros(*t.shape[:3], W - n, hd)], 3) if W > n else t

    valid = torch.arange(W, device="cuda") < n
    compiled = torch.compile(merge_diagonal)

    def ref_fn():
        return torch.autograd.grad(compiled(q, o0, lse0, pad(kd), pad(vd), valid), inputs, do)

    def tri_fn():
        return torch.autograd.grad(triton_ttt.DiagonalMerge.apply(*inputs), inputs, do)

    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(tri_fn(), ref_fn())]
    o_diff = (triton_ttt.DiagonalMerge.apply(*inputs) - compiled(q, o0, lse0, pad(kd), pad(vd), valid)).abs().max()
    return {"n": n, "max_abs_diff": {"o": o_diff.item(), "grads": diffs},
            "torch_compile_ms": cuda_ms(ref_fn), "triton_ms": cuda_ms(tri_fn)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kernels.json")
    args = ap.parse_args()
    loss = bench_loss()
    print("head loss:", loss)
    merges = [bench_merge(n) for n in range(1, 7)]
    for m in merges:
        print("merge:", m)
    total = {k: sum(m[k] for m in merges) for k in ("torch_compile_ms", "triton_ms")}
    print("merge per unroll (n = 1..6), fwd+bwd:", total)
    write_result(args.out, {"what": "TTT memory-bound kernels at 8192 tokens, Triton vs torch.compile",
                            "head_loss": loss, "merge": merges, "merge_per_unroll_ms": total})


if __name__ == "__main__":
    main()
