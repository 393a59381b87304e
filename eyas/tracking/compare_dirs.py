"""``eyas compare --metrics DIR ...``: committed results side by side, one column per metrics directory
(``metrics/``, ``dev/records/h200/``), read from the metrics files a pipeline run writes instead of MLflow
(:mod:`eyas.tracking.compare` reads MLflow; both share its row labels and cell formats)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from eyas import yaml12
from eyas.pipeline import dvcfiles
from eyas.tracking.compare import BENCHES, ENGINE_ROWS, FLAGGED, WORTH, CompareError, _cell, _fmt, _with_ci

# (label, metrics file, path of keys in it)
DIR_ROWS: list[tuple[str, str, tuple]] = [
    ("train-scratch val acc_0", "train_scratch.json", ("val", "acc_0")),
    ("train-finetune step-0 val acc_0", "train_finetune.json", ("step0_val", "acc_0")),
    ("train-finetune val acc_0", "train_finetune.json", ("val", "acc_0")),
    *[row for b in BENCHES for row in (
        (f"scratch {b} accept_len", "eval_scratch.json", (b, "accept_len")),
        (f"scratch {b} accept_len k=4", "eval_scratch.json", (b, "accept_len_by_chain_length", "4")),
        (f"scratch {b} accept_len without looping prompts", "eval_scratch.json",
         (b, "repetition", "accept_len_non_looping")),
        (f"scratch {b} speedup (median)", "eval_scratch.json", (b, "speedup")),
        *[(f"{d} {b} {label}", f"eval_{d}.json", (b, *keys))
          for d in ("scratch", "finetune") for label, _, keys in ENGINE_ROWS],
        (f"finetune {b} accept_len", "eval_finetune.json", (b, "accept_len")),
        (f"finetune {b} accept_len k=4", "eval_finetune.json", (b, "accept_len_by_chain_length", "4")),
        (f"n-gram floor {b} accept_len", "eval_scratch.json", ("ngram", b, "accept_len")),
        (f"n-gram floor {b} accept_len k=4", "eval_scratch.json", ("ngram", b, "accept_len_by_chain_length", "4")),
        (f"scratch {b} {WORTH}", "eval_scratch.json", (b, "serving_verdict", "worth_serving")),
        (f"finetune {b} {WORTH}", "eval_finetune.json", (b, "serving_verdict", "worth_serving")),
    )],
]


def _engine_apart(fname: str, keys: tuple) -> tuple[str, tuple] | None:
    """Where an engine row of ``eval_<drafter>.json`` (``<bench>.engine.<block>.<what>``) stands when the
    eval ran without the engine and llama.cpp served the drafter apart: ``engine_<drafter>.json``, which
    benchmarks/engine_check.py writes with each benchmark's engine block at ``<bench>``; None for other rows."""
    if fname.startswith("eval_") and len(keys) == 4 and keys[1] == "engine":
        return "engine_" + fname[len("eval_"):], (keys[0], *keys[2:])
    return None


# the metrics files compare_dirs reads (the served tables: eval_<drafter>.json; llama.cpp apart: engine_<drafter>.json)
READ_FILES = frozenset(f for _, f, _ in DIR_ROWS) | {alt[0] for _, f, k in DIR_ROWS if (alt := _engine_apart(f, k))}
# the recipe keys a lever changes (dev/levers/*.yaml): data, training contexts, TTT, eval
DIR_PARAMS = ("data.max_conversations", "data.code_prompts", "data.code_packages", "distill.turns",
              "distill.max_new_tokens", "distill.max_prompt_tokens", "extract.max_length", "vocab.draft_vocab_size",
              "train.loss_tokens", "train.batch_tokens", "train.epochs", "train.ttt_length",
              "eval.num_draft_tokens", "eval.chat_prompts", "eval.humaneval_prompts")


_ABSENT = object()  # a metrics file, or a key in it, that is not there


def _file_key(d: str, fname: str, files: dict, keys: tuple) -> Any:
    """The value at ``keys`` in the metrics file ``fname`` of directory ``d``; :data:`_ABSENT` when
    the file or a key is not there (older files lack newer keys).

    Raises:
        CompareError: a step of the key path that is not a mapping (the top level included), naming
            the directory, file and key path.
    """
    obj = files.get(fname, _ABSENT)
    if obj is _ABSENT:
        return _ABSENT
    for i, k in enumerate(keys):
        if not isinstance(obj, dict):
            raise CompareError(f"{d}: {fname}: {'.'.join(keys[:i]) or 'the top level'} is {obj!r}; "
                               f"expected a mapping holding {k!r}")
        if k not in obj:
            return _ABSENT
        obj = obj[k]
    return obj


def _engine_number(d: str, fname: str, keys: tuple, alt: tuple[str, tuple], files: dict) -> str:
    """An engine row (``<bench>.engine.<block>.<what>`` of ``fname``), else the same figure from the file
    llama.cpp served apart wrote (``alt``: :func:`_engine_apart`), formatted. A null block (``quantized``
    without ``serve.quantized_target``: eyas.eval.evaluate.engine_part) shows ``–``.

    Raises:
        CompareError: as :func:`_file_number`.
    """
    for f, k in ((fname, keys), alt):
        block = _file_key(d, f, files, k[:-1])
        if block is None:
            return _fmt(None)
        if block is not _ABSENT:
            return _file_number(d, f, files, k)
    return _fmt(None)


def _file_number(d: str, fname: str, files: dict, keys: tuple) -> str:
    """A number read from a metrics file, formatted; ``–`` when the file or a key is absent, or the
    value is null (what eyas.io.write_json writes for NaN and inf). A ``speedup`` whose block holds
    ``speedup_flagged: true`` is marked :data:`eyas.tracking.compare.FLAGGED`.

    Raises:
        CompareError: any other value (a string, a list, a mapping, a boolean), or a step of the key
            path that is not a mapping, naming the directory, file and key path.
    """
    v = _file_key(d, fname, files, keys)
    if v is _ABSENT or v is None:
        return _fmt(None)
    if not _number(v):
        raise CompareError(f"{d}: {fname}: {'.'.join(keys)} is {v!r}; expected a number")
    flagged = keys[-1] == "speedup" and _file_key(d, fname, files, (*keys[:-1], "speedup_flagged")) is True
    return _fmt(v) + (FLAGGED if flagged else "")


def _not_json(constant: str) -> None:
    """``json.loads``' hook for ``NaN``, ``Infinity`` and ``-Infinity``, which Python reads and JSON
    lacks (eyas.io.write_json writes null for them): raise ValueError naming the constant."""
    raise ValueError(f"{constant} is not JSON (a metrics file writes null for a value that is not finite)")


def _finite(text: str) -> float:
    """``json.loads``' hook for a JSON number with a fraction or exponent: its float; ValueError for
    one too large for a float (``1e400`` reads as inf)."""
    if not math.isfinite(v := float(text)):
        raise ValueError(f"{text} is beyond a float's range (a metrics file writes null for a value that is "
                         f"not finite)")
    return v


def _read_metrics(d: str, path: Path) -> dict[str, dict]:
    """The metrics files of :data:`READ_FILES` that the directory ``path`` (named ``d``) holds, by
    file name, each a JSON object; other files there are not read.

    Raises:
        CompareError: naming the file: a link to a file that is gone (not a missing file), a FIFO or
            a device (its read would block or not end), unreadable, not JSON (``NaN``, ``Infinity``
            and a fraction or exponent beyond a float's range, ``1e400``, included), nested past the
            decoder, a top level that is
            not an object, or an ``engine_<drafter>.json`` whose ``drafter`` is another
            (benchmarks/engine_check.py writes the one it served).
    """
    files = {}
    for name in sorted(READ_FILES):
        f = path / name
        if not os.path.lexists(f):
            continue
        if not f.exists():  # a link whose file is gone (a DVC cache link, the cache removed)
            raise CompareError(f"{d}: {name}: a symbolic link to {os.readlink(f)}, which leads nowhere (a missing "
                               f"file, or a loop)")
        if not f.is_file() and not f.is_dir():  # a directory fails the read below
            raise CompareError(f"{d}: {name}: not a regular file (a FIFO or a device); a metrics file is JSON")
        try:
            doc = json.loads(f.read_text(encoding="utf-8"), parse_constant=_not_json, parse_float=_finite)
        except (OSError, ValueError) as e:  # a directory, no permission; json.JSONDecodeError, UnicodeDecodeError
            raise CompareError(f"{d}: cannot read {f}: {e}") from None
        except RecursionError:  # the decoder recurses once per level
            raise CompareError(f"{d}: cannot read {f}: nested too deeply to decode") from None
        if not isinstance(doc, dict):
            raise CompareError(f"{d}: {name}: the top level is {doc!r}; expected a mapping (a metrics file is a "
                               f"JSON object)")
        if name.startswith("engine_") and "drafter" in doc \
                and doc["drafter"] != (want := name[len("engine_"):-len(".json")]):
            raise CompareError(f"{d}: {name}: drafter is {json.dumps(doc['drafter'])}, not {json.dumps(want)}: the "
                               f"file name says which drafter llama.cpp served")
        files[name] = doc
    return files


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _served_rows(d: str, fname: str, doc: Any) -> dict[tuple[str, str], tuple[Any, list | None]]:
    """The served table of one eval metrics file (eyas/eval/modes.py's layout:
    ``served.<bench>.rows.<row>`` holding ``accept_len`` and ``ci95``) as
    ``{(bench, row): (accept_len, ci95)}``; empty when the file has none.

    Raises:
        CompareError: another layout (a list where a mapping goes, an interval that is not two
            numbers, a value that is not a number), naming the directory, file and key path.
    """
    def bad(path: str, value: Any, want: str):
        raise CompareError(f"{d}: {fname}: {path} is {value!r}; expected {want}")

    served = doc.get("served") if isinstance(doc, dict) else None
    if served is None:
        return {}
    if not isinstance(served, dict):
        bad("served", served, "a mapping of benchmarks")
    out = {}
    for bench, table in served.items():
        rows = table.get("rows") if isinstance(table, dict) else table
        if not isinstance(table, dict) or not isinstance(rows, (dict, type(None))):
            bad(f"served.{bench}", table, "a mapping with 'rows'")
        for row, v in (rows or {}).items():
            where = f"served.{bench}.rows.{row}"
            if not isinstance(v, dict):
                bad(where, v, "a mapping with 'accept_len' and 'ci95'")
            value, ci = v.get("accept_len"), v.get("ci95")
            if value is not None and not _number(value):
                bad(where + ".accept_len", value, "a number")
            if ci is not None and not (isinstance(ci, list) and len(ci) == 2 and all(map(_number, ci))):
                bad(where + ".ci95", ci, "[low, high] numbers or null")
            out[(bench, row)] = (value, ci)
    return out


def lock_params(root: Path, metrics_dir: Path,
                locks: tuple[str, ...] = dvcfiles.LOCKS) -> tuple[dict[str, Any], list[str]] | None:
    """The params that made the metrics files in ``metrics_dir``, as DVC recorded them in the lock
    files under ``root`` (each stage's ``params: {params.yaml: {...}}`` beside its ``outs``, paths
    relative to ``root``, where every stage runs: eyas.pipeline.dvcfiles), flattened to dotted keys,
    and the lock files that recorded them; a key the stages recorded with different values (one
    not rerun since a change) maps to ``"mixed: v1 (stage) / v2 (stage)"``. None when no lock is
    there or none of their stages wrote into ``metrics_dir`` (the locks did not record these files).

    Raises:
        CompareError: a lock is not valid YAML or not DVC's layout (named).
    """
    from eyas.params.schema import flatten

    where = metrics_dir.resolve()
    values: dict[str, dict[str, list[str]]] = {}  # key -> repr(value) -> stages
    used = []
    for name in locks:
        lock = Path(root) / name
        if not lock.is_file():
            continue
        try:
            stages = (yaml12.load_file(lock) or {}).get("stages") or {}
        except (yaml12.YamlError, AttributeError) as e:
            raise CompareError(f"{lock}: cannot read the params DVC recorded: {e}") from None
        if not isinstance(stages, dict) or not all(isinstance(st, dict) for st in stages.values()):
            raise CompareError(f"{lock}: cannot read the params DVC recorded: 'stages' is not a mapping of stages")
        try:
            for stage, st in stages.items():
                outs = [(Path(root) / o["path"]).resolve() for o in (st.get("outs") or [])]
                if not any(where in (o, o.parent) for o in outs):
                    continue  # only the stages that wrote into metrics_dir made its files
                if name not in used:
                    used.append(name)
                for _file, ps in (st.get("params") or {}).items():
                    for k, v in flatten(ps or {}).items():
                        values.setdefault(k, {}).setdefault(json.dumps(v), []).append(stage)
        except (AttributeError, KeyError, TypeError) as e:
            raise CompareError(f"{lock}: cannot read the params DVC recorded: a stage's outs or params are not "
                               f"DVC's layout ({e!r})") from None
    if not used:
        return None
    return ({k: json.loads(next(iter(vs))) if len(vs) == 1 else
             "mixed: " + " / ".join(f"{v} ({', '.join(st)})" for v, st in vs.items()) for k, vs in values.items()},
            used)


def compare_dirs(dirs: list[str], params_default: str | Path = "params.yaml", root: str | Path = ".",
                 all_params: bool = False) -> str:
    """The committed results of several runs side by side, one column per metrics directory.

    Each directory holds the stage metrics a pipeline run writes (``train_scratch.json``,
    ``eval_scratch.json``, ...); its params are ``<dir>/params.yaml`` when present (the exact
    params a run elsewhere used, e.g. ``dev/records/h200/params.yaml``), else those the workspace's
    lock files under ``root`` (``dvc.lock``, ``finetune/dvc.lock``, ...) recorded for the stages that
    wrote the directory's files (:func:`lock_params`: ``params.yaml`` may have changed since, e.g. a
    quick trial's or an edit not yet reproduced), else ``params_default``. The llama.cpp rows come from
    ``eval_<drafter>.json``'s engine block, else from ``engine_<drafter>.json`` (benchmarks/engine_check.py:
    the drafter served apart from an eval run with ``serve.engine: none``).

    A missing metrics file, a key missing from a well-formed one (older files lack newer keys) and a
    null value (eyas.io.write_json's NaN or inf) show ``–``; a file of the wrong shape is an error,
    never a ``–``.

    Raises:
        CompareError: a directory does not exist, is a file or holds no metrics file this reads
            (:data:`READ_FILES`); a params or lock file that is
            unreadable or not YAML; a metrics file this reads that is not valid (:func:`_read_metrics`
            says when); a value read where a number goes that is not a number (a string, a list,
            a boolean), or a key path through something that is not a mapping; a ``worth_serving``
            verdict that is not true, false or null. The message names the directory, the file and
            the key path.
    """
    cols = [_column(d, params_default, root) for d in dirs]
    lines = ["| | " + " | ".join(f"**{_cell(d)}**" for d, *_ in cols) + " |", "|---|" + "---:|" * len(cols)]
    lines.append("| params file | " + " | ".join(_cell(p or "–") for _, p, _, _ in cols) + " |")
    every = list(dict.fromkeys(k for _, _, params, _ in cols for k in params))
    differ = [k for k in every if len({json.dumps(params.get(k), default=str) for _, _, params, _ in cols}) > 1]
    for k in [*DIR_PARAMS, *(k for k in (every if all_params else differ) if k not in DIR_PARAMS)]:
        lines.append(f"| `{k}` | " + " | ".join(_fmt(params.get(k)) for _, _, params, _ in cols) + " |")
    for label, fname, keys in DIR_ROWS:
        verdict = keys[-1] == "worth_serving"
        alt = _engine_apart(fname, keys)
        cells = [_engine_number(d, fname, keys, alt, files) if alt
                 else (_file_verdict if verdict else _file_number)(d, fname, files, keys) for d, *_, files in cols]
        lines.append(f"| {_cell(label)} | " + " | ".join(cells) + " |")
    lines += _served_lines(cols)
    return "\n".join(lines) + "\n"


def _column(d: str, params_default: str | Path, root: str | Path) -> tuple[str, str | None, dict, dict]:
    """One column of :func:`compare_dirs`: ``(d, the params file(s) shown, flat params, metrics files)``,
    the params from ``<d>/params.yaml``, else the lock files' (:func:`lock_params`), else
    ``params_default`` (None shown when that file is absent too).

    Raises:
        CompareError: as :func:`compare_dirs`, for this directory.
    """
    from eyas.params.schema import flatten

    path = Path(d)
    if not path.is_dir():
        raise CompareError(f"{d}: {'not a directory' if path.exists() else 'no such metrics directory'} (give "
                           f"the directory a pipeline run wrote its metrics in, e.g. metrics/)")
    recorded = None if (path / "params.yaml").is_file() else lock_params(Path(root), path)
    if recorded is not None:
        params, used = recorded
        pfile = ", ".join(used)
    else:
        pfile = path / "params.yaml" if (path / "params.yaml").is_file() else Path(params_default)
        try:
            raw = yaml12.load_file(pfile) if pfile.is_file() else {}
        except yaml12.YamlError as e:  # names the file and line
            raise CompareError(f"{d}: cannot read its params: {e}") from None
        if raw is not None and not isinstance(raw, dict):
            raise CompareError(f"{d}: cannot read its params: {pfile}: the top level must be a mapping")
        params = flatten(raw or {})
        pfile = str(pfile) if pfile.is_file() else None
    files = _read_metrics(d, path)
    if not files:  # a mistyped or wrong directory would show the workspace's params as its own
        raise CompareError(f"{d}: holds none of the metrics files compare reads ({', '.join(sorted(READ_FILES))}): "
                           f"give the directory a pipeline run wrote its metrics in, e.g. metrics/")
    return d, pfile, params, files


def _served_lines(cols: list) -> list[str]:
    """The decoding-modes tables' rows of :func:`compare_dirs` (eyas/eval/modes.py): every row any column has,
    the n-gram rows from eval_scratch.json, each ``accept_len [95% CI]`` per column."""
    lines = []
    tables = [{fname: _served_rows(d, fname, files.get(fname)) for fname in ("eval_scratch.json", "eval_finetune.json")}
              for d, *_, files in cols]
    served: dict[tuple[str, str, str], None] = {}
    for col in tables:
        for fname, rows in col.items():
            for bench, row in rows:
                if not row.startswith("ngram/") or fname == "eval_scratch.json":
                    served[(bench, fname, row)] = None
    for bench, fname, row in sorted(served, key=lambda r: (r[0], r[2].startswith("ngram/"), r[1], r[2])):
        who = "n-gram floor" if row.startswith("ngram/") else fname[len("eval_"):-len(".json")]
        cells = []
        for col in tables:
            value, ci = col[fname].get((bench, row), (None, None))
            cells.append(_with_ci(value, *(ci or [None, None])))
        lines.append(f"| {_cell(f'{who} {bench} served {row} accept_len [95% CI]')} | " + " | ".join(cells) + " |")
    return lines


def _file_verdict(d: str, fname: str, files: dict, keys: tuple) -> str:
    """A ``worth_serving`` verdict read from a metrics file: ``yes`` / ``no`` for JSON true /
    false, ``unknown`` for null (a figure it needs is missing), ``–`` when the file or a key is
    absent.

    Raises:
        CompareError: any other value (a string ``"false"`` would otherwise read as true), or a
            step of the key path that is not a mapping, naming the directory, file and key path.
    """
    obj = _file_key(d, fname, files, keys)
    if obj is _ABSENT:
        return "–"
    if obj is None:
        return "unknown"
    if not isinstance(obj, bool):
        raise CompareError(f"{d}: {fname}: {'.'.join(keys)} is {obj!r}; a verdict is true, false or null")
    return "yes" if obj else "no"
