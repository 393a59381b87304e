"""MLflow for a team: the store checked before use, system metrics, every stage's numbers on the
parent run (the reused ones too), and each exported drafter an MLflow logged model.

- :func:`check_store`: a PostgreSQL URI (``postgresql+psycopg2://user:pw@host:port/db``, MLflow's SQLAlchemy
  form) or an MLflow server (``http(s)://``) is tried once, within seconds, before a stage computes
  anything; a refused connection, a wrong password, a missing database or role, or a server that
  does not answer raise :class:`StoreError` naming the URL (password masked) and what to do. sqlite
  needs no check (eyas.tracking.runs creates it).
- :func:`start_system_metrics`: MLflow's own sampler (``mlflow.system_metrics``: CPU, memory, disk,
  network, and GPUs with ``nvidia-ml-py``) on the training and eval stage runs
  (:func:`wants_system_metrics`), what ``mlflow.start_run(log_system_metrics=True)`` starts; it
  needs ``psutil``. ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` (s, default 10) sets its period,
  ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING`` (MLflow's own switch), where set, turns it on or off for
  every stage.
- :func:`sync_parent`: a stage DVC skips (unchanged, or restored from the run-cache) runs no code and
  logs no run, so the parent run of a pipeline execution would lack its numbers. Each stage run, when
  it closes, logs onto its parent every stage's metrics as ``metrics/`` holds them then (the files
  the ``dvc.yaml`` files declare, the ones DVC checked out for the stages it skipped), as
  ``<stage>/<key>`` (``@`` written ``:``, which MLflow names allow; ``key`` the name the stage's own
  run logs, :func:`run_keys`), and tags ``eyas.reused.<stage>``: ``true`` when the parent has no
  child run of that stage (DVC reused its outputs), ``false`` when it has. The last stage to close
  leaves the final picture. A pipeline in which no stage ran has no parent run to sync.
- :func:`log_drafter_model` / :func:`log_acceptance`: MLflow 3's logged models
  (``MlflowClient.create_logged_model``, ``log_model_artifacts``, ``finalize_logged_model``; metrics
  carry a ``model_id``) for each drafter a training stage exports: its ``config.json`` (and provenance
  fingerprint) as the model's artifacts (the weights stay DVC's), its config as params, its final
  val metrics, and its dataset inputs: the features and the conversations as MLflow datasets whose
  digest is DVC's (the md5 ``dvc.lock`` records for that output; :func:`dvc_dataset`). The eval
  stage finds the model by its weights' sha256 (tag ``eyas.weights_sha256``) and adds the
  acceptance metrics to it, and the model as an input of the eval run.

Upstream: ``mlflow/tracking/client.py`` (logged models, ``log_inputs``), ``mlflow/system_metrics/``,
``mlflow/utils/validation.py`` (metric names), ``mlflow/data/meta_dataset.py`` (mlflow 3.17.2).

One module past 500 lines on purpose: what a team's MLflow adds to a stage run (the store checked,
system metrics, the parent's summary, logged models and datasets), each part small and read alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from eyas.pipeline import dvcfiles
from eyas.urls import safe_uri

log = logging.getLogger(__name__)

REUSED_TAG = "eyas.reused."
WEIGHTS_TAG = "eyas.weights_sha256"
MODEL_TAG = "eyas.model_id"
SYSTEM_METRICS_STAGES = ("train-", "stand-in-drafter", "eval-accept-len")
CHECK_TIMEOUT_S = 5


class StoreError(RuntimeError):
    """The MLflow store (or an MLflow setting) cannot be used: the message names its URL (or the
    variable) and what to do."""


# --------------------------------------------------------------------------------------------
# The store, checked


def check_store(uri: str, timeout: float = CHECK_TIMEOUT_S) -> None:
    """Try the store behind ``uri`` once; nothing for sqlite, a file path and other schemes MLflow knows.

    ``postgresql[+driver]://``: one psycopg2 connection (``connect_timeout`` = ``timeout`` s), with
    the URL read as SQLAlchemy (so MLflow) reads it: a ``%40``-escaped password, ``?password=`` and
    other libpq query parameters included; ``http(s)://``: ``GET <uri>/health`` (the MLflow
    server's own health endpoint), ``user:password@`` sent as basic auth as MLflow sends it.

    Raises:
        StoreError: a scheme MLflow has no store for (``foo://``), a URL that does not parse (a port
            out of range), refused / timed out / unknown host, wrong password, missing database or
            role, psycopg2 absent, or a server that does not answer: the message names the URL
            (password masked) and what to do.
    """
    shown = safe_uri(uri)
    try:
        parts = urlsplit(uri)
        parts.port  # noqa: B018 - ValueError on a port out of range or not a number
    except ValueError as e:
        raise StoreError(f"MLflow store {shown}: the URL does not parse ({e}): fix MLFLOW_TRACKING_URI "
                         f"(a port is 1-65535), or unset it to log to the repository's sqlite store") from None
    scheme = parts.scheme.split("+", 1)[0]
    known = _store_schemes()
    if scheme not in known and not (len(scheme) == 1 and uri[1:3] in (":\\", ":/")):  # C:\... is a path
        raise StoreError(f"MLflow store {shown}: MLflow has no tracking store for {parts.scheme + '://'!r} "
                         f"(it knows {', '.join(sorted(s + '://' for s in known if s))}): fix MLFLOW_TRACKING_URI, "
                         f"e.g. http://host:5000 or postgresql+psycopg2://user@host:5432/mlflow, or unset it to "
                         f"log to the repository's sqlite store. Nothing was logged")
    if scheme in ("postgresql", "postgres"):
        _check_postgres(uri, timeout)
    elif scheme in ("http", "https"):
        _check_server(uri, timeout)


def _store_schemes() -> set[str]:
    """The URI schemes MLflow has a tracking store for (its registry, plugins included)."""
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry

        return set(_tracking_store_registry._registry)
    except Exception:  # noqa: BLE001 - a private API: fall back to the schemes of mlflow 3.17.2
        return {"", "file", "databricks", "databricks-uc", "uc", "http", "https", "postgresql", "mysql",
                "sqlite", "mssql"}


def _check_postgres(uri: str, timeout: float) -> None:
    shown = safe_uri(uri)
    try:
        import psycopg2
    except ImportError as e:
        raise StoreError(f"MLflow store {shown}: psycopg2 is not installed; `pip install -e '.[team]'` "
                         "(psycopg2-binary)") from e
    if urlsplit(uri).scheme in ("postgresql", "postgres"):
        import importlib.util

        from sqlalchemy.dialects import postgresql

        driver = postgresql.dialect.driver  # SQLAlchemy 2.1 defaults to psycopg (3), 2.0 to psycopg2
        if driver != "psycopg2" and importlib.util.find_spec(driver) is None:
            raise StoreError(f"MLflow store {shown}: SQLAlchemy reads postgresql:// with the {driver!r} driver, "
                             f"which is not installed; name the installed one: "
                             f"{shown.replace('postgresql://', 'postgresql+psycopg2://', 1)}")
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        u = make_url(uri)  # what MLflow's SqlAlchemyStore reads: the password unescaped, the query kept
    except (ArgumentError, ValueError) as e:
        raise StoreError(f"MLflow store {shown}: the URL does not parse ({safe_uri(str(e))}): the form is "
                         f"postgresql+psycopg2://user[:password]@host:port/db (a password's @ : / # ? written "
                         f"%40 %3A %2F %23 %3F)") from None
    host, port = u.host or "localhost", u.port or 5432
    user, db = u.username, u.database or None
    query = {k: (v[-1] if isinstance(v, tuple) else v) for k, v in u.query.items()}
    kwargs = {"host": host, "port": port, "user": user, "password": u.password, "dbname": db, **query}
    kwargs["connect_timeout"] = max(1, int(timeout))
    try:
        psycopg2.connect(**{k: v for k, v in kwargs.items() if v is not None}).close()
    except psycopg2.OperationalError as e:
        text = " ".join(str(e).split())
        low = text.lower()
        if "password authentication failed" in low or "no password supplied" in low:
            what = (f"wrong or missing password for role {user!r}: fix it in the URL (MLFLOW_TRACKING_URI, or "
                    f"EYAS_MLFLOW_BACKEND for scripts/mlflow_server.sh; a password's @ : / # ? written %40 %3A %2F "
                    f"%23 %3F) or in ~/.pgpass; a DBA resets it with `ALTER ROLE \"{user}\" PASSWORD '...'`")
        elif "does not exist" in low and "database" in low:
            what = f"create the database: `createdb -h {host} -p {port} -O {user} {db}`"
        elif "does not exist" in low and "role" in low:
            what = f"create the role: `createuser -h {host} -p {port} -P {user}` (as the postgres superuser)"
        else:
            what = (f"is PostgreSQL running and listening on {host}:{port} (`pg_isready -h {host} -p {port}`)? "
                    "Start it, or fix the host and port in the URL; pg_hba.conf must admit this host")
        raise StoreError(f"MLflow store {shown} refused the connection ({safe_uri(text)}): {what}. Nothing was "
                         "logged; outputs DVC already holds are untouched") from e
    except psycopg2.ProgrammingError as e:  # an unknown query parameter (`?sslmod=...`)
        raise StoreError(f"MLflow store {shown}: libpq refused the URL's parameters ({' '.join(str(e).split())}): "
                         "fix the query part of the URL") from e


def _check_server(uri: str, timeout: float) -> None:
    import requests  # MLflow's own HTTP client: user:password@ in the URL becomes basic auth, as MLflow sends it

    url = uri.rstrip("/") + "/health"
    try:
        r = requests.get(url, timeout=timeout)
    except (requests.RequestException, OSError, ValueError) as e:
        raise StoreError(
            f"MLflow server {safe_uri(uri)} does not answer ({safe_uri(str(e))}): start it (scripts/mlflow_server.sh; "
            f"docs/team.md) or fix MLFLOW_TRACKING_URI; unset it to log to the repository's sqlite "
            f"store. Nothing was logged; outputs DVC already holds are untouched") from e
    if r.status_code != 200:
        raise StoreError(f"MLflow server {safe_uri(uri)} answered {r.status_code} on /health: is it an MLflow server "
                         f"(scripts/mlflow_server.sh), and are the credentials right (MLFLOW_TRACKING_USERNAME / "
                         f"MLFLOW_TRACKING_PASSWORD)? Nothing was logged")


# --------------------------------------------------------------------------------------------
# System metrics


def wants_system_metrics(stage: str) -> bool:
    """Whether ``stage`` (a DVC stage name) runs with system metrics. MLflow's own
    ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING`` decides where it is set (``true``: every stage,
    ``false``: none; ``mlflow/environment_variables.py``); unset, the training stages and the evals."""
    from mlflow.environment_variables import MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING as enabled

    if enabled.defined:
        try:
            return bool(enabled.get())
        except ValueError:  # MLflow's own message names neither the fix nor the default
            raise StoreError(
                f"MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING={os.environ.get(enabled.name)!r}: MLflow reads true, false, "
                f"1 or 0; set one (true: system metrics on every stage, false: none) or unset it (on for the "
                f"training and eval stages). Nothing was logged") from None
    return stage.startswith(SYSTEM_METRICS_STAGES)


def start_system_metrics(run_id: str, uri: str):
    """Start MLflow's system-metrics sampler on run ``run_id``; returns it (``.finish()`` stops it
    and logs what it holds) or None, with a warning, where ``psutil`` is absent."""
    try:
        import psutil  # noqa: F401 - mlflow's CPU monitor needs it
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
    except ImportError as e:
        log.warning("no system metrics for run %s: %s (pip install psutil)", run_id, e)
        return None
    monitor = SystemMetricsMonitor(run_id, tracking_uri=uri)
    monitor.start()
    return monitor


# --------------------------------------------------------------------------------------------
# Every stage's metrics on the parent run


def metric_stage(stage: str) -> str:
    """A stage name as MLflow names allow it (``eval-accept-len@scratch`` -> ``eval-accept-len:scratch``)."""
    return stage.replace("@", ":")


def stage_metrics_files(root: str | os.PathLike = ".") -> dict[str, list[Path]]:
    """{stage: [its declared metrics files]} over the pipeline files under ``root``
    (eyas.pipeline.dvcfiles: the default DAG and the fine-tune comparison; those missing skipped),
    ``foreach`` lists expanded (``name@item``, ``${item}`` substituted)."""
    out: dict[str, list[Path]] = {}
    for stage, body in dvcfiles.stages(root).items():
        files = [Path(root, f) for m in body.get("metrics") or [] for f in (m if isinstance(m, dict) else {m: None})]
        if files:
            out[stage] = files
    return out


def _flat_numbers(obj: Any, prefix: str = "") -> dict[str, float]:
    """Numbers (bools as 1/0) of a JSON document by ``/``-joined key path; lists and strings skipped."""
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat_numbers(v, f"{prefix}{k}/"))
    elif isinstance(obj, bool) or (isinstance(obj, (int, float)) and math.isfinite(obj)):
        out[prefix[:-1]] = float(obj)
    return out


def run_keys(stage: str, doc: dict) -> dict[str, float]:
    """A stage's metrics file as the numbers its own MLflow run logs them, by the same names.

    Every number by its ``/``-joined key path, plus the names the stages give their headline
    numbers: a training stage's ``final/<k>`` (its ``val.<k>``), an eval's
    ``<bench>/ngram_accept_len`` (``ngram.<bench>.accept_len``), ``<bench>/worth_serving``
    (``<bench>.serving_verdict.worth_serving``) and ``<bench>/engine/<k>`` /
    ``<bench>/engine_quantized/<k>`` (``<bench>.engine.same_precision|quantized.<k>``), as
    eyas.tracking.compare reads them.
    """
    flat = _flat_numbers(doc)
    if isinstance(doc.get("val"), dict) and ("train-" in stage or stage == "stand-in-drafter"):
        flat.update({f"final/{k}": v for k, v in _flat_numbers(doc["val"]).items()})
    if stage.startswith("eval-accept-len"):
        for bench, v in _flat_numbers(doc.get("ngram", {})).items():
            b, _, rest = bench.partition("/")
            if rest == "accept_len":
                flat[f"{b}/ngram_accept_len"] = v
        for b, block in doc.items():
            if not isinstance(block, dict):
                continue
            verdict = (block.get("serving_verdict") or {}).get("worth_serving")
            if isinstance(verdict, bool):
                flat[f"{b}/worth_serving"] = float(verdict)
            engine = block.get("engine") or {}
            for src, dst in (("same_precision", "engine"), ("quantized", "engine_quantized")):
                for k, v in _flat_numbers(engine.get(src) or {}).items():
                    flat[f"{b}/{dst}/{k}"] = v
    return flat


def sync_parent(client, experiment_id: str, parent_run_id: str, root: str | os.PathLike = ".") -> dict[str, bool]:
    """Log every stage's metrics file onto the parent run (``<stage>/<key>``, :func:`run_keys`) and
    tag ``eyas.reused.<stage>`` (``true``: no child run of it under this parent). Returns
    {stage: reused} for the stages whose metrics file exists.

    A number or tag the parent already holds with the same value is not logged again (each stage
    run syncs: the parent's history gains a point only where a value changed). Raises what
    MlflowClient raises (the caller, :class:`eyas.tracking.runs.MlflowTracker`, logs it as a warning: the
    parent's summary never fails a stage).
    """
    from mlflow.entities import Metric, RunTag

    ran = {r.data.tags.get("dvc.stage") for r in client.search_runs(
        [experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}'", max_results=1000)}
    have = client.get_run(parent_run_id).data  # what an earlier stage's sync logged: not logged again
    metrics, tags, out = [], [], {}
    ts = int(time.time() * 1000)
    for stage, files in stage_metrics_files(root).items():
        docs = []
        for f in files:
            try:
                docs.append(json.loads(f.read_text()))
            except (OSError, ValueError):
                continue
        if not docs:
            continue
        reused = stage not in ran
        out[stage] = reused
        name = metric_stage(stage)
        if have.tags.get(REUSED_TAG + name) != ("true" if reused else "false"):
            tags.append(RunTag(REUSED_TAG + name, "true" if reused else "false"))
        for doc in docs:
            if isinstance(doc, dict):
                metrics += [Metric(f"{name}/{k}", v, ts, 0) for k, v in run_keys(stage, doc).items()
                            if have.metrics.get(f"{name}/{k}") != v]
    for i in range(0, len(metrics), 1000):
        client.log_batch(parent_run_id, metrics=metrics[i:i + 1000])
    if tags:
        client.log_batch(parent_run_id, tags=tags)
    return out


# --------------------------------------------------------------------------------------------
# Logged models and DVC datasets


def dvc_digest(path: str | os.PathLike, lock: str | os.PathLike = "dvc.lock") -> str | None:
    """The md5 ``dvc.lock`` records for output ``path`` (``<md5>.dir`` for a directory), or None.

    It is what DVC wrote after the producing stage ran, so it describes the output as a stage
    downstream reads it (DVC runs stages in order and writes each one's lock entry when it ends).
    """
    import yaml

    p = Path(lock)
    if not p.is_file():
        return None
    want = str(Path(path))
    for st in (yaml.safe_load(p.read_text()) or {}).get("stages", {}).values():
        for o in st.get("outs") or []:
            if str(Path(o.get("path", ""))) == want and o.get("md5"):
                return o["md5"]
    return None


def dvc_dataset(path: str | os.PathLike, lock: str | os.PathLike = "dvc.lock"):
    """An MLflow dataset for DVC output ``path``: name the path, digest DVC's md5 (32 hex digits,
    ``.dir`` dropped: MLflow keeps digests to 36 characters), source ``{"path", "md5"}``. None
    when ``dvc.lock`` has no entry for it."""
    from mlflow.data.dataset_source import DatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    md5 = dvc_digest(path, lock)
    if md5 is None:
        return None

    class DvcDatasetSource(DatasetSource):
        """A DVC-tracked output: its path in the repository and its md5 in dvc.lock."""

        def __init__(self, path: str, md5: str):
            self.path, self.md5 = path, md5

        @staticmethod
        def _get_source_type() -> str:
            return "dvc"

        def load(self, **kwargs):
            raise NotImplementedError(f"`dvc pull {self.path}` fetches it")

        @staticmethod
        def _can_resolve(raw_source: Any) -> bool:
            return False

        @classmethod
        def _resolve(cls, raw_source: Any):
            raise NotImplementedError

        def to_dict(self) -> dict:
            return {"path": self.path, "md5": self.md5}

        @classmethod
        def from_dict(cls, d: dict):
            return cls(d["path"], d["md5"])

    return MetaDataset(DvcDatasetSource(str(path), md5), name=str(path), digest=md5.removesuffix(".dir"))


def _weights_sha256(drafter_dir: Path) -> str | None:
    f = drafter_dir / "model.safetensors"
    if not f.is_file():
        return None
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _log_inputs(client, run_id: str, datasets: list[tuple[Any, str]]) -> None:
    from mlflow.entities import DatasetInput, InputTag

    inputs = [DatasetInput(ds._to_mlflow_entity(), [InputTag("mlflow.data.context", ctx)])
              for ds, ctx in datasets if ds is not None]
    if inputs:
        client.log_inputs(run_id, datasets=inputs)


def log_drafter_model(tracker, stage: str, drafter_dir: str | os.PathLike, val: dict[str, float],
                      step: int = 0, datasets: dict[str, str] | None = None,
                      lock: str | os.PathLike = "dvc.lock") -> str | None:
    """Record the drafter exported to ``drafter_dir`` as an MLflow logged model of ``tracker``'s run.

    Artifacts: ``config.json`` (and ``fingerprint.json`` where present), not the weights; params:
    the config's keys (flattened, as strings); tags ``dvc.stage``, ``eyas.drafter`` (the directory's
    name) and ``eyas.weights_sha256``; metrics ``final/<k>`` from ``val`` at ``step`` (the names and
    step the training run logs them under: its ``val/`` curves gain no point), linked to the model
    and to the first dataset; inputs of the run: ``datasets`` ({DVC output path: context},
    e.g. ``{"data/features": "training", "data/conversations": "source"}``) as :func:`dvc_dataset`
    gives them (those ``dvc.lock`` lacks are left out). Returns the model id, or None for a no-op
    tracker. The run gets tag ``eyas.model_id``.
    """
    client, run_id = getattr(tracker, "client", None), getattr(tracker, "run_id", None)
    if client is None or run_id is None:
        return None
    what = f"the MLflow logged model of {Path(drafter_dir).name}"
    if tracker.offline:  # the store is away: the tracker's spool says the model was not logged
        tracker.not_sent(what)
        return None
    try:
        return _log_drafter_model(tracker, stage, Path(drafter_dir), val, step, datasets, lock)
    except Exception as e:  # noqa: BLE001 - an outage of the store costs the record, not the stage
        tracker.outage(e, what)
        return None


def _log_drafter_model(tracker, stage: str, d: Path, val: dict[str, float], step: int,
                       datasets: dict[str, str] | None, lock: str | os.PathLike) -> str:
    from mlflow.entities import Metric

    from eyas.params.schema import flatten

    client, run_id = tracker.client, tracker.run_id

    config = json.loads((d / "config.json").read_text())
    params = {k: str(v)[:6000] for k, v in flatten(config).items()}
    tags = {"dvc.stage": dvcfiles.running_stage() or stage, "eyas.drafter": d.name,
            "dvc.exp_name": os.environ.get("DVC_EXP_NAME", "")}
    sha = _weights_sha256(d)
    if sha:
        tags[WEIGHTS_TAG] = sha
    model = client.create_logged_model(tracker.experiment_id, name=d.name, source_run_id=run_id, tags=tags,
                                       params=params, model_type="eagle3-drafter")
    mid = model.model_id
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for f in ("config.json", "fingerprint.json"):
                if (d / f).is_file():
                    shutil.copy(d / f, Path(tmp) / f)
            client.log_model_artifacts(mid, tmp)
        sets = [(dvc_dataset(p, lock), ctx) for p, ctx in (datasets or {}).items()]
        _log_inputs(client, run_id, sets)
        first = next((ds for ds, _ in sets if ds is not None), None)
        ts = int(time.time() * 1000)
        metrics = [Metric(f"final/{k}", float(v), ts, int(step), model_id=mid, run_id=run_id,
                          dataset_name=first.name if first else None, dataset_digest=first.digest if first else None)
                   for k, v in val.items() if isinstance(v, (int, float)) and math.isfinite(float(v))]
        if metrics:
            client.log_batch(run_id, metrics=metrics)
        client.set_tag(run_id, MODEL_TAG, mid)
        client.finalize_logged_model(mid, "READY")
    except BaseException:
        client.finalize_logged_model(mid, "FAILED")
        raise
    return mid


def find_drafter_model(client, experiment_id: str, drafter_dir: str | os.PathLike):
    """The newest READY logged model whose weights' sha256 is ``drafter_dir``'s, or None."""
    sha = _weights_sha256(Path(drafter_dir))
    if sha is None:
        return None
    found = client.search_logged_models(
        [experiment_id], filter_string=f"tags.`{WEIGHTS_TAG}` = '{sha}'",
        order_by=[{"field_name": "creation_time", "ascending": False}], max_results=10)
    return next((m for m in found if str(m.status).endswith("READY")), None)


def log_acceptance(tracker, drafter_dir: str | os.PathLike, doc: dict, stage: str,
                   dataset: str | None = "data/conversations", lock: str | os.PathLike = "dvc.lock") -> str | None:
    """Add an eval's metrics (``doc``: metrics/eval_<drafter>.json; names of :func:`run_keys`) to the
    drafter's logged model (:func:`find_drafter_model`), the model and the eval's dataset as inputs of
    ``tracker``'s run. Returns the model id; None for a no-op tracker or when no logged model has
    these weights (a drafter trained before logged models, or with tracking off: logged, not raised).
    """
    client, run_id = getattr(tracker, "client", None), getattr(tracker, "run_id", None)
    if client is None or run_id is None:
        return None
    what = f"the acceptance on the MLflow logged model of {Path(drafter_dir).name}"
    if tracker.offline:
        tracker.not_sent(what)
        return None
    try:
        return _log_acceptance(tracker, drafter_dir, doc, stage, dataset, lock)
    except Exception as e:  # noqa: BLE001 - an outage of the store costs the record, not the stage
        tracker.outage(e, what)
        return None


def _log_acceptance(tracker, drafter_dir, doc: dict, stage: str, dataset: str | None,
                    lock: str | os.PathLike) -> str | None:
    from mlflow.entities import LoggedModelInput, Metric

    client, run_id = tracker.client, tracker.run_id
    model = find_drafter_model(client, tracker.experiment_id, drafter_dir)
    if model is None:
        log.info("%s: no MLflow logged model has the weights of %s; acceptance logged on the run only",
                 stage, drafter_dir)
        return None
    mid = model.model_id
    ds = dvc_dataset(dataset, lock) if dataset else None
    client.log_inputs(run_id, datasets=None, models=[LoggedModelInput(mid)])
    _log_inputs(client, run_id, [(ds, "eval")])
    ts = int(time.time() * 1000)
    metrics = [Metric(k, v, ts, 0, model_id=mid, run_id=run_id, dataset_name=ds.name if ds else None,
                      dataset_digest=ds.digest if ds else None) for k, v in run_keys(stage, doc).items()]
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i:i + 1000])
    client.set_tag(run_id, MODEL_TAG, mid)
    return mid


def main(argv: list[str] | None = None) -> int:
    """``python3 -m eyas.tracking.team check-store URI``: exit 0 when the store answers, 2 (the
    message on stderr) when not."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python3 -m eyas.tracking.team")
    ap.add_argument("op", choices=("check-store",))
    ap.add_argument("uri")
    a = ap.parse_args(argv)
    try:
        check_store(a.uri)
    except StoreError as e:
        sys.stderr.write(f"eyas: error: {e}\n")
        return 2
    print(f"MLflow store {safe_uri(a.uri)}: answers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
