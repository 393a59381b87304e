"""eyas/tracking/team.py without a store: which metrics files each stage declares, and the names a
stage's numbers get on the parent run and the logged model. The logged model, the system metrics and
the reused stages on the real MLflow server and PostgreSQL: tests/tracking/test_team_postgres.py.

Run: ``python3 -m pytest tests/tracking/test_team_tracking.py -q``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("mlflow")
from eyas.tracking import team as team_tracking  # noqa: E402

EVAL_DOC = {"drafter": "scratch",
            "chat": {"accept_len": 1.9, "serving_verdict": {"worth_serving": True},
                     "engine": {"same_precision": {"accept_len": 1.85}}},
            "humaneval": {"accept_len": 1.75, "serving_verdict": {"worth_serving": False}},
            "ngram": {"chat": {"accept_len": 1.91}, "humaneval": {"accept_len": 1.54}}}


def test_stage_metrics_files_and_run_keys():
    root = Path(__file__).resolve().parents[2]
    files = team_tracking.stage_metrics_files(root)  # every pipeline file: the fine-tune comparison's too
    assert files["eval-accept-len@finetune"] == [root / "metrics/eval_finetune.json"]  # wdir: the root
    assert files["stand-in-drafter"] == [root / "metrics/stand_in.json"]
    assert files["train-scratch"][0].name == "train_scratch.json"
    assert "target-gguf" not in files  # no metrics declared
    keys = team_tracking.run_keys("eval-accept-len@scratch", EVAL_DOC)
    assert keys["chat/worth_serving"] == 1.0 and keys["humaneval/worth_serving"] == 0.0
    assert keys["chat/ngram_accept_len"] == 1.91 and keys["ngram/chat/accept_len"] == 1.91
    assert team_tracking.run_keys("train-scratch", {"val": {"acc_0": 0.5}, "steps": 3}) == \
        {"val/acc_0": 0.5, "steps": 3.0, "final/acc_0": 0.5}
    assert team_tracking.safe_uri("postgresql://eyas:s3cret@db:5432/mlflow") == "postgresql://eyas:***@db:5432/mlflow"


def test_a_stage_is_named_without_its_dvc_file(monkeypatch):
    """DVC sets DVC_STAGE to ``finetune/dvc.yaml:remap`` for a stage of a subdirectory's dvc.yaml;
    the MLflow tags (and eyas compare) name it ``remap``, as the stage of the root file is named."""
    from eyas.pipeline.dvcfiles import running_stage

    for env, name in (("finetune/dvc.yaml:eval-accept-len@finetune", "eval-accept-len@finetune"),
                      ("published/dvc.yaml:stand-in-drafter", "stand-in-drafter"), ("train-scratch", "train-scratch")):
        monkeypatch.setenv("DVC_STAGE", env)
        assert running_stage() == name
    monkeypatch.delenv("DVC_STAGE")
    assert running_stage() is None


def test_system_metrics_on_training_and_eval_stages_only(monkeypatch):
    monkeypatch.delenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", raising=False)
    wants = team_tracking.wants_system_metrics
    assert wants("train-scratch") and wants("train-finetune") and wants("eval-accept-len@scratch")
    assert wants("stand-in-drafter")
    assert not wants("prepare-data") and not wants("extract") and not wants("export-gguf@scratch")
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")  # negative control: MLflow's switch off
    assert not wants("train-scratch")
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "true")  # on: every stage, as in MLflow
    assert wants("prepare-data")


@pytest.mark.parametrize("uri, shown", [
    ("postgresql+psycopg2://u:s3cret@h:5432/db", "postgresql+psycopg2://u:***@h:5432/db"),
    ("postgresql://u:pa#s3cret@h/db", "postgresql://u:***@h/db"),        # SQLAlchemy reads the password to the @
    ("postgresql://u:pa?s3cret@h/db", "postgresql://u:***@h/db"),
    ("ssh://u:pa/s3cret@h/srv", "ssh://u:***@h/srv"),
    ("postgresql+psycopg2://u@h/db?sslmode=require&password=s3cret", "postgresql+psycopg2://u@h/db?sslmode=require&password=***"),
    ("http://h:5000/?token=s3cret", "http://h:5000/?token=***"),
    ("could not reach http://u:s3cret@h:5000: refused", "could not reach http://u:***@h:5000: refused"),
    ("http://h:5000", "http://h:5000"), ("ssh://alice@h:22/srv", "ssh://alice@h:22/srv"),  # negative controls
    ("sqlite:////repo/mlflow.db", "sqlite:////repo/mlflow.db"), ("ssh://h:22/srv/x", "ssh://h:22/srv/x"),
    ("ssh://h:22/srv/a@b", "ssh://h:22/srv/a@b"),  # an @ in the path after host:port is no password
])
def test_safe_uri_masks_every_password_form(uri, shown):
    assert team_tracking.safe_uri(uri) == shown
    assert "s3cret" not in team_tracking.safe_uri(uri)


def _no_store_env(monkeypatch, tmp_path):
    for k in ("EYAS_TRACKING", "RANK", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "DVC_STAGE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))


@pytest.mark.parametrize("uri, message", [
    ("foo://bar", r"MLflow store foo://bar: MLflow has no tracking store for 'foo://' .*unset it"),
    ("http://127.0.0.1:99999", r"MLflow store http://127\.0\.0\.1:99999: the URL does not parse .*1-65535"),
    ("postgresql+psycopg2://u:s3cret@127.0.0.1:99999/db",
     r"postgresql\+psycopg2://u:\*\*\*@127\.0\.0\.1:99999/db: the URL does not parse"),
])
def test_a_store_url_mlflow_cannot_use_stops_the_stage_and_compare_before_anything(uri, message, monkeypatch, tmp_path):
    """Was: "answers" for foo://, a ValueError traceback for a port out of range, and `eyas compare`
    a traceback for both. Now StoreError / one `eyas compare: error:` line naming the URL."""
    from eyas.cli import main as cli_main
    from eyas.params.full import parse_params
    from eyas.tracking import runs as tracking

    _no_store_env(monkeypatch, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(team_tracking.StoreError, match=message) as e:
        tracking.start_stage_run("prepare-data", parse_params({}))
    assert "s3cret" not in str(e.value)
    assert cli_main(["compare"]) == 2
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_system_metrics_switch_that_mlflow_cannot_read_stops_before_any_run(monkeypatch, tmp_path):
    """MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=maybe: was MLflow's ValueError after the stage's run was
    created (a FAILED run left behind); now a StoreError naming the variable, and no run."""
    from mlflow import MlflowClient

    from eyas.params.full import parse_params
    from eyas.tracking import runs as tracking

    _no_store_env(monkeypatch, tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "maybe")
    with pytest.raises(team_tracking.StoreError, match=r"MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING='maybe': .*true, false"):
        tracking.start_stage_run("prepare-data", parse_params({}))
    assert not (tmp_path / "mlflow.db").exists()
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")  # negative control: a value MLflow reads
    with tracking.start_stage_run("prepare-data", parse_params({})) as t:
        pass
    assert MlflowClient(tracking.tracking_uri()).get_run(t.run_id).info.status == "FINISHED"


def test_a_relative_sqlite_store_is_anchored_at_the_repo_root(monkeypatch, tmp_path):
    """MLFLOW_TRACKING_URI=sqlite:///rel.db from a subdirectory (a queued experiment's temp dir):
    was a store in that directory, deleted with it; now <repo root>/rel.db, as the default is."""
    from eyas.tracking import runs as tracking

    _no_store_env(monkeypatch, tmp_path)
    sub = tmp_path / ".dvc" / "tmp" / "exps" / "tmpx"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///rel.db")
    assert tracking.tracking_uri() == f"sqlite:///{tmp_path}/rel.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{sub}/abs.db")  # negative control: absolute, verbatim
    assert tracking.tracking_uri() == f"sqlite:///{sub}/abs.db"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "")  # empty: the default experiment
    assert tracking._experiment_name() == "eyas"


def test_mlflow_server_script_refuses_bad_settings_before_starting(tmp_path):
    """scripts/mlflow_server.sh with a port that is not one, a backend that is not a database URL
    (an http:// server, foo://, with a password), an artifacts path that is a file: one line naming
    the variable, exit 1, nothing created (was: mlflow's own usage error, a check that passed an
    http:// backend and then "mlflow db upgrade ... failed" with no reason, mkdir's "File exists",
    and the artifacts directory made before the database was checked). Positive control: a sqlite
    backend and a new artifacts directory pass the same checks."""
    import os
    import subprocess

    from tests import team_servers

    script = Path(__file__).resolve().parents[2] / "scripts" / "mlflow_server.sh"
    afile = tmp_path / "afile"
    afile.write_text("x")
    art = tmp_path / "art"
    db = f"sqlite:///{tmp_path}/s.db"
    cases = [({"EYAS_MLFLOW_PORT": "abc"}, "EYAS_MLFLOW_PORT='abc' is not a port"),
             ({"EYAS_MLFLOW_BACKEND": "http://u:s3cret@127.0.0.1:1"},
              "EYAS_MLFLOW_BACKEND=http://u:***@127.0.0.1:1 is not a database URL"),
             ({"EYAS_MLFLOW_BACKEND": "foo://x"}, "EYAS_MLFLOW_BACKEND=foo://x is not a database URL"),
             ({"EYAS_MLFLOW_ARTIFACTS": str(afile)}, f"EYAS_MLFLOW_ARTIFACTS={afile} is a file, not a directory")]
    for settings, message in cases:
        env = {**os.environ, "EYAS_MLFLOW_BACKEND": db, "EYAS_MLFLOW_ARTIFACTS": str(art),
               "EYAS_MLFLOW_PORT": str(team_servers.free_port()), **settings}
        r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and f"mlflow_server.sh: error: {message}" in r.stderr, r.stderr
        assert "s3cret" not in r.stdout + r.stderr and not art.exists() and not (tmp_path / "s.db").exists()
    # positive control: the same settings, each valid, pass these checks (a fresh sqlite schema costs
    # 13 s here, so the server start itself is tests/tracking/test_team_postgres.py's `server` fixture)
    r = subprocess.run(["bash", "-c", f"sed '/^# schema first/,$d' {script} | bash -s"], capture_output=True, text=True,
                       env={**os.environ, "EYAS_MLFLOW_BACKEND": db, "EYAS_MLFLOW_ARTIFACTS": str(art),
                            "EYAS_ROOT": str(script.parents[1])}, timeout=60)
    assert r.returncode == 0 and art.is_dir(), r.stderr


def test_a_store_mlflow_cannot_open_is_one_compare_error_line(monkeypatch, tmp_path, capsys):
    """A file:// store (MLflow refuses its file backend), a file:// path that is a file (with the file
    backend allowed) and a sqlite file that is not a database: was an MlflowException /
    NotADirectoryError / SQLAlchemy traceback; now one `eyas compare: error:` line naming the URI and
    the error, exit 2, and the files as they were."""
    from mlflow import MlflowClient

    from eyas.cli import main as cli_main

    _no_store_env(monkeypatch, tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    afile, notdb, store = tmp_path / "afile", tmp_path / "bad.db", tmp_path / "store"
    afile.write_text("x")
    notdb.write_text("not a database\n")
    store.mkdir()
    for uri, allow, why in (
            (f"file://{store}", None, "MlflowException: The filesystem tracking backend"),
            (f"file://{afile}", "true", f"NotADirectoryError: [Errno 20] Not a directory: '{afile}/"),
            (f"sqlite:///{notdb}", None, "DatabaseError: (sqlite3.DatabaseError) file is not a database")):
        if allow:
            monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", allow)
        assert cli_main(["compare", "--tracking-uri", uri]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith(f"eyas compare: error: cannot query the MLflow tracking store {uri}: {why}"), err
        monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    assert afile.read_text() == "x" and notdb.read_text() == "not a database\n" and list(store.iterdir()) == []
    # negative control: a sqlite store MLflow opens, with the experiment and no pipeline runs
    good = tmp_path / "good.db"
    MlflowClient(f"sqlite:///{good}").create_experiment("eyas")
    assert cli_main(["compare", "--tracking-uri", f"sqlite:///{good}"]) == 1
    out, err = capsys.readouterr()
    assert "No pipeline runs found." in out and "eyas compare: error" not in err, err
