"""Weight gradients of one TTT unroll: the 8B drafter's decoder weights are used by every one of the
7 TTT steps, so each weight's gradient is the sum of 7 per-step products ``dY_k^T @ X_k``. Two
ways to form that sum, timed on the GPU for each decoder weight shape at 2048 and 8192 tokens:

- ``bf16_sum``: what autograd does with a bf16 copy of the weight (eyas' unroll,
  eyas/training/unroll.py, under autocast): 7 bf16 GEMMs, 6 bf16 adds of the [N, K] products, one cast to fp32;
- ``fp32_accumulate``: the first GEMM writes an fp32 accumulator (``torch.mm(..., out_dtype=fp32)``)
  and the 6 others accumulate into it inside the GEMM (``torch.addmm(acc, ..., out_dtype=fp32,
  out=acc)``: cuBLAS with beta = 1 and fp32 C/D, bf16 A/B);
- ``one_gemm_cat``: the products deferred to the end of the backward and summed by ONE GEMM over
  the 7 steps' tokens (K = 7 T), fp32 output, after concatenating each step's X and dY;
- ``one_gemm``: the same GEMM on inputs already contiguous (the bound when each step writes its X
  and dY into its slice of one buffer).

Also records each method's max abs error against the fp32 sum of the same bf16 products (the
bf16 sum rounds 6 times). Usage (on a GPU): python dev/bench/bench_wgrad.py --out wgrad.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from dev.bench.bench_kernels import cuda_ms  # noqa: E402
from dev.bench.common import write_result  # noqa: E402

# [N, K] of the 8B drafter's decoder matrices as the unroll uses them (eyas.drafter.model.LayerWeights)
SHAPES = {"qkv": (6144, 8192), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def bf16_sum(dys, xs):
    g = dys[0].T @ xs[0]
    for dy, x in zip(dys[1:], xs[1:]):
        g = g + dy.T @ x
    return g.float()


def fp32_accumulate(dys, xs):
    acc = torch.mm(dys[0].T, xs[0], out_dtype=torch.float32)
    for dy, x in zip(dys[1:], xs[1:]):
        torch.addmm(acc, dy.T, x, out_dtype=torch.float32, out=acc)
    return acc


def one_gemm_cat(dys, xs):
    return torch.mm(torch.cat(dys).T, torch.cat(xs), out_dtype=torch.float32)


def measure(T: int, name: str, N: int, K: int, ttt: int) -> dict:
    """One weight shape at T tokens per step: each method's median ms and its error."""
    dys = [torch.randn(T, N, device="cuda", dtype=torch.bfloat16) * 0.01 for _ in range(ttt)]
    xs = [torch.randn(T, K, device="cuda", dtype=torch.bfloat16) for _ in range(ttt)]
    ref = sum(dy.T.float() @ x.float() for dy, x in zip(dys, xs))
    dy_all, x_all = torch.cat(dys), torch.cat(xs)

    def one_gemm(_dys, _xs):
        return torch.mm(dy_all.T, x_all, out_dtype=torch.float32)

    row = {"tokens": T, "weight": name, "shape": [N, K], "flops": 2 * ttt * T * N * K}
    for fn in (bf16_sum, fp32_accumulate, one_gemm_cat, one_gemm):
        ms = cuda_ms(lambda: fn(dys, xs))
        row[fn.__name__] = {"ms": round(ms, 4), "tflops": round(row["flops"] / ms / 1e9, 1),
                            "max_abs_err": (fn(dys, xs) - ref).abs().max().item()}
    row["saved_ms"] = {m: round(row["bf16_sum"]["ms"] - row[m]["ms"], 4) for m in METHODS}
    return row


METHODS = ("fp32_accumulate", "one_gemm_cat", "one_gemm")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--out", default="wgrad.json")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for T in a.tokens:
        for name, (N, K) in SHAPES.items():
            rows.append(measure(T, name, N, K, a.ttt))
            print(rows[-1], flush=True)
    total = {T: {m: round(sum(r["saved_ms"][m] for r in rows if r["tokens"] == T), 3) for m in METHODS}
             for T in a.tokens}
    print("saved ms per unroll against bf16_sum:", total)
    write_result(a.out, {"what": __doc__.split("\n")[0], "ttt": a.ttt, "rows": rows, "saved_ms_per_unroll": total})


if __name__ == "__main__":
    main()
