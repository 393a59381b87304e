"""Self-distill's batched greedy generation on a GPU: transformers' ``generate`` with its default
dynamic KV cache (:func:`eyas.data.distill.generate_batch` with ``decode="dynamic"``, what the stage
ran before its graphed decode; benchmarks/bench_decode.py compares that one) against the same call
with ``cache_implementation="static"`` (a cache preallocated to prompt + new tokens; transformers
compiles the decode step for it, transformers docs "Caching" and "torch.compile" pages).

    python3 dev/bench/bench_generate.py --conversations data/conversations/train.jsonl   # -> results/generate_gpu.json

The prompts are the stage's: every assistant turn of the file's conversations planned with
:func:`eyas.data.distill.plan_prompts` at the given prompt budget and sorted by length as
:func:`eyas.data.distill.regenerate` sorts them; ``--batches`` runs of ``--batch-size`` of them, evenly
spaced over that order, are the batches.
Each cache runs one untimed warm-up batch, then the timed batches. The static cache is compiled
for each prompt length it meets, and every batch has its own: its timed batches include their
compiles, as the stage's batches would.
Figures: generated tokens per second of the timed batches, peak GPU memory, and how many replies are
identical token for token to the dynamic cache's (padding and kernel choice can flip a near-tie). The
result is written after each cache, so a run cut off in the static cache's compile keeps the
dynamic cache's figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.common import sync  # noqa: E402
from dev.bench.common import write_result  # noqa: E402
from eyas.data.conversations import read_jsonl  # noqa: E402
from eyas.data.distill import generate_batch, plan_prompts  # noqa: E402
from eyas.target.model import load_target, load_tokenizer_and_config  # noqa: E402


def run(cache, model, batches, max_new_tokens, pad_id, stop_ids) -> tuple[dict, list[list[int]]]:
    """One untimed batch, then the rest timed, with ``cache_implementation=cache``; returns the
    figures and the timed batches' replies."""
    cuda = torch.cuda.is_available()
    torch.cuda.reset_peak_memory_stats() if cuda else None
    sync()
    t0 = time.perf_counter()
    generate_batch(model, batches[0], max_new_tokens, pad_id, stop_ids, cache, decode="dynamic")  # warm-up
    sync()
    warm = time.perf_counter() - t0
    replies, t0 = [], time.perf_counter()
    for b in batches[1:]:
        replies += generate_batch(model, b, max_new_tokens, pad_id, stop_ids, cache, decode="dynamic")
    sync()
    sec = time.perf_counter() - t0
    tokens = sum(len(r) for r in replies)
    return {"warmup_seconds": round(warm, 1), "seconds": round(sec, 2), "generated_tokens": tokens,
            "tokens_per_second": round(tokens / sec, 1),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}, replies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", required=True, help="a conversations JSONL (data/conversations/train.jsonl)")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=3, help="batches per cache, the first one untimed")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=192)
    ap.add_argument("--dtype", default="float32", help="the target's dtype (presets/h200.yaml keeps float32)")
    ap.add_argument("--device", default="cuda", help="cpu: a quick look at the script, not a figure")
    ap.add_argument("--out", default="generate_gpu.json")
    a = ap.parse_args()
    if a.batches < 2 or a.batch_size < 1:
        ap.error(f"--batches >= 2 (one untimed, the rest timed) and --batch-size >= 1, got {a.batches} and {a.batch_size}")
    tok, _ = load_tokenizer_and_config()
    n = a.batches * a.batch_size
    items, plan = plan_prompts(tok, read_jsonl(Path(a.conversations)), turns="all",
                               max_prompt_tokens=a.max_prompt_tokens)
    if len(items) < n:
        raise SystemExit(f"{a.conversations}: {len(items)} prompts planned, {n} needed (--batches x --batch-size)")
    # regenerate's batches are runs of the length-sorted prompts: --batches such runs, evenly spaced
    prompts = sorted((it["prompt_ids"] for it in items), key=len)
    step = (len(prompts) - a.batch_size) // max(1, a.batches - 1)
    batches = [prompts[k * step:k * step + a.batch_size] for k in range(a.batches)]
    target = load_target(dtype=a.dtype, device=torch.device(a.device), tokenizer=tok)
    stop_ids = target.stop_ids
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else stop_ids[0]
    results = {}
    dyn, dyn_replies = run(None, target.model, batches, a.max_new_tokens, pad_id, stop_ids)
    results["dynamic"] = dyn
    print("dynamic", dyn, flush=True)
    doc = {"conversations": a.conversations, "planned_prompts": plan["prompts"],
           "batch_prompt_tokens": [max(len(p) for p in b) for b in batches], "prompts": n,
           "batch_size": a.batch_size, "timed_batches": a.batches - 1, "max_new_tokens": a.max_new_tokens,
           "max_prompt_tokens": a.max_prompt_tokens, "dtype": a.dtype, "results": results}
    write_result(a.out, doc)  # a run cut off in the static cache's compile keeps the dynamic figures
    st, st_replies = run("static", target.model, batches, a.max_new_tokens, pad_id, stop_ids)
    same = sum(x == y for x, y in zip(st_replies, dyn_replies))
    results["static"] = {**st, "identical_replies_to_dynamic": f"{same}/{len(st_replies)}",
                         "speedup_over_dynamic": round(st["tokens_per_second"] / dyn["tokens_per_second"], 2)}
    print("static", results["static"], flush=True)
    write_result(a.out, doc)


if __name__ == "__main__":
    main()
