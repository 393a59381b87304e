"""eyas/tracking/runs.py with the real MLflow (sqlite stores in tmp dirs, a real server; no mocks).

The store anchored at the repository root, parent and child runs per pipeline execution, params,
curves, figures and tags, killed runs closed, parallel stages on a fresh store.

A tracking outage costs telemetry, not the run (MlflowTracker and Spool):

- The real train-scratch stage logs to a real MLflow server (scripts/mlflow_server.sh), which is
  killed mid-training: the stage goes on, warns once, exits 0 with its outputs, and keeps what it could
  not send in a spool; the server started again on the same store, ``python3 -m eyas.tracking.runs
  sync`` sends it, and the run ends FINISHED holding the whole curve, point for point the rows of
  ``plots/train_scratch/train.tsv``.
- A sqlite store moved away (or replaced by something that is not a database) mid-run: the same, and
  the spool is sent by the next stage that opens a run once the file is back.

Run: ``python -m pytest tests/tracking/test_runs.py -q``
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

from eyas import io as eyas_files  # noqa: E402
from eyas.params.full import default_params, flatten, params_hash  # noqa: E402
from eyas.tracking import runs as tracking  # noqa: E402
from eyas.training import checkpoint as ckpt  # noqa: E402
from tests import team_servers  # noqa: E402
from tests.training.test_resume import CKPT, DRIVER, _copy, _env, workspace  # noqa: E402, F401 - workspace is a fixture

ROOT = Path(__file__).resolve().parents[2]

DVC_VARS = ("DVC_ROOT", "DVC_STAGE", "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV")


@pytest.fixture
def bare_repo(tmp_path, monkeypatch):
    """A tmp repo root with a dvc.yaml and no store; cwd there; DVC/MLflow env cleared."""
    root = tmp_path / "repo"
    root.mkdir()
    (root / "dvc.yaml").write_text("stages: {}\n")
    for var in (*DVC_VARS, "MLFLOW_TRACKING_URI", "RANK", "EYAS_TRACKING", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(root)
    return root.resolve()


@pytest.fixture(scope="session")
def schema_db(tmp_path_factory) -> Path:
    """An empty MLflow sqlite schema, made once (creating one costs ~2 s)."""
    db = tmp_path_factory.mktemp("schema") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}")
    return db


@pytest.fixture
def repo(bare_repo, schema_db):
    """``bare_repo`` with a copy of the empty schema (the ``eyas`` experiment is not in it)."""
    shutil.copy(schema_db, bare_repo / "mlflow.db")
    return bare_repo


def _client(root: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")


def _exp_id(client: MlflowClient) -> str:
    return client.get_experiment_by_name("eyas").experiment_id


def test_repo_root_and_uri(bare_repo, monkeypatch):
    repo = bare_repo
    sub = repo / "a" / "b"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    assert tracking.repo_root() == repo
    assert tracking.tracking_uri() == f"sqlite:///{repo}/mlflow.db"
    assert tracking.tracking_uri().startswith("sqlite:////")
    monkeypatch.setenv("DVC_ROOT", str(repo / "a"))
    assert tracking.repo_root() == repo / "a"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking.tracking_uri() == "http://127.0.0.1:5000"


def test_queued_run_lands_in_root_store(bare_repo, monkeypatch):
    repo = bare_repo
    """A queued experiment runs in .dvc/tmp/exps/tmpXXX, deleted afterwards (docs/dvc-mlflow.md §1)."""
    tmp = repo / ".dvc" / "tmp" / "exps" / "tmpabc"
    tmp.mkdir(parents=True)
    (tmp / "dvc.yaml").write_text("stages: {}\n")  # the copy has its own dvc.yaml
    monkeypatch.chdir(tmp)
    monkeypatch.setenv("DVC_ROOT", str(repo))
    monkeypatch.setenv("DVC_EXP_NAME", "queued-exp")
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "a" * 40)
    monkeypatch.setenv("DVC_STAGE", "train-scratch")

    tracking.ensure_store(tracking.tracking_uri())
    with tracking.start_stage_run("train-scratch", default_params()) as t:
        t.log_metrics({"train/loss_0": 1.5}, step=0)
        t.log_dict({"a": 1}, "report")
        art = tmp / "note.txt"
        art.write_text("hello\n")
        t.log_artifact(art)
        run_id = t.run_id

    monkeypatch.chdir(repo)
    shutil.rmtree(repo / ".dvc")
    assert (repo / "mlflow.db").is_file()
    assert not (tmp / "mlflow.db").exists()

    client = _client(repo)
    exp = client.get_experiment_by_name("eyas")
    assert exp.artifact_location == str(repo / "mlartifacts")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "train-scratch"
    assert run.data.tags["dvc.stage"] == "train-scratch"
    assert run.data.tags["dvc.exp_name"] == "queued-exp"
    assert run.data.tags["dvc.baseline_rev"] == "a" * 40
    assert run.data.metrics["train/loss_0"] == 1.5
    names = {f.path for f in client.list_artifacts(run_id)}
    assert names == {"note.txt", "report.json"}
    local = client.download_artifacts(run_id, "report.json", str(repo))
    assert json.loads(Path(local).read_text()) == {"a": 1}
    assert str(repo / "mlartifacts") in run.info.artifact_uri

    parent = client.get_run(run.data.tags["mlflow.parentRunId"])
    assert parent.info.run_name == "queued-exp"
    assert parent.data.tags["eyas.pipeline_key"] == f"queued-exp:{'a' * 40}:{params_hash(default_params())}"
    assert parent.info.status == "FINISHED"


def test_stages_share_parent_and_exp_name_splits(repo, monkeypatch):
    monkeypatch.setenv("DVC_ROOT", str(repo))
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "b" * 40)
    monkeypatch.setenv("DVC_EXP_NAME", "exp-one")
    params = default_params()
    with tracking.start_stage_run("extract", params) as a:
        pass
    with tracking.start_stage_run("build-vocab", params) as b:
        pass
    assert a.parent_run_id == b.parent_run_id
    monkeypatch.setenv("DVC_EXP_NAME", "exp-two")
    with tracking.start_stage_run("extract", params) as c:
        pass
    assert c.parent_run_id != a.parent_run_id
    params.lr = 5e-5  # other params -> other pipeline execution
    monkeypatch.setenv("DVC_EXP_NAME", "exp-one")
    with tracking.start_stage_run("extract", params) as d:
        pass
    assert d.parent_run_id not in (a.parent_run_id, c.parent_run_id)

    client = _client(repo)
    children = client.search_runs(
        [_exp_id(client)], f"tags.mlflow.parentRunId = '{a.parent_run_id}'"
    )
    assert sorted(r.info.run_name for r in children) == ["build-vocab", "extract"]
    parents = client.search_runs([_exp_id(client)], "tags.`eyas.pipeline_key` LIKE '%'")
    assert len(parents) == 3
    p = client.get_run(a.parent_run_id)
    assert p.data.tags["dvc.exp_name"] == "exp-one"
    assert p.data.tags["eyas.params_hash"] == params_hash(default_params())


def test_workspace_parent_name_without_exp(repo, monkeypatch):
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "c" * 40)
    with tracking.start_stage_run("extract", default_params()) as t:
        pass
    p = _client(repo).get_run(t.parent_run_id)
    assert p.info.run_name == "workspace-ccccccc"
    assert p.data.tags["eyas.pipeline_key"].startswith(f"workspace:{'c' * 40}:")


def test_params_flat_and_secrets_masked(repo, monkeypatch):
    params = default_params()
    stage_params = {"hub": {"hf_token": "hf_abc"}, "API_KEY": "k", "db_password": "p", "n": 3}
    with tracking.start_stage_run("remap", params, stage_params) as t:
        pass
    logged = _client(repo).get_run(t.run_id).data.params
    expected = {k: json.dumps(v) if isinstance(v, list) else str(v) for k, v in flatten(params).items()}
    for k, v in expected.items():
        assert logged[k] == v, k
    assert logged["lr"] == "0.001" and logged["train_finetune.lr"] == "0.0003"
    assert logged["train.batch_tokens"] == "512"  # a count of tokens is not a secret
    assert logged["hub.hf_token"] == "***"
    assert logged["API_KEY"] == "***"
    assert logged["db_password"] == "***"
    assert logged["n"] == "3"
    parent = _client(repo).get_run(t.parent_run_id).data.params
    assert parent == expected  # the parent holds the pipeline params, not stage_params
    assert not any(isinstance(v, dict) for v in logged.values())
    assert tracking.is_secret_key("target.Access_Token")
    assert tracking.is_secret_key("client_secret")
    assert not tracking.is_secret_key("eval.max_new_tokens")
    assert not tracking.is_secret_key("target.tokenizer")


def test_killed_runs_are_closed_and_only_the_same_execution_linked(repo, monkeypatch):
    """A stage rerun after kill -9 ends the dead process's RUNNING runs KILLED, and links as its
    earlier attempt (``eyas.resumes`` / ``eyas.resumed_by``) only the one of the same pipeline
    execution (same parent): a killed run of other params (a `-S lr=...` rerun) or of another
    experiment (a queued one, in its own directory) is not the run it continues."""
    import socket
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = gone.stdout.strip()  # that process has exited
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "d" * 40)
    params, other = default_params(), default_params()
    other.lr = 5e-5
    parents = {}
    for name, exp_name, p in (("same", "", params), ("other params", "", other), ("other exp", "exp-q", params)):
        monkeypatch.setenv("DVC_EXP_NAME", exp_name)
        with tracking.start_stage_run("extract", p) as t:
            parents[name] = t.parent_run_id
    assert len(set(parents.values())) == 3
    client = _client(repo)
    exp = _exp_id(client)

    def orphan(parent):
        tags = {"dvc.stage": "train-scratch", "eyas.host": socket.gethostname(), "eyas.pid": dead_pid,
                "mlflow.parentRunId": parent}
        return client.create_run(exp, tags=tags, run_name="train-scratch").info.run_id

    ids = {name: orphan(parent) for name, parent in parents.items()}
    monkeypatch.setenv("DVC_EXP_NAME", "")
    with tracking.start_stage_run("train-scratch", params) as t:
        pass
    assert t.parent_run_id == parents["same"]
    assert client.get_run(t.run_id).data.tags["eyas.resumes"] == ids["same"]
    runs = {name: client.get_run(i) for name, i in ids.items()}
    assert {r.info.status for r in runs.values()} == {"KILLED"}
    assert runs["same"].data.tags["eyas.resumed_by"] == t.run_id
    assert "eyas.resumed_by" not in runs["other params"].data.tags
    assert "eyas.resumed_by" not in runs["other exp"].data.tags


def test_metric_curves(repo):
    with tracking.start_stage_run("train-scratch", default_params()) as t:
        for step in range(1500):  # > one batch of 1000: flushes mid-run and on close
            t.log_metrics({"train/loss_0": 1.0 / (step + 1), "train/acc_0": step / 1500}, step=step)
    client = _client(repo)
    hist = client.get_metric_history(t.run_id, "train/loss_0")
    assert sorted(m.step for m in hist) == list(range(1500))
    assert {m.step: m.value for m in hist}[9] == pytest.approx(0.1)
    assert len(client.get_metric_history(t.run_id, "train/acc_0")) == 1500


def test_failure_marks_run_failed(repo):
    with pytest.raises(RuntimeError, match="boom"):
        with tracking.start_stage_run("extract", default_params()) as t:
            t.log_metrics({"x": 1.0}, step=1)
            raise RuntimeError("boom")
    run = _client(repo).get_run(t.run_id)
    assert run.info.status == "FAILED"
    assert run.data.metrics["x"] == 1.0  # buffered metrics still flushed


def test_nonzero_rank_and_off_are_noop(bare_repo, monkeypatch):
    repo = bare_repo
    monkeypatch.setenv("RANK", "1")
    t = tracking.start_stage_run("extract", default_params())
    assert type(t) is tracking.Tracker and t.run_id is None
    with t:
        t.log_metrics({"a": 1.0}, step=0)
        t.log_params({"a": 1})
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("EYAS_TRACKING", "off")
    assert type(tracking.start_stage_run("extract", default_params())) is tracking.NoOpTracker
    assert not (repo / "mlflow.db").exists()


def test_log_figure_and_tags(repo):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    with tracking.start_stage_run("eval-accept-len", default_params()) as t:
        t.log_figure(fig, "hist")
        t.set_tags({"target": "smollm2", "hf_token": "x"})
    plt.close(fig)
    client = _client(repo)
    assert {f.path for f in client.list_artifacts(t.run_id)} == {"hist.png"}
    tags = client.get_run(t.run_id).data.tags
    assert tags["target"] == "smollm2" and tags["hf_token"] == "***"


def test_write_json_atomic(tmp_path):
    path = tmp_path / "metrics" / "sub" / "train.json"
    eyas_files.write_json(path, {"b": 1, "a": [1.5, 2], "c": {"z": 0, "y": None}})
    assert path.read_bytes() == (
        b'{\n  "a": [\n    1.5,\n    2\n  ],\n  "b": 1,\n'
        b'  "c": {\n    "y": null,\n    "z": 0\n  }\n}\n'
    )
    eyas_files.write_json(path, {"x": 2})
    assert json.loads(path.read_text()) == {"x": 2}
    assert os.listdir(path.parent) == ["train.json"]  # no tmp file left
    with pytest.raises(TypeError):
        eyas_files.write_json(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"x": 2}  # old content intact on failure
    assert os.listdir(path.parent) == ["train.json"]


def test_write_tsv(tmp_path):
    path = tmp_path / "plots" / "loss.tsv"
    eyas_files.write_tsv(path, [{"step": 0, "loss": 2.5}, {"step": 1, "loss": 1.0}])
    assert path.read_bytes() == b"step\tloss\n0\t2.5\n1\t1.0\n"
    assert os.listdir(path.parent) == ["loss.tsv"]


def _worker(root: str, name: str, q) -> None:
    try:
        os.chdir(root)
        os.environ["DVC_ROOT"] = root
        os.environ["DVC_EXP_NAME"] = name
        os.environ["DVC_EXP_BASELINE_REV"] = "d" * 40
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        from eyas.params.full import default_params
        from eyas.tracking import runs as tr

        tr.ensure_store(tr.tracking_uri())
        with tr.start_stage_run("train-scratch", default_params()) as t:
            for step in range(50):
                t.log_metrics({"train/loss_0": float(step)}, step=step)
        q.put((name, t.run_id, None))
    except BaseException as e:  # noqa: BLE001
        q.put((name, None, repr(e)))


def test_parallel_fresh_store(bare_repo):
    repo = bare_repo
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(repo), f"exp-{i}", q)) for i in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(err is None for _, _, err in results), results
    client = _client(repo)
    for _, run_id, _ in results:
        assert len(client.get_metric_history(run_id, "train/loss_0")) == 50
        assert client.get_run(run_id).info.status == "FINISHED"
    assert len(client.search_experiments(filter_string="name = 'eyas'")) == 1


def test_mlflow_experiment_name_is_read_as_mlflow_reads_it(repo, monkeypatch):
    """``MLFLOW_EXPERIMENT_NAME`` (MLflow's own variable) names the experiment the stages log to,
    and ``eyas compare`` reads; unset, it is ``eyas``."""
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-a")
    tracking.ensure_store(tracking.tracking_uri())
    with tracking.start_stage_run("train-scratch", default_params()) as t:
        run_id = t.run_id
    client = _client(repo)
    assert client.get_run(run_id).info.experiment_id == client.get_experiment_by_name("team-a").experiment_id
    assert client.get_experiment_by_name("eyas") is None  # negative control: the default was not used
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")
    assert tracking._experiment_name() == "eyas"


# --- a tracking outage ------------------------------------------------------------------------

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
