"""llama.cpp serves a drafter whose eyas eval already ran: the engine's figures beside eyas' own.

    python3 benchmarks/engine_check.py scratch --out metrics/engine_scratch.json [--benchmarks humaneval]

Run from a pipeline workspace (params.yaml, data/conversations/test.jsonl, models/NAME,
models/NAME.gguf, models/target_gguf/target.gguf: target-gguf writes it with ``serve.engine: llamacpp``)
whose ``metrics/eval_NAME.json`` was written by ``eval-accept-len@NAME``, with the engine or without it. It builds the eval's prompts as the stage
does (eyas.eval.evaluate.fit_benchmarks, params ``eval``), serves each benchmark with
llama-server ``--spec-type draft-eagle3`` exactly as the stage's engine block does
(eyas.eval.evaluate.engine_part: the F32 target, and the target's own GGUF when
``serve.quantized_target``; the build params ``serve.device`` picks, the CPU one with ``serve.threads``
threads) and holds the engine's per-prompt counts to the ones the eval recorded
(eyas.eval.evaluate.report_engine, eyas.eval.llamacpp.agreement).

So an eval run with ``serve.engine: none`` (e.g. to fit a time limit) gets its engine figures afterwards,
on any machine with the build it names (scripts/build_llama_server.sh, ``--cuda`` for the CUDA one).

Writes ``--out`` (atomically): ``drafter``, ``eval`` (the metrics file read), ``k``, ``threads``,
``eyas_eval`` (per benchmark eyas' acceptance, lossless, prompts, verify steps, new tokens) and per
benchmark the stage's ``engine`` block (``same_precision``, ``quantized``, ``agreement``, ...), then
exits 1 when the engine disagrees with eyas beyond the tolerance (the file is written first).

Raises (SystemExit naming the file), before anything is served: ``--out`` a directory or the eval record itself,
no eval metrics, no target or drafter GGUF, a benchmark's record without ``settings`` or
per-prompt walks (written before they existed), made with other eval settings (k, max_new_tokens,
max_prompt_tokens) or of another prompt count than the prompts built here (other params or test split).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # eyas and stages from this checkout
from eyas.data.conversations import chat_prompts, humaneval_prompts, read_jsonl  # noqa: E402
from eyas.eval.evaluate import EvalError, engine_part, fit_benchmarks, report_engine  # noqa: E402
from eyas.io import read_json, write_json  # noqa: E402
from eyas.params.full import load_params  # noqa: E402
from eyas.target.model import load_tokenizer_and_config  # noqa: E402
from stages.common import CONVERSATIONS, METRICS, TARGET_GGUF  # noqa: E402
from stages.eval_accept_len import eval_files  # noqa: E402

EYAS_KEYS = ("accept_len", "lossless", "num_prompts", "num_verify_steps", "new_tokens", "oracle_matches_real")


BENCHMARKS = ("chat", "humaneval")


def check(name: str, out: Path, benchmarks: tuple[str, ...] = BENCHMARKS) -> dict:
    """Serve ``models/<name>.gguf`` on the eval's prompts of ``benchmarks`` (names in :data:`BENCHMARKS`,
    e.g. only the one a cut-off run did not reach) and write ``out``; returns what was written.
    Raises SystemExit as the module docstring says (a disagreement after writing ``out``)."""
    p = load_params()
    e = p.eval
    path = METRICS / f"eval_{name}.json"
    if out.is_dir() or (out.exists() and out.resolve() == path.resolve()) or not out.parent.is_dir():
        raise SystemExit(f"--out {out}: must be a new or result file in an existing directory, not a directory or "
                         f"the eval record {path} it is compared with")
    if not path.is_file():
        raise SystemExit(f"{path}: no such file: run `dvc repro eval-accept-len@{name}` first")
    ev = read_json(path)
    for f in (TARGET_GGUF / "target.gguf", Path("models", f"{name}.gguf")):
        if not f.is_file():
            raise SystemExit(f"{f}: no such file: run `dvc repro target-gguf export-gguf@{name}` with serve.engine "
                             f"llamacpp (serve.engine none writes no target.gguf)")
    tok, cfg = load_tokenizer_and_config(p.target.path, p.target.gguf_file, p.target.trust_remote_code,
                                         revision=p.target.revision)
    build = {"chat": lambda: chat_prompts(read_jsonl(CONVERSATIONS / "test.jsonl"), e.chat_prompts),
             "humaneval": lambda: humaneval_prompts(e.humaneval_prompts)}
    benchmarks = fit_benchmarks(tok, {b: build[b]() for b in benchmarks}, e.max_prompt_tokens)
    result: dict = {"drafter": name, "eval": str(path), "k": e.num_draft_tokens, "threads": p.serve.threads,
                    "eyas_eval": {}}
    for bench, (prompts, _) in benchmarks.items():  # every benchmark's record checked before any is served
        r = ev.get(bench)
        if not isinstance(r, dict) or not isinstance(r.get("per_prompt"), list):
            raise SystemExit(f"{path}: {bench} has no per_prompt walks (an eval from before they were recorded): "
                             f"rerun eval-accept-len@{name}")
        if not isinstance(r.get("settings"), dict):
            raise SystemExit(f"{path}: {bench}.settings is {r.get('settings')!r}, not a mapping: not an eval record")
        want = {"num_draft_tokens": e.num_draft_tokens, "max_new_tokens": e.max_new_tokens,
                "max_prompt_tokens": e.max_prompt_tokens}
        got = {k: r["settings"].get(k) for k in want}
        if got != want:  # other settings decode other outputs: nothing would be compared, silently
            raise SystemExit(f"{path}: {bench} was evaluated with {got}, params.yaml's eval has {want}: "
                             f"not the eval of this workspace")
        if len(r["per_prompt"]) != len(prompts):
            raise SystemExit(f"{path}: {bench} has {len(r['per_prompt'])} prompts, params.yaml's eval and "
                             f"{CONVERSATIONS / 'test.jsonl'} give {len(prompts)}: not the eval of this workspace")
    failed = []
    for bench, (prompts, _) in benchmarks.items():
        r = ev[bench]
        try:
            engine = engine_part(name, p, prompts, bench, cfg.num_hidden_layers, eval_files(name))
        except EvalError as err:
            raise SystemExit(str(err)) from None
        result["eyas_eval"][bench] = {k: r.get(k) for k in EYAS_KEYS}
        try:
            report_engine(name, bench, engine, r, lambda metrics: None)  # no MLflow run here
        except EvalError as err:  # the figures are kept; the exit comes after the file
            failed.append(str(err))
        result[bench] = r["engine"]
    write_json(out, result)
    print(f"engine_check: wrote {out}")
    if failed:
        raise SystemExit("\n".join(failed))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("drafter", help="the drafter's name: models/<drafter>, metrics/eval_<drafter>.json")
    ap.add_argument("--out", type=Path, required=True, help="the result file (JSON)")
    ap.add_argument("--benchmarks", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS),
                    help="the benchmarks to serve (default: both)")
    a = ap.parse_args(argv)
    check(a.drafter, a.out, tuple(dict.fromkeys(a.benchmarks)))


if __name__ == "__main__":
    main()
