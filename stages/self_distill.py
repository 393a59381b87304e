"""DVC stage `self-distill`: the target rewrites assistant turns (`distill.turns`: the last, or all).

Reads params `distill`, `target`, `extract.max_length`, `data.on_bad_line`; reads
`data/conversations/{train,val,publish}.jsonl` (refused when prepare-data's fingerprint says they are
stale); writes `data/distilled/{train,val,publish}.jsonl` (regenerated rows carry the target's token
ids: eyas/data/distill.py), their fingerprint (`data/distilled/fingerprint.json`: the params, the
conversations' digests and, where replies were generated, the target's identity; extract refuses
replies of another target: eyas/pipeline/provenance.py) and `metrics/self_distill.json`.
Every prompt is rendered with the tokenizer before the target's weights load, so a conversation the
chat template refuses stops the stage (or, with `data.on_bad_line: skip`, is counted by id) in
seconds. Splits not named in `distill.splits` (and every split when `distill.enabled` is false) are
copied byte for byte, so the DAG is the same either way. `distill.backend: server` sends the
prompts, as token ids, to an engine already hosting the target (eyas/data/remote.py: it only generates
the replies) instead of loading it here. Finished replies are journaled in `self_distill` under
`.eyas/work`: a killed run, rerun, generates only the rest (eyas.data.distill.Journal). The test
split is never touched (eval reads it from data/conversations).
Run from the repository root: `python -m stages.self_distill`.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from eyas.data.conversations import read_jsonl, write_jsonl
from eyas.data.distill import Journal, plan_prompts, regenerate
from eyas.data.remote import RemoteError, hosted_models, regenerate_remote
from eyas.io import write_json
from eyas.params import data as data_schema
from eyas.params import distill as distill_schema
from eyas.params import extract as extract_schema
from eyas.params import target as target_schema
from eyas.params.schema import FEATURE_SPLITS, ParamsError, load_sections
from eyas.pipeline.provenance import FILE as FINGERPRINT
from eyas.pipeline.provenance import check, record
from eyas.pipeline.runlock import hold
from eyas.target.model import load_generation_config, stop_token_ids
from eyas.tracking.runs import start_stage_run

SPLITS = FEATURE_SPLITS
IN_DIR, OUT_DIR = Path("data/conversations"), Path("data/distilled")
# repo-relative: per-split journals of finished replies (resume)
WORK = Path(".eyas", "work", "self_distill")
METRICS = Path("metrics/self_distill.json")


def prompt_budget(p) -> int:
    """Prompt tokens kept: ``distill.max_prompt_tokens``, or (0) what leaves room for the reply
    inside ``extract.max_length``, so extract does not truncate the generated reply away."""
    d = p.distill
    budget = d.max_prompt_tokens or p.extract.max_length - d.max_new_tokens
    if budget < 1:
        raise ParamsError(f"distill: prompt budget {budget} < 1 (extract.max_length "
                          f"{p.extract.max_length} - distill.max_new_tokens {d.max_new_tokens})")
    return budget


def resume_key(p, stop_ids: list[int]) -> dict:
    """What a journaled reply depends on besides its prompt: the target, the backend that ran it
    (dtype for ``hf``; API, model and revision for ``server``), the reply budget and the stop set."""
    d = p.distill
    key = {"target": p.target.path, "gguf_file": p.target.gguf_file, "max_new_tokens": d.max_new_tokens,
           "stop_ids": stop_ids}
    if d.backend == "server":
        return {**key, "backend": "server", "api": d.server.api, "model": d.server.model,
                "revision": d.server.revision}
    return {**key, "dtype": p.target.dtype}


def check_hosted_model(server) -> dict:
    """``distill.server.model`` must be among the models the engine hosts (``GET /v1/models``);
    returns ``{"api", "url", "model", "revision", "served": that model's entry}`` for the metrics
    (the key ``served`` kept from before: the entry ``GET /v1/models`` lists).

    Raises:
        RemoteError: the server cannot be reached, or does not host the model (the ids it lists
            are named)."""
    models = hosted_models(server.url, server.timeout)
    entry = next((m for m in models if m.get("id") == server.model), None)
    if entry is None:
        raise RemoteError(f"{server.url}/v1/models lists {[m.get('id') for m in models]}, not "
                          f"distill.server.model {server.model!r}")
    return {"api": server.api, "url": server.url, "model": server.model, "revision": server.revision,
            "served": entry}


def run(p, in_dir: Path = IN_DIR, out_dir: Path = OUT_DIR, metrics_path: Path = METRICS,
        tracker=None, load_target=None, work_dir: Path = WORK, load_tokenizer=None) -> dict:
    d = p.distill
    check(in_dir, p, reader="self-distill")  # conversations of other params or another source: refused
    todo = [s for s in SPLITS if d.enabled and s in d.splits]
    metrics: dict = {"enabled": d.enabled, "turns": d.turns, "splits": {}}
    plans = {}
    if todo:
        if load_tokenizer is None:
            from eyas.target.model import load_tokenizer_and_config as load_tokenizer
        tokenizer, _ = load_tokenizer(p.target.path, p.target.gguf_file, p.target.trust_remote_code,
                                      revision=p.target.revision)
        for split in todo:
            plans[split] = plan_prompts(tokenizer, read_jsonl(in_dir / f"{split}.jsonl"), turns=d.turns,
                                        max_prompt_tokens=prompt_budget(p), on_bad_line=p.data.on_bad_line)
            print(f"self-distill {split}: {plans[split][1]['prompts']} prompts from "
                  f"{plans[split][1]['conversations']} conversations")
            dropped = plans[split][1]["dropped_long_prompt"]
            if dropped:  # a single-turn prompt (every code prompt) cannot lose earlier turns: it is lost
                print(f"self-distill {split}: WARNING {dropped} of {dropped + plans[split][1]['prompts']} prompts "
                      f"dropped: even their last user turn is longer than the prompt budget of {prompt_budget(p)} "
                      f"tokens (distill.max_prompt_tokens; 0 = extract.max_length - distill.max_new_tokens), so "
                      f"the drafter never trains on prompts like them")
        if d.backend == "server":  # the engine holds the weights: only the stop set is needed here
            stop_ids = stop_token_ids(tokenizer, load_generation_config(
                p.target.path, p.target.gguf_file, p.target.trust_remote_code, revision=p.target.revision))
            metrics["server"] = check_hosted_model(d.server)
        else:
            if load_target is None:
                from eyas.target.model import load_target
            t0 = time.time()
            target = load_target(p.target.path, p.target.gguf_file, p.target.dtype, p.target.trust_remote_code,
                                 tokenizer=tokenizer, revision=p.target.revision)
            metrics["target_load_seconds"] = round(time.time() - t0, 1)
            stop_ids = target.stop_ids
        metrics["stop_ids"] = stop_ids
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / FINGERPRINT).unlink(missing_ok=True)  # a run killed below leaves no fingerprint of the last one
    for split in SPLITS:
        src, dst = in_dir / f"{split}.jsonl", out_dir / f"{split}.jsonl"
        if split not in todo:
            shutil.copyfile(src, dst)
            metrics["splits"][split] = {"copied": True, "conversations": len(read_jsonl(dst))}
            continue
        items, plan_stats = plans[split]
        journal = Journal(work_dir / f"{split}.jsonl", resume_key=resume_key(p, stop_ids))
        progress = lambda i, n, s=split: print(f"self-distill {s}: {i}/{n}", flush=True)
        if d.backend == "server":
            rows, stats = regenerate_remote(d.server, tokenizer, stop_ids, items, max_new_tokens=d.max_new_tokens,
                                                journal=journal, progress=progress)
        else:
            rows, stats = regenerate(target, items, max_new_tokens=d.max_new_tokens, batch_size=d.batch_size,
                                     journal=journal, progress=progress)
        write_jsonl(dst, rows)
        journal.remove()
        stats = {**plan_stats, **stats, "max_prompt_tokens": prompt_budget(p)}
        metrics["splits"][split] = {"copied": False, **stats}
        if tracker is not None:
            tracker.log_metrics({f"{split}/{k}": v for k, v in stats.items()
                                 if isinstance(v, (int, float)) and not isinstance(v, bool)})
        print(f"self-distill {split}: {stats}")
    gen = [s for s in metrics["splits"].values() if not s["copied"]]
    if gen:
        tok, sec = sum(s["generated_tokens"] for s in gen), sum(s["seconds"] for s in gen)
        metrics["generated_tokens"], metrics["generation_seconds"] = tok, round(sec, 1)
        metrics["tokens_per_second"] = round(tok / sec, 1) if sec > 0 else None
    # what the replies were built from (the target only where it wrote some), checked by extract
    write_json(out_dir / FINGERPRINT, record("self-distill", p, [in_dir / f"{s}.jsonl" for s in SPLITS],
                                             target=bool(todo)))
    write_json(metrics_path, metrics)
    return metrics


def main() -> None:
    hold("self-distill")  # one run of this stage at a time in this workspace (eyas/pipeline/runlock.py)
    p = load_sections(target_schema, data_schema, distill_schema, extract_schema)
    with start_stage_run("self-distill", p) as tracker:
        metrics = run(p, tracker=tracker)
        tracker.log_dict(metrics, "self_distill.json")


if __name__ == "__main__":
    main()
