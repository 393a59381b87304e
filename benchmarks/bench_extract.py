"""Extraction throughput vs a bare forward of an 8B-shaped Llama (random bf16 weights, sdpa).

Rows (tokens/s, median over timed batches of B x T tokens):
  bare      model.model(input_ids) (the decoder stack only: the floor extraction is compared with);
  capture   eyas.target.model.Target.capture (aux + final hidden states + full-vocab argmax: adds the
            lm_head, ~7.5% of the FLOPs of an 8B forward);
  e2e_sync  capture + per-sample synchronous .cpu() + synchronous shard writes (the old extract);
  e2e       what stages/extract.py does now: capture, cast on device, async copy to pinned host
            memory on a side stream (eyas.features.HostCopy), one batch of lookahead, shards
            written and fsync'd by ShardWriter(background=True) threads straight from the pinned
            buffers (no concatenation, no in-memory serialisation); timed from the first forward
            to the manifest (all bytes durable); ``tail_s`` is the part after the last sample
            was handed over (the last shard's write, which no compute can hide).
Plus local disk's fsync'd write rate and bytes/token. ``--dtype float8_e4m3fn`` adds an ``e2e``
run with fp8 aux states, quantised on the GPU before the copy (eyas.features.quantize_capture, as
stages/extract.py does): ``e2e_fp8``.

    python benchmarks/bench_extract.py --batches 96 --fp8 --out extract.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import median, sync, timed, write_result  # noqa: E402
from eyas.features import FP8, HostCopy, ShardWriter, bytes_per_token, quantize_capture  # noqa: E402
from eyas.target.model import Target  # noqa: E402


def build(tiny: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    if tiny:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096)
    else:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        torch.set_default_dtype(torch.bfloat16 if dev == "cuda" else torch.float32)
        model = LlamaForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
    return Target(model, None, {}), cfg


def e2e(target, batches, out_dir, dtype, pipelined: bool, shard_samples: int) -> dict:
    L = target.num_layers
    aux = [2, L // 2, L - 3]
    dev = target.device
    sync()
    t0 = time.perf_counter()
    w = ShardWriter(out_dir, shard_samples, dtype, background=pipelined)
    host = HostCopy(dev)
    pending = None

    fp8 = dtype == FP8

    def store(handle, ids):
        out = handle.wait()
        for j in range(ids.shape[0]):
            w.add(ids[j], torch.ones(ids.shape[1], dtype=torch.bool), out["aux_hidden"][j],
                  out["final_hidden"][j], out["target_argmax"][j], out["aux_scale"][j] if fp8 else None)

    with torch.inference_mode():
        for ids in batches:
            att = torch.ones_like(ids)
            out = target.capture(ids.to(dev, non_blocking=True), att.to(dev, non_blocking=True), aux)
            if pipelined:
                if fp8:
                    out = quantize_capture(out, len(aux))
                h = host.submit(out, {"final_hidden": torch.bfloat16 if fp8 else dtype, "target_argmax": torch.int32,
                                      **({} if fp8 else {"aux_hidden": dtype})})
                if pending is not None:
                    store(*pending)
                pending = (h, ids)
            else:  # the previous extract loop: per-sample .cpu() of device slices, sync writes
                for j in range(ids.shape[0]):
                    w.add(ids[j], torch.ones(ids.shape[1], dtype=torch.bool), out["aux_hidden"][j],
                          out["final_hidden"][j], out["target_argmax"][j])
        if pending is not None:
            store(*pending)
    t_fed = time.perf_counter()  # every sample handed to the writer; the rest is the write tail
    m = w.finish(aux_layers=aux)
    dt = time.perf_counter() - t0
    n = m["num_tokens"]
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt, "tail_s": dt - (t_fed - t0),
            "bytes_written": w.bytes_written,
            "bytes_per_token_written": w.bytes_written / n, "shards": len(m["shards"])}


def disk_rate(path: Path, gib: float = 2.0) -> float:
    buf = torch.empty(128 * 2**20, dtype=torch.uint8).random_()
    f_path = path / "probe.bin"
    n = int(gib * 8)
    t = time.perf_counter()
    with open(f_path, "wb") as f:
        for _ in range(n):
            f.write(memoryview(buf.numpy()))
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    f_path.unlink()
    return n * 128 / 1024 / dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=24)
    ap.add_argument("--shard-samples", type=int, default=16)
    ap.add_argument("--dir", default=None, help="where shards go (default: a temp dir on local disk)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="also the e2e run with fp8 aux states (e2e_fp8)")
    ap.add_argument("--out", default="extract.json")
    a = ap.parse_args()
    target, cfg = build(a.tiny)
    dev = target.device
    root = Path(a.dir or tempfile.mkdtemp(prefix="eyas_extract_"))
    root.mkdir(parents=True, exist_ok=True)
    L = cfg.num_hidden_layers
    aux = [2, L // 2, L - 3]
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    B, T = a.batch, a.seq
    x = torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(dev)
    res = {"what": "extraction throughput vs bare forward, 8B-shaped Llama, random bf16 weights, sdpa",
           "batch": B, "seq": T, "batches_e2e": a.batches,
           "bytes_per_token_floor": bytes_per_token(3, cfg.hidden_size, dtype)}
    with torch.inference_mode():
        _, t = timed(lambda: target.model.model(input_ids=x), 3, 8)
        res["bare_tok_s"] = B * T / median(t)
        _, t = timed(lambda: target.capture(x, torch.ones_like(x), aux), 3, 8)
        res["capture_tok_s"] = B * T / median(t)
    print({k: v for k, v in res.items()}, flush=True)
    batches = [torch.randint(0, cfg.vocab_size, (B, T), generator=g) for _ in range(a.batches)]
    e2e(target, batches[:2], root / "warm", dtype, True, a.shard_samples)  # warm allocator, threads
    shutil.rmtree(root / "warm", ignore_errors=True)
    res["e2e"] = e2e(target, batches, root / "e2e", dtype, True, a.shard_samples)
    shutil.rmtree(root / "e2e", ignore_errors=True)
    print("e2e", res["e2e"], flush=True)
    n_sync = max(4, a.batches // 3)
    res["e2e_sync"] = e2e(target, batches[:n_sync], root / "sync", dtype, False, a.shard_samples)
    shutil.rmtree(root / "sync", ignore_errors=True)
    print("e2e_sync", res["e2e_sync"], flush=True)
    if a.fp8:
        res["e2e_fp8"] = e2e(target, batches, root / "fp8", FP8, True, a.shard_samples)
        shutil.rmtree(root / "fp8", ignore_errors=True)
        res["e2e_fp8"]["bytes_per_token_floor"] = bytes_per_token(3, cfg.hidden_size, FP8)
        res["e2e_fp8_over_bare"] = res["e2e_fp8"]["tokens_per_s"] / res["bare_tok_s"]
        print("e2e_fp8", res["e2e_fp8"], flush=True)
    res["disk_write_GiB_s"] = disk_rate(root)
    res["disk_bound_tok_s"] = res["disk_write_GiB_s"] * 2**30 / res["bytes_per_token_floor"]
    for k in ("capture_tok_s", "disk_bound_tok_s"):
        res[k.replace("_tok_s", "_over_bare")] = res[k] / res["bare_tok_s"]
    res["e2e_over_bare"] = res["e2e"]["tokens_per_s"] / res["bare_tok_s"]
    res["e2e_sync_over_bare"] = res["e2e_sync"]["tokens_per_s"] / res["bare_tok_s"]
    print(f"bare {res['bare_tok_s']:.0f} tok/s | capture {res['capture_tok_s']:.0f} ({res['capture_over_bare']:.2f}x) | "
          f"e2e {res['e2e']['tokens_per_s']:.0f} ({res['e2e_over_bare']:.2f}x) | sync e2e "
          f"{res['e2e_sync']['tokens_per_s']:.0f} ({res['e2e_sync_over_bare']:.2f}x) | disk "
          f"{res['disk_write_GiB_s']:.2f} GiB/s = {res['disk_bound_tok_s']:.0f} tok/s", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    write_result(a.out, res)


if __name__ == "__main__":
    main()
