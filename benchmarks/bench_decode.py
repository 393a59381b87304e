"""The target's decode on a GPU: transformers' own (``DynamicCache``, one Python-driven forward per
step) against eyas' graphed decode (:mod:`eyas.target.graphed`: a static KV cache, each step shape
replayed from one CUDA graph), same prompts, same GPU, same call.

Two parts (``--parts``), each a results file and a one-line summary per figure:

- ``selfdistill`` -> ``decode_selfdistill.json``: self-distill's batched greedy generation of the
  embedded target (SmolLM2-135M, ``--dtype`` float32 as the stage runs it) at each ``--batch-sizes``:
  :func:`eyas.data.distill.generate_batch` with ``decode="dynamic"`` (transformers ``generate``) and
  ``decode="graphed"``; prompts are chitchat's assistant turns (``distill.turns: all``) planned at the
  ``--max-prompt-tokens`` budget and sorted by length as :func:`eyas.data.distill.regenerate` sorts
  them, ``--batches`` evenly spaced runs of them per batch size, the longest one first and untimed
  (the graphed decode's cache and captures are made there). Figures: generated tokens per second, and
  how many replies are identical token for token; with ``--sampled T P`` also a sampled row at the
  largest batch size (the user turns of synthesized prompts; the decodes draw from different
  generators, so no replies are compared). On a machine without the embedded target's package
  (or chitchat's) a random Llama of its shape (random-id prompts) stands in; the results say which.
- ``step`` -> ``decode_step.json``: one decode step at batch 1 after a ``--ctx``-token prompt (the
  forward and its argmax read on the host, as the eval's greedy loop does), and one verify step of
  k + 1 tokens with the aux hidden states an EAGLE-3 drafter reads, for the embedded target and an
  8B-shaped random Llama (bf16, benchmarks/bench_extract.py's shape); beside them the memory-bound
  floor, the weights' bytes over the GPU's bandwidth (``--bandwidth-tbs``, an H100 SXM's 3.35 TB/s).

    python3 benchmarks/bench_decode.py                      # both parts, ~3 min on an H100
    python3 benchmarks/bench_decode.py --parts step --models tiny --device cpu   # a look at the script
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import median, sync, timed, write_result  # noqa: E402
from eyas.data.conversations import DataError, load_conversations  # noqa: E402
from eyas.data.distill import generate_batch, plan_prompts  # noqa: E402
from eyas.eval.speculative import TargetCache  # noqa: E402
from eyas.target import graphed  # noqa: E402
from eyas.target.model import TargetError, load_target, load_tokenizer_and_config, stop_token_ids  # noqa: E402


def smollm(a):
    """(model, tokenizer, name): the embedded target, or where its package is missing (a bare GPU
    machine) a random Llama of its shape (the decode's speed depends on the shape only)."""
    try:
        tok, _ = load_tokenizer_and_config()
        return load_target(dtype=a.dtype, device=torch.device(a.device), tokenizer=tok).model, tok, \
            "SmolLM2-135M-Instruct (embedded)"
    except (TargetError, ImportError) as e:  # ImportError: the gguf package transformers reads it with
        print(f"the embedded target is not here ({e}): a random Llama of its shape", flush=True)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).to(a.device, getattr(torch, a.dtype)).eval()
    return model, None, "random SmolLM2-135M-shaped Llama"


def distill_prompts(tok, a, need: int) -> tuple[list[list[int]], str]:
    """Self-distill's prompts sorted by length: chitchat's assistant turns planned as the stage plans
    them, or (no tokenizer or no chitchat package) random ids of 16..max_prompt_tokens tokens."""
    if tok is not None:
        try:
            convs, _ = load_conversations("chitchat")
            items, _ = plan_prompts(tok, convs[: max(50, need // 8)], turns="all",
                                    max_prompt_tokens=a.max_prompt_tokens)
            if len(items) >= need:
                return sorted((it["prompt_ids"] for it in items), key=len), "chitchat, distill.turns all"
        except DataError as e:
            print(f"chitchat is not here ({e}): random prompts", flush=True)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, a.max_prompt_tokens + 1, (need,), generator=g).sort().values.tolist()
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths], "random ids"


def selfdistill(a) -> dict:
    need = max(a.batch_sizes) * a.batches
    model, tok, name = smollm(a)
    prompts, source = distill_prompts(tok, a, need)
    stop_ids = stop_token_ids(tok, model.generation_config) if tok is not None else []
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else (stop_ids or [0])[0]
    doc = {"what": "self-distill batched greedy: transformers generate vs eyas' graphed decode, same prompts",
           "model": name, "prompts": source, "dtype": a.dtype, "max_new_tokens": a.max_new_tokens,
           "max_prompt_tokens": a.max_prompt_tokens, "timed_batches": a.batches - 1, "rows": []}
    fast = "graphed" if a.device == "cuda" else "static"  # off CUDA: the same loop without graphs
    runs = [(bs, {}) for bs in a.batch_sizes]
    if a.sampled:  # synthesized prompts' user turns: sampled at the largest batch
        runs.append((max(a.batch_sizes), {"temperature": a.sampled[0], "top_p": a.sampled[1]}))
    for bs, sampling in runs:
        step = (len(prompts) - bs) // max(1, a.batches - 1)
        # the longest batch first, untimed: the graphed decode's cache and graphs then fit every batch
        batches = [prompts[k * step:k * step + bs] for k in range(a.batches)][::-1]
        row, replies = {"batch_size": bs, **sampling, "prompt_tokens_max": [len(b[-1]) for b in batches]}, {}
        for decode in ("dynamic", fast):
            sync()
            t0 = time.perf_counter()
            generate_batch(model, batches[0], a.max_new_tokens, pad, stop_ids, decode=decode, **sampling)  # warm-up
            sync()
            warm = time.perf_counter() - t0
            out, t0 = [], time.perf_counter()
            for b in batches[1:]:
                out += generate_batch(model, b, a.max_new_tokens, pad, stop_ids, decode=decode, **sampling)
            sync()
            sec = time.perf_counter() - t0
            n = sum(len(r) for r in out)
            replies[decode] = out
            row[decode] = {"warmup_seconds": round(warm, 2), "seconds": round(sec, 3), "generated_tokens": n,
                           "tokens_per_second": round(n / sec, 1)}
        row["speedup"] = round(row[fast]["tokens_per_second"] / row["dynamic"]["tokens_per_second"], 2)
        if not sampling:  # sampled, the two decodes draw from different generators
            same = sum(x == y for x, y in zip(replies[fast], replies["dynamic"]))
            row["identical_replies"] = f"{same}/{len(replies['dynamic'])}"
        graphed.release(model)  # the next batch size's cache in its own memory
        doc["rows"].append(row)
        print(f"self-distill batch {bs}{' sampled' if sampling else ''}: generate "
              f"{row['dynamic']['tokens_per_second']:,.0f} tok/s, {fast} {row[fast]['tokens_per_second']:,.0f} tok/s "
              f"({row['speedup']}x), identical replies {row.get('identical_replies', 'n/a (sampled)')}", flush=True)
        write_result(a.out_selfdistill, doc)
    return doc


def build_8b(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        model = LlamaForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
    return model


def build_tiny(device: str):
    from tests.tiny import tiny_target

    return tiny_target().model.to(device)


def step_row(name: str, model, a) -> dict:
    L = model.config.num_hidden_layers
    aux = [2, L // 2, L - 3]
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, model.config.vocab_size, (a.ctx,), generator=g).tolist()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    row = {"model": name, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
           "weights_gb": round(weights / 1e9, 3),
           "memory_bound_ms": round(weights / (a.bandwidth_tbs * 1e12) * 1e3, 4)}
    decodes = ("dynamic", "graphed") if a.device == "cuda" else ("dynamic", "static")
    for decode in decodes:
        cache = TargetCache(model, decode, a.ctx + max(a.k) + 2)
        with torch.no_grad():
            cache(ctx, last_only=True)  # the prompt

            def decode_step():
                int(cache([ctx[-1]], last_only=True)[1][0, -1])
                cache.keep(a.ctx)

            _, t = timed(decode_step, 5, a.steps)
            row[f"{decode}_decode_ms"] = round(median(t) * 1e3, 3)
            for k in a.k:
                def verify():
                    _, greedy, feats = cache(ctx[-k - 1:], aux)
                    greedy[0].tolist()  # the accept rule reads the target's tokens on the host
                    cache.keep(a.ctx)

                _, t = timed(verify, 3, a.steps)
                row[f"{decode}_verify_k{k}_ms"] = round(median(t) * 1e3, 3)
    graphed.release(model)
    fast = decodes[1]
    row["decode_speedup"] = round(row["dynamic_decode_ms"] / row[f"{fast}_decode_ms"], 2)
    row["decode_over_memory_bound"] = round(row[f"{fast}_decode_ms"] / (weights / (a.bandwidth_tbs * 1e9)), 2)
    print(f"decode step {name} batch 1 ctx {a.ctx}: transformers {row['dynamic_decode_ms']} ms, {fast} "
          f"{row[f'{fast}_decode_ms']} ms ({row['decode_speedup']}x), memory-bound floor {row['memory_bound_ms']} ms "
          f"({row['decode_over_memory_bound']}x of it); verify k={a.k[-1]} {fast} {row[f'{fast}_verify_k{a.k[-1]}_ms']} "
          f"ms vs {row[f'dynamic_verify_k{a.k[-1]}_ms']} ms", flush=True)
    return row


def steps(a) -> dict:
    doc = {"what": "decode step and verify step at batch 1: transformers DynamicCache vs eyas' graphed decode",
           "ctx": a.ctx, "k": a.k, "bandwidth_tbs": a.bandwidth_tbs, "rows": []}
    for name in a.models:
        if name == "embedded":
            model, _, _ = smollm(a)
        elif name == "8b":
            model = build_8b(a.device)
        else:
            model = build_tiny(a.device)
        doc["rows"].append(step_row(name, model, a))
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        write_result(a.out_step, doc)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["selfdistill", "step"], choices=["selfdistill", "step"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--batches", type=int, default=3, help="batches per batch size, the first one untimed")
    ap.add_argument("--sampled", type=float, nargs=2, metavar=("TEMPERATURE", "TOP_P"),
                    help="also a sampled row at the largest batch size (synthesized prompts' user turns)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=192)
    ap.add_argument("--dtype", default="float32", help="the embedded target's dtype (the stages' default)")
    ap.add_argument("--models", nargs="+", default=["embedded", "8b"], choices=["embedded", "8b", "tiny"])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--k", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--bandwidth-tbs", type=float, default=3.35, help="the GPU's memory bandwidth, TB/s")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out-selfdistill", default="decode_selfdistill.json")
    ap.add_argument("--out-step", default="decode_step.json")
    a = ap.parse_args()
    if a.batches < 2:
        ap.error("--batches >= 2 (one untimed, the rest timed)")
    if a.sampled and not (a.sampled[0] > 0 and 0 < a.sampled[1] <= 1):
        ap.error(f"--sampled TEMPERATURE > 0 and TOP_P in (0, 1], got {a.sampled}")
    if "selfdistill" in a.parts:
        selfdistill(a)
    if "step" in a.parts:
        steps(a)


if __name__ == "__main__":
    main()
