"""Projected training, extraction and online figures on 4 and 8 H200s, from the measured 1- and 2-GPU ones.

    python3 dev/bench/scale_projection.py      # -> dev/results/scale_projection.json (no GPU)

Arithmetic only, until a 4/8-GPU machine measures the same rows (`bash dev/gpu/device.sh scale 8
ddp|fsdp|extract`). Every figure in the output carries ``"kind": "measured"`` with the result file
it comes from, or ``"kind": "projected"`` with the formula and its inputs. Inputs:

- ``ddp_w1.json``, ``multi_gpu.json`` (2 H200s): the DDP step of the 8B-shaped drafter at 8,192
  tokens per GPU on 1 and 2 GPUs (step time, peak memory per rank).
- The drafter's trainable parameters N, counted from ``eyas.drafter.model.Eagle3Drafter`` built on the
  meta device with bench_train.py's 8B shape; gradients are fp32 (4N bytes), and so are the
  weights FSDP2 gathers (no mixed-precision policy in eyas.training.distributed).
- ``extract.json``, ``extract_w1.json``, ``extract_w2.json``, ``extract_split.json``: capture and
  end-to-end extraction rates, bytes per token, the disk's fsync'd write rate.
- ``online_h200.json``: the capture and drafter-step rates of one call, and online training with
  the target in the training process.

Assumptions (stated in the output): the NCCL bus bandwidth of H200 NVLink, and that what DDP
exposes of its all-reduce scales with the ring volume 2(W-1)/W (calibrated on the measured W = 2
step time).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.bench_train import DOCS, config, exact_flops  # noqa: E402
from benchmarks.common import PEAK_BF16_TFLOPS  # noqa: E402
from dev.bench.common import RESULTS, write_result  # noqa: E402
from eyas.drafter.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from eyas.features import bytes_per_token  # noqa: E402

WORLDS = (1, 2, 4, 8)
GiB = 2**30
# NCCL all-reduce bus bandwidth assumed for H200s on one NVSwitch host. The H200 has NVLink 4 at
# 900 GB/s bidirectional per GPU (NVIDIA H200 datasheet), 450 GB/s per direction; nccl-tests
# (NVIDIA/nccl-tests, doc/PERFORMANCE.md) defines busbw so that it is comparable to that link
# rate, and published all_reduce_perf runs on 8x H100 SXM (the same NVLink 4 / NVSwitch fabric)
# report 460-480 GB/s at large sizes. Not measured on the lent machines.
BUSBW_GB_S = 450.0
H200_HBM_GB = 141.0  # per GPU, NVIDIA H200 datasheet (decimal GB)
# Llama-3.1-70B's shape (its config.json on the hub), with random weights in a benchmark
LLAMA_70B = {"hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 28672, "num_attention_heads": 64,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256}
LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256}
SEQ = 2048  # extraction rows (bench_extract.py): mean causal context SEQ/2


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def measured(value: float, source: str, **extra) -> dict:
    return {"value": value, "kind": "measured", "source": source, **extra}


def projected(value: float, formula: str, **inputs) -> dict:
    return {"value": value, "kind": "projected", "formula": formula, "inputs": inputs}


def drafter_params(c: DrafterConfig) -> tuple[int, int]:
    """(trainable, frozen) parameter counts of the drafter eyas trains (lm_head trainable)."""
    with torch.device("meta"):
        d = Eagle3Drafter(c)
    return (sum(p.numel() for p in d.parameters() if p.requires_grad),
            sum(p.numel() for p in d.parameters() if not p.requires_grad))


def target_params(s: dict) -> dict:
    """Parameter counts of a Llama-shaped target: per decoder layer, all layers, embedding, lm_head."""
    h, a, kv = s["hidden_size"], s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    layer = h * a + 2 * h * kv + a * h + 3 * h * s["intermediate_size"] + 2 * h
    return {"layer": layer, "layers": layer * s["num_hidden_layers"], "embed": s["vocab_size"] * h,
            "lm_head": s["vocab_size"] * h}


def capture_flops_per_token(s: dict, mean_ctx: float) -> float:
    """Forward FLOPs per token of a Llama-shaped target: 2 x (decoder linears + lm_head) + attention
    (QK^T and AV: 4 x layers x heads x head_dim x mean context)."""
    p = target_params(s)
    lin = p["layers"] - 2 * s["hidden_size"] * s["num_hidden_layers"]  # norms are not GEMMs
    return 2 * (lin + p["lm_head"]) + 4 * s["num_hidden_layers"] * s["num_attention_heads"] * s["head_dim"] * mean_ctx


def ring_volume(world: int, nbytes: float) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes`` (the same as a reduce-scatter
    followed by an all-gather): 2 (W-1)/W x nbytes; 0 in one process."""
    return 2 * (world - 1) / world * nbytes


def training(busbw: float) -> dict:
    w1, mg = load("ddp_w1.json"), load("multi_gpu.json")["training_ddp"]["scaling_weak_8192_tokens_per_gpu"]
    tok = w1["scaling"]["tokens_per_gpu_step"]
    t1, t2 = w1["scaling"]["step_ms_median"] / 1e3, mg["w2"]["step_ms_median"] / 1e3
    peak1, peak2 = w1["scaling"]["peak_alloc_GiB_per_rank"][0], mg["w2"]["peak_alloc_GiB_per_rank"][0]
    n_train, n_frozen = drafter_params(config(False))
    grad_bytes = 4 * n_train
    t_comm = lambda w: ring_volume(w, grad_bytes) / (busbw * 1e9)  # noqa: E731
    # calibration: DDP's W = 2 step time = t1 + f x (the ring all-reduce time at busbw)
    f = (t2 - t1) / t_comm(2)
    c = config(False)
    head_rows = c.draft_vocab_size * c.target_hidden_size * 4  # fp32 target lm_head rows, replicated
    fixed = n_frozen * 4 + head_rows
    # W = 1: what is not the 16 B/param of fp32 weights + grads + AdamW, nor the frozen tensors
    activations = peak1 * GiB - 16 * n_train - fixed
    # W = 2 under DDP, beyond W = 1: its bucket copy of the gradients (4N) and the rest (NCCL)
    comm_mem = peak2 * GiB - peak1 * GiB - 4 * n_train
    rows = {}
    for w in WORLDS:
        row = {}
        for strat in ("ddp", "fsdp"):
            if w == 1:
                row[strat] = {"step_ms": measured(t1 * 1e3, "ddp_w1.json scaling.step_ms_median"),
                              "tokens_per_s_per_gpu": measured(tok / t1, "ddp_w1.json"),
                              "efficiency": measured(1.0, "by definition"),
                              "peak_GiB_per_rank": measured(peak1, "ddp_w1.json peak_alloc_GiB_per_rank")}
                continue
            if strat == "ddp" and w == 2:
                row[strat] = {"step_ms": measured(t2 * 1e3, "multi_gpu.json training_ddp...w2.step_ms_median"),
                              "tokens_per_s_per_gpu": measured(tok / t2, "multi_gpu.json"),
                              "efficiency": measured(t1 / t2, "multi_gpu.json scaling_efficiency"),
                              "peak_GiB_per_rank": measured(peak2, "multi_gpu.json peak_alloc_GiB_per_rank")}
                continue
            if strat == "ddp":
                t = t1 + f * t_comm(w)
                step = projected(t * 1e3, "t1 + f x 2(W-1)/W x 4N / busbw", t1_ms=t1 * 1e3, f=f, N=n_train,
                                 busbw_GB_s=busbw, W=w)
                mem = projected(peak2, "the measured W = 2 peak (DDP holds a full replica at every W)",
                                peak_w2_GiB=peak2)
            else:
                # one FSDP unit: the all-gather (before forward) and the reduce-scatter (after
                # backward) cannot overlap compute, so their bandwidth time adds to DDP's exposed part
                t = t1 + f * t_comm(w) + t_comm(w)
                step = projected(t * 1e3, "t1 + (f + 1) x 2(W-1)/W x 4N / busbw (all-gather of the fp32 weights + "
                                 "reduce-scatter of the fp32 gradients, (W-1)/W x 4N each, not overlapped)",
                                 t1_ms=t1 * 1e3, f=f, N=n_train, busbw_GB_s=busbw, W=w)
                mem_b = activations + fixed + comm_mem + 8 * n_train + 16 * n_train / w
                mem = projected(mem_b / GiB, "activations(W=1) + frozen + NCCL(W=2) + 8N (gathered weights + full "
                                "gradients before the reduce-scatter) + 16N/W (sharded weights, gradients, AdamW)",
                                activations_GiB=activations / GiB, frozen_and_head_rows_GiB=fixed / GiB,
                                nccl_GiB=comm_mem / GiB, N=n_train, W=w)
            row[strat] = {"step_ms": step, "tokens_per_s_per_gpu": projected(tok / t, "tokens / step", tokens=tok),
                          "efficiency": projected(t1 / t, "t1 / t(W)"), "peak_GiB_per_rank": mem}
        rows[f"w{w}"] = row
    return {"what": "weak scaling of eyas' TTT training step, 8B-shaped drafter, lm_head trainable, 7 TTT steps, "
                    "8,192 tokens per GPU per step (bench_ddp.py)",
            "trainable_params_N": n_train, "frozen_params": n_frozen, "grad_bytes_fp32": grad_bytes,
            "busbw_GB_s_assumed": busbw,
            "calibration": {"f": f, "measured_overhead_w2_ms": (t2 - t1) * 1e3,
                            "ring_allreduce_ms_w2_at_busbw": t_comm(2) * 1e3,
                            "note": "f = (t2 - t1) / (ring all-reduce time of the fp32 gradients at busbw): "
                                    "the measured W = 2 overhead is f times what bandwidth alone costs, so it is "
                                    "not bandwidth (NCCL kernels sharing SMs with backward, DDP's bucket copies, "
                                    "the extra all-reduces of counts and loss); projected as scaling with the "
                                    "ring volume 2(W-1)/W"},
            "activations_GiB_w1": activations / GiB, "rows": rows,
            "ddp_efficiency_by_W": {w: (t1 / t2 if w == 2 else t1 / (t1 + f * t_comm(w))) for w in range(1, 9)}}


def extraction() -> dict:
    x, x1, x2, xs = load("extract.json"), load("extract_w1.json"), load("extract_w2.json"), load("extract_split.json")
    bpt, bpt8 = x["e2e"]["bytes_per_token_written"], x["e2e_fp8"]["bytes_per_token_written"]
    per_rank = x["e2e"]["tokens_per_s"]  # one rank, 96 batches: the pipelined writer keeps up
    per_rank8 = x["e2e_fp8"]["tokens_per_s"]
    disk = x2["e2e_total_tok_s"] * bpt  # bytes/s two ranks sustained on the machine's one disk
    rows = {}
    for w in WORLDS:
        r = {}
        for name, rate, b in (("bf16", per_rank, bpt), ("fp8", per_rank8, bpt8)):
            bound = disk / b
            if w == 1:
                r[name] = {"tokens_per_s": measured(rate, f"extract.json {'e2e' if name == 'bf16' else 'e2e_fp8'}"),
                           "bound": "capture (the pipelined writer keeps up, one writer under the disk's rate)"}
                continue
            if w == 2 and name == "bf16":
                r[name] = {"tokens_per_s": measured(x2["e2e_total_tok_s"], "extract_w2.json e2e_total_tok_s"),
                           "bound": "disk (one local disk, 1.22 GB/s fsync'd)"}
                continue
            v = min(w * rate, bound)
            r[name] = {"tokens_per_s": projected(v, "min(W x per-rank e2e, disk bytes/s / bytes per token)", W=w,
                                                 per_rank_tok_s=rate, disk_GB_s=disk / 1e9, bytes_per_token=b),
                       "bound": "disk" if bound < w * rate else "capture",
                       "per_rank_tok_s": v / w,
                       "tokens_per_s_one_disk_per_rank": projected(w * rate, "W x per-rank e2e", W=w)}
        rows[f"w{w}"] = r
    # a 70B-shaped target, layers split over 4 GPUs in sequence (device_map, as --mode split)
    p70 = target_params(LLAMA_70B)
    w70 = 2 * (p70["layers"] + p70["embed"] + p70["lm_head"])
    f8, f70 = capture_flops_per_token(LLAMA_8B, SEQ / 2), capture_flops_per_token(LLAMA_70B, SEQ / 2)
    cap8 = x["capture_tok_s"]
    eff8 = cap8 * f8 / (PEAK_BF16_TFLOPS * 1e12)
    cap70 = cap8 * f8 / f70
    b70 = bytes_per_token(3, LLAMA_70B["hidden_size"], torch.bfloat16)
    split = {
        "shape": LLAMA_70B, "params": sum(v for k, v in p70.items() if k != "layer"),
        "weights_GB_bf16": w70 / 1e9, "weights_GB_per_gpu_over_4": w70 / 4 / 1e9,
        "fits_141GB_per_gpu": w70 / 4 / 1e9 < H200_HBM_GB,
        "capture_flops_per_token_8b": f8, "capture_flops_per_token_70b": f70,
        "capture_8b": measured(cap8, "extract.json capture_tok_s", mfu=eff8),
        "split_8b_over_2": measured(xs["capture_tok_s"], "extract_split.json capture_tok_s: a target split over "
                                    "2 GPUs in sequence runs at one GPU's rate (one layer range busy at a time)"),
        "capture_tok_s_per_4gpu_group": projected(cap70, "capture_8b x flops_8b / flops_70b (the 8B capture's "
                                                  "FLOP efficiency; one GPU busy at a time)", capture_8b=cap8,
                                                  flops_8b=f8, flops_70b=f70, mfu_8b=eff8),
        "bytes_per_token_bf16": b70, "disk_GB_s_needed_per_group": cap70 * b70 / 1e9,
        "bound": "capture compute (one GPU of four busy at a time; the disk needs "
                 f"{cap70 * b70 / 1e9:.2f} GB/s of its {disk / 1e9:.2f})",
        "two_groups_on_8_gpus_tok_s": projected(2 * cap70, "2 x capture per group")}
    return {"what": "extraction with the data sharded over W ranks (8B-shaped Llama, every rank a whole target, "
                    "fsync'd shards on the machine's one local disk), and a 70B-shaped target split over 4 GPUs",
            "disk_bytes_per_s": measured(disk, "extract_w2.json e2e_total_tok_s x bytes_per_token (2 ranks, "
                                         "disk-bound)"),
            "disk_probe_GiB_s": measured(x["disk_write_GiB_s"], "extract.json disk_write_GiB_s (one writer)"),
            "per_rank_capture_w2": measured([r["capture_tok_s"] for r in x2["per_rank"]], "extract_w2.json"),
            "per_rank_e2e_w1_16_batches": measured(x1["e2e_total_tok_s"], "extract_w1.json (16 batches: the "
                                                   "writer's tail counts)"),
            "host_copies": "per rank bytes_per_token x rate over its own PCIe link: "
                           f"{per_rank * bpt / 1e9:.2f} GB/s per GPU (bf16), far below a Gen5 x16 link",
            "rows": rows, "target_70b_split_over_4": split}


def online(tr: dict) -> dict:
    o = load("online_h200.json")
    cap, train = o["capture"]["tokens_per_s"], o["offline"]["tokens_per_s"]
    train_rows, eff = tr["rows"], tr["ddp_efficiency_by_W"]  # W = 2 measured, the others projected

    def split(n_cap: int, n_train: int) -> dict:
        c, t = n_cap * cap, n_train * train * eff[n_train]
        return {"gpus": n_cap + n_train, "capture:train": f"{n_cap}:{n_train}",
                "tokens_per_s": projected(min(c, t), "min(capture GPUs x capture rate, training GPUs x train rate "
                                          "x DDP efficiency(training GPUs))", capture_tok_s=cap, train_tok_s=train,
                                          n_capture=n_cap, n_train=n_train, ddp_efficiency=eff[n_train]),
                "bound": "capture" if c < t else "training"}

    ratios = {"4_gpus": [split(2, 2), split(1, 3), split(3, 1)], "8_gpus": [split(4, 4), split(2, 6), split(6, 2)]}
    step_ms = o["online"]["ahead_0"]["step_ms_median"]
    tps = o["online"]["ahead_0"]["tokens_per_step"]
    w1_ms = train_rows["w1"]["ddp"]["step_ms"]["value"]
    in_proc = {}
    for w in WORLDS:
        ovh = train_rows[f"w{w}"]["ddp"]["step_ms"]["value"] - w1_ms
        v = w * tps / ((step_ms + ovh) / 1e3)
        in_proc[f"w{w}"] = (measured(v, "online_h200.json online.ahead_0.tokens_per_s") if w == 1 else
                            projected(v, "W x tokens per step / (online step + DDP's overhead at W)", W=w,
                                      online_step_ms=step_ms, tokens_per_step=tps, ddp_overhead_ms=ovh))
    # a 70B-shaped target: one 4-GPU capture group feeds drafters of hidden 8192
    c70 = DrafterConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=128, vocab_size=128256, draft_vocab_size=32000, target_hidden_size=8192,
                        num_target_layers=80)
    fl8 = exact_flops(config(False), DOCS[8192], 7, True)["exact"]
    fl70 = exact_flops(c70, DOCS[8192], 7, True)["exact"]
    x = load("extract.json")
    cap70 = x["capture_tok_s"] * capture_flops_per_token(LLAMA_8B, SEQ / 2) / capture_flops_per_token(LLAMA_70B,
                                                                                                      SEQ / 2)
    tr70 = load("ddp_w1.json")["scaling"]["tokens_per_s_per_gpu"] * fl8 / fl70
    return {"what": "online training: capture GPUs (the target's forward) against training GPUs (the drafter step); "
                    "rates from one call of bench_online.py on one H200",
            "capture_tok_s": measured(cap, "online_h200.json capture.tokens_per_s"),
            "train_tok_s": measured(train, "online_h200.json offline.tokens_per_s"),
            "separate_capture_process": {
                "note": "needs a capture process feeding the trainers (an eyas.training.online.Capture that reads from "
                        "another process): not in eyas; train.mode online captures in the training process",
                **ratios},
            "in_process_each_rank_its_own_target": in_proc,
            "target_70b": {
                "capture_tok_s_per_4gpu_group": projected(cap70, "as extraction.target_70b_split_over_4"),
                "drafter": "hidden 8192, intermediate 28672, 64/8 heads, draft vocab 32000, lm_head trainable",
                "train_tok_s_per_gpu": projected(tr70, "ddp_w1 tok/s x flops(8B drafter) / flops(70B drafter), "
                                                 "exact FLOPs of bench_train.exact_flops at 8,192 tokens",
                                                 flops_8b_drafter=fl8, flops_70b_drafter=fl70),
                "training_gpus_per_capture_group": projected(cap70 / tr70, "capture per group / train per GPU"),
                "capture_gpus_per_training_gpu": projected(4 * tr70 / cap70, "4 x train per GPU / capture per group"),
                "8_gpus_4_capture_4_train": projected(min(cap70, 4 * tr70), "min(capture, 4 x train)"),
                "bound": "capture: one 4-GPU group (one GPU busy at a time) feeds less than one training GPU"}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--busbw", type=float, default=BUSBW_GB_S, help="NCCL bus bandwidth, GB/s (assumed)")
    ap.add_argument("--out", default="scale_projection.json")
    a = ap.parse_args()
    tr = training(a.busbw)
    doc = {"what": "4- and 8-GPU H200 figures projected from the measured 1- and 2-GPU ones (arithmetic, no GPU)",
           "kind": "arithmetic on measured results",
           "assumptions": {"busbw_GB_s": a.busbw, "busbw_source": "NVLink 4: 900 GB/s bidirectional per H200 "
                           "(NVIDIA H200 datasheet), 450 GB/s per direction; nccl-tests' busbw (NVIDIA/nccl-tests "
                           "doc/PERFORMANCE.md) reaches 460-480 GB/s at large sizes on 8x H100 SXM's NVLink 4 "
                           "NVSwitch fabric in published all_reduce_perf runs; not measured here",
                           "hbm_GB_per_gpu": H200_HBM_GB, "peak_bf16_TFLOPS": PEAK_BF16_TFLOPS},
           "training": tr, "extraction": extraction(), "online": online(tr)}
    write_result(a.out, doc)
    for w in WORLDS:
        r = tr["rows"][f"w{w}"]
        print(f"W={w}: " + "; ".join(
            f"{s} {r[s]['tokens_per_s_per_gpu']['value']:,.0f} tok/s/GPU eff {r[s]['efficiency']['value']:.3f} "
            f"peak {r[s]['peak_GiB_per_rank']['value']:.1f} GiB ({r[s]['step_ms']['kind']})" for s in ("ddp", "fsdp")))
    for w, r in doc["extraction"]["rows"].items():
        print(f"extract {w}: " + "; ".join(f"{k} {v['tokens_per_s']['value']:,.0f} ({v['bound']})" for k, v in r.items()))
    print("70B over 4:", {k: v for k, v in doc["extraction"]["target_70b_split_over_4"].items()
                          if k in ("weights_GB_per_gpu_over_4", "fits_141GB_per_gpu")},
          f"{doc['extraction']['target_70b_split_over_4']['capture_tok_s_per_4gpu_group']['value']:,.0f} tok/s")
    for g, rows in doc["online"]["separate_capture_process"].items():
        if g != "note":
            print(f"online {g}: " + "; ".join(f"{r['capture:train']} {r['tokens_per_s']['value']:,.0f} ({r['bound']})"
                                              for r in rows))
    print("online in-process:", {k: round(v["value"]) for k, v in doc["online"]["in_process_each_rank_its_own_target"]
                                 .items()})
    print("70B online:", {k: (round(v["value"], 2) if isinstance(v, dict) else v)
                          for k, v in doc["online"]["target_70b"].items() if k != "drafter"})


if __name__ == "__main__":
    main()
