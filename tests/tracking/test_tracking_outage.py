"""A tracking outage costs telemetry, not the run (eyas/tracking/runs.py, MlflowTracker and Spool).

- The real train-scratch stage logs to a real MLflow server (scripts/mlflow_server.sh), which is
  killed mid-training: the stage goes on, warns once, exits 0 with its outputs, and keeps what it could
  not send in a spool; the server started again on the same store, ``python3 -m eyas.tracking.runs
  sync`` sends it, and the run ends FINISHED holding the whole curve, point for point the rows of
  ``plots/train_scratch/train.tsv``.
- A sqlite store moved away (or replaced by something that is not a database) mid-run: the same, and
  the spool is sent by the next stage that opens a run once the file is back.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from mlflow import MlflowClient

from eyas.params.full import default_params
from eyas.tracking import runs as tracking
from eyas.training import checkpoint as ckpt
from tests import team_servers
from tests.training.test_resume import CKPT, DRIVER, _copy, _env, workspace  # noqa: F401 - workspace is a fixture

ROOT = Path(__file__).resolve().parents[2]


def _server(root: Path, port: int) -> subprocess.Popen:
    """scripts/mlflow_server.sh on 127.0.0.1:``port`` with its store under ``root``, in a process
    group of its own (the server's workers die with it)."""
    env = {**_env(), "EYAS_ROOT": str(root), "EYAS_MLFLOW_PORT": str(port), "EYAS_MLFLOW_WORKERS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen(["bash", str(ROOT / "scripts/mlflow_server.sh")], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow_server.sh exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except requests.RequestException:
            pass
        time.sleep(0.3)
    _kill(proc)
    raise RuntimeError("the MLflow server did not answer within 120 s")


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the server's process group (the one this test started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tsv(path: Path) -> list[dict]:
    head, *rows = path.read_text().splitlines()
    cols = head.split("\t")
    return [{c: (float(v) if v else math.nan) for c, v in zip(cols, r.split("\t"))} for r in rows]


@pytest.mark.slow
def test_train_scratch_survives_the_mlflow_server_dying_and_its_spool_is_sent_later(workspace, tmp_path):  # noqa: F811
    ws = _copy(workspace, tmp_path / "ws")
    srv = tmp_path / "srv"
    srv.mkdir()
    port = team_servers.free_port()
    uri = f"http://127.0.0.1:{port}"
    server = _server(srv, port)
    env = _env(EYAS_TRACKING="on", MLFLOW_TRACKING_URI=uri, MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING="false")
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=ws, env={**env, "EYAS_TEST_STEP_SLEEP": "0.3"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        meta = ws / CKPT / ckpt.STATE / ckpt.META
        deadline = time.time() + 240
        while not meta.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        _kill(server)  # mid-training: the next flush (a checkpoint's, or the end's) finds no server
        killed = time.monotonic()
        err = proc.communicate(timeout=300)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill(server)
    after_kill = time.monotonic() - killed
    assert proc.returncode == 0, err[-3000:]
    assert (ws / "models/scratch/model.safetensors").is_file() and (ws / "metrics/train_scratch.json").is_file()
    assert err.count("goes on without it") == 1, err[-3000:]
    assert f"MLflow store {uri} failed" in err
    # MLflow's own retries (7 x 120 s by default) did not stall it: the rest of training plus a few seconds
    assert after_kill < 90, after_kill
    spools = list((ws / ".eyas/mlflow-spool").iterdir())
    assert len(spools) == 1 and (spools[0] / "ops.jsonl").is_file()

    server = _server(srv, port)  # the same store, back
    try:
        r = subprocess.run([sys.executable, "-m", "eyas.tracking.runs", "sync"], cwd=ws, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.strip().endswith("1 spool(s) sent, 0 kept"), r.stdout
        assert not spools[0].exists()
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name("eyas")
        runs = client.search_runs([exp.experiment_id], "tags.`dvc.stage` = 'train-scratch'")
        assert len(runs) == 1
        run = runs[0]
        assert run.info.status == "FINISHED" and "sent late" in run.data.tags["eyas.telemetry.late"]
        assert "logged model" in run.data.tags.get("eyas.telemetry.lost", "")  # not replayable: named
        train = _tsv(ws / "plots/train_scratch/train.tsv")
        hist = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss"))
        assert [s for s, _ in hist] == [int(row["step"]) for row in train]
        assert all(v == row["loss"] for (_, v), row in zip(hist, train))
        assert "final/acc_0" in run.data.metrics  # logged after the outage, sent late
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"train_scratch_metrics.json", "config.json", "train_scratch_curves.png"} <= artifacts, artifacts
        parent = client.get_run(run.info.run_id).data.tags["mlflow.parentRunId"]
        assert client.get_run(parent).info.status == "FINISHED"
    finally:
        _kill(server)


@pytest.fixture
def sqlite_repo(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "dvc.yaml").write_text("stages: {}\n")
    for var in ("DVC_ROOT", "DVC_STAGE", "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV", "MLFLOW_TRACKING_URI", "RANK",
                "EYAS_TRACKING", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    monkeypatch.chdir(root)
    return root.resolve()


@pytest.mark.parametrize("how", ["moved", "replaced"])
def test_a_sqlite_store_gone_mid_run_costs_telemetry_not_the_stage(sqlite_repo, caplog, how):
    db = sqlite_repo / "mlflow.db"
    p = default_params()
    with caplog.at_level(logging.WARNING, logger="eyas.tracking.runs"):
        t = tracking.start_stage_run("train-scratch", p)
        t.log_metrics({"train/loss": 3.0}, step=1)
        t.flush()
        away = db.rename(sqlite_repo / "elsewhere.db")
        if how == "replaced":  # a directory where the database was: nothing can open it
            db.mkdir()
        t.log_metrics({"train/loss": 2.0}, step=2)
        t.flush()
        t.log_metrics({"train/loss": 1.0}, step=3)
        t.log_dict({"a": 1}, "summary.json")
        t.set_tags({"note": "x"})
        t.close()  # no raise
    warnings = [r for r in caplog.records if "goes on without it" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    spool = sqlite_repo / ".eyas/mlflow-spool" / t.run_id
    assert spool.is_dir()
    if how == "replaced":
        db.rmdir()
    away.rename(db)  # the database is back
    # the next stage that opens a run on this store sends the spool first
    with tracking.start_stage_run("build-vocab", p):
        pass
    assert not spool.exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED"
    assert sorted((m.step, m.value) for m in client.get_metric_history(t.run_id, "train/loss")) == \
        [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert run.data.tags["note"] == "x" and "eyas.telemetry.late" in run.data.tags
    assert "summary.json" in {a.path for a in client.list_artifacts(t.run_id)}


@pytest.mark.slow
def test_a_spool_of_a_run_the_store_lacks_is_kept(sqlite_repo):
    """A spool whose run is not in the store (the sqlite file replaced by a fresh one) is kept, not
    dropped as refused calls; ``python3 -m eyas.tracking.runs sync`` says so and exits 1."""
    db = sqlite_repo / "mlflow.db"
    t = tracking.start_stage_run("train-scratch", default_params())
    db.rename(sqlite_repo / "elsewhere.db")
    t.log_metrics({"train/loss": 2.0}, step=2)
    t.close()
    spool = sqlite_repo / ".eyas/mlflow-spool" / t.run_id
    env = {**_env(), "MLFLOW_TRACKING_URI": f"sqlite:///{db}"}
    # in processes of their own: this one's MLflow keeps its connection to the moved file
    subprocess.run([sys.executable, "-c", f"from mlflow import MlflowClient; MlflowClient(tracking_uri="
                    f"'sqlite:///{db}').search_experiments()"], env=env, check=True, capture_output=True)
    r = subprocess.run([sys.executable, "-m", "eyas.tracking.runs", "sync"], cwd=sqlite_repo, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout.strip().endswith("0 spool(s) sent, 1 kept"), r.stdout + r.stderr
    assert f"has no run {t.run_id}" in r.stderr
    assert spool.is_dir()


def test_the_store_back_mid_run_gets_the_spool_and_logging_goes_on_live(sqlite_repo, monkeypatch):
    db = sqlite_repo / "mlflow.db"
    t = tracking.start_stage_run("train-scratch", default_params())
    t.log_metrics({"train/loss": 3.0}, step=1)
    t.flush()
    away = db.rename(sqlite_repo / "elsewhere.db")
    t.log_metrics({"train/loss": 2.0}, step=2)
    t.flush()
    assert t.offline
    away.rename(db)
    t.flush()  # within REPROBE_S of the outage: not tried yet
    assert t.offline
    monkeypatch.setattr(tracking, "REPROBE_S", 0)
    t.log_metrics({"train/loss": 1.0}, step=3)
    t.flush()  # tried: it answers, the spool goes, this flush is live
    assert not t.offline and not (sqlite_repo / ".eyas/mlflow-spool" / t.run_id).exists()
    t.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    assert sorted((m.step, m.value) for m in client.get_metric_history(t.run_id, "train/loss")) == \
        [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert client.get_run(t.run_id).info.status == "FINISHED"


def test_a_stage_started_during_an_outage_runs_offline_and_its_run_is_created_at_sync(sqlite_repo, monkeypatch,
                                                                                       caplog):
    """A store that does not answer at a stage's start stops the stage there (a wrong URL or password
    is not an outage), unless runs of this workspace already kept calls for it during an outage: then
    the stage runs, its run kept whole in a spool (its creation included), created with its parent
    when the spool is sent."""
    from eyas.tracking.team import StoreError

    down = f"http://127.0.0.1:{team_servers.free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", down)
    p = default_params()
    with pytest.raises(StoreError, match="does not answer"):  # no outage seen here: refused
        tracking.start_stage_run("build-vocab", p)
    earlier = sqlite_repo / ".eyas/mlflow-spool/earlier-run"  # what an earlier stage kept for this store
    earlier.mkdir(parents=True)
    (earlier / "meta.json").write_text(f'{{"store": "{down}", "run_id": "earlier-run", "host": "elsewhere"}}\n')
    with caplog.at_level(logging.WARNING, logger="eyas.tracking.runs"):
        t = tracking.start_stage_run("build-vocab", p)
        assert t.offline and t.run_id.startswith("offline-")
        t.log_metrics({"coverage": 0.5}, step=0)
        t.log_dict({"a": 1}, "vocab_report.json")
        t.close()
    assert len([r for r in caplog.records if "goes on without it" in r.getMessage()]) == 1
    spool = sqlite_repo / ".eyas/mlflow-spool" / t.run_id
    uri = f"sqlite:///{sqlite_repo / 'mlflow.db'}"  # the store it is sent to
    client = MlflowClient(tracking_uri=uri)
    meta = tracking.sync(client, spool, uri)
    assert meta and not spool.exists()
    run = client.get_run(meta["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "build-vocab"
    assert run.data.metrics["coverage"] == 0.5 and run.data.tags["dvc.stage"] == "build-vocab"
    assert run.data.params["vocab.draft_vocab_size"] == str(p.vocab.draft_vocab_size)
    assert "vocab_report.json" in {a.path for a in client.list_artifacts(meta["run_id"])}
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])
    assert parent.info.status == "FINISHED" and parent.data.tags["eyas.pipeline_key"] == tracking.pipeline_key(p)
