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

A tracking outage costs telemetry, not the stage (:class:`MlflowTracker`): a store that stops
answering mid-run (the server killed, its database gone, a sqlite file moved away) is warned about
once; what the run cannot send is kept in a spool under ``.eyas/mlflow-spool/`` in the repository
root (:class:`Spool`) and sent when the store answers again (:func:`sync`: at a later flush, at the
stage's end, at the next stage's start, or ``python3 -m eyas.tracking.runs sync``); the stage
writes its outputs and metrics files and exits as it would have. A stage that starts while the store
is away stops before any compute (a wrong URL or password is not an outage), unless runs of this
workspace already kept calls for that store (:func:`pending_spools`): then it runs offline, its run
created when its spool is sent. MLflow's HTTP client retries 7 times
with a 120 s timeout per request by default; a stage sets ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` and
``MLFLOW_HTTP_REQUEST_TIMEOUT`` (:data:`HTTP_SETTINGS`) unless the user did, so a dead server costs
a stage seconds once, not minutes per call (a training run lost to an MLflow outage:
radixark/miles PR #2571).

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
import shutil
import socket
import subprocess
import time
import uuid
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


def _get_or_create_experiment(client, uri: str, name: str | None = None) -> str:
    """The id of the experiment ``name`` (default ``$MLFLOW_EXPERIMENT_NAME``, else ``eyas``), created
    if missing.

    For sqlite stores the experiment gets an ABSOLUTE ``artifact_location`` under the repo
    root: MLflow fixes it when the experiment is created, and one first created from inside a
    queued run's temp dir would send every later run's artifacts to a deleted directory
    (docs/dvc-mlflow.md §2). Servers keep their own default (``mlflow-artifacts:/``).
    """
    from mlflow.exceptions import MlflowException

    name = name or _experiment_name()
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
    offline = False  # whether the store is away (MlflowTracker: calls go to its spool)

    def outage(self, err: BaseException, what: str = "") -> None:
        """The store failed a call made outside the tracker (a logged model): see MlflowTracker."""
        pass

    def not_sent(self, what: str) -> None:
        """``what`` was not sent because the store is away: see MlflowTracker."""
        pass

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

    An outage of the store (a server that stops answering, a database that goes away or refuses
    writes) costs telemetry, not the stage: the first failed call warns once, naming the store, the
    error and the spool; from then on every call is written to the spool (:class:`Spool`, under
    ``.eyas/mlflow-spool/<run id>/`` in the repository root) instead of the store, and the stage goes
    on. Every :data:`REPROBE_S` seconds (at a flush) and at :meth:`close` the store is tried again
    (:func:`store_answers`, seconds at most); once it answers, the spool is sent (:func:`sync`) and
    logging goes on live. A spool left at the end (the store still away) is sent by the next stage
    that opens a run on the same store, or by ``python3 -m eyas.tracking.runs sync``. No method
    raises for the store's sake.
    """

    def __init__(
        self,
        client: Any,
        run_id: str,
        *,
        experiment_id: str | None = None,
        parent_run_id: str | None = None,
        flush_every_s: float = 15.0,
        uri: str | None = None,
        stage: str = "",
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.parent_run_id = parent_run_id
        self.flush_every_s = flush_every_s
        self.uri = uri or tracking_uri()
        self.stage = stage
        self._buffer: list = []
        self._history: list = []
        self._last_flush = time.monotonic()
        self._closed = False
        self.monitor = None  # system metrics (eyas.tracking.team.start_system_metrics), stopped by close
        self.spool: Spool | None = None  # set at the first failed call: the store is away
        self._last_probe = 0.0
        self._db = _db_identity(self.uri)  # a sqlite file removed or replaced under the run is an outage too

    @property
    def offline(self) -> bool:
        """Whether the store is away: calls go to :attr:`spool`."""
        return self.spool is not None

    # ---------------------------------------------------------------------------------- outages

    def outage(self, err: BaseException, what: str = "") -> None:
        """The store failed a call: warn (the first time only) and keep what follows in the spool;
        ``what`` (a thing that cannot be replayed, e.g. a logged model) is recorded as not sent."""
        if self.spool is None:
            self.spool = Spool.open(self.uri, self, err)
            log.warning(
                "MLflow store %s failed (%s): %s goes on without it. What it cannot send is kept in %s and sent "
                "when the store answers again (tried every %d s, at the end of the stage, at the next stage's "
                "start, or by `python3 -m eyas.tracking.runs sync`); the metrics and plots files are "
                "written as usual", _safe(self.uri), _safe(_one_line(err)), self.stage or "the stage",
                self.spool.path, REPROBE_S)
            self._last_probe = time.monotonic()
        if what:
            self.spool.add({"op": "lost", "what": what, "error": _safe(_one_line(err))})

    def not_sent(self, what: str) -> None:
        """Record ``what`` (a thing the spool cannot replay) as not sent, while offline."""
        if self.spool is not None:
            self.spool.add({"op": "lost", "what": what, "error": "the store was away"})

    def _send(self, op: dict, method: str, *args, **kwargs) -> None:
        """``self.client.<method>(*args, **kwargs)`` against the store, or ``op`` into the spool when the
        store is away (or fails now)."""
        if self.spool is not None:
            self.spool.add(op)
            return
        try:
            self._check_db()
            _retry(getattr(self.client, method), *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - MlflowException, requests' and sqlalchemy's errors alike
            self.outage(e)
            self.spool.add(op)

    def _check_db(self) -> None:
        """Raise when the sqlite file this run started on was removed or replaced: a client still
        holding the old file's connection would write into a file nobody reads."""
        if self._db is not None and _db_identity(self.uri) != self._db:
            raise OSError(f"{_sqlite_path(self.uri)} was removed or replaced during the run")

    def _maybe_back(self, force: bool = False) -> None:
        """While offline: every :data:`REPROBE_S` seconds (or now, with ``force``), if the store
        answers, send the spool and go back online."""
        if self.spool is None or (not force and time.monotonic() - self._last_probe < REPROBE_S):
            return
        self._last_probe = time.monotonic()
        if self._db is not None and _db_identity(self.uri) != self._db:
            return  # another file now: the run is not there
        if not store_answers(self.uri):
            return
        try:
            self.client = self.client or _client(self.uri)
            back = sync(self.client, self.spool.path, self.uri)
        except (OSError, ValueError) as e:  # the spool itself unreadable: it stays for a later sync
            log.warning("MLflow spool %s could not be sent: %s", self.spool.path, e)
            back = None
        if back:  # a run created now (a stage started offline) has its ids from here on
            self.run_id, self.parent_run_id = back["run_id"], back["parent_run_id"]
            self.experiment_id = back["experiment_id"]
            log.info("MLflow store %s answers again: what %s kept meanwhile was sent to run %s",
                        _safe(self.uri), self.stage or "the stage", self.run_id)
            self.spool = None

    # ---------------------------------------------------------------------------------- logging

    def log_params(self, params: dict[str, Any]) -> None:
        """Log params (nested dicts are flattened to dotted keys; secrets masked)."""
        from mlflow.entities import Param

        flat = redact(flatten(params)) if params else {}
        items = [(k, _str_value(v, MAX_PARAM_VAL_LENGTH)) for k, v in flat.items()]
        for chunk in _chunks(items, MAX_PARAMS_TAGS_PER_BATCH):
            self._send({"op": "params", "params": chunk}, "log_batch", self.run_id,
                       params=[Param(k, v) for k, v in chunk])

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
        """Send buffered metrics now (into the spool while the store is away)."""
        self._maybe_back()
        buf, self._buffer = self._buffer, []
        for chunk in _chunks(buf, MAX_METRICS_PER_BATCH):
            op = {"op": "metrics", "metrics": [[m.key, m.value, m.timestamp, m.step] for m in chunk]}
            self._send(op, "log_batch", self.run_id, metrics=chunk)
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
        if self.spool is None:
            try:
                self._check_db()
                if p.is_dir():
                    self.client.log_artifacts(self.run_id, str(p), artifact_path=p.name)
                else:
                    self.client.log_artifact(self.run_id, str(p))
                return
            except Exception as e:  # noqa: BLE001 - the store, not the stage
                self.outage(e)
        self.spool.add_file({"op": "artifact", "artifact_path": p.name if p.is_dir() else None}, p)

    def log_dict(self, obj: dict, name: str) -> None:
        """Store ``obj`` as a JSON artifact ``name`` (``.json`` appended if missing)."""
        from eyas.io import _jsonable  # imports torch: not at module level, so that `eyas compare`
        # and stages that never log a dict start fast

        if not name.endswith((".json", ".yaml", ".yml")):
            name += ".json"
        obj = json.loads(json.dumps(obj, default=_jsonable))
        self._send({"op": "dict", "obj": obj, "name": name}, "log_dict", self.run_id, obj, name)

    def log_figure(self, fig: Any, name: str) -> None:
        """Store a matplotlib figure as an image artifact ``name`` (``.png`` if no suffix)."""
        if not Path(name).suffix:
            name += ".png"
        if self.spool is None:
            try:
                self._check_db()
                self.client.log_figure(self.run_id, fig, name)
                return
            except Exception as e:  # noqa: BLE001 - the store, not the stage
                self.outage(e)
        self.spool.add_figure(fig, name)

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [(k, _str_value(v, MAX_TAG_VAL_LENGTH)) for k, v in redact(tags).items()]
        for chunk in _chunks(items, MAX_PARAMS_TAGS_PER_BATCH):
            self._send({"op": "tags", "tags": chunk}, "log_batch", self.run_id,
                       tags=[RunTag(k, v) for k, v in chunk])

    def close(self, status: str = "FINISHED") -> None:
        """Flush metrics and end the run with ``status`` (FINISHED / FAILED / KILLED).

        The parent run's status and end time follow its latest child, so the UI shows a
        finished pipeline as finished. While the store is away, the ends go into the spool with
        their time, and the store is tried once more first. Idempotent; never raises for the store.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self.monitor is not None and not self.offline:
                self.monitor.finish()  # offline, MLflow's sampler has stopped itself at its first failure
            self._maybe_back(force=True)
            self.flush()
            if self.parent_run_id and not self.offline:  # every stage's metrics onto the parent, the reused marked
                from eyas.tracking.team import sync_parent
                try:
                    sync_parent(self.client, self.experiment_id, self.parent_run_id)
                except Exception as e:  # noqa: BLE001 - the parent's summary never fails a stage
                    log.warning("MLflow: could not log the stages' metrics onto parent run %s: %s",
                                self.parent_run_id, e)
        finally:
            end = int(time.time() * 1000)
            for run_id in filter(None, (self.run_id, self.parent_run_id)):
                self._send({"op": "terminate", "run_id": run_id, "status": status, "end_time": end},
                           "set_terminated", run_id, status, end_time=end)
            if self.spool is not None:
                log.info("MLflow: %d calls of %s kept in %s (the store %s is away): sent when it answers "
                         "(`python3 -m eyas.tracking.runs sync`)", self.spool.count, self.stage or "the stage",
                         self.spool.path, _safe(self.uri))


# --------------------------------------------------------------------------------------------
# The spool: what a run could not send while its store was away


SPOOL = Path(".eyas/mlflow-spool")  # under the repository root
REPROBE_S = 60  # while offline, the store is tried again at most this often (at a flush)
# MLflow's HTTP client waits 7 retries x 120 s per request by default (mlflow/environment_variables.py);
# a stage sets these unless the user did, so a dead server costs a stage seconds, not minutes
HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
PROBE_TIMEOUT_S = 2


def _safe(text: str) -> str:
    from eyas.tracking.team import safe_uri

    return safe_uri(text)


def _one_line(err: BaseException) -> str:
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= 300 else text[:297] + "..."


def _db_identity(uri: str) -> tuple | None:
    """(device, inode) of a sqlite store's file, ``("absent",)`` when it is gone; None for other stores."""
    db = _sqlite_path(uri) if uri.startswith("sqlite:///") else None
    if db is None:
        return None
    try:
        st = db.stat()
    except OSError:
        return ("absent",)
    return (st.st_dev, st.st_ino)


def store_answers(uri: str) -> bool:
    """Whether the store behind ``uri`` answers now, within :data:`PROBE_TIMEOUT_S` seconds: an MLflow
    server's ``/health``, a PostgreSQL connection (eyas.tracking.team.check_store), a sqlite
    file that is there."""
    if uri.startswith(("http://", "https://")):
        import requests

        try:
            return requests.get(uri.rstrip("/") + "/health", timeout=PROBE_TIMEOUT_S).status_code == 200
        except (requests.RequestException, OSError, ValueError):
            return False
    if uri.startswith("sqlite:///"):
        return _db_identity(uri) not in (None, ("absent",))
    from eyas.tracking.team import StoreError, check_store

    try:
        check_store(uri, timeout=PROBE_TIMEOUT_S)
        return True
    except StoreError:
        return False


class Spool:
    """What one run could not send: ``<repo root>/.eyas/mlflow-spool/<run id>/`` holding ``meta.json``
    (the store, masked; the run, its parent and experiment; the host, pid and stage; the first error
    and when), ``ops.jsonl`` (one call per line, in order: metrics, params, tags, dicts, artifacts and
    figures as files under ``files/``, the runs' ends with their times, and what could not be kept) and
    ``sent`` (how many lines are in the store already)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = 0

    @classmethod
    def open(cls, uri: str, tracker: MlflowTracker, err: BaseException) -> Spool:
        spool = cls(repo_root() / SPOOL / tracker.run_id)
        try:
            (spool.path / "files").mkdir(parents=True, exist_ok=True)
            meta = spool.path / "meta.json"
            if not meta.is_file():
                meta.write_text(json.dumps({
                    "store": _safe(uri), "run_id": tracker.run_id, "parent_run_id": tracker.parent_run_id,
                    "experiment_id": tracker.experiment_id, "stage": tracker.stage, "host": socket.gethostname(),
                    "pid": os.getpid(), "error": _safe(_one_line(err)),
                    "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1) + "\n")
        except OSError as e:
            log.warning("MLflow spool %s cannot be written (%s): the run's telemetry from here on is lost",
                        spool.path, e)
        return spool

    def set_create(self, create: dict) -> None:
        """Record that the run itself is to be created when the spool is sent (a stage that started
        while the store was away): ``create`` holds the experiment, the parent's key, tags, name and
        params, and the run's tags, name and start time."""
        meta = json.loads((self.path / "meta.json").read_text())
        meta["create"] = create
        (self.path / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")

    def add(self, op: dict) -> None:
        try:
            with open(self.path / "ops.jsonl", "a") as fh:
                fh.write(json.dumps(op) + "\n")
            self.count += 1
        except OSError as e:  # a full disk: the telemetry is lost, the stage goes on
            log.debug("MLflow spool %s: %s", self.path, e)

    def _file(self, name: str) -> Path:
        d = self.path / "files" / str(self.count)
        d.mkdir(parents=True, exist_ok=True)
        return d / name

    def add_file(self, op: dict, src: Path) -> None:
        try:
            dst = self._file(src.name)
            shutil.copytree(src, dst) if src.is_dir() else shutil.copyfile(src, dst)
            self.add({**op, "file": str(dst.relative_to(self.path))})
        except OSError as e:
            self.add({"op": "lost", "what": f"artifact {src}", "error": str(e)})

    def add_figure(self, fig: Any, name: str) -> None:
        try:
            dst = self._file(Path(name).name)
            fig.savefig(dst)
            self.add({"op": "artifact", "file": str(dst.relative_to(self.path)),
                      "artifact_path": str(Path(name).parent) if Path(name).parent != Path(".") else None})
        except (OSError, ValueError) as e:
            self.add({"op": "lost", "what": f"figure {name}", "error": str(e)})


def _apply(client, spool: Path, meta: dict, op: dict) -> None:
    from mlflow.entities import Metric, Param, RunTag

    run_id = meta["run_id"]
    kind = op["op"]
    if kind == "metrics":
        client.log_batch(run_id, metrics=[Metric(k, v, ts, s) for k, v, ts, s in op["metrics"]])
    elif kind == "params":
        client.log_batch(run_id, params=[Param(k, v) for k, v in op["params"]])
    elif kind == "tags":
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in op["tags"]])
    elif kind == "dict":
        client.log_dict(run_id, op["obj"], op["name"])
    elif kind == "artifact":
        f = spool / op["file"]
        if f.is_dir():
            client.log_artifacts(run_id, str(f), artifact_path=op.get("artifact_path") or f.name)
        else:
            client.log_artifact(run_id, str(f), artifact_path=op.get("artifact_path"))
    elif kind == "terminate":  # a run created at sync: its placeholders stand for the ids it got
        rid = {meta.get("offline_id"): run_id, f"{meta.get('offline_id')}-parent": meta.get("parent_run_id")}.get(
            op["run_id"], op["run_id"])
        client.set_terminated(rid, op["status"], end_time=op["end_time"])
    elif kind != "lost":
        raise ValueError(f"{spool}: unknown spooled call {kind!r}")


def _create_run(client, uri: str, spool: Path, meta: dict) -> dict:
    """Create the run (and, if missing, its parent) a spool of a stage started offline stands for;
    record their ids in its ``meta.json`` (the placeholder as ``offline_id``); returns the new meta."""
    c = meta["create"]
    exp_id = _get_or_create_experiment(client, uri, c["experiment"])
    parent = _find_or_create_parent(client, exp_id, c["pipeline_key"], c["parent_tags"], c["parent_name"],
                                    c["parent_params"])
    run = client.create_run(exp_id, start_time=c["start_time"], run_name=c["run_name"],
                            tags={**c["tags"], "mlflow.parentRunId": parent, "eyas.started_offline": "true"})
    meta = {**meta, "offline_id": meta["run_id"], "run_id": run.info.run_id, "parent_run_id": parent,
            "experiment_id": exp_id}
    (spool / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def sync(client, spool: str | os.PathLike, uri: str) -> dict | None:
    """Send what ``spool`` (a :class:`Spool` directory) holds to the store, in order, from where an
    earlier sync stopped; then tag the run ``eyas.telemetry.late`` (how many calls came late, since
    when, the first error) and, where something could not be kept, ``eyas.telemetry.lost``, and remove
    the spool. A spool of a stage that started while the store was away creates its run (and the
    parent, if missing) first. Returns the spool's meta (the run's id in the store as ``run_id``) when
    all of it was sent; None (the spool kept, the rest for a later sync) when the store failed again.
    A call the store refuses while it answers (the run deleted meanwhile, a value it rejects) is
    counted as lost, not retried forever.
    """
    spool = Path(spool)
    meta = json.loads((spool / "meta.json").read_text())
    if "create" in meta and "offline_id" not in meta:
        try:
            meta = _create_run(client, uri, spool, meta)
        except Exception:  # noqa: BLE001 - away again: the spool stays
            return None
    try:
        client.get_run(meta["run_id"])
    except Exception as e:  # noqa: BLE001 - away again, or a store without the run (a sqlite file replaced)
        if store_answers(uri):
            log.warning("MLflow store %s has no run %s (%s): the calls kept in %s stay there", _safe(uri),
                        meta["run_id"], _safe(_one_line(e)), spool)
        return None
    lines = (spool / "ops.jsonl").read_text().splitlines() if (spool / "ops.jsonl").is_file() else []
    sent_file = spool / "sent"
    sent = int(sent_file.read_text() or 0) if sent_file.is_file() else 0
    lost = [json.loads(x)["what"] for x in lines if json.loads(x)["op"] == "lost"]
    for i in range(sent, len(lines)):
        op = json.loads(lines[i])
        try:
            _apply(client, spool, meta, op)
        except Exception as e:  # noqa: BLE001 - the store again, or a call it refuses
            if not store_answers(uri):
                sent_file.write_text(str(i))
                return None
            lost.append(f"{op['op']} ({_safe(_one_line(e))})")
        sent_file.write_text(str(i + 1))
    from mlflow.entities import RunTag

    tags = [RunTag("eyas.telemetry.late", _str_value(
        f"{len(lines)} calls kept in {spool} on {meta['host']} while the store was away (from {meta['since']}: "
        f"{meta['error']}), sent late", MAX_TAG_VAL_LENGTH))]
    if lost:
        tags.append(RunTag("eyas.telemetry.lost", _str_value("; ".join(lost), MAX_TAG_VAL_LENGTH)))
    try:
        client.log_batch(meta["run_id"], tags=tags)
    except Exception:  # noqa: BLE001 - the calls are in; the note is not worth a second spool
        log.warning("MLflow: run %s got the calls of %s but not the tag saying they came late", meta["run_id"], spool)
    shutil.rmtree(spool, ignore_errors=True)
    return meta


def _ended(spool: Path, run_id: str) -> bool:
    """Whether ``spool`` holds its run's end (the tracker closed)."""
    try:
        return any(op.get("op") == "terminate" and op.get("run_id") == run_id
                   for op in map(json.loads, (spool / "ops.jsonl").read_text().splitlines()))
    except (OSError, ValueError):
        return False


def sync_spools(uri: str | None = None, client=None) -> tuple[int, int]:
    """Send every spool of the store ``uri`` (default :func:`tracking_uri`) under the repository root
    whose run has ended (or whose process has, or runs on another host); returns (spools sent, spools
    kept)."""
    uri = uri or tracking_uri()
    root = repo_root() / SPOOL
    if not root.is_dir():
        return 0, 0
    done = kept = 0
    for d in sorted(p for p in root.iterdir() if (p / "meta.json").is_file()):
        try:
            meta = json.loads((d / "meta.json").read_text())
        except (OSError, ValueError):
            continue
        if meta.get("store") != _safe(uri):
            continue
        live = meta.get("host") == socket.gethostname() and meta.get("pid") != os.getpid() and _pid_alive(meta["pid"])
        if live and not _ended(d, meta["run_id"]):
            continue  # its run is still going: it sends its own spool
        client = client or _client(uri)
        if sync(client, d, uri):
            done += 1
        else:
            kept += 1
    return done, kept


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


def _parent_fields(params: Any) -> tuple[str, dict[str, str], str]:
    """The parent run of this pipeline execution: (its :func:`pipeline_key`, its tags, its name)."""
    key = pipeline_key(params)
    tags = {**_dvc_tags(params), "eyas.pipeline_key": key}
    exp_name = os.environ.get("DVC_EXP_NAME")
    if exp_name:
        name = exp_name
    else:
        rev = tags["dvc.baseline_rev"]
        name = f"workspace-{rev[:7]}" if rev else "workspace"
    return key, tags, name


def _find_or_create_parent(client, experiment_id: str, key: str, tags: dict, name: str, flat: dict) -> str:
    """Find the parent run by tag ``eyas.pipeline_key`` = ``key``; create it (``tags``, ``name``, the
    params ``flat``) if none."""
    from mlflow.entities import Param

    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`eyas.pipeline_key` = '{key}'",
        max_results=1,
        order_by=["attributes.start_time ASC"],
    )
    if found:
        return found[0].info.run_id
    run = client.create_run(experiment_id, tags=tags, run_name=name)
    items = [Param(k, _str_value(v, MAX_PARAM_VAL_LENGTH)) for k, v in flat.items()]
    for chunk in _chunks(items, MAX_PARAMS_TAGS_PER_BATCH):
        _retry(client.log_batch, run.info.run_id, params=chunk)
    return run.info.run_id


def _get_or_create_parent(client, experiment_id: str, params: Any, flat: dict) -> str:
    """Find the parent run by tag ``eyas.pipeline_key``; create it (with the params) if none."""
    return _find_or_create_parent(client, experiment_id, *_parent_fields(params), flat)


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
      raises ``StoreError`` naming the URL, before any compute); the spools earlier runs kept during an
      outage of this store are sent next (:func:`sync_spools`), before killed runs are ended; MLflow's
      HTTP retries and timeout are bounded (:data:`HTTP_SETTINGS`); training and eval stages sample
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
    for k, v in HTTP_SETTINGS.items():  # MLflow's own variables, unless the user set them
        os.environ.setdefault(k, v)
    uri = tracking_uri()
    from eyas.tracking.team import StoreError, check_store, start_system_metrics, wants_system_metrics
    stage_tag = running_stage() or stage
    system_metrics = wants_system_metrics(stage_tag)  # a bad MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING: before any run
    pipeline_flat = redact(flatten(params))
    flat = redact({**flatten(params), **(flatten(stage_params) if stage_params else {})})
    try:
        check_store(uri)  # a server or PostgreSQL that refuses: StoreError naming the URL, before any compute
    except StoreError as e:
        if not pending_spools(uri):  # never answered here: a wrong URL or password, said before any compute
            raise
        return _start_offline(stage, stage_tag, params, flat, pipeline_flat, uri, e)  # an outage goes on
    with _store_lock(uri):
        client = _client(uri)
        experiment_id = _get_or_create_experiment(client, uri)
        parent_id = _get_or_create_parent(client, experiment_id, params, pipeline_flat)
    _send_spools(uri, client)
    tracker = _create_child_run(client, experiment_id, parent_id, uri, stage, stage_tag, params)
    try:
        tracker.log_params(flat)
        if system_metrics:
            tracker.monitor = start_system_metrics(tracker.run_id, uri)
    except BaseException:
        tracker.close("FAILED")
        raise
    return tracker


def _send_spools(uri: str, client) -> None:
    """What earlier runs kept while the store ``uri`` was away (:func:`sync_spools`), sent before a new
    run starts, so their runs end as they ended; logged, never raised: a spool that cannot be sent
    never stops a stage."""
    try:
        sent, kept = sync_spools(uri, client)
        if sent or kept:
            log.info("MLflow: the calls kept by %d earlier run(s) during an outage were sent%s", sent,
                     f"; {kept} spool(s) kept for later (`python3 -m eyas.tracking.runs sync`)" if kept else "")
    except Exception as e:  # noqa: BLE001 - a spool that cannot be sent never stops a stage
        log.warning("MLflow: the spools under %s were not sent: %s", repo_root() / SPOOL, _one_line(e))


def _create_child_run(client, experiment_id: str, parent_id: str, uri: str, stage: str, stage_tag: str,
                      params: Any) -> MlflowTracker:
    """The stage's child run under ``parent_id``, created with its tags (:func:`start_stage_run`), after the
    runs of ``stage_tag`` a killed process left RUNNING are ended (:func:`close_orphans`); those of the
    same parent are linked both ways (``eyas.resumes`` on the new run, ``eyas.resumed_by`` on each).
    Its params are not logged yet. Raises what MLflow raises once :func:`_retry` gives up."""
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
    return MlflowTracker(
        client, run.info.run_id, experiment_id=experiment_id, parent_run_id=parent_id, uri=uri, stage=stage_tag
    )


def pending_spools(uri: str) -> list[Path]:
    """The spools under the repository root kept for the store ``uri`` (runs of this workspace saw it
    answer, then go away)."""
    root = repo_root() / SPOOL
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            if json.loads((d / "meta.json").read_text()).get("store") == _safe(uri):
                out.append(d)
        except (OSError, ValueError):
            continue
    return out


def _start_offline(stage: str, stage_tag: str, params: Any, flat: dict, pipeline_flat: dict, uri: str,
                   err: BaseException) -> MlflowTracker:
    """A stage that starts while the store is away, during an outage earlier runs of this workspace
    already met (:func:`pending_spools`): its run exists only in a spool, created in the store (with its
    parent) when the spool is sent."""
    key, parent_tags, parent_name = _parent_fields(params)
    run_id = "offline-" + uuid.uuid4().hex
    tracker = MlflowTracker(None, run_id, parent_run_id=f"{run_id}-parent", uri=uri, stage=stage_tag)
    tracker._db = None
    tracker.outage(err)  # the one warning; the spool opened
    tags = {**_dvc_tags(params), "dvc.stage": stage_tag, "eyas.host": socket.gethostname(),
            "eyas.pid": str(os.getpid())}
    parent_params = {k: str(v) for k, v in pipeline_flat.items()}
    tracker.spool.set_create({"experiment": _experiment_name(), "pipeline_key": key, "parent_tags": parent_tags,
                              "parent_name": parent_name, "parent_params": parent_params, "tags": tags,
                              "run_name": stage, "start_time": int(time.time() * 1000)})
    tracker.log_params(flat)
    return tracker


def main(argv: list[str] | None = None) -> int:
    """``python3 -m eyas.tracking.runs sync``: send the spools of the store (``$MLFLOW_TRACKING_URI``,
    else the repository's sqlite store) that runs kept while it was away. Exit 0 when all were sent, 1
    when some stay (the store still away), 2 when the store refuses outright."""
    import argparse
    import sys

    from eyas.tracking.team import StoreError, check_store

    ap = argparse.ArgumentParser(prog="python3 -m eyas.tracking.runs")
    ap.add_argument("op", choices=("sync",))
    ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    for k, v in HTTP_SETTINGS.items():
        os.environ.setdefault(k, v)
    uri = tracking_uri()
    try:
        check_store(uri)
    except StoreError as e:
        sys.stderr.write(f"eyas: error: {e}\n")
        return 2
    sent, kept = sync_spools(uri)
    print(f"MLflow store {_safe(uri)}: {sent} spool(s) sent, {kept} kept")
    return 1 if kept else 0


if __name__ == "__main__":
    raise SystemExit(main())
