"""The eval's front door: one drafter evaluated with its target on every benchmark, part by part.

:func:`evaluate_drafter` is what stage ``eval-accept-len`` calls. Per benchmark, in turn:

1. the chain evaluation (:func:`eyas.eval.acceptance.evaluate_benchmark`: chain drafting with
   greedy verification on a timed subset checked token for token against plain greedy decoding,
   the exact oracle over every prompt, the prompt-lookup n-gram floor);
2. with params ``serve.engine: llamacpp``, the drafter served by llama.cpp (:func:`engine_part`,
   :func:`report_engine`: the engine's figures beside eyas' own, their per-prompt agreement checked);
3. with ``eval.served_prompts`` > 0, the decoding-modes table of the first prompts (chain vs tree vs
   sampled: :func:`eyas.eval.modes.evaluate_modes`; its params and metrics keys say ``served``).

Each part's measurements go into a store of finished parts (``parts``:
:class:`eyas.pipeline.resume.Parts`, which the stage opens under its resume key and passes in) as
soon as they are made, so a killed run, rerun, resumes them; the prompt settings, checks and
verdicts (:func:`eyas.eval.checks.position_check`, ``misconfiguration``, ``serving_verdict``,
``sampled_verdict``) are recomputed from the measurements on every run, by the code that runs now;
``misconfiguration`` holds the acceptance to the drafter's own training figures when the stage has
them (:func:`eyas.eval.checks.training_figures`).
Metrics go to MLflow through the ``log_metrics`` callback (eyas.eval sits below eyas.tracking);
writing ``metrics/eval_<drafter>.json`` is the stage's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eyas.data.distill import fit_prompt
from eyas.eval import checks as eval_checks
from eyas.eval.acceptance import evaluate_benchmark
from eyas.eval.llamacpp import ENGINE, agreement, disagreement_message, resolve_backend, serve_benchmark
from eyas.eval.modes import evaluate_modes
from eyas.export.gguf import GGUFReadError, ServeMismatchError, require_served_as_trained
from eyas.io import read_json
from eyas.target.model import embedded_target

__all__ = ["EvalError", "EvalFiles", "engine_part", "evaluate_drafter", "fit_benchmarks", "report_engine"]

LogMetrics = Callable[[dict[str, float]], Any]


class EvalError(RuntimeError):
    """The eval cannot go on: a drafter built for another target, a drafter GGUF llama.cpp would not
    serve as trained, or llama.cpp's acceptance disagreeing with eyas'. The message names the
    drafter, the benchmark and what to do."""


@dataclasses.dataclass(frozen=True)
class EvalFiles:
    """Where one drafter's eval reads and keeps files (workspace-relative paths, the stage's).

    Attributes:
        drafter: the drafter's checkpoint directory (``models/<drafter>``).
        drafter_gguf: its GGUF, as export-gguf wrote it (``models/<drafter>.gguf``).
        target_gguf: target-gguf's directory (``config.json``, ``target.gguf``: the F32 target llama.cpp serves).
        work: the run's work directory, outside every DVC out (``.eyas/work/eval_<drafter>``): llama-server's
            logs, per benchmark and target.
    """

    drafter: Path
    drafter_gguf: Path
    target_gguf: Path
    work: Path


def fit_benchmarks(tok, benchmarks: dict[str, list[list[dict]]], max_prompt_tokens: int) -> dict[str, tuple]:
    """Each benchmark's prompts as token ids, with the settings that count what the prompt budget
    did: ``{bench: (prompts, {"max_prompt_tokens", "prompts_shortened", "prompts_dropped_too_long"})}``.
    Chat prompts longer than ``max_prompt_tokens`` (0 = no budget) lose their earliest turns
    (:func:`eyas.data.distill.fit_prompt`, the rule self-distill applies), and are dropped, counted,
    when even the last user turn does not fit; HumanEval problems are kept whole."""
    out = {}
    for bench, chats in benchmarks.items():
        budget = (max_prompt_tokens or None) if bench == "chat" else None  # HumanEval: whole problems
        fits = [fit_prompt(tok, m, budget) for m in chats]
        out[bench] = ([f[1] for f in fits if f is not None], {
            "max_prompt_tokens": max_prompt_tokens,
            "prompts_shortened": sum(f is not None and len(f[0]) < len(m) for f, m in zip(fits, chats)),
            "prompts_dropped_too_long": sum(f is None for f in fits)})
    return out


def _attach(drafter, target, source: Path) -> None:
    """Check that ``drafter`` was built for ``target`` (layer count, vocab, the width of the aux hidden
    states its ``fc`` reads and of the input embedding it shares), give it the target's input
    embedding, and put it on the target's device in eval mode.

    Raises:
        EvalError: another layer count, vocab size or hidden size (both figures named, with ``source``)."""
    c, embed = drafter.config, target.model.get_input_embeddings().weight
    built = {"layers": c.num_target_layers, "vocab": c.vocab_size, "hidden size": c.target_hidden_size,
             "embedding width": c.hidden_size}
    this = {"layers": target.num_layers, "vocab": target.config.vocab_size, "hidden size": target.config.hidden_size,
            "embedding width": embed.shape[1]}
    if built != this:
        def say(x: dict) -> str:
            return f"{x['layers']} layers (" + ", ".join(f"{k} {v}" for k, v in x.items() if k != "layers") + ")"
        raise EvalError(f"{source}: built for a target with {say(built)}; this target has {say(this)}")
    drafter.set_embedding(target.model.get_input_embeddings().weight)
    drafter.to(target.device).eval()


def _chain_part(target, drafter, prompts: list[list[int]], e) -> dict:
    """One benchmark's chain evaluation, the measurement a part keeps:
    ``{"eagle": r, "ngram": n}`` of eyas.eval.acceptance.evaluate_benchmark."""
    r, n = evaluate_benchmark(target, drafter, prompts, num_draft_tokens=e.num_draft_tokens,
                              max_new_tokens=e.max_new_tokens, stop_ids=target.stop_ids,
                              aux_layer_ids=drafter.config.resolved_aux_layers(), timed_prompts=e.timed_prompts,
                              timing_repeats=e.timing_repeats, batch_size=e.batch_size)
    return {"eagle": r, "ngram": n}


def _modes_part(target, drafter, prompts: list[list[int]], e) -> dict:
    """One benchmark's decoding-modes table on its first ``eval.served_prompts`` prompts
    (eyas.eval.modes.evaluate_modes)."""
    return evaluate_modes(target, drafter, prompts[:e.served_prompts], num_draft_tokens=e.num_draft_tokens,
                          max_new_tokens=e.served_max_new_tokens, stop_ids=target.stop_ids,
                          aux_layer_ids=drafter.config.resolved_aux_layers(), temperatures=e.temperatures,
                          top_p=e.top_p, seeds=e.seeds, tree_topk=e.tree_topk, tree_num_steps=e.tree_num_steps,
                          tree_num_draft_tokens=e.tree_num_draft_tokens)


def _quantized_target_file(p) -> Path | None:
    """The target's own GGUF file, as a user would serve it (the embedded Q4_1; a local
    ``target.gguf_file``), or None when the target is not a GGUF."""
    if p.target.path == "embedded":
        d, f = embedded_target()
        return Path(d, f)
    if p.target.gguf_file and Path(p.target.path, p.target.gguf_file).is_file():
        return Path(p.target.path, p.target.gguf_file)
    return None


def engine_part(name: str, p, prompts: list[list[int]], bench: str, num_target_layers: int,
                files: EvalFiles) -> dict:
    """One benchmark served by llama.cpp (eyas.eval.llamacpp.serve_benchmark): ``same_precision`` with
    the weights eyas evaluates (``files.target_gguf / "target.gguf"``), and ``quantized`` with the
    target's own GGUF file when params ``serve.quantized_target`` asks and there is one (else None).
    Both are served by the build params ``serve.device`` picks (eyas.eval.llamacpp.resolve_backend), the
    like-for-like target with the wall-clock sweep over ``serve.k_sweep``; llama-server's logs go under
    ``files.work / bench``.

    Raises:
        EvalError: ``files.drafter_gguf`` disagrees with the checkpoint ``files.drafter``
            (eyas.export.gguf.require_served_as_trained): a mismatch, bytes changed since export-gguf
            recorded their digest, a file that is not an eagle3 GGUF (empty, truncated, a target's) or
            no file; the message names it and the stage to rerun, and no server has started.
        eyas.eval.llamacpp.EngineError: llama-server cannot start or answer.
    """
    e, s = p.eval, p.serve
    backend = resolve_backend(s.device)
    kw = {"k": e.num_draft_tokens, "max_new_tokens": e.max_new_tokens, "threads": s.threads, "backend": backend}
    drafter = files.drafter_gguf
    try:  # a GGUF that disagrees with the checkpoint (rebuilt by hand, another drafter's) is not served
        target_cfg = files.target_gguf / "config.json"  # the target's class: llama.cpp's graph for target layer id L
        arch = (read_json(target_cfg).get("architectures") or [None])[0] if target_cfg.is_file() else None
        require_served_as_trained(drafter, files.drafter, num_target_layers, target_arch=arch)
    except (ServeMismatchError, GGUFReadError, FileNotFoundError) as err:
        raise EvalError(f"eval {name} {bench}: {err}\n(rebuild it from the checkpoint: "
                        f"`dvc repro export-gguf@{name}`)") from None
    out = {"engine": ENGINE, "num_draft_tokens": e.num_draft_tokens, "threads": s.threads, "backend": backend,
           "same_precision": serve_benchmark(files.target_gguf / "target.gguf", drafter, prompts, k_sweep=s.k_sweep,
                                             log_dir=files.work / bench / "same_precision", **kw)}
    q = _quantized_target_file(p) if s.quantized_target else None
    out["quantized"] = None if q is None else serve_benchmark(
        q, drafter, prompts, log_dir=files.work / bench / "quantized", **kw)
    return out


def report_engine(name: str, bench: str, engine: dict, r: dict, log_metrics: LogMetrics) -> None:
    """Put llama.cpp's figures beside eyas' own in ``r["engine"]`` (with their per-prompt
    ``agreement``, eyas.eval.llamacpp.agreement), print them and pass them to ``log_metrics``
    (``<bench>/engine/<key>``, ``<bench>/engine_quantized/<key>``, ``<bench>/engine/k<k>/speedup``).

    Raises:
        EvalError: the engine's per-prompt counts disagree with eyas' beyond the tolerance (the
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
        log_metrics({f"{bench}/{label}/{key}": float(x[key]) for key in
                     ("accept_len", "speedup", "speedup_flagged", "tokens_per_second", "tokens_per_second_plain",
                      "lossless") if x.get(key) is not None})
        print(f"eval {name} {bench}: llama.cpp {x.get('backend', 'cpu')} on {x.get('device', 'cpu')} "
              f"({x['target_gguf']}) accept_len {x['accept_len']} (eyas {r['accept_len']}), {x['tokens_per_second']} "
              f"tokens/s vs {x['tokens_per_second_plain']} without the drafter (speedup {x['speedup']}), lossless "
              f"{x['lossless']}")
        if x.get("speedup_flagged"):
            print(f"eval {name} {bench}: WARNING llama.cpp's speedup {x['speedup']:.3f} is more than its acceptance "
                  f"length {x['accept_len']:.3f} allows (a verify step costs at least a plain one): the two runs were "
                  f"timed under different load; not a result (rerun on idle cores)")
        if x.get("k_sweep"):
            log_metrics({f"{bench}/{label}/k{k}/speedup": v["speedup"] for k, v in x["k_sweep"]["rows"].items()
                         if v["speedup"] is not None})
            by_k = {k: v["speedup"] if not v.get("speedup_flagged") else f"{v['speedup']:.3f} (flagged)"
                    for k, v in x["k_sweep"]["rows"].items()}
            print(f"eval {name} {bench}: llama.cpp speedup by k {by_k}, recommended k {x['k_sweep']['recommended_k']}")
    if agree["ok"] is None:
        print(f"eval {name} {bench}: WARNING llama.cpp's acceptance NOT CHECKED against eyas': {agree['unchecked']}")
    else:
        print(f"eval {name} {bench}: llama.cpp agrees with eyas on {agree['exact']} of {agree['compared']} prompts "
              f"with equal greedy outputs exactly ({agree['exact_share']:.0%}); {len(agree['outside_tolerance'])} "
              f"outside the tolerance")
    if agree["ok"] is False:
        raise EvalError(disagreement_message(name, bench, agree))


# --- the shapes a stored part must have to be resumed (a hand-edited file is recomputed) --------

# what _judge, _report_chain and report_engine read of a chain part's eagle and ngram results
_CHAIN_KEYS = ("accept_len", "speedup", "speedup_predicted", "speedup_iqr", "speedup_flagged", "lossless",
               "accept_len_by_chain_length", "oracle_matches_real", "per_prompt", "per_position_accept_rate",
               "num_verify_steps")


def _is_chain(x) -> bool:
    """Whether a stored part has the shape :func:`_chain_part` gives: every key the eval reads, and
    figures its checks accept (eyas.eval.checks.misconfiguration)."""
    if not (isinstance(x, dict) and isinstance(x.get("eagle"), dict) and isinstance(x.get("ngram"), dict)
            and isinstance(x["eagle"].get("settings"), dict) and all(k in x["eagle"] for k in _CHAIN_KEYS)
            and "accept_len" in x["ngram"]
            and all(isinstance(r.get("repetition"), dict) and "accept_len_non_looping" in r["repetition"]
                    for r in (x["eagle"], x["ngram"]))):
        return False
    try:
        eval_checks.misconfiguration(x["eagle"])
    except (ValueError, TypeError):  # a rate outside [0, 1], a step count or figure of another type
        return False
    return True


def _is_engine(x) -> bool:
    """Whether a stored part has the shape :func:`engine_part` gives."""
    return isinstance(x, dict) and isinstance(x.get("same_precision"), dict) and "quantized" in x


def _is_modes(x) -> bool:
    """Whether a stored part has the shape eyas.eval.modes.evaluate_modes gives (its ``rows``)."""
    return isinstance(x, dict) and isinstance(x.get("rows"), dict)


def _part(name: str, parts, key: str, valid: Callable[[Any], bool], compute: Callable[[], Any],
          label: str) -> Any:
    """Part ``key`` of ``parts``: the stored result when there is a valid one (printing
    ``eval <name> <label> resumed from <file>``), else ``compute()`` stored at once and returned as
    stored. A stored part ``valid`` rejects is dropped, and said so."""
    x = parts.get(key, valid=valid)
    while parts.dropped:
        print(f"eval {name}: {parts.dropped.pop(0)}")
    if x is None:
        return parts.add(key, compute())
    print(f"eval {name} {label} resumed from {parts.path}")
    return x


def _check_benchmarks(name: str, benchmarks: dict[str, tuple]) -> None:
    """Refuse benchmarks the eval cannot measure, before anything is decoded.

    Raises:
        EvalError: no benchmark, a benchmark with no prompt (with how many the prompt budget dropped)
            or a prompt with no token (its index named)."""
    if not benchmarks:
        raise EvalError(f"eval {name}: no benchmark to evaluate")
    for bench, (prompts, settings) in benchmarks.items():
        if not prompts:
            dropped = settings.get("prompts_dropped_too_long") or 0
            raise EvalError(f"eval {name} {bench}: no prompt to evaluate" + (
                f" ({dropped} dropped as longer than eval.max_prompt_tokens {settings.get('max_prompt_tokens')}: "
                f"raise it, or 0 for no budget)" if dropped else ""))
        empty = [i for i, x in enumerate(prompts) if len(x) == 0]
        if empty:
            raise EvalError(f"eval {name} {bench}: prompts {empty[:5]} hold no token")


def _judge(r: dict, n: dict, prompts: list[list[int]], settings: dict, e, drafter, trained: dict | None) -> None:
    """What the eval adds to a chain result ``r`` (in place), recomputed on every run from the
    measurements (a resumed part is judged by the code that runs now): the prompt-budget
    ``settings``, ``positions``, ``suspected_misconfiguration`` (against the drafter's training
    figures ``trained``, or None), ``serving_verdict`` against the n-gram floor ``n``."""
    pos = eval_checks.position_check([len(x) for x in prompts], e.max_new_tokens, e.num_draft_tokens,
                                     drafter.config.max_position_embeddings)
    r["settings"].update(settings)
    r["positions"], r["suspected_misconfiguration"] = pos, eval_checks.misconfiguration(r, trained)
    r["serving_verdict"] = eval_checks.serving_verdict(r, n)


def _report_chain(name: str, bench: str, r: dict, n: dict, log_metrics: LogMetrics) -> None:
    """Print a judged chain result ``r`` (its warnings first, then the misconfiguration check's
    note: a weak drafter, not a fault) beside the n-gram floor ``n``, and pass its figures to
    ``log_metrics`` (``<bench>/accept_len``, ``<bench>/worth_serving``, ...)."""
    pos, mis = r["positions"], r["suspected_misconfiguration"]
    for w in ([pos["warning"]] if pos["warning"] else []) + mis["reasons"] + \
            [f"not worth serving: {x}" for x in r["serving_verdict"]["reasons"]]:
        print(f"eval {name} {bench}: WARNING {w}")
    if mis["note"]:
        print(f"eval {name} {bench}: {mis['note']}")
    log_metrics({key: v for key, v in {
        f"{bench}/accept_len": r["accept_len"], f"{bench}/speedup": r["speedup"],
        f"{bench}/speedup_predicted": r["speedup_predicted"],
        f"{bench}/ngram_accept_len": n["accept_len"],
        f"{bench}/accept_len_non_looping": r["repetition"]["accept_len_non_looping"],
        f"{bench}/ngram_accept_len_non_looping": n["repetition"]["accept_len_non_looping"],
        f"{bench}/suspected_misconfiguration": float(mis["suspected"]),
        f"{bench}/worth_serving": (None if r["serving_verdict"]["worth_serving"] is None
                                   else float(r["serving_verdict"]["worth_serving"])),
        f"{bench}/prompts_past_max_position": float(pos["prompts_past_limit"])}.items()
        if v is not None})
    print(f"eval {name} {bench}: accept_len {r['accept_len']} (n-gram {n['accept_len']}), "
          f"lossless {r['lossless']}, speedup {r['speedup']} (IQR {r['speedup_iqr']}, predicted "
          f"{r['speedup_predicted']}, flagged {r['speedup_flagged']}); by chain length "
          f"{r['accept_len_by_chain_length']} (oracle matches real: {r['oracle_matches_real']}); "
          f"{r['repetition']['looping_prompts']} looping prompts")


def _report_modes(name: str, bench: str, modes: dict, r: dict, log_metrics: LogMetrics) -> None:
    """Add the sampled verdict of the decoding-modes table ``modes`` to ``r["serving_verdict"]``
    (eyas.eval.checks.sampled_verdict), print the table's rows and pass them to ``log_metrics``
    (``<bench>/served/<row>/accept_len``, ``.../ci95_low``, ``.../ci95_high``)."""
    sampled = r["serving_verdict"]["sampled"] = eval_checks.sampled_verdict(modes["rows"])
    beats = {t: v["beats_ngram_floor"] for t, v in sampled.items()}
    print(f"eval {name} {bench}: beats the n-gram floor as sampled: {beats}")
    for row, v in modes["rows"].items():
        log_metrics({f"{bench}/served/{row}/{key}": x for key, x in (
            ("accept_len", v["accept_len"]), *zip(("ci95_low", "ci95_high"), v["ci95"] or ()))
            if x is not None})
        print(f"eval {name} {bench} served {row}: accept_len {v['accept_len']} (95% CI {v['ci95']}, "
              f"per seed {v['accept_len_per_seed']})"
              + (f", matches greedy {v['matches_greedy']}" if "matches_greedy" in v else ""))


def evaluate_drafter(name: str, p, target, drafter, benchmarks: dict[str, tuple], parts, files: EvalFiles,
                     log_metrics: LogMetrics, trained: dict | None = None) -> dict:
    """Evaluate ``drafter`` with ``target`` on ``benchmarks``, resuming the parts ``parts`` holds
    (module docstring); returns the metrics the stage writes to ``metrics/eval_<name>.json``.

    Args:
        name: the drafter's name (``scratch``, ``finetune``), in every printed line and message.
        p: params with sections ``eval``, ``serve`` and ``target`` (eyas.params).
        target: ``eyas.target.model.Target``. drafter: an ``Eagle3Drafter`` built for it (given the
            target's input embedding and moved to its device here).
        benchmarks: ``{bench: (prompts as token ids, prompt settings)}`` (:func:`fit_benchmarks`).
        parts: the store of finished parts (:class:`eyas.pipeline.resume.Parts`): ``get(key, valid=)``,
            ``add(key, result)``, ``path``, ``discarded``, ``dropped``. Keys: ``<bench>/chain``,
            ``<bench>/engine``, ``<bench>/served``.
        files: where the drafter, its GGUF, the target's GGUF and the work directory are (:class:`EvalFiles`).
        log_metrics: called with each group of MLflow metrics (``{key: float}``), as they are made.
        trained: the drafter's own training figures (:func:`eyas.eval.checks.training_figures` of
            ``metrics/train_<name>.json``: validation ``acc_0``, ``train_tokens``), or None (a drafter
            with no training metrics): what each benchmark's ``suspected_misconfiguration`` holds the
            position-0 acceptance to (:func:`eyas.eval.checks.misconfiguration`).
    Returns:
        ``{"drafter": name, <bench>: chain metrics (eyas.eval.acceptance.evaluate_benchmark's, judged;
        with ``engine`` under ``serve.engine: llamacpp``), "ngram": {<bench>: the n-gram floor}
        [, "served": {<bench>: eyas.eval.modes.evaluate_modes' table}]}``.
    Raises:
        EvalError: no benchmark, a benchmark with no prompt or an empty prompt, the drafter does not fit the
            target (:func:`_attach`), its GGUF is not served as trained (:func:`engine_part`), or llama.cpp
            disagrees with eyas (:func:`report_engine`); the first three before anything is decoded.
    """
    e = p.eval
    _check_benchmarks(name, benchmarks)
    _attach(drafter, target, files.drafter)
    if parts.discarded:
        print(f"eval {name}: {parts.discarded}")
    metrics: dict = {"drafter": name, "ngram": {}}
    for bench, (prompts, settings) in benchmarks.items():
        chain = _part(name, parts, f"{bench}/chain", _is_chain,
                      lambda: _chain_part(target, drafter, prompts, e), f"{bench}: chain")
        r, n = chain["eagle"], chain["ngram"]
        _judge(r, n, prompts, settings, e, drafter, trained)
        if p.serve.engine == "llamacpp":
            engine = _part(name, parts, f"{bench}/engine", _is_engine,
                           lambda: engine_part(name, p, prompts, bench, target.num_layers, files), f"{bench}: engine")
            report_engine(name, bench, engine, r, log_metrics)
        metrics[bench], metrics["ngram"][bench] = r, n
        _report_chain(name, bench, r, n, log_metrics)
        if e.served_prompts:
            modes = _part(name, parts, f"{bench}/served", _is_modes,
                          lambda: _modes_part(target, drafter, prompts, e), f"{bench}: served table")  # the key's name
            metrics.setdefault("served", {})[bench] = modes
            _report_modes(name, bench, modes, r, log_metrics)
    return metrics
