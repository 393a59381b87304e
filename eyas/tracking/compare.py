"""``eyas compare``: the latest pipeline executions side by side, read back from MLflow.

eyas.tracking.runs records one *parent* run per pipeline execution (a DVC experiment, or a plain
``dvc repro``; tag ``eyas.pipeline_key``) and one *child* run per stage (tag ``dvc.stage``,
``mlflow.parentRunId``). This module reads them back and renders a Markdown table with one
column per parent (latest first) and one row per key param / stage metric:

- params (from the parent, flattened dotted keys as in ``dvc exp show``; with ``--metrics``, the
  directories' recipe keys and those that differ): ``lr`` (the scratch
  drafter's) and every key whose value differs between the columns, of any section (the others
  counted in one line under the table; ``--all-params`` gives every key its row);
- ``train-scratch`` / ``train-finetune``: the final val ``acc_0`` (metric ``final/acc_0``);
- ``eval-accept-len@<drafter>``: ``chat/accept_len``, ``humaneval/accept_len``; the n-gram
  floor (``<bench>/ngram_accept_len``, independent of the drafter) from either eval child;
  ``<bench>/worth_serving`` (logged 1 / 0, shown ``yes`` / ``no``, ``not logged`` while the
  verdict is unknown: the drafter beats the n-gram floor and greedy decoding,
  eyas.eval.checks.serving_verdict);
- llama.cpp serving each drafter (eyas/eval/llamacpp.py): ``<bench>/engine/accept_len`` and ``speedup``
  (the target eyas evaluates, as a GGUF) and ``<bench>/engine_quantized/...`` (the target's own GGUF);
- the served table (eyas/eval/served.py): every ``<bench>/served/<row>/accept_len`` an eval child
  logged (greedy chain, greedy tree, sampled chain per temperature; the n-gram rows from either
  eval child), with its 95% interval (``ci95_low`` / ``ci95_high``) in brackets.

A stage DVC skipped (unchanged, or restored from the run-cache) logs no run (docs/dvc-mlflow.md §5);
its numbers then come from the parent run, where every stage run logs all stages' metrics files
(``<stage>/<key>``, reused stages tagged ``eyas.reused.<stage>``; eyas.tracking.team.sync_parent), and
a row lists the reused stages. A figure shows only under the execution that made or checked it: a stage
with a run under that parent, or one DVC reused for a stage that ran (upstream of it in the pipeline
files). The workspace's metrics files of a stage outside the execution (the fine-tune's, under an
experiment of the default DAG) are not its figures. A cell shows ``–`` when there is no such number
(``dvc exp show`` has them all).

Run: ``eyas compare [--experiment eyas] [--limit 8] [--all-params] [--out compare.md]``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from eyas import yaml12
from eyas.pipeline import dvcfiles
from eyas.tracking.runs import _experiment_name, _sqlite_path, tracking_uri

PARENT_TAG = "eyas.pipeline_key"
EVAL_STAGES = ("eval-accept-len@scratch", "eval-accept-len@finetune")
BENCHES = ("chat", "humaneval")

# the serving verdict's row label, after "<drafter> <bench>" (both modes)
WORTH = "worth serving (beats the n-gram floor and greedy)"

# llama.cpp serving the drafter (eyas/eval/llamacpp.py): (row label after "<drafter> <bench>", MLflow metric
# key after "<bench>/", keys after "<bench>" in metrics/eval_<drafter>.json), as the eval stage writes them
ENGINE_ROWS = [
    (f"{what} in llama.cpp ({target} target)", f"{log}/{what}", ("engine", block, what))
    for target, log, block in (("same-precision", "engine", "same_precision"), ("quantized", "engine_quantized",
                                                                                   "quantized"))
    for what in ("accept_len", "speedup")]

# (label, stage, metric key); stage None = the first eval child that has the metric
STAGE_METRICS: list[tuple[str, str | None, str]] = [
    ("train-scratch val acc_0", "train-scratch", "final/acc_0"),
    ("train-finetune val acc_0", "train-finetune", "final/acc_0"),
    *[(f"scratch {b} accept_len", "eval-accept-len@scratch", f"{b}/accept_len") for b in BENCHES],
    *[(f"finetune {b} accept_len", "eval-accept-len@finetune", f"{b}/accept_len") for b in BENCHES],
    *[(f"{d} {b} {label}", f"eval-accept-len@{d}", f"{b}/{key}") for d in ("scratch", "finetune") for b in BENCHES
      for label, key, _ in ENGINE_ROWS],
    *[(f"n-gram floor {b} accept_len", None, f"{b}/ngram_accept_len") for b in BENCHES],
    *[(f"{d} {b} {WORTH}", f"eval-accept-len@{d}", f"{b}/worth_serving")
      for d in ("scratch", "finetune") for b in BENCHES],
]


# <bench>/served/<proposer>/<mode>/T<t>/accept_len, as the eval stage logs the served table
SERVED_METRIC = re.compile(r"^(?P<bench>[^/]+)/served/(?P<row>(?P<proposer>[^/]+)/[^/]+/T[^/]+)/accept_len$")


class CompareError(RuntimeError):
    """No store, no such experiment, no answer from the server, an input file that is not valid or
    an ``--out`` that cannot be written: the message names the path or URI and what is wrong."""


# MLflow's own HTTP settings for the first request, which doubles as the reachability probe: its
# defaults (7 retries with exponential backoff, 120 s timeout) wait minutes on a dead server
_PROBE_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
# the reads after the probe: a server that answered once and then stops answering (hung, or a
# proxy that accepts and never forwards) fails within a bounded time too, not 7 x 120 s per request
_READ_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


@contextlib.contextmanager
def _fail_fast_http(settings: dict | None = None):
    """Set ``settings`` (default :data:`_PROBE_HTTP_ENV`) for the block, except what the user
    set; then restore."""
    settings = settings or _PROBE_HTTP_ENV
    unset = [k for k in settings if k not in os.environ]
    os.environ.update({k: settings[k] for k in unset})
    try:
        yield
    finally:
        for k in unset:
            os.environ.pop(k, None)


@dataclass
class Pipeline:
    """One parent run and its latest child run per stage."""

    name: str
    run_id: str
    start_time: int
    status: str
    params: dict[str, str]
    tags: dict[str, str]
    stages: dict[str, Any] = field(default_factory=dict)  # stage -> mlflow Run
    # the parent's own metrics: every stage's numbers as ``<stage>/<key>`` (``@`` as ``:``), reused
    # stages' too (eyas.tracking.team.sync_parent)
    parent_metrics: dict[str, float] = field(default_factory=dict)
    # stage -> the stages upstream of it in the pipeline files (:func:`upstream_stages`)
    upstream: dict[str, set[str]] = field(default_factory=dict)

    def metric(self, stage: str | None, key: str) -> float | None:
        stages = [stage] if stage else [s for s in EVAL_STAGES if s in self.stages] + sorted(self.stages)
        for s in stages:
            run = self.stages.get(s)
            if run is not None and key in run.data.metrics:
                return run.data.metrics[key]
        reused = self.reused()
        for s in [stage] if stage else EVAL_STAGES:  # a stage DVC reused: its numbers on the parent
            v = self.parent_metrics.get(f"{s.replace('@', ':')}/{key}")
            if v is not None and s in reused:
                return v
        return None

    def reused(self) -> list[str]:
        """The stages DVC reused in this execution: tagged ``eyas.reused.<stage>`` = ``true`` by the
        parent and upstream of a stage that ran under it (a stage outside the execution is tagged
        too: its metrics file was in the workspace, no run made it)."""
        ran = set(self.stages)
        part = set().union(*(self.upstream.get(s, set()) for s in ran)) if ran else set()
        return sorted(s for k, v in self.tags.items() if k.startswith("eyas.reused.") and v == "true"
                      for s in [k[len("eyas.reused."):].replace(":", "@")] if s in part)


def _upstream(root: str) -> dict[str, set[str]]:
    """:func:`upstream_stages` of the pipeline files under ``root``.

    Raises:
        CompareError: a pipeline file DVC would refuse too (naming it)."""
    import yaml

    try:
        return upstream_stages(dvcfiles.stages(root))
    except (ValueError, OSError, yaml.YAMLError) as e:
        raise CompareError(f"cannot read the pipeline files under {root}: {_first_line(e)}") from None


def upstream_stages(stages: dict[str, dict]) -> dict[str, set[str]]:
    """Stage -> every stage upstream of it (transitively): those whose outputs (``outs``, ``metrics``,
    ``plots``) are, or lie under or above, one of its ``deps``. ``stages``: eyas.pipeline.dvcfiles.stages."""
    def parts(p: str) -> tuple[str, ...]:
        return Path(p).parts

    outs = {}
    for name, st in stages.items():
        for key in ("outs", "metrics", "plots"):
            for o in st.get(key) or []:
                outs.setdefault(name, []).append(parts(o if isinstance(o, str) else next(iter(o))))
    direct = {}
    for name, st in stages.items():
        deps = [parts(d if isinstance(d, str) else next(iter(d))) for d in st.get("deps") or []]
        direct[name] = {other for other, os_ in outs.items() if other != name
                        for o in os_ for d in deps if o[:len(d)] == d or d[:len(o)] == o}
    out = {}
    for name in stages:
        seen, todo = set(), list(direct[name])
        while todo:
            s = todo.pop()
            if s not in seen:
                seen.add(s)
                todo += direct.get(s, [])
        out[name] = seen
    return out


def key_params(params: dict[str, str]) -> list[str]:
    """Every param key, ``lr`` first, then sorted."""
    return [k for k in ("lr",) if k in params] + sorted(k for k in params if k != "lr")


def _all_runs(client, experiment_id: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], max_results=1000, page_token=token,
                                  order_by=["attributes.start_time DESC"])
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _stage_of(run) -> str:
    return run.data.tags.get("dvc.stage") or run.data.tags.get("mlflow.runName") or run.info.run_id


def collect(client, experiment_id: str, limit: int = 8, upstream: dict[str, set[str]] | None = None) -> list[Pipeline]:
    """The ``limit`` latest parent runs (newest first), each with its latest child per stage
    (a FINISHED child preferred over a failed or running one); ``upstream``: :func:`upstream_stages`
    of the pipeline files (none: no reused stage's figure is shown)."""
    runs = _all_runs(client, experiment_id)
    parents = [r for r in runs if PARENT_TAG in r.data.tags and "mlflow.parentRunId" not in r.data.tags]
    parents = parents[:limit] if limit > 0 else parents
    by_id = {p.info.run_id: Pipeline(
        name=p.data.tags.get("mlflow.runName") or p.info.run_id[:8], run_id=p.info.run_id,
        start_time=p.info.start_time or 0, status=p.info.status, params=dict(p.data.params),
        tags=dict(p.data.tags), parent_metrics=dict(p.data.metrics), upstream=upstream or {}) for p in parents}
    for r in runs:  # newest first: keep the first FINISHED child, else the newest
        pipe = by_id.get(r.data.tags.get("mlflow.parentRunId", ""))
        if pipe is None:
            continue
        stage = _stage_of(r)
        have = pipe.stages.get(stage)
        if have is None or (have.info.status != "FINISHED" and r.info.status == "FINISHED"):
            pipe.stages[stage] = r
    return [by_id[p.info.run_id] for p in parents]


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    if isinstance(v, list):  # data.code_packages
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def _logged_verdict(pipe: "Pipeline", stage: str, key: str) -> str:
    """A ``worth_serving`` verdict as MLflow holds it (a metric: 1.0 / 0.0) as ``yes`` / ``no``;
    ``–`` when the pipeline has no run of ``stage``; ``not logged`` when that run has no such
    metric (the eval logs none while the verdict is unknown, eyas.eval.checks.serving_verdict,
    nor did evals older than the verdict); any other value as it is, marked ``(not 0/1)``."""
    v = pipe.metric(stage, key)
    if stage not in pipe.stages and v is None:
        return "–"
    if v is None:
        return "not logged"
    return {1.0: "yes", 0.0: "no"}.get(v, f"{v!r} (not 0/1)")  # unrounded: 0.99999 is not 1


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


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def render_markdown(pipes: list[Pipeline], header: str | None = None, all_params: bool = False) -> str:
    """A Markdown table: one column per pipeline, rows = identity, key params, stage metrics.

    Params equal in every column are counted in one line under the table (``lr`` always gets its
    row), like ``dvc exp show --only-changed``; ``all_params`` gives each its row.
    """
    if not pipes:
        return (header + "\n\n" if header else "") + "No pipeline runs found.\n"
    pkeys: list[str] = []
    for p in pipes:
        pkeys += [k for k in key_params(p.params) if k not in pkeys]
    same: list[str] = []
    if not all_params:
        same = [k for k in pkeys if k != "lr" and len({p.params.get(k) for p in pipes}) == 1]
        pkeys = [k for k in pkeys if k not in same]
    rows: list[tuple[str, list[str]]] = [
        ("run id", [p.run_id[:8] for p in pipes]),
        ("started (UTC)", [datetime.fromtimestamp(p.start_time / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M")
                           for p in pipes]),
        ("baseline rev", [p.tags.get("dvc.baseline_rev", "")[:7] or "–" for p in pipes]),
        ("stages logged", [str(len(p.stages)) for p in pipes]),
        ("stages reused (numbers from metrics/)", [", ".join(p.reused()) or "–" for p in pipes]),
    ]
    rows += [(f"`{k}`", [_fmt(p.params.get(k)) for p in pipes]) for k in pkeys]
    rows += [(label, [_logged_verdict(p, stage, key) if key.endswith("/worth_serving") else _fmt(p.metric(stage, key))
                      for p in pipes]) for label, stage, key in STAGE_METRICS]
    rows += [(label, [_with_ci(p.metric(stage, key), p.metric(stage, key[:-len("accept_len")] + "ci95_low"),
                               p.metric(stage, key[:-len("accept_len")] + "ci95_high")) for p in pipes])
             for label, stage, key in served_metric_rows(pipes)]
    lines = []
    if header:
        lines += [header, ""]
    lines.append("| | " + " | ".join(f"**{_cell(p.name)}**" for p in pipes) + " |")
    lines.append("|---|" + "---:|" * len(pipes))
    lines += ["| " + _cell(label) + " | " + " | ".join(_cell(c) for c in cells) + " |" for label, cells in rows]
    if same:
        lines += ["", f"{len(same)} other params {'are the same in every column' if len(pipes) > 1 else 'not shown'} "
                      f"(`--all-params` lists them)."]
    lines += ["", "`–`: no number for that stage in this pipeline execution (DVC skipped it, unchanged or "
                  "restored from the run-cache, and no stage that ran logged its metrics file onto the parent); "
                  "`dvc exp show` has every number."]
    return "\n".join(lines) + "\n"


def _with_ci(value: float | None, low: float | None, high: float | None) -> str:
    """``1.52 [1.31, 1.70]``: a value and its interval (``–`` without a value)."""
    if value is None:
        return _fmt(None)
    return _fmt(value) + ("" if low is None or high is None else f" [{_fmt(low)}, {_fmt(high)}]")


def served_metric_rows(pipes: list[Pipeline]) -> list[tuple[str, str | None, str]]:
    """(label, stage, metric key) of every served-table row any pipeline's eval children logged:
    the drafter's rows per eval stage, the n-gram rows once (stage None: either eval child)."""
    found: dict[tuple[str, str | None, str], None] = {}
    for p in pipes:
        for stage in EVAL_STAGES:
            run = p.stages.get(stage)
            for key in sorted(run.data.metrics) if run is not None else ():
                m = SERVED_METRIC.match(key)
                if m is None:
                    continue
                drafter = None if m["proposer"] == "ngram" else stage
                who = "n-gram floor" if drafter is None else stage.split("@", 1)[1]
                found[(f"{who} {m['bench']} served {m['row']} accept_len [95% CI]", drafter, key)] = None
    return sorted(found, key=lambda r: (r[2].split("/", 1)[0], r[1] is None, r[1] or "", r[0]))


def _hint(uri: str, e: Exception) -> str:
    if not uri.startswith(("http:", "https:")):
        return ""
    what = "it did not answer in time" if "timed out" in str(e).lower() else "is the server up?"
    return (f" ({what} MLFLOW_HTTP_REQUEST_TIMEOUT and MLFLOW_HTTP_REQUEST_MAX_RETRIES make it wait "
            f"longer)")


def _safe_uri(uri: str) -> str:
    from eyas.tracking.team import safe_uri  # the one mask: passwords in the userinfo and the query

    return safe_uri(uri)


def compare(uri: str | None = None, experiment: str | None = None, limit: int = 8,
            all_params: bool = False) -> str:
    """Read the store and return the Markdown comparison.

    Raises:
        CompareError: the sqlite file does not exist (nothing is created), the store's URL is not one
            MLflow reads or PostgreSQL refuses it (eyas.tracking.team.check_store), the MLflow
            experiment does not, or the tracking store does not answer its first request (a
            dead or unreachable server fails within seconds; the message names the URI).
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    uri = uri or tracking_uri()
    db = _sqlite_path(uri)
    if db is not None and not db.is_file():
        raise CompareError(f"no MLflow store at {db} (run the pipeline first, or set MLFLOW_TRACKING_URI)")
    if not uri.startswith(("http:", "https:")):  # a server's first request fails fast below, with its hint
        from eyas.tracking.team import StoreError, check_store

        try:  # an unknown scheme, a URL that does not parse, PostgreSQL refusing: one line, not a traceback
            check_store(uri)
        except StoreError as e:
            raise CompareError(str(e)) from e
    name = experiment or _experiment_name()
    # what opening or reading a store raises: MLflow's own errors (a file store MLflow refuses), the
    # filesystem's (a file:// path that is a file), the database's (a sqlite file that is not a database)
    store_errors = (MlflowException, OSError, SQLAlchemyError)
    try:
        with _fail_fast_http():
            client = MlflowClient(tracking_uri=uri)
            exp = client.get_experiment_by_name(name)
    except store_errors as e:
        raise CompareError(f"cannot query the MLflow tracking store {_safe_uri(uri)}{_hint(uri, e)}: "
                           f"{type(e).__name__}: {_safe_uri(_first_line(e))}") from e
    if exp is None:
        raise CompareError(f"no MLflow experiment {name!r} in {_safe_uri(uri)}")
    try:
        with _fail_fast_http(_READ_HTTP_ENV):
            pipes = collect(client, exp.experiment_id, limit, _upstream("."))
    except store_errors as e:
        raise CompareError(f"the MLflow tracking store {_safe_uri(uri)} stopped answering{_hint(uri, e)}: "
                           f"{type(e).__name__}: {_safe_uri(_first_line(e))}") from e
    header = (f"Pipeline runs in MLflow experiment `{name}` ({_safe_uri(uri)}), latest first: "
              f"{len(pipes)} shown.")
    return render_markdown(pipes, header, all_params)


def _first_line(e: Exception) -> str:
    """The first line of an error's message (SQLAlchemy's go on with the SQL and a link)."""
    return (str(e).strip().splitlines() or [""])[0]


def write(text: str, out: str | Path) -> Path:
    """Write ``text`` to ``out`` atomically (eyas.io.write_text: a file already there is replaced
    whole or not at all), creating its parent directories.

    Raises:
        CompareError: ``out`` cannot be written (a directory, a parent that is a file, no
            permission, a full disk), naming the path and why.
    """
    from eyas.io import write_text

    out = Path(out)
    if out.is_dir():
        raise CompareError(f"--out {out}: is a directory; name a file (e.g. {out / 'compare.md'})")
    blocked = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise CompareError(f"--out {out}: cannot write the table there: {blocked} is a file, not a directory")
    try:
        write_text(out, text)
    except OSError as e:  # no permission, a read-only filesystem, a full disk
        raise CompareError(f"--out {out}: cannot write the table there ({e.strerror or e})") from None
    return out


# ---------------------------------------------------------------------------------------------
# committed results: metrics directories (metrics/, dev/records/h200/) instead of MLflow

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
    without ``serve.quantized_target``: stages.eval_accept_len.engine_part) shows ``–``.

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
    value is null (what eyas.io.write_json writes for NaN and inf).

    Raises:
        CompareError: any other value (a string, a list, a mapping, a boolean), or a step of the key
            path that is not a mapping, naming the directory, file and key path.
    """
    v = _file_key(d, fname, files, keys)
    if v is _ABSENT or v is None:
        return _fmt(None)
    if not _number(v):
        raise CompareError(f"{d}: {fname}: {'.'.join(keys)} is {v!r}; expected a number")
    return _fmt(v)


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
    """The served table of one eval metrics file (eyas/eval/served.py's layout:
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
    from eyas.params.schema import flatten

    cols = []
    for d in dirs:
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
        cols.append((d, pfile, params, files))
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
    # the served tables (eyas/eval/served.py): every row any column has, the n-gram rows from eval_scratch.json
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
    return "\n".join(lines) + "\n"
