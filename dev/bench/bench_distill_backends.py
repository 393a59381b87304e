"""Self-distill tokens/s: HF ``generate`` in-process (``distill.backend: hf``) against llama.cpp's
``llama-server`` (``distill.backend: server``, api ``llamacpp``) on the embedded SmolLM2 GGUF, CPU.

    python dev/bench/bench_distill_backends.py                 # -> results/distill_backends_cpu.json
    python dev/bench/bench_distill_backends.py --prompts 8 --max-new-tokens 16   # a quick look

The same planned prompts (the last assistant turn of the first ``--prompts`` chitchat
conversations, the stage's prompt budget) go through :func:`eyas.data.distill.regenerate` (fp32, batch
``--batch-size``) and through :func:`eyas.data.serving.regenerate_via_server` at each ``--concurrency``
(llama-server started with that many slots and ``--threads`` threads; the binary from
scripts/build_llama_server.sh). Figures: generated tokens / generation seconds (model load
excluded, as the stage's metric), the model load seconds, and how many replies are identical
token for token across the backends (HF de-quantises the Q4_1 GGUF to fp32; llama.cpp multiplies
the quantised blocks: near-ties can flip a greedy token).

Run it on an otherwise idle machine: both backends use every core given (torch threads, server
threads), and contention changes the ratio.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from dev.bench.common import write_result  # noqa: E402
from eyas.data.conversations import load_conversations  # noqa: E402
from eyas.data.distill import plan_prompts, regenerate  # noqa: E402
from eyas.data.serving import regenerate_via_server  # noqa: E402
from eyas.target.model import embedded_target, load_target, load_tokenizer_and_config  # noqa: E402


def start_server(exe: str, gguf: Path, port: int, slots: int, threads: int, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        proc = subprocess.Popen([exe, "-m", str(gguf), "--alias", "smollm2", "--host", "127.0.0.1",
                                 "--port", str(port), "-c", str(1024 * slots), "-np", str(slots),
                                 "-t", str(threads), "--no-webui"], stdout=f, stderr=subprocess.STDOUT)
    for _ in range(240):
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise SystemExit("llama-server did not become healthy in 120 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16, help="hf: prompts per generate call")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], help="server: requests in flight")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="server threads")
    ap.add_argument("--out", default="distill_backends_cpu.json")
    a = ap.parse_args()

    exe = Path(sysconfig.get_path("scripts")) / "llama-server"
    if not exe.is_file():
        raise SystemExit(f"{exe}: not built; run bash scripts/build_llama_server.sh")
    d, gguf = embedded_target()
    tok, _ = load_tokenizer_and_config()
    convs = load_conversations("chitchat")[0][: a.prompts]
    items, _ = plan_prompts(tok, convs, turns="last", max_prompt_tokens=128)
    t0 = time.perf_counter()
    target = load_target(tokenizer=tok)
    stop_ids = target.stop_ids
    hf_load = time.perf_counter() - t0
    hf_rows, hf = regenerate(target, items, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size)
    results = {"hf": {"load_seconds": round(hf_load, 1), "batch_size": a.batch_size,
                      "torch_threads": torch.get_num_threads(), **{k: hf[k] for k in
                      ("generated_tokens", "seconds", "tokens_per_second", "truncated")}}}
    print("hf", results["hf"], flush=True)
    del target
    for c in a.concurrency:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t0 = time.perf_counter()
        proc = start_server(str(exe), Path(d) / gguf, port, c, a.threads, Path(f"/tmp/llama_server_bench_{c}.log"))
        load = time.perf_counter() - t0
        try:
            server = SimpleNamespace(api="llamacpp", url=f"http://127.0.0.1:{port}", model="smollm2",
                                     concurrency=c, timeout=600.0)
            rows, st = regenerate_via_server(server, tok, stop_ids, items, max_new_tokens=a.max_new_tokens)
        finally:
            proc.terminate()
            proc.wait(30)
        same = sum(x["reply_ids"] == y["reply_ids"] for x, y in zip(rows, hf_rows))
        results[f"server_c{c}"] = {"load_seconds": round(load, 1), "concurrency": c, "slots": c,
                                   "threads": a.threads, "identical_replies_to_hf": f"{same}/{len(rows)}",
                                   "stop_ids": stop_ids, **{k: st[k] for k in
                                   ("generated_tokens", "seconds", "tokens_per_second", "truncated")}}
        print(f"server c={c}", results[f"server_c{c}"], flush=True)
    write_result(a.out, {"prompts": len(items), "max_new_tokens": a.max_new_tokens,
                         "target": "embedded SmolLM2-135M-Instruct Q4_1 GGUF (HF: de-quantised to fp32)",
                         "results": results})


if __name__ == "__main__":
    main()
