"""The TTT step-0 attention of the 8B drafter (flex_attention over packed documents, eyas.drafter.attention)
under different kernel settings: the largest non-GEMM cost of a TTT step at 8192 tokens (15.6 of
215 ms, `results/profile_train.json`), forward + backward, 7 calls per step.

Per setting: median milliseconds of one forward + backward (CUDA events), and the max abs
difference of the output and of dq/dk/dv from the default setting. Settings: the default kernel;
``kernel_options`` of torch's flex template (``ROWS_GUARANTEED_SAFE``: every query row here sees
at least its own key; forward ``BLOCK_M``/``BLOCK_N``; backward ``BLOCK_M1``/``BLOCK_N1``/
``BLOCK_M2``/``BLOCK_N2``; ``num_warps``/``num_stages``; torch/_inductor/kernel/flex/); and
torch.compile's ``max-autotune-no-cudagraphs`` mode, which autotunes the template's blocks.
The documents are bench_train.py's (2048: one row of 1024+640+384; 8192: four rows of 2048).
Usage (on a GPU): python dev/bench/bench_flex.py --out flex.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.bench_train import DOCS  # noqa: E402
from dev.bench.bench_kernels import cuda_ms  # noqa: E402
from dev.bench.common import write_result  # noqa: E402
from eyas.drafter.attention import doc_causal_block_mask  # noqa: E402
from eyas.drafter.backend import Backend  # noqa: E402

SETTINGS = {
    "default": None,
    "rows_safe": {"ROWS_GUARANTEED_SAFE": True},
    "fwd_128x64_w8_s3": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    "fwd_128x128_w8_s2": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    "bwd_64x128_128x64": {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64},
    "bwd_64x64_64x64": {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64},
    "bwd_32x128_128x32_w8": {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "num_warps": 8},
    "max_autotune": "max-autotune-no-cudagraphs",
}


def inputs(tokens: int, seed: int = 0):
    """q [B, 32, 2048, 128], k, v [B, 8, 2048, 128] bf16 with grad, doc_ids [B, 2048], upstream grad."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = DOCS[tokens]
    B, T = len(rows), 2048
    doc_ids = torch.stack([torch.repeat_interleave(torch.arange(len(r), device="cuda"),
                                                   torch.tensor(r, device="cuda")) for r in rows])
    assert doc_ids.shape == (B, T)

    def t(h):
        return torch.randn(B, h, T, 128, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v = (x.requires_grad_() for x in (t(32), t(8), t(8)))
    return q, k, v, doc_ids, t(32)


def run(setting, q, k, v, mask, do):
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if isinstance(setting, str):
        fn, opts = torch.compile(flex_attention, dynamic=False, mode=setting), None
    else:
        fn, opts = torch.compile(flex_attention, dynamic=False), setting

    def step():
        o, aux = fn(q, k, v, block_mask=mask, enable_gqa=True, return_aux=AuxRequest(lse=True),
                    kernel_options=opts)
        return (o,) + torch.autograd.grad(o, (q, k, v), do)

    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--out", default="flex.json")
    a = ap.parse_args()
    backend = Backend(attention="flex", compile=True, compile_layers=True, triton=True, cuda_graphs=False)
    rows = []
    for T in a.tokens:
        q, k, v, doc_ids, do = inputs(T)
        mask = doc_causal_block_mask(doc_ids, backend)
        ref = None
        for name in a.settings:
            torch._dynamo.reset()
            row = {"tokens": T, "setting": name, "kernel_options": SETTINGS[name]}
            try:
                step = run(SETTINGS[name], q, k, v, mask, do)
                out = step()
                row["ms_fwd_bwd"] = round(cuda_ms(step, warmup=3, steps=20), 4)
                ref = out if ref is None else ref
                row["max_abs_diff_vs_default"] = [round((x - y).abs().max().item(), 6) for x, y in zip(out, ref)]
            except Exception as e:  # noqa: BLE001 - a setting the template rejects is a result too
                row["error"] = repr(e)[:300]
            print(row, flush=True)
            rows.append(row)
            write_result(a.out, {"what": __doc__.split("\n")[0], "rows": rows})
    best = {T: min((r for r in rows if r["tokens"] == T and "ms_fwd_bwd" in r), key=lambda r: r["ms_fwd_bwd"],
                   default=None) for T in a.tokens}
    summary = {T: (b["setting"], b["ms_fwd_bwd"]) if b else None for T, b in best.items()}
    print("fastest:", summary)
    write_result(a.out, {"what": __doc__.split("\n")[0], "rows": rows, "fastest": summary})


if __name__ == "__main__":
    main()
