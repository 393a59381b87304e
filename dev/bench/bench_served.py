"""Cost of the decoding-modes table (eyas/eval/modes.py) at the params' eval settings: wall and process CPU
seconds of evaluate_modes per benchmark, with the trained drafter of a local pipeline run.

The eval stage adds this to its chain eval; on a loaded CPU the process time is the better
estimate of what an unloaded run takes (wall time counts the waits for a core). Needs a local
`dvc repro` (models/<drafter>, data/conversations/test.jsonl).

    python dev/bench/bench_served.py --drafter scratch --out served_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from dev.bench.common import write_result  # noqa: E402
from eyas.data.conversations import chat_prompts, humaneval_prompts, read_jsonl  # noqa: E402
from eyas.data.distill import fit_prompt  # noqa: E402
from eyas.eval.modes import evaluate_modes  # noqa: E402
from eyas.export.load import load_drafter  # noqa: E402
from eyas.params.full import load_params  # noqa: E402
from eyas.target.model import load_target  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default="scratch")
    ap.add_argument("--out", default="served_cpu.json")
    args = ap.parse_args()
    p = load_params()
    e = p.eval
    target = load_target(p.target.path, p.target.gguf_file, p.target.dtype, p.target.trust_remote_code,
                         revision=p.target.revision)
    drafter = load_drafter(f"models/{args.drafter}", num_target_layers=target.num_layers)
    drafter.set_embedding(target.model.get_input_embeddings().weight)
    drafter.to(target.device).eval()
    benches = {"chat": (chat_prompts(read_jsonl(Path("data/conversations/test.jsonl")), e.served_prompts),
                        e.max_prompt_tokens or None),
               "humaneval": (humaneval_prompts(e.served_prompts), None)}
    out = {}
    for bench, (chats, budget) in benches.items():
        prompts = [f[1] for f in (fit_prompt(target.tokenizer, m, budget) for m in chats) if f is not None]
        w0, c0 = time.perf_counter(), time.process_time()
        table = evaluate_modes(target, drafter, prompts[:e.served_prompts], num_draft_tokens=e.num_draft_tokens,
                               max_new_tokens=e.served_max_new_tokens, stop_ids=target.stop_ids,
                               aux_layer_ids=drafter.config.resolved_aux_layers(), temperatures=e.temperatures,
                               top_p=e.top_p, seeds=e.seeds, tree_topk=e.tree_topk, tree_num_steps=e.tree_num_steps,
                               tree_num_draft_tokens=e.tree_num_draft_tokens)
        out[bench] = {"wall_s": time.perf_counter() - w0, "process_cpu_s": time.process_time() - c0, **table}
        print(bench, {k: out[bench][k] for k in ("wall_s", "process_cpu_s")},
              {r: v["accept_len"] for r, v in table["rows"].items()})
    write_result(args.out, {"drafter": args.drafter, "torch_threads": torch.get_num_threads(),
                            "served": out})


if __name__ == "__main__":
    main()
