"""Self-distill tokens/s: HF ``generate`` in-process (``distill.backend: hf``) against llama.cpp's
``llama-server`` (``distill.backend: server``, api ``llamacpp``) on the embedded SmolLM2 target, on the
CPU or on a GPU.

    python3 dev/bench/bench_distill_backends.py                  # CPU -> dev/results/distill_backends_cpu.json
    python3 dev/bench/bench_distill_backends.py --prompts 8 --max-new-tokens 16   # a quick look
    python3 dev/bench/bench_distill_backends.py --backend cuda   # GPU -> dev/results/distill_backends_<gpu>.json

The same planned prompts go through :func:`eyas.data.distill.regenerate` (batch ``--batch-size``, the
target in ``--dtype``) and through :func:`eyas.data.remote.regenerate_remote` at each ``--concurrency``
(llama-server with that many slots, ``-np``, decoded together by its continuous batching, and
``--threads`` threads; on ``cuda`` llama-server-cuda with every layer on the GPU, checked in its log:
eyas.eval.llamacpp.LlamaServer). The prompts (``--source``): ``chitchat``, the conversations' assistant
turns as the stage plans them (``--turns``, ``--max-prompt-tokens``), or ``humaneval``, the HumanEval
problems as the eval asks them, repeated in order up to ``--prompts`` (requests never reuse a cached
prompt: eyas.data.remote sends ``cache_prompt: false``); the default is chitchat where its package is
installed, else humaneval, and the result says which.

The GGUF served (``--gguf``): ``converted`` (default), the HF weights as loaded (de-quantised from the
embedded Q4_1) converted at ``--dtype`` by llama.cpp's converter, so both backends run the same weights at
the same precision; ``embedded``, the Q4_1 file itself (llama.cpp multiplies the quantised blocks: near-ties
flip greedy tokens). Figures: generated tokens / generation seconds (model load excluded, as the stage's
metric), the load seconds, and how many replies are identical token for token across the backends.

Defaults by backend: CPU as the figures of record (32 prompts, 64 tokens, batch 16, concurrency 1 and 4,
last turns, 128 prompt tokens); ``cuda`` as the GPU profile self-distills (presets/h200.yaml: every turn,
192 prompt tokens, 128 new tokens, batch 1024, the target in params ``target.dtype``) on 2048 prompts at
concurrency 64, 128 and 256. Run it on an otherwise idle machine: both backends use every core given.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.common import device_tag  # noqa: E402
from dev.bench.common import write_result  # noqa: E402
from eyas.data.conversations import code_user_turn, humaneval_problems, load_conversations  # noqa: E402
from eyas.data.distill import plan_prompts, regenerate  # noqa: E402
from eyas.data.remote import regenerate_remote  # noqa: E402
from eyas.eval.llamacpp import LlamaServer, build_info  # noqa: E402
from eyas.export.gguf import OUTTYPES, convert, write_target_dir  # noqa: E402
from eyas.params.full import default_params  # noqa: E402
from eyas.target.model import embedded_target, load_target, load_tokenizer_and_config  # noqa: E402

DEFAULTS = {  # per backend: prompts, reply tokens, HF batch, server concurrencies, turns, prompt budget
    "cpu": {"prompts": 32, "max_new_tokens": 64, "batch_size": 16, "concurrency": [1, 4], "turns": "last",
            "max_prompt_tokens": 128},
    "cuda": {"prompts": 2048, "max_new_tokens": 128, "batch_size": 1024, "concurrency": [64, 128, 256],
             "turns": "all", "max_prompt_tokens": 192},
}


def plan(tok, source: str, n: int, turns: str, max_prompt_tokens: int) -> tuple[list[dict], dict]:
    """The first ``n`` planned prompts (eyas.data.distill.plan_prompts items) of ``source``, and what they are."""
    if source == "chitchat":
        items, used = [], 0
        for conv in load_conversations("chitchat")[0]:  # conversation by conversation until n prompts
            items += plan_prompts(tok, [conv], turns=turns, max_prompt_tokens=max_prompt_tokens)[0]
            used += 1
            if len(items) >= n:
                break
        return items[:n], {"source": "chitchat", "turns": turns, "max_prompt_tokens": max_prompt_tokens,
                           "conversations": used, "distinct_prompts": len(items[:n])}
    problems = humaneval_problems()
    convs = [{"id": p["task_id"], "messages": [code_user_turn(p["prompt"]), {"role": "assistant", "content": "-"}]}
             for p in problems]
    base, _ = plan_prompts(tok, convs, turns="last", max_prompt_tokens=None)
    items = [{**base[i % len(base)], "id": f"{base[i % len(base)]['id']}#{i // len(base)}"} for i in range(n)]
    return items, {"source": "humaneval", "distinct_prompts": min(n, len(base)),
                   "repeated": "in order, up to --prompts (no cached prompt is reused: cache_prompt false)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["cpu", "cuda"],
                    help="cpu: llama-server and HF on the CPU; cuda: llama-server-cuda and HF on the GPU "
                         "(default cuda where torch sees a GPU)")
    ap.add_argument("--source", choices=["chitchat", "humaneval"],
                    help="prompt source (default chitchat where installed, else humaneval)")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--batch-size", type=int, help="hf: prompts per generate call")
    ap.add_argument("--concurrency", type=int, nargs="+", help="server: requests in flight = slots")
    ap.add_argument("--turns", choices=["last", "all"], help="chitchat: the turns a conversation gives")
    ap.add_argument("--max-prompt-tokens", type=int, help="chitchat: the prompt budget")
    ap.add_argument("--dtype", default=default_params().target.dtype, choices=sorted(OUTTYPES),
                    help="hf: the target's dtype (params target.dtype); the converted GGUF's too")
    ap.add_argument("--gguf", choices=["converted", "embedded"], default="converted")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="server threads")
    ap.add_argument("--out", help="result file (default distill_backends_<device>.json)")
    a = ap.parse_args()
    backend = a.backend or ("cuda" if torch.cuda.is_available() else "cpu")
    if backend == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--backend cuda: torch sees no CUDA device")
    for key, v in DEFAULTS[backend].items():
        if getattr(a, key) is None:
            setattr(a, key, v)
    source = a.source or ("chitchat" if importlib.util.find_spec("chitchat_dataset") else "humaneval")
    dev = torch.device("cuda" if backend == "cuda" else "cpu")
    work = Path("/tmp") / f"bench_distill_backends_{backend}"
    work.mkdir(parents=True, exist_ok=True)

    tok, _ = load_tokenizer_and_config()
    items, prompt_info = plan(tok, source, a.prompts, a.turns, a.max_prompt_tokens)
    t0 = time.perf_counter()
    target = load_target(dtype=a.dtype, device=dev, tokenizer=tok)
    stop_ids = target.stop_ids
    hf_load = time.perf_counter() - t0
    if a.gguf == "converted":
        tdir = write_target_dir(target.model, tok, work / "target", weights=True)
        gguf = convert(tdir, work / "target.gguf", outtype=OUTTYPES[a.dtype])
        (tdir / "model.safetensors").unlink()
        what = f"embedded SmolLM2-135M-Instruct, de-quantised from Q4_1, HF in {a.dtype}, served as a " \
               f"{OUTTYPES[a.dtype]} GGUF of the same weights"
    else:
        d, name = embedded_target()
        gguf = Path(d) / name
        what = f"embedded SmolLM2-135M-Instruct Q4_1 GGUF (HF: de-quantised to {a.dtype})"
    hf_rows, hf = regenerate(target, items, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size)
    results = {"hf": {"load_seconds": round(hf_load, 1), "batch_size": a.batch_size, "dtype": a.dtype,
                      "device": str(dev), "torch_threads": torch.get_num_threads(),
                      **{k: hf[k] for k in ("generated_tokens", "seconds", "tokens_per_second", "truncated")}}}
    print(f"distill hf ({dev}, {a.dtype}, batch {a.batch_size}): {hf['tokens_per_second']} tok/s, "
          f"{hf['generated_tokens']} tokens in {hf['seconds']} s", flush=True)
    del target
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    longest = max(len(it["prompt_ids"]) for it in items)
    for c in a.concurrency:
        t0 = time.perf_counter()
        s = LlamaServer(gguf, None, k=1, threads=a.threads, ctx=c * (longest + a.max_new_tokens + 16),
                        log=work / f"server_c{c}.log", backend=backend, slots=c)
        with s:
            load = time.perf_counter() - t0
            server = SimpleNamespace(api="llamacpp", url=s.url, model=gguf.name, concurrency=c, timeout=600.0)
            rows, st = regenerate_remote(server, tok, stop_ids, items, max_new_tokens=a.max_new_tokens)
        hf_by_id = {r["id"]: r["reply_ids"] for r in hf_rows}
        same = sum(hf_by_id.get(r["id"]) == r["reply_ids"] for r in rows)
        results[f"server_c{c}"] = {"load_seconds": round(load, 1), "concurrency": c, "slots": c,
                                   "threads": a.threads, "device": s.device, "offload": s.offload,
                                   "identical_replies_to_hf": f"{same}/{len(rows)}", "stop_ids": stop_ids,
                                   **{k: st[k] for k in ("generated_tokens", "seconds", "tokens_per_second",
                                                         "truncated")}}
        ratio = st["tokens_per_second"] / hf["tokens_per_second"] if st["tokens_per_second"] and hf["tokens_per_second"] else None
        results[f"server_c{c}"]["vs_hf"] = round(ratio, 2) if ratio else None
        print(f"distill server c={c} ({s.device}): {st['tokens_per_second']} tok/s ({results[f'server_c{c}']['vs_hf']}x "
              f"hf), {same}/{len(rows)} replies identical to hf", flush=True)
    out = a.out or f"distill_backends_{device_tag() if backend == 'cuda' else 'cpu'}.json"
    print("distill: wrote", write_result(out, {"prompts": len(items), "prompt_source": prompt_info,
                                             "max_new_tokens": a.max_new_tokens, "backend": backend,
                                             "target": what, "gguf": a.gguf, "build": build_info(backend),
                                             "results": results}), flush=True)


if __name__ == "__main__":
    main()
