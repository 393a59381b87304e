"""The 8B drafter's SwiGLU ``silu(gate) * up`` over the [T, 2I] gate_up GEMM output (I = 14336),
forward and backward: Inductor's fused kernels inside the compiled layer (4.2 + 1.2 ms per step at
8192 tokens, `results/profile_train.json`) against a plain Triton kernel per direction, to size the
lever before building it into the layer. eyas.drafter.kernels.swiglu now runs the same two kernels there
(with ``I`` a runtime argument, behind the custom op's dispatch); here they stay as measured (``I`` a
compile-time constant, launched directly).

Per tokens T and direction: median ms (CUDA events), GB/s at the bytes it must move (forward reads
gate and up, writes the product; backward reads gate, up and the product's gradient, writes the
gradients of gate and up; all bf16), and the max abs difference from the torch definition in fp32.
Usage (on a GPU): python dev/bench/bench_swiglu.py --out swiglu.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from dev.bench.bench_kernels import cuda_ms  # noqa: E402
from dev.bench.common import write_result  # noqa: E402

INTERMEDIATE = 14336


@triton.jit
def _swiglu_fwd(gu_ptr, out_ptr, I: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inb = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=inb).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=inb).to(tl.float32)
    tl.store(out_ptr + row * I + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=inb)


@triton.jit
def _swiglu_bwd(gu_ptr, dout_ptr, dgu_ptr, I: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inb = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=inb).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=inb).to(tl.float32)
    d = tl.load(dout_ptr + row * I + cols, mask=inb).to(tl.float32)
    s = tl.sigmoid(g)
    dg = d * u * s * (1.0 + g * (1.0 - s))
    du = d * g * s
    tl.store(dgu_ptr + row * 2 * I + cols, dg.to(dgu_ptr.dtype.element_ty), mask=inb)
    tl.store(dgu_ptr + row * 2 * I + I + cols, du.to(dgu_ptr.dtype.element_ty), mask=inb)


def triton_fwd(gu, block=1024):
    M, I = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(M, I, device=gu.device, dtype=gu.dtype)
    _swiglu_fwd[(M, triton.cdiv(I, block))](gu, out, I, BLOCK=block)
    return out


def triton_bwd(gu, dout, block=1024):
    M, I = dout.shape
    dgu = torch.empty_like(gu)
    _swiglu_bwd[(M, triton.cdiv(I, block))](gu, dout, dgu, I, BLOCK=block)
    return dgu


def torch_fwd(gu):
    gate, up = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def torch_fwd_bwd(gu, dout):
    """The compiled layer's way: autograd through ``silu(gate) * up`` of the chunked GEMM output."""
    gu = gu.detach().requires_grad_()
    out = torch_fwd(gu)
    (dgu,) = torch.autograd.grad(out, gu, dout)
    return out, dgu


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--out", default="swiglu.json")
    a = ap.parse_args()
    fwd_c = torch.compile(torch_fwd, dynamic=False)
    fwd_bwd_c = torch.compile(torch_fwd_bwd, dynamic=False)
    rows = []
    for T in a.tokens:
        g = torch.Generator(device="cuda").manual_seed(0)
        gu = torch.randn(T, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16, generator=g)
        dout = torch.randn(T, INTERMEDIATE, device="cuda", dtype=torch.bfloat16, generator=g)
        ref_out, ref_dgu = torch_fwd_bwd(gu.float(), dout.float())
        e = T * INTERMEDIATE * 2  # bytes of one [T, I] bf16 tensor
        row = {"tokens": T, "bytes_fwd": 3 * e, "bytes_bwd": 5 * e}
        for name, fwd, bwd in (
                ("inductor", lambda: fwd_c(gu), lambda: fwd_bwd_c(gu, dout)),
                ("triton", lambda: triton_fwd(gu), lambda: (triton_fwd(gu), triton_bwd(gu, dout)))):
            ms_f, ms_fb = cuda_ms(fwd), cuda_ms(bwd)
            out, dgu = bwd()
            row[name] = {"ms_fwd": round(ms_f, 4), "ms_fwd_plus_bwd": round(ms_fb, 4),
                         "GB_per_s_fwd": round(row["bytes_fwd"] / ms_f / 1e6, 1),
                         "max_abs_diff": [round((out.float() - ref_out).abs().max().item(), 5),
                                          round((dgu.float() - ref_dgu).abs().max().item(), 5)]}
        print(row, flush=True)
        rows.append(row)
    write_result(a.out, {"what": __doc__.split("\n")[0], "intermediate": INTERMEDIATE, "rows": rows})


if __name__ == "__main__":
    main()
