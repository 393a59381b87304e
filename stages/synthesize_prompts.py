"""DVC stage `synthesize-prompts`: prompts the target writes itself (Magpie: eyas/data/synth.py).

Reads params `data.synth` (with `data.synth.prompts` 0, the default, it writes an empty set and
loads nothing), the split params (`seed`, `data.source`,
`data.max_conversations`, `data.val`, `data.test`, `data.publish`, `data.on_bad_line`: the chat test split
the prompts must not copy is computed as prepare-data computes it), `target`, and how the target decodes
(`distill.backend`, `distill.server`, `distill.batch_size`, `distill.max_new_tokens`: the replies between
user turns). Writes `data/synth/conversations.jsonl` (each conversation ends with an empty assistant turn
that self-distill fills) with `data/synth/fingerprint.json` (eyas/pipeline/provenance.py: prepare-data
refuses a set made for other params or another target), and `metrics/synthesize_prompts.json`:
the counts per filter (`dropped.overlap_chat`, `dropped.overlap_humaneval`, ...), the tokens generated
and the seconds they took. Rounds are saved under `.eyas/work/synthesize_prompts` as they finish: a
killed or failed run, rerun, reuses them. Run from the repository root: `python -m stages.synthesize_prompts`.

Bad params or a set that cannot be reached end the stage with one line
`synthesize-prompts: error: <message naming the key>` and exit status 1; the previous set is left as it was.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from eyas.data.conversations import DataError, encode_jsonl, humaneval_problems, load_conversations, split_conversations
from eyas.data.remote import RemoteError, generate_ids
from eyas.data.synth import benchmark_texts, synthesize
from eyas.io import atomic_dir, atomic_path, write_json
from eyas.params import data as data_schema
from eyas.params import distill as distill_schema
from eyas.params import target as target_schema
from eyas.params.schema import ParamsError, flatten, load_sections
from eyas.pipeline.provenance import FILE, SOURCE_ID, record
from eyas.pipeline.runlock import hold
from eyas.tracking.runs import start_stage_run

STAGE = "synthesize-prompts"
OUT_DIR = Path("data/synth")
SET = "conversations.jsonl"
METRICS = Path("metrics/synthesize_prompts.json")
WORK = Path(".eyas", "work", "synthesize_prompts")  # repo-relative: the rounds done (resume)


def test_split(p) -> list[dict]:
    """The chat test split prepare-data will write for params ``p`` (the same functions and params)."""
    d = p.data
    convs, _ = load_conversations(d.source, on_bad_line=d.on_bad_line)
    return split_conversations(convs, val=d.val, test=d.test, publish=d.publish,
                               max_conversations=d.max_conversations, seed=p.seed)["test"]


def decoder(p, tokenizer):
    """``(generate, stop_ids, backend info)``: the target's decode as eyas.data.synth.Generate, through
    eyas.data.distill.generate_batch (``distill.backend: hf``) or the engine (``server``)."""
    from eyas.target.model import load_generation_config, load_target, stop_token_ids

    t = p.target
    if p.distill.backend == "server":
        from stages.self_distill import check_hosted_model

        server = p.distill.server
        info = check_hosted_model(server)
        stop_ids = stop_token_ids(tokenizer, load_generation_config(t.path, t.gguf_file, t.trust_remote_code,
                                                                    revision=t.revision))

        def generate(prompts, max_new_tokens, *, temperature, top_p, seed):
            return generate_ids(server, prompts, max_new_tokens, stop_ids, len(tokenizer), temperature=temperature,
                                top_p=top_p, seed=seed)
        return generate, stop_ids, {"backend": "server", **{k: info[k] for k in ("api", "model", "revision")}}
    from eyas.data.distill import generate_batch
    from eyas.target import graphed

    target = load_target(t.path, t.gguf_file, t.dtype, t.trust_remote_code, tokenizer=tokenizer, revision=t.revision)
    stop_ids = target.stop_ids
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop_ids[0] if stop_ids else 0)

    def generate(prompts, max_new_tokens, *, temperature, top_p, seed):
        return generate_batch(target.model, prompts, max_new_tokens, pad_id, stop_ids, temperature=temperature,
                              top_p=top_p, seed=seed)
    # the decode generate_batch runs (graphed on CUDA, greedy and sampled alike): rounds it did not write are
    # not reused, and the metrics name it
    return generate, stop_ids, {"backend": "hf", "dtype": t.dtype, "decode": graphed.choose(target.model)}


def run(p, out_dir: Path = OUT_DIR, metrics_path: Path = METRICS, work_dir: Path = WORK) -> dict:
    """Synthesize ``data.synth.prompts`` conversations for params ``p`` and write them (module docstring).
    Raises DataError (SynthError), ParamsError or RemoteError naming the key; nothing is replaced then."""
    s = p.data.synth
    with start_stage_run(STAGE, p) as tracker:
        if s.prompts == 0:
            with atomic_dir(out_dir) as tmp:
                (tmp / SET).write_bytes(b"")
            write_json(metrics_path, {"prompts": 0})
            shutil.rmtree(work_dir, ignore_errors=True)
            return {"prompts": 0}
        from eyas.target.model import load_tokenizer_and_config

        t = p.target
        tokenizer, _ = load_tokenizer_and_config(t.path, t.gguf_file, t.trust_remote_code, revision=t.revision)
        benchmarks = benchmark_texts(test_split(p), humaneval_problems())
        t0 = time.time()
        generate, stop_ids, backend = decoder(p, tokenizer)
        load_seconds = time.time() - t0
        fingerprint = record(STAGE, p, [SOURCE_ID])
        resume_key = {"target": fingerprint["target"], **backend, "stop_ids": stop_ids}
        t0 = time.perf_counter()
        convs, stats = synthesize(
            generate, tokenizer, stop_ids, s, benchmarks=benchmarks, reply_tokens=p.distill.max_new_tokens,
            batch_size=p.distill.batch_size, resume_key=resume_key, work_dir=work_dir,
            progress=lambda kept, n, r: print(f"{STAGE}: round {r}: {min(kept, n)}/{n} kept", flush=True))
        seconds = time.perf_counter() - t0
        data = encode_jsonl(out_dir / SET, convs)
        with atomic_dir(out_dir) as tmp:
            with atomic_path(tmp / SET) as f:
                f.write_bytes(data)
            (tmp / FILE).write_text(json.dumps(fingerprint, indent=2, sort_keys=True) + "\n")
        generated = stats["user_tokens"] + stats["reply_tokens"]
        metrics = {"prompts": s.prompts, **stats, **backend, "target_load_seconds": round(load_seconds, 1),
                   "seconds": round(seconds, 1),
                   "tokens_per_second": round(generated / seconds, 1) if seconds > 0 else None,
                   # what 1M tokens of kept prompts cost here (the drafter trains on them), resumed rounds aside
                   "seconds_per_1m_kept_user_tokens": (round(seconds / stats["kept_user_tokens"] * 1e6)
                                                       if stats["kept_user_tokens"] and not stats["resumed_rounds"]
                                                       else None)}
        write_json(metrics_path, metrics)
        shutil.rmtree(work_dir, ignore_errors=True)
        tracker.log_metrics({k: float(v) for k, v in flatten(metrics).items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool)})
        tracker.log_dict(metrics, "synthesize_prompts.json")
    print(f"{STAGE}: {s.prompts} conversations ({stats['kept']}) in {stats['rounds']} rounds of "
          f"{stats['generated']} drawn; dropped {stats['dropped']}")
    return metrics


def main() -> None:
    hold(STAGE)  # one run of this stage at a time in this workspace (eyas/pipeline/runlock.py)
    try:
        run(load_sections(target_schema, data_schema, distill_schema))
    except (DataError, ParamsError, RemoteError) as e:
        raise SystemExit(f"{STAGE}: error: {e}") from None


if __name__ == "__main__":
    main()
