"""Where one graphed decode step's GPU time goes (eyas.target.graphed): for a random SmolLM2-135M-shaped
target (fp32) at batch 1 after 1,024 tokens and at self-distill's batch 1,024 after 320, and an
8B-shaped one (bf16, benchmarks/bench_decode.py's shape) at batch 1 after 1,024:

- ``replay_ms``: one replayed step's GPU time (CUDA events around 20 replays, no host read);
- ``kernels_per_step`` and ``kernel_ms``: the step's kernels and their summed time (torch.profiler over
  3 eager steps of the same shape); ``replay_ms - kernel_ms`` is what the kernels' count costs;
- ``top``: the 12 kernels with the most time per step.

Writes dev/results/decode_profile.json (and $OUT/, where set). On a GPU machine, from the repository root:

    python3 dev/bench/profile_decode_gpu.py
"""
import sys

import torch
from torch.autograd import DeviceType

sys.path.insert(0, ".")  # the repository root
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.bench_decode import build_8b
from dev.bench.common import write_result
from eyas.target import graphed


def smollm_shaped():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).cuda().eval()


@torch.no_grad()
def profile(name: str, model, batch: int, ctx: int) -> dict:
    V = model.config.vocab_size
    dec = graphed.StaticDecoder(model, batch, ctx + graphed.LEN_QUANTUM, graphs=True)
    dec.reset()
    dec.forward(torch.randint(0, V, (batch, ctx)), 0, last_only=True, graph=False)
    tok = torch.randint(0, V, (batch, 1), device="cuda")
    dec.forward(tok, ctx, last_only=True)  # the capture
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(20):
        dec.forward(tok, ctx, last_only=True)
    b.record()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            dec.forward(tok, ctx, last_only=True, graph=False)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.device_time_total)
    row = {"target": name, "batch": batch, "ctx": ctx, "visible_columns": dec.visible(ctx + 1),
           "replay_ms": round(a.elapsed_time(b) / 20, 3),
           "kernels_per_step": round(sum(e.count for e in kernels) / 3, 1),
           "kernel_ms": round(sum(e.device_time_total for e in kernels) / 3e3, 3),
           "top": [{"kernel": e.key[:100], "per_step": round(e.count / 3, 1),
                    "us_per_step": round(e.device_time_total / 3, 1)} for e in kernels[:12]]}
    print(f"{name} batch {batch} ctx {ctx}: replay {row['replay_ms']} ms, {row['kernels_per_step']} kernels "
          f"{row['kernel_ms']} ms; top: " + "; ".join(f"{t['kernel'][:50]} {t['us_per_step']} us" for t in row["top"][:5]),
          flush=True)
    graphed.release(model)
    return row


def main() -> None:
    doc = {"what": "one graphed decode step: replayed GPU time, kernels per step and the heaviest kernels", "rows": []}
    small = smollm_shaped()
    for batch, ctx in ((1, 1024), (1024, 320)):
        doc["rows"].append(profile("smollm2-135m-shaped fp32", small, batch, ctx))
        write_result("decode_profile.json", doc)
    del small
    torch.cuda.empty_cache()
    doc["rows"].append(profile("8b-shaped bf16", build_8b("cuda"), 1, 1024))
    write_result("decode_profile.json", doc)


if __name__ == "__main__":
    main()
