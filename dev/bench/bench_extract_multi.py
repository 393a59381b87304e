"""Extraction on several GPUs, 8B-shaped Llama (random bf16 weights, sdpa).

Mode ``data`` (plain python = 1 GPU; torchrun = W GPUs): every rank holds a whole copy of the
target and runs the pipelined extract path of bench_extract.e2e (capture, pinned async D2H,
background fsync'd shard writers) over its own share of the batches, into its own shard folder on
the machine's one local disk. Total tokens/s = all ranks' tokens / slowest rank's wall time.
(stages/extract.py itself is single-process: this measures what sharding the data over ranks
would give.)

Mode ``split``: one process, the target's layers split over ``--gpus`` GPUs in sequence with
accelerate's dispatch_model (what ``device_map="auto"`` does): bare forward and capture tokens/s,
captured shapes, weights and peak memory per GPU; whether eyas.target.model.Target.capture works
unchanged on it. ``--shape 70b`` is Llama-3.1-70B's shape (141 GB of bf16 weights: 4 GPUs); the
weights are made on the meta device and materialised piece by piece on their GPU (random, normal
std 0.02, norms 1, as transformers initialises Llama), so no GPU ever holds the whole target.

    python dev/bench/bench_extract_multi.py --mode data --out extract_w1.json
    torchrun --standalone --nproc-per-node 2 dev/bench/bench_extract_multi.py --mode data --out extract_w2.json
    python dev/bench/bench_extract_multi.py --mode split --out extract_split.json
    python dev/bench/bench_extract_multi.py --mode split --shape 70b --gpus 4 --out scale_extract_split70b.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.bench_extract import build, e2e  # noqa: E402
from benchmarks.common import median, sync, timed  # noqa: E402
from dev.bench.common import write_result  # noqa: E402
from eyas.training import distributed as du  # noqa: E402


def data_mode(a) -> dict:
    rank, world, dev = du.init_distributed("cuda")
    target, cfg = build(a.tiny)  # on the current device (cuda:LOCAL_RANK)
    L = cfg.num_hidden_layers
    aux = [2, L // 2, L - 3]
    B, T = a.batch, a.seq
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(dev)
    with torch.inference_mode():
        _, t = timed(lambda: target.model.model(input_ids=x), 2, 6)
        bare = B * T / median(t)
        _, t = timed(lambda: target.capture(x, torch.ones_like(x), aux), 2, 6)
        cap = B * T / median(t)
    batches = [torch.randint(0, cfg.vocab_size, (B, T), generator=g) for _ in range(a.batches)]
    root = Path(tempfile.mkdtemp(prefix=f"eyas_xm_r{rank}_"))
    e2e(target, batches[:2], root / "warm", torch.bfloat16, True, a.shard_samples)
    shutil.rmtree(root / "warm", ignore_errors=True)
    du.barrier()
    sync()
    t0 = time.perf_counter()
    r = e2e(target, batches, root / "e2e", torch.bfloat16, True, a.shard_samples)
    du.barrier()
    wall = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    per = torch.zeros(max(world, 1), 4, dtype=torch.float64, device=dev)
    per[rank] = torch.tensor([bare, cap, r["tokens_per_s"], r["tokens"]], dtype=torch.float64)
    per = du.all_reduce_sum(per).cpu().tolist()
    total = sum(p[3] for p in per)
    return {"world": world, "batch": B, "seq": T, "batches_per_rank": a.batches,
            "per_rank": [{"bare_tok_s": p[0], "capture_tok_s": p[1], "e2e_tok_s": p[2], "tokens": p[3]} for p in per],
            "wall_s": wall, "e2e_total_tok_s": total / wall, "bare_total_tok_s": sum(p[0] for p in per),
            "bytes_per_token_written": r["bytes_per_token_written"]}


SHAPES = {  # Llama-3.1 shapes (their config.json on the hub); the tiny one for CPU checks
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096)}


def build_split(shape: str, gpus: int):
    """A random bf16 Llama of ``shape``, layers split in sequence over ``gpus`` GPUs (CPU when
    there is none: the same code path in fp32 for checks), each piece materialised on its own
    device. Returns (model with accelerate's hooks, config, {module name: device index})."""
    from accelerate import dispatch_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(**SHAPES[shape])
    cfg._attn_implementation = "sdpa"
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < gpus:
        raise SystemExit(f"--gpus {gpus}: only {torch.cuda.device_count()} GPUs here")
    dev = (lambda g: torch.device("cuda", g)) if cuda else (lambda g: torch.device("cpu"))
    dtype = torch.bfloat16 if cuda else torch.float32
    L = cfg.num_hidden_layers
    per = -(-L // gpus)
    dm = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": gpus - 1, "lm_head": gpus - 1}
    dm.update({f"model.layers.{i}": i // per for i in range(L)})
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg).eval()
        for name, g in dm.items():
            mod = model.get_submodule(name)
            if name == "model.rotary_emb":  # buffers computed at construction: build it again there
                with torch.device(dev(g)):
                    model.model.rotary_emb = LlamaRotaryEmbedding(config=cfg)
                continue
            mod.to_empty(device=dev(g))
            with torch.no_grad():
                for p in mod.parameters():
                    if p.dim() > 1:  # linear and embedding weights
                        p.normal_(0.0, 0.02)
                    else:  # RMSNorm weights
                        p.fill_(1.0)
    finally:
        torch.set_default_dtype(torch.float32)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"not materialised: {left[:5]}")
    dm = {k: (v if cuda else "cpu") for k, v in dm.items()}
    return dispatch_model(model, device_map=dm), cfg, dm


def split_mode(a) -> dict:
    from eyas.target.model import Target

    shape = "tiny" if a.tiny else a.shape
    model, cfg, dm = build_split(shape, a.gpus)
    target = Target(model, None, {})
    L = cfg.num_hidden_layers
    n_dev = torch.cuda.device_count()
    mem = [torch.cuda.memory_allocated(i) / 2**30 for i in range(n_dev)]
    aux = [2, L // 2, L - 3]
    B, T = a.batch, a.seq
    x = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0)).to(
        model.model.embed_tokens.weight.device)
    per = -(-L // a.gpus)
    out = {"shape": shape, "gpus": a.gpus,
           "device_map": ", ".join(f"layers {g * per}-{min(L, (g + 1) * per) - 1} on GPU {g}" for g in range(a.gpus))
           + f"; embed on GPU 0, norm + lm_head on GPU {a.gpus - 1}",
           "weights_GiB_per_gpu": mem, "batch": B, "seq": T}

    def syn():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)

    def tm(fn, n=6):
        fn(); fn(); syn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter(); fn(); syn(); ts.append(time.perf_counter() - t0)
        return median(ts)

    with torch.inference_mode():
        out["bare_tok_s"] = B * T / tm(lambda: model.model(input_ids=x))
        try:
            r = target.capture(x, torch.ones_like(x), aux)
            out["eyas_capture_unchanged"] = "ok"
        except Exception as e:  # noqa: BLE001
            out["eyas_capture_unchanged"] = f"fails: {e!r}"[:300]

        def capture():  # Target.capture with the hidden states gathered onto the last GPU
            o = model(input_ids=x, attention_mask=torch.ones_like(x), output_hidden_states=True, use_cache=False)
            hs, d = o.hidden_states, o.hidden_states[-1].device
            return {"aux_hidden": torch.cat([hs[k].to(d) for k in aux], -1), "final_hidden": hs[L],
                    "target_argmax": o.logits.argmax(-1)}
        r = capture()
        out["capture_tok_s"] = B * T / tm(capture)
        out["captured_shapes"] = {k: list(v.shape) for k, v in r.items()}
        out["captured_devices"] = {k: str(v.device) for k, v in r.items()}
        out["shapes_ok"] = (list(r["aux_hidden"].shape) == [B, T, 3 * cfg.hidden_size]
                            and list(r["final_hidden"].shape) == [B, T, cfg.hidden_size]
                            and list(r["target_argmax"].shape) == [B, T])
        out["finite"] = bool(torch.isfinite(r["aux_hidden"]).all() and torch.isfinite(r["final_hidden"]).all())
    out["peak_alloc_GiB_per_gpu"] = [torch.cuda.max_memory_allocated(i) / 2**30 for i in range(n_dev)]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["data", "split"], default="data")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--shard-samples", type=int, default=16)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--shape", choices=("8b", "70b"), default="8b", help="split mode: the target's shape")
    ap.add_argument("--gpus", type=int, default=2, help="split mode: GPUs the layers are split over")
    ap.add_argument("--out", default="extract_multi.json")
    a = ap.parse_args()
    res = data_mode(a) if a.mode == "data" else split_mode(a)
    shape = "tiny" if a.tiny else "70B" if a.mode == "split" and a.shape == "70b" else "8B"
    res["what"] = f"extraction on several GPUs, mode {a.mode}, {shape}-shaped Llama, random bf16 weights"
    print(res, flush=True)
    if du.is_main():
        write_result(a.out, res)
    du.destroy()


if __name__ == "__main__":
    main()
