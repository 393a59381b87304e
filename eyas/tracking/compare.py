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
  (the target eyas evaluates, as a GGUF) and ``<bench>/engine_quantized/...`` (the target's own GGUF); a
  speedup the run flagged (``speedup_flagged``) shows ``(flagged)``: timed under uneven load, not a result;
- the decoding-modes table (eyas/eval/modes.py): every ``<bench>/served/<row>/accept_len`` an eval child
  logged (greedy chain, greedy tree, sampled chain per temperature; the n-gram rows from either
  eval child), with its 95% interval (``ci95_low`` / ``ci95_high``) in brackets.

The committed metrics directories side by side (``eyas compare --metrics``) are
:mod:`eyas.tracking.compare_dirs`.

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
import math
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

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


FLAGGED = " (flagged)"
"""After a speedup its run flagged (``speedup_flagged``: past the bound its acceptance length sets, so timed
under uneven load; eyas.eval.llamacpp.speedup_beyond_bound): not a result."""


def _logged_speedup(pipe: "Pipeline", stage: str, key: str) -> str:
    """A ``.../speedup`` metric formatted, marked :data:`FLAGGED` where the run logged
    ``<key>_flagged`` as 1 (eyas.eval.evaluate.report_engine logs it beside the speedup)."""
    return _fmt(pipe.metric(stage, key)) + (FLAGGED if pipe.metric(stage, key + "_flagged") == 1.0 else "")


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
    cell = {"/worth_serving": _logged_verdict, "/speedup": _logged_speedup}
    rows += [(label, [cell.get(key[key.rfind("/"):], lambda p, s, k: _fmt(p.metric(s, k)))(p, stage, key)
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
