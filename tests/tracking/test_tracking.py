"""Tests for eyas.tracking.runs with the real MLflow (sqlite stores in tmp dirs, no mocks).

Run: ``python -m pytest tests/tracking/test_tracking.py -q``
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
from pathlib import Path

import pytest

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

from eyas import io as eyas_files  # noqa: E402
from eyas.params.full import default_params, flatten, params_hash  # noqa: E402
from eyas.tracking import runs as tracking  # noqa: E402

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
