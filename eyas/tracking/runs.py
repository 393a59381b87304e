"""MLflow runs, tags, and the metrics files DVC reads.

Two records of every stage, written side by side (docs/dvc-mlflow.md §5; the § numbers below are
sections of that page):

- **DVC files** (the reproducible record, read by ``dvc exp show`` / ``metrics diff`` /
  ``plots diff``): ``eyas.io.write_json`` and ``write_tsv`` write ``metrics/*.json`` and the
  per-step ``.tsv`` plots atomically, with ``\\n`` line endings so hashes are stable.
- **MLflow runs** (for comparison in the UI): :func:`start_stage_run` opens one child run per
  stage under one parent run per pipeline execution (§6), tagged with the DVC variables
  ``dvc.exp_name`` / ``dvc.baseline_rev`` / ``dvc.stage`` (§1) and with the params
  flattened to the dotted keys ``dvc exp show`` uses (§6).

This module knows nothing about DVC beyond reading the variables DVC sets for stage commands
(``DVC_ROOT``, ``DVC_STAGE``, ``DVC_EXP_NAME``, ``DVC_EXP_BASELINE_REV``; table in §1).

Where the store lives (§2): queued and ``--temp`` experiments run in
``.dvc/tmp/exps/tmpXXXX``, which is deleted afterwards, so MLflow's default (a relative
``sqlite:///mlflow.db``) would lose their runs. :func:`tracking_uri` therefore anchors the
store at ``$DVC_ROOT`` (the *original* repo root, also for queued runs):
``sqlite:////<root>/mlflow.db``, which ``mlflow ui`` started in the repo root finds by its own
defaults. ``$MLFLOW_TRACKING_URI`` (e.g. a local ``mlflow server``, the preferred option)
overrides it, verbatim (a relative ``sqlite:///x.db`` anchored at the root the same way).

The experiment is ``MLFLOW_EXPERIMENT_NAME`` (MLflow's own variable, read through
``mlflow.environment_variables`` as ``mlflow.start_run`` reads it), else ``eyas``.
``EYAS_TRACKING=off`` turns MLflow off (every tracker is the no-op one); ``RANK`` logs on rank 0
only, as nanochat/torchtitan do (section 4). Every variable eyas reads: docs/pipeline.md.

One module past 500 lines on purpose: a stage run's whole life against one MLflow store (the store,
the parent found or made under its lock, the child, resume, logging, the end), read top to bottom;
the team's store checks and the parent's summary are :mod:`eyas.tracking.team`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

from eyas.params.schema import flatten, params_hash
from eyas.pipeline.dvcfiles import running_stage

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "eyas"
MASK = "***"

# MLflow's limits (mlflow.utils.validation in 3.17.2).
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000


# --------------------------------------------------------------------------------------------
# Where things live


def repo_root() -> Path:
    """The repository root: ``$DVC_ROOT``, else the nearest parent of cwd holding ``dvc.yaml``.

    DVC sets ``DVC_ROOT`` to the *original* repo root even for queued / ``--temp`` experiments
    that run in ``.dvc/tmp/exps/tmpXXXX`` (docs/dvc-mlflow.md §1). Use it only for side channels
    such as the MLflow store, never to read stage inputs (that would break the snapshot isolation).
    Falls back to cwd when neither is found.
    """
    env = os.environ.get("DVC_ROOT")
    if env:
        return Path(env).resolve()
    cwd = Path.cwd().resolve()
    for d in (cwd, *cwd.parents):
        if (d / "dvc.yaml").is_file():
            return d
    return cwd


def tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` verbatim if set (a relative ``sqlite:///x.db`` anchored at the repo
    root: ``sqlite:///<abs repo_root>/x.db``), else ``sqlite:///<abs repo_root>/mlflow.db``.

    The absolute form (four slashes on POSIX) does not depend on the working directory, so
    runs from queued experiments land in the same store (docs/dvc-mlflow.md §2).
    """
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        if env.startswith("sqlite:///") and not os.path.isabs(env[len("sqlite:///"):]):
            # relative: each process's cwd, for a queued experiment a temp dir deleted after the run
            # (docs/dvc-mlflow.md §2); anchored at the repo root like the default, where `mlflow ui
            # --backend-store-uri <the same URI>` started in the repo root finds it
            return "sqlite:///" + str(repo_root() / env[len("sqlite:///"):])
        return env
    return "sqlite:///" + str(repo_root() / "mlflow.db")


def _sqlite_path(uri: str) -> Path | None:
    """The DB file of a ``sqlite:///...`` URI (``None`` for other stores)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    if not os.path.isabs(path):
        log.warning(
            "MLFLOW_TRACKING_URI %s is relative: it resolves against each process's cwd, "
            "which for queued DVC experiments is a temp dir deleted after the run "
            "(docs/dvc-mlflow.md §2). Use an absolute sqlite:////... or a server.",
            uri,
        )
    return Path(path)


def _experiment_name() -> str:
    """``$MLFLOW_EXPERIMENT_NAME``, else ``eyas``."""
    from mlflow.environment_variables import MLFLOW_EXPERIMENT_NAME

    return MLFLOW_EXPERIMENT_NAME.get() or DEFAULT_EXPERIMENT


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``<db>.lock`` for sqlite stores; nothing for servers.

    Parallel queue workers (``dvc queue start -j N``) creating or migrating a fresh sqlite
    file at once fail with ``table ... already exists`` (docs/dvc-mlflow.md §3); serialising the
    first touch of the store fixes it. A server owns its DB, so it needs no lock.
    """
    db = _sqlite_path(uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(str(db) + ".lock", "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _get_or_create_experiment(client, uri: str) -> str:
    """The id of the experiment (``$MLFLOW_EXPERIMENT_NAME``, else ``eyas``), created if missing.

    For sqlite stores the experiment gets an ABSOLUTE ``artifact_location`` under the repo
    root: MLflow fixes it when the experiment is created, and one first created from inside a
    queued run's temp dir would send every later run's artifacts to a deleted directory
    (docs/dvc-mlflow.md §2). Servers keep their own default (``mlflow-artifacts:/``).
    """
    from mlflow.exceptions import MlflowException

    name = _experiment_name()
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            log.warning("MLflow experiment %r (id %s) was deleted: restoring it to log this run (set "
                        "MLFLOW_EXPERIMENT_NAME to log elsewhere)", name, exp.experiment_id)
            client.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    location = None
    if _sqlite_path(uri) is not None:
        location = str(repo_root() / "mlartifacts")
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException:  # created meanwhile by another process (RESOURCE_ALREADY_EXISTS)
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def ensure_store(uri: str) -> None:
    """Create/upgrade the store's schema and the MLflow experiment once, before any run.

    For sqlite this is done under an exclusive ``flock`` on ``<db>.lock``: constructing the
    client creates the tables (what ``mlflow db upgrade`` does; docs/dvc-mlflow.md §3), and the
    experiment is got-or-created under the same lock. Safe to call from parallel processes.
    """
    with _store_lock(uri):
        _get_or_create_experiment(_client(uri), uri)


# --------------------------------------------------------------------------------------------
# Secrets and values

_SECRET_SUBSTRINGS = ("secret", "password", "passwd", "api_key", "apikey", "api-key")


def is_secret_key(key: str) -> bool:
    """Whether a param/tag key names a secret (its value is then logged as ``***``).

    Case-insensitive: the key contains ``secret``, ``password``, ``api_key``, or a word
    (split on non-alphanumerics) that is or ends in ``token`` (``hf_token``, ``authtoken``,
    ``token``). Counts of tokens (``batch_tokens``, ``max_new_tokens``) and ``tokenizer`` are
    not secrets and stay visible. Redacting before logging follows SpecForge's tracker
    (``sgl-project/SpecForge: specforge/tracker.py``).
    """
    k = key.lower()
    if any(s in k for s in _SECRET_SUBSTRINGS):
        return True
    return any(w.endswith("token") for w in re.split(r"[^a-z0-9]+", k))


def redact(d: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``d`` with the values of secret keys (:func:`is_secret_key`) replaced."""
    return {k: (MASK if is_secret_key(k) else v) for k, v in d.items()}


def _str_value(v: Any, limit: int) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str) if isinstance(v, (list, dict)) else str(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _chunks(items: list, n: int) -> Iterator[list]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _retry(fn, *args, attempts: int = 4, **kwargs):
    """Call ``fn``, retrying a few times: sqlite may answer "database is locked" under
    parallel writers (mlflow/mlflow#6490; docs/dvc-mlflow.md §3)."""
    for i in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - sqlalchemy/MlflowException both surface here
            if i == attempts - 1 or "locked" not in str(e).lower():
                raise
            time.sleep(0.5 * 2**i)


def _git_head() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha or None


# --------------------------------------------------------------------------------------------
# Trackers


class Tracker:
    """The no-op tracker: the same interface as :class:`MlflowTracker`, doing nothing.

    Returned on non-zero ranks and when tracking is off, so loops carry no ``if``s (nanochat's
    ``DummyWandb``, torchtitan's ``BaseLogger``; docs/dvc-mlflow.md §7). Usable as a context
    manager.
    """

    run_id: str | None = None
    parent_run_id: str | None = None
    experiment_id: str | None = None

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_artifact(self, path: str | os.PathLike) -> None:
        pass

    def log_dict(self, obj: dict, name: str) -> None:
        pass

    def log_figure(self, fig: Any, name: str) -> None:
        pass

    def set_tags(self, tags: dict[str, Any]) -> None:
        pass

    def flush(self) -> None:
        pass

    def history(self) -> list:
        """Every metric logged to this run so far, as ``[key, value, step]`` (JSON-ready: NaN and
        inf as None); a training checkpoint saves it, so a resumed run can :meth:`replay` it."""
        return []

    def replay(self, entries: list) -> None:
        """Log ``entries`` (from :meth:`history`, maybe another run's) at their own steps."""
        pass

    def close(self, status: str = "FINISHED") -> None:
        pass

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close("FINISHED")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.close("KILLED")
        else:
            self.close("FAILED")
        # returning None: the exception (if any) propagates


NoOpTracker = Tracker


class MlflowTracker(Tracker):
    """One MLflow run, written through ``MlflowClient`` only (no fluent, process-global
    active-run state). Metrics are buffered and sent with ``log_batch`` (<= 1000 per call)
    when the buffer fills, every ``flush_every_s`` seconds, and on :meth:`close`.
    """

    def __init__(
        self,
        client: Any,
        run_id: str,
        *,
        experiment_id: str | None = None,
        parent_run_id: str | None = None,
        flush_every_s: float = 15.0,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.parent_run_id = parent_run_id
        self.flush_every_s = flush_every_s
        self._buffer: list = []
        self._history: list = []
        self._last_flush = time.monotonic()
        self._closed = False
        self.monitor = None  # system metrics (eyas.tracking.team.start_system_metrics), stopped by close

    def log_params(self, params: dict[str, Any]) -> None:
        """Log params (nested dicts are flattened to dotted keys; secrets masked)."""
        from mlflow.entities import Param

        flat = redact(flatten(params)) if params else {}
        items = [Param(k, _str_value(v, MAX_PARAM_VAL_LENGTH)) for k, v in flat.items()]
        for chunk in _chunks(items, MAX_PARAMS_TAGS_PER_BATCH):
            _retry(self.client.log_batch, self.run_id, params=chunk)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Buffer ``{name: value}`` at ``step`` (0 when ``None``, as MLflow does).

        Names may contain ``/`` (``train/loss_0``). Values are anything ``float()`` accepts
        (Python numbers, 0-d tensors, numpy scalars).
        """
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        s = int(step) if step is not None else 0
        for k, v in metrics.items():
            self._buffer.append(Metric(key=k, value=float(v), timestamp=ts, step=s))
            self._history.append([k, float(v) if math.isfinite(float(v)) else None, s])
        if (
            len(self._buffer) >= MAX_METRICS_PER_BATCH
            or time.monotonic() - self._last_flush >= self.flush_every_s
        ):
            self.flush()

    def flush(self) -> None:
        """Send buffered metrics now."""
        buf, self._buffer = self._buffer, []
        for chunk in _chunks(buf, MAX_METRICS_PER_BATCH):
            _retry(self.client.log_batch, self.run_id, metrics=chunk)
        self._last_flush = time.monotonic()

    def history(self) -> list:
        return list(self._history)

    def replay(self, entries: list) -> None:
        for k, v, s in entries:
            self.log_metrics({k: math.nan if v is None else v}, step=s)
        self.flush()

    def log_artifact(self, path: str | os.PathLike) -> None:
        """Copy a file or a directory into the run's artifacts (small things only: DVC owns
        checkpoints and features; docs/dvc-mlflow.md §6)."""
        p = Path(path)
        if p.is_dir():
            self.client.log_artifacts(self.run_id, str(p), artifact_path=p.name)
        else:
            self.client.log_artifact(self.run_id, str(p))

    def log_dict(self, obj: dict, name: str) -> None:
        """Store ``obj`` as a JSON artifact ``name`` (``.json`` appended if missing)."""
        from eyas.io import _jsonable  # imports torch: not at module level, so that `eyas compare`
        # and stages that never log a dict start fast

        if not name.endswith((".json", ".yaml", ".yml")):
            name += ".json"
        self.client.log_dict(self.run_id, json.loads(json.dumps(obj, default=_jsonable)), name)

    def log_figure(self, fig: Any, name: str) -> None:
        """Store a matplotlib figure as an image artifact ``name`` (``.png`` if no suffix)."""
        if not Path(name).suffix:
            name += ".png"
        self.client.log_figure(self.run_id, fig, name)

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, _str_value(v, MAX_TAG_VAL_LENGTH)) for k, v in redact(tags).items()]
        for chunk in _chunks(items, MAX_PARAMS_TAGS_PER_BATCH):
            _retry(self.client.log_batch, self.run_id, tags=chunk)

    def close(self, status: str = "FINISHED") -> None:
        """Flush metrics and end the run with ``status`` (FINISHED / FAILED / KILLED).

        The parent run's status and end time follow its latest child, so the UI shows a
        finished pipeline as finished. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self.monitor is not None:
                self.monitor.finish()
            self.flush()
            if self.parent_run_id:  # every stage's metrics onto the parent, the reused ones marked
                from eyas.tracking.team import sync_parent
                try:
                    sync_parent(self.client, self.experiment_id, self.parent_run_id)
                except Exception as e:  # noqa: BLE001 - the parent's summary never fails a stage
                    log.warning("MLflow: could not log the stages' metrics onto parent run %s: %s",
                                self.parent_run_id, e)
        finally:
            _retry(self.client.set_terminated, self.run_id, status)
            if self.parent_run_id:
                _retry(self.client.set_terminated, self.parent_run_id, status)


def _tracking_disabled() -> bool:
    return os.environ.get("EYAS_TRACKING", "").strip().lower() in {"0", "off", "false", "no", "none"}


def pipeline_key(params: Any) -> str:
    """The key that identifies one pipeline execution: all its stages share one parent run.

    ``<exp name or 'workspace'>:<baseline rev or git HEAD or 'nogit'>:<params hash>``, from
    ``$DVC_EXP_NAME`` / ``$DVC_EXP_BASELINE_REV`` (docs/dvc-mlflow.md §1: ``DVC_EXP_GIT_COMMIT`` and
    ``DVC_BASELINE_REV`` do not exist).
    """
    exp = os.environ.get("DVC_EXP_NAME") or "workspace"
    rev = os.environ.get("DVC_EXP_BASELINE_REV") or _git_head() or "nogit"
    return f"{exp}:{rev}:{params_hash(params)}".replace("'", "_")


def _dvc_tags(params: Any) -> dict[str, str]:
    rev = os.environ.get("DVC_EXP_BASELINE_REV") or _git_head() or ""
    return {
        "dvc.exp_name": os.environ.get("DVC_EXP_NAME", ""),
        "dvc.baseline_rev": rev,
        "eyas.params_hash": params_hash(params),
    }


def _get_or_create_parent(client, experiment_id: str, params: Any, flat: dict) -> str:
    """Find the parent run by tag ``eyas.pipeline_key``; create it (with the params) if none."""
    from mlflow.entities import Param

    key = pipeline_key(params)
    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`eyas.pipeline_key` = '{key}'",
        max_results=1,
        order_by=["attributes.start_time ASC"],
    )
    if found:
        return found[0].info.run_id
    tags = {**_dvc_tags(params), "eyas.pipeline_key": key}
    exp_name = os.environ.get("DVC_EXP_NAME")
    if exp_name:
        name = exp_name
    else:
        rev = tags["dvc.baseline_rev"]
        name = f"workspace-{rev[:7]}" if rev else "workspace"
    run = client.create_run(experiment_id, tags=tags, run_name=name)
    items = [Param(k, _str_value(v, MAX_PARAM_VAL_LENGTH)) for k, v in flat.items()]
    for chunk in _chunks(items, MAX_PARAMS_TAGS_PER_BATCH):
        _retry(client.log_batch, run.info.run_id, params=chunk)
    return run.info.run_id


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def close_orphans(client, experiment_id: str, stage: str) -> list[tuple[str, str]]:
    """End as KILLED the runs of ``stage`` left RUNNING by a process of this host that is gone
    (SIGKILL, OOM, power loss: nothing ran ``close``). Returns (run id, its parent run's id, ""
    when it has none), oldest first.

    A run is recognised by its tags ``dvc.stage``, ``eyas.host`` and ``eyas.pid`` (set by
    :func:`start_stage_run`); runs of other hosts are left alone (their processes cannot be
    checked from here). MLflow itself never ends such runs (``mlflow.start_run`` only ends a run
    at interpreter exit through ``atexit``, mlflow ``tracking/fluent.py``), so without this they
    stay RUNNING forever.
    """
    host = socket.gethostname()
    runs = _retry(client.search_runs, [experiment_id],
                  filter_string=f"tags.`dvc.stage` = '{stage}' and attributes.status = 'RUNNING' "
                                f"and tags.`eyas.host` = '{host}'",
                  order_by=["attributes.start_time ASC"], max_results=100)
    out = []
    for r in runs:
        pid = r.data.tags.get("eyas.pid", "")
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            _retry(client.set_terminated, r.info.run_id, "KILLED")
            out.append((r.info.run_id, r.data.tags.get("mlflow.parentRunId", "")))
    return out


def start_stage_run(stage: str, params: Any, stage_params: dict | None = None) -> Tracker:
    """Open the MLflow child run for one stage, under the pipeline execution's parent run.

    - Parent: one per :func:`pipeline_key`, found by tag or created (under the store lock for
      sqlite, so two stages never create two parents), named ``$DVC_EXP_NAME`` or
      ``workspace-<short sha>``, tagged ``dvc.exp_name``, ``dvc.baseline_rev``,
      ``eyas.params_hash``, and holding ``flatten(params)`` too (the row to compare in the UI;
      not ``stage_params``, which differ per stage).
    - Child: named ``stage``, tag ``mlflow.parentRunId`` (works across processes;
      docs/dvc-mlflow.md §6),
      tags ``dvc.stage`` (``$DVC_STAGE`` without its file, eyas.pipeline.dvcfiles.running_stage, or
      ``stage``), ``dvc.exp_name``, ``dvc.baseline_rev``,
      ``eyas.params_hash``; params = ``flatten(params)`` plus ``stage_params`` (flattened;
      they win on a clash), secrets masked; tags ``eyas.host`` and ``eyas.pid``.
    - Runs of the same stage left RUNNING by a killed process are ended KILLED first
      (:func:`close_orphans`); those of the same pipeline execution (the same parent: experiment
      name, baseline commit and params) are linked both ways as its earlier attempts: tag
      ``eyas.resumes`` on the new run (their ids), ``eyas.resumed_by`` on each. A killed run of
      another experiment (a queued one works in its own directory) or of other params is ended but
      not linked. What a rerun reuses is the stage's own business and has its own key (a training
      checkpoint's fingerprint of the training params, eyas/training/checkpoint.py; the eval's
      ``resume_key``, eyas/pipeline/resume.py); a training stage that resumes from a checkpoint replays the
      metrics saved with it (eyas/training/loop.py), so the new run holds the whole curve either way.

    - The store is checked first (a PostgreSQL URI or a server: eyas.tracking.team.check_store
      raises ``StoreError`` naming the URL, before any compute); training and eval stages sample
      system metrics; closing the run logs every stage's metrics files onto the parent, the stages
      DVC skipped marked reused (eyas/tracking/team.py, docs/team.md).

    Returns the no-op :class:`Tracker` on ranks other than 0 (``$RANK``) or when
    ``$EYAS_TRACKING=off``. Use as a context manager: an exception ends the run FAILED and
    propagates::

        with start_stage_run("train-scratch", params) as tracker:
            tracker.log_metrics({"train/loss_0": loss}, step=step)
    """
    rank = os.environ.get("RANK")
    if (rank is not None and rank.strip() not in ("", "0")) or _tracking_disabled():
        return Tracker()
    uri = tracking_uri()
    from eyas.tracking.team import check_store, start_system_metrics, wants_system_metrics
    check_store(uri)  # a server or PostgreSQL that refuses: StoreError naming the URL, before any compute
    stage_tag = running_stage() or stage
    system_metrics = wants_system_metrics(stage_tag)  # a bad MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING: before any run
    pipeline_flat = redact(flatten(params))
    flat = redact({**flatten(params), **(flatten(stage_params) if stage_params else {})})
    with _store_lock(uri):
        client = _client(uri)
        experiment_id = _get_or_create_experiment(client, uri)
        parent_id = _get_or_create_parent(client, experiment_id, params, pipeline_flat)
    orphans = [run_id for run_id, parent in close_orphans(client, experiment_id, stage_tag) if parent == parent_id]
    tags = {
        **_dvc_tags(params),
        "mlflow.parentRunId": parent_id,
        "dvc.stage": stage_tag,
        "eyas.host": socket.gethostname(),
        "eyas.pid": str(os.getpid()),
        **({"eyas.resumes": ",".join(orphans)} if orphans else {}),
    }
    run = _retry(client.create_run, experiment_id, tags=tags, run_name=stage)
    for old in orphans:
        _retry(client.set_tag, old, "eyas.resumed_by", run.info.run_id)
    tracker = MlflowTracker(
        client, run.info.run_id, experiment_id=experiment_id, parent_run_id=parent_id
    )
    try:
        tracker.log_params(flat)
        if system_metrics:
            tracker.monitor = start_system_metrics(run.info.run_id, uri)
    except BaseException:
        tracker.close("FAILED")
        raise
    return tracker
