"""Training throughput of eyas' TTT step for a Llama-3.1-8B-shaped EAGLE-3 drafter.

Shapes as the peer benchmark (vLLM's speculators 0.9.0 trainer step; dev/README.md): hidden
4096, 32/8 heads, head_dim 128, intermediate 14336, target vocab 128256, draft vocab 32000; packed
documents (2048 tokens/step: 1024+640+384; 8192: 2048+1536+1024+1024+1024+768+512+256 packed into
rows of 2048, eyas' row length); bf16 autocast, fp32 master weights, AdamW, grad clip, cosine
schedule; the step body of eyas.training.loop.Trainer.train_step (the TTT unroll, finite check, backward,
clip, step, loss.item()), in two modes: ``graphs`` (forward + backward replayed as one CUDA graph,
eyas.training.loop.GraphedTTT, what train_drafter does on one GPU) and ``eager`` (compiled parts only). The
kernels are ``params.yaml``'s ``train.backend`` (eyas/drafter/backend.py) unless --attention /
--no-compile / --no-compile-layers / --no-triton say otherwise.

Where the batch comes from (--batch-on, recorded as ``batch_on``): ``device``, already on the GPU
(the figures of record up to 2026-12-02); ``host``, in pageable host memory and copied to the GPU at
the start of each step with ``batch.to(device)`` as train_step does (eyas' loader packs into pageable
memory); ``host-pinned``, the same from pinned memory (a loader with ``pin_memory``, as the peer's),
copied with ``non_blocking`` as train_step copies a pinned batch; ``host-prefetched``, what
train_drafter does on a GPU: host batches pinned by the prefetch thread (eyas.training.batches.prefetch,
each step a fresh pinned copy) and copied with ``non_blocking``.

The headline is the useful throughput beside ms/step: ``useful_tokens_per_s`` (``wall_`` back to
back), the tokens of real samples (doc id >= 0: no padding) per second.

Timing, both in every run: ``step_ms_median``, the median of --steps after --warmup (which includes
compilation and graph capture) with the device synchronised before and after each step; then
``wall_ms_per_step``, the same number of steps back to back, the device synchronised only at both
ends (the peer's ``ms_per_step``, peer_speculators.py). The step reads its loss and counts back every
step, as train_step does, so the two differ only by the harness's own syncs; ``host_syncs_two_steps``
counts the step's host-device syncs (benchmarks/common.py ``count_host_syncs``).

Exact FLOP count (the peer's): fc 6PT once; decoder linears 6PT per TTT step; lm_head 4PT per
step (+2PT weight grad when trainable); teacher head (draft rows of the target lm_head) 2PT once;
attention 12 * heads * head_dim * allowed (query, key) pairs.

    python benchmarks/bench_train.py --tokens 2048 --ttt 7 --frozen-only --modes graphs --out train_2048.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import PEAK_BF16_TFLOPS, count_host_syncs, median, sync, timed, write_result  # noqa: E402
from eyas.drafter.backend import ATTENTION, Backend  # noqa: E402
from eyas.drafter.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from eyas.params.full import load_params  # noqa: E402
from eyas.training.batches import Batch, autocast, prefetch  # noqa: E402
from eyas.training.loop import GraphedTTT, clip_in_step  # noqa: E402
from eyas.training.unroll import TTTUnroll, ttt_forward  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

DOCS = {2048: [[1024, 640, 384]],
        8192: [[2048], [1536, 512], [1024, 1024], [1024, 768, 256]]}
TINY_DOCS = {2048: [[64, 40, 24]], 8192: [[64, 64], [100, 28]]}
BATCH_ON = ("device", "host-pinned", "host", "host-prefetched")


def config(tiny: bool) -> DrafterConfig:
    if tiny:
        return DrafterConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, vocab_size=1000, draft_vocab_size=200, target_hidden_size=64,
                             num_target_layers=8)
    return DrafterConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096,
                         num_target_layers=32, rope_theta=500000.0, max_position_embeddings=131072)


def make_batch(rows: list[list[int]], c: DrafterConfig, dev, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    T = max(sum(r) for r in rows)
    B = len(rows)
    pos = torch.zeros(B, T, dtype=torch.long)
    doc = torch.full((B, T), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        a = 0
        for i, n in enumerate(r):
            pos[b, a:a + n] = torch.arange(n)
            doc[b, a:a + n] = i
            a += n
    return Batch(input_ids=torch.randint(0, c.vocab_size, (B, T), generator=g),
                 loss_mask=doc >= 0,
                 aux_hidden=torch.randn(B, T, c.num_aux * c.target_hidden_size, generator=g).to(torch.bfloat16),
                 final_hidden=torch.randn(B, T, c.target_hidden_size, generator=g).to(torch.bfloat16),
                 target_argmax=torch.randint(0, c.vocab_size, (B, T), generator=g),
                 positions=pos, doc_ids=doc, sample_ids=[]).to(dev)


def exact_flops(c: DrafterConfig, rows, ttt: int, lm_head_trainable: bool) -> dict:
    T = sum(sum(r) for r in rows)
    a = c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    p_dec = 2 * c.hidden_size * (a + 2 * kv) + a * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    p_fc = c.num_aux * c.target_hidden_size * c.hidden_size
    p_head = c.draft_vocab_size * c.hidden_size
    causal = sum(n * (n + 1) // 2 for r in rows for n in r)
    pairs = sum(causal + k * T for k in range(ttt))
    parts = {"fc": 6 * p_fc * T, "decoder_linears": ttt * 6 * p_dec * T,
             "lm_head": ttt * (6 if lm_head_trainable else 4) * p_head * T,
             "teacher_head": 2 * c.draft_vocab_size * c.target_hidden_size * T,
             "attention": 12 * c.num_attention_heads * c.head_dim * pairs}
    return {"tokens": T, "pairs": pairs, "parts": parts, "exact": sum(parts.values()),
            "exact_peer_convention_lm_frozen": sum(parts.values()) - (ttt * 2 * p_head * T if lm_head_trainable else 0)}


# first match wins: "triton fused" before "copy/fill", so Inductor kernels whose names hold
# "copy"/"cat" (e.g. the loss) are not counted as copies (results made before that order, in git
# history only, counted them as copy/fill)
KERNEL_KINDS = (("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")),
                ("attention", ("flex", "attention", "triton_tem", "_merge_")),
                ("head loss", ("_head_ce_kernel",)),
                ("optimizer", ("adam", "multi_tensor", "foreach", "norm_kernel", "clip")),
                ("triton fused", ("triton_", "_swiglu_")),
                ("copy/fill", ("memcpy", "memset", "copy", "fill", "cat")))


def kernel_kind(name: str) -> str:
    n = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in n for k in keys)), "other")


def profile_steps(step, n: int, top_n: int = 25) -> dict:
    """GPU kernel time of ``n`` calls of ``step`` (torch.profiler): per step, by kind (the first
    matching rule of KERNEL_KINDS) and the ``top_n`` largest kernels, next to the wall time."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        wall = time.perf_counter() - t0
    # CUDA-side events without the user-annotated ranges (`Optimizer.step#AdamW.step` spans the AdamW
    # kernels on the GPU timeline: counted, it added its span again; results before 2026-12-02's lm-head
    # run carry that double count in ms_by_kind["optimizer"] and gpu_busy_ms_per_step)
    kernels = [e for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    per = [(e.key, e.self_device_time_total / 1e3 / n, e.count // n) for e in kernels]
    kinds: dict = {}
    for name, ms, _ in per:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms
    busy = sum(ms for _, ms, _ in per)
    top = sorted(per, key=lambda x: -x[1])[:top_n]
    return {"steps": n, "wall_ms_per_step": wall * 1e3 / n, "gpu_busy_ms_per_step": busy,
            "ms_by_kind": {k: round(v, 2) for k, v in sorted(kinds.items(), key=lambda x: -x[1])},
            "kernels_per_step": sum(c for _, _, c in per),
            "top_kernels": [{"name": k[:160], "ms": round(ms, 3), "calls": c} for k, ms, c in top]}


def bench(c, dev, tokens: int, ttt: int, freeze_lm_head: bool, warmup: int, steps: int, tiny: bool,
          backend: Backend, graphs: bool = False, profile: int = 0, profile_top: int = 25,
          batch_on: str = "device") -> dict:
    """One timed configuration; ``graphs``: forward + backward replayed as a CUDA graph
    (eyas.training.loop.GraphedTTT, as train_drafter does on one GPU), else eager with compiled parts.
    ``batch_on``: one of BATCH_ON (the module docstring). ``profile`` > 0: then that many steps under
    torch.profiler (:func:`profile_steps`)."""
    torch.manual_seed(0)
    with torch.device(dev):  # initialise on the device (a 1B-parameter CPU init takes seconds)
        d = Eagle3Drafter(c)
    d.embed_tokens.weight.data.normal_(std=0.02)
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(c.vocab_size, generator=g)[: c.draft_vocab_size].sort().values
    d.set_vocab(perm - torch.arange(c.draft_vocab_size), torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, perm, True))
    d.to(dev).train()
    if freeze_lm_head:
        d.lm_head.weight.requires_grad_(False)
    head_rows = (torch.randn(c.draft_vocab_size, c.target_hidden_size, generator=g) * 0.02).to(dev)
    rows = (TINY_DOCS if tiny else DOCS)[tokens]
    if batch_on not in BATCH_ON:
        raise ValueError(f"batch_on must be one of {BATCH_ON}, got {batch_on!r}")
    batches = [make_batch(rows, c, dev if batch_on == "device" else torch.device("cpu"), s) for s in range(2)]
    if batch_on == "host-pinned":
        batches = [b.pin_memory() for b in batches]
    useful = batches[0].useful_tokens()
    feed = prefetch(itertools.cycle(batches), 2, pin=True) if batch_on == "host-prefetched" else None
    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=dev.type == "cuda")
    from transformers import get_cosine_schedule_with_warmup
    sched = get_cosine_schedule_with_warmup(opt, 10, 10_000)
    losses = []
    it = [0]
    graphed = GraphedTTT(TTTUnroll(d, head_rows, ttt, 0.8, backend)) if graphs else None

    def step():  # the body of eyas.training.loop.Trainer.train_step
        b = batches[it[0] % 2] if feed is None else next(feed)  # noqa: F821
        it[0] += 1
        if batch_on != "device":
            b = b.to(dev, non_blocking=b.is_pinned())  # train_step's copy
        if graphed is not None:
            loss, metrics, counts = graphed.step(b)
        else:
            with autocast(dev):
                loss, metrics, counts = ttt_forward(d, b, head_rows, ttt, 0.8, backend=backend)  # noqa: F821
        if not torch.isfinite(loss):
            raise FloatingPointError("non-finite loss")
        if graphed is None:
            opt.zero_grad(set_to_none=True)  # noqa: F821
            loss.backward()
        # Trainer's clip: inside the fused AdamW kernel on CUDA (eyas.training.loop.clip_in_step)
        gn = clip_in_step(opt, 1.0) if dev.type == "cuda" else torch.nn.utils.clip_grad_norm_(params, 1.0)  # noqa: F821
        opt.step()  # noqa: F821
        sched.step()
        losses.append(loss.item())
        gn.item()

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    w, t = timed(step, warmup, steps)
    sync()  # then the same number of steps back to back: nothing added between them
    t0 = time.perf_counter()
    ends = []
    for _ in range(steps):
        step()
        ends.append(time.perf_counter())
    sync()
    t_end = time.perf_counter()
    gaps = [b - a for a, b in zip([t0] + ends[:-1], ends[:-1] + [t_end])]
    syncs = count_host_syncs(lambda: [step() for _ in range(2)])
    fl = exact_flops(c, rows, ttt, not freeze_lm_head)
    med = median(t)
    wall = (t_end - t0) / steps
    out = {"useful_tokens_per_s": useful / med, "wall_useful_tokens_per_s": useful / wall,
           "tokens_per_step": fl["tokens"], "useful_tokens_per_step": useful, "ttt": ttt, "lm_head": "frozen" if freeze_lm_head else "trainable",
           "attn": "flex" if backend.flex_attention(torch.empty(0, device=dev), c.head_dim) else "dense",
           "backend": dataclasses.asdict(backend),
           "triton_kernels": backend.triton_kernels(torch.empty(0, device=dev)),
           "rows": rows, "batch_on": batch_on,
           "mode": "cuda_graph" if graphs else "eager", "optimizer": "AdamW fused" if dev.type == "cuda" else "AdamW",
           "step_ms_median": med * 1e3, "step_ms_min": min(t) * 1e3, "step_ms_max": max(t) * 1e3,
           "warmup_ms": [round(x * 1e3, 1) for x in w], "tokens_per_s": fl["tokens"] / med,
           "mfu_exact": fl["exact"] / med / (PEAK_BF16_TFLOPS * 1e12),
           "tflops_exact": fl["exact"] / med / 1e12, "flops": fl,
           "wall_ms_per_step": wall * 1e3, "wall_step_ms_median": median(gaps) * 1e3,
           "wall_step_ms_all": [round(x * 1e3, 2) for x in gaps], "wall_tokens_per_s": fl["tokens"] / wall,
           "wall_mfu_exact": fl["exact"] / wall / (PEAK_BF16_TFLOPS * 1e12), "host_syncs_two_steps": syncs,
           "losses": [round(x, 4) for x in losses], "n_timed": len(t)}
    if dev.type == "cuda":
        out["peak_alloc_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    if profile:
        out["profile"] = profile_steps(step, profile, profile_top)
        print("profile:", {k: out["profile"][k] for k in ("wall_ms_per_step", "gpu_busy_ms_per_step", "ms_by_kind")},
              flush=True)
    print(f"eyas T={fl['tokens']} ttt={ttt} lm_head={out['lm_head']:9s} {out['mode']:10s} attn={out['attn']} "
          f"batch_on={batch_on}: {out['wall_useful_tokens_per_s']:.0f} useful tok/s at {out['wall_ms_per_step']:.1f} "
          f"ms/step back to back; synced step {out['step_ms_median']:.1f} ms  {out['useful_tokens_per_s']:.0f} useful "
          f"tok/s  MFU(exact) {out['mfu_exact']:.3f}  "
          f"peak {out.get('peak_alloc_GiB', 0):.1f} GiB  warmup {out['warmup_ms'][:2]}"
          + (f"  host syncs/2 steps {syncs['explicit']}+{syncs['implicit']}" if syncs else ""), flush=True)
    # frees the closure cells step() reads (ruff takes the del for an unbinding: F821 noqa above)
    if feed is not None:
        feed.close()  # stops the prefetch thread
    del d, opt, batches, feed
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def check_flex(c, dev, tokens: int, ttt: int, backend: Backend) -> dict:
    """ttt_forward loss, metrics and gradients, and three ttt_steps, with flex attention vs the
    dense reference path on the same weights and batch, under bf16 autocast and in fp32 (CUDA)."""
    torch.manual_seed(0)
    with torch.device(dev):
        d = Eagle3Drafter(c)
    d.set_vocab(torch.zeros(c.draft_vocab_size, dtype=torch.long), torch.arange(c.vocab_size) < c.draft_vocab_size)
    d.lm_head.weight.requires_grad_(False)
    rows = DOCS[tokens] if c.hidden_size > 64 else TINY_DOCS[tokens]
    b = make_batch(rows, c, dev, 7)
    head = (torch.randn(c.draft_vocab_size, c.target_hidden_size) * 0.02).to(dev)
    params = [p for p in d.parameters() if p.requires_grad]
    out = {}
    for precision in ("bf16", "fp32"):
        amp = autocast(dev) if precision == "bf16" else torch.autocast(dev.type, enabled=False)
        res = {}
        for mode in ("dense", "flex"):
            b_mode = dataclasses.replace(backend, attention=mode)
            for p in params:
                p.grad = None
            with amp:
                loss, m, _ = ttt_forward(d, b, head, ttt, 0.8, backend=b_mode)
            loss.backward()
            grads = [p.grad.float().clone() for p in params]
            with torch.no_grad(), amp:
                h = d.project(b.aux_hidden.to(torch.float32))
                cache, outs = [], []
                for k in range(3):
                    h = d.ttt_step(h, b.input_ids, b.positions + k, b.doc_ids, cache, backend=b_mode)
                    outs.append(h.float())
            res[mode] = (float(loss.detach()), m, outs, grads)
        gd, gf = res["dense"][3], res["flex"][3]
        out[precision] = {
            "loss_dense": res["dense"][0], "loss_flex": res["flex"][0],
            "loss_rel_diff": abs(res["dense"][0] - res["flex"][0]) / abs(res["dense"][0]),
            "grad_rel_err": (sum(float((a - f).norm() ** 2) for a, f in zip(gd, gf))
                             / sum(float(a.norm() ** 2) for a in gd)) ** 0.5,
            "ttt_step_rel_err": [float((a - f).norm() / a.norm()) for a, f in zip(res["dense"][2], res["flex"][2])],
            "acc_0": [res["dense"][1]["acc_0"], res["flex"][1]["acc_0"]]}
        print(f"flex vs dense ({precision}):", out[precision], flush=True)
    del d
    return out


def check_graph(c, dev, ttt: int, backend: Backend) -> dict:
    """GraphedTTT vs eager ttt_forward + backward on the same weights, over two batches of one
    shape whose documents differ (so the block mask must be rebuilt inside the graph) and back:
    loss and gradient relative differences, and the supervised counts (must be equal)."""
    torch.manual_seed(0)
    with torch.device(dev):
        d = Eagle3Drafter(c)
    d.embed_tokens.weight.data.normal_(std=0.02)
    d.set_vocab(torch.zeros(c.draft_vocab_size, dtype=torch.long), torch.arange(c.vocab_size) < c.draft_vocab_size)
    d.lm_head.weight.requires_grad_(False)
    small = c.hidden_size == 64
    layouts = [[[64, 40, 24]], [[24, 24, 80]]] if small else [[[1024, 640, 384]], [[256, 256, 1536]]]
    bs = [make_batch(r, c, dev, 11 + i) for i, r in enumerate(layouts)]
    head = (torch.randn(c.draft_vocab_size, c.target_hidden_size) * 0.02).to(dev)
    params = [p for p in d.parameters() if p.requires_grad]

    def eager(b):
        for p in params:
            p.grad = None
        with autocast(dev):
            loss, _, counts = ttt_forward(d, b, head, ttt, 0.8, backend=backend)  # noqa: F821
        loss.backward()
        return float(loss.detach()), [p.grad.float().clone() for p in params], counts

    ref = [eager(b) for b in bs]
    g = GraphedTTT(TTTUnroll(d, head, ttt, 0.8, backend))
    out = {"loss_rel_diff": [], "grad_rel_err": [], "counts_equal": [], "captures": 0}
    for i in (0, 1, 0, 1):
        loss, _, counts = g.step(bs[i])
        r_loss, r_grads, r_counts = ref[i]
        num = sum(float((p.grad.float() - r).norm() ** 2) for p, r in zip(params, r_grads)) ** 0.5
        den = sum(float(r.norm() ** 2) for r in r_grads) ** 0.5
        out["loss_rel_diff"].append(abs(float(loss) - r_loss) / abs(r_loss))
        out["grad_rel_err"].append(num / den)
        out["counts_equal"].append(all(counts[f"tokens_{k}"] == r_counts[f"tokens_{k}"] for k in range(ttt)))
    out["captures"] = g.captures
    out["losses_eager"] = [r[0] for r in ref]
    print("graph vs eager:", out, flush=True)
    del d, g
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dense-ablation", action="store_true", help="also time dense attention at 2048")
    ap.add_argument("--attention", choices=ATTENTION, help="train.backend.attention (default: params.yaml's)")
    ap.add_argument("--no-compile", action="store_true", help="train.backend.compile: false")
    ap.add_argument("--no-compile-layers", action="store_true", help="train.backend.compile_layers: false")
    ap.add_argument("--no-triton", action="store_true", help="train.backend.triton: false")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--frozen-only", action="store_true", help="only the lm_head-frozen runs (the peer's set)")
    ap.add_argument("--modes", nargs="+", default=["eager", "graphs"], choices=["eager", "graphs"],
                    help="graphs: CUDA-graph replay (train_drafter's default on one GPU); eager: compiled parts only")
    ap.add_argument("--batch-on", nargs="+", default=["device"], choices=BATCH_ON,
                    help="where each step's batch comes from: device (already on the GPU), host (pageable, "
                         "blocking copy), host-pinned (pinned, non_blocking copy) or host-prefetched (pinned by "
                         "the prefetch thread each step, non_blocking copy: train_drafter's path)")
    ap.add_argument("--skip-checks", action="store_true", help="skip the flex-vs-dense and graph-vs-eager checks")
    ap.add_argument("--profile", type=int, default=0, help="then profile this many steps (kernel time by kind)")
    ap.add_argument("--profile-top", type=int, default=25, help="kernels listed in the profile, largest first")
    ap.add_argument("--out", default="train.json")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    c = config(a.tiny)
    backend = Backend.of(load_params(REPO / "params.yaml").train.backend)
    backend = dataclasses.replace(backend, attention=a.attention or backend.attention,
                                  compile=backend.compile and not a.no_compile,
                                  compile_layers=backend.compile_layers and not a.no_compile_layers,
                                  triton=backend.triton and not a.no_triton)
    doc = {"what": "eyas TTT training step, Llama-3.1-8B-shaped drafter, synthetic packed batches, 1 GPU",
           "peak_bf16_tflops_assumed": PEAK_BF16_TFLOPS, "runs": [], "errors": []}
    if dev.type == "cuda" and not a.skip_checks:
        try:
            doc["flex_check"] = check_flex(c, dev, 2048, 3, backend)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            doc["errors"].append(f"flex_check: {e!r}")
        try:
            doc["graph_check"] = check_graph(c, dev, a.ttt, backend)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            doc["errors"].append(f"graph_check: {e!r}")
    for T in a.tokens:
        for freeze in ((True,) if a.frozen_only else (False, True)):
            for mode, batch_on in ((m, b) for m in a.modes for b in a.batch_on):
                if dev.type != "cuda" and (mode == "graphs" or batch_on != "device"):
                    continue  # CPU: no graphs, and the batch is on the device already
                try:
                    doc["runs"].append(bench(c, dev, T, a.ttt, freeze, a.warmup, a.steps, a.tiny, backend,
                                             mode == "graphs", a.profile, a.profile_top, batch_on))
                except Exception as e:  # noqa: BLE001
                    import traceback
                    traceback.print_exc()
                    doc["errors"].append(f"T={T} freeze={freeze} mode={mode} batch_on={batch_on}: {e!r}")
                write_result(a.out, doc)
    if a.dense_ablation and dev.type == "cuda":
        try:
            doc["runs"].append(bench(c, dev, 2048, a.ttt, True, 3, 10, a.tiny,
                                     dataclasses.replace(backend, attention="dense")))
        except Exception as e:  # noqa: BLE001
            doc["errors"].append(f"dense ablation: {e!r}")
    write_result(a.out, doc)


if __name__ == "__main__":
    main()
