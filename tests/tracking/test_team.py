"""eyas/tracking/team.py: the MLflow store checked before use, system metrics, the parent run's
summary, each drafter an MLflow logged model.

Without a store: which metrics files each stage declares, the names a stage's numbers get on the
parent run and the logged model, passwords masked, and the store URLs and settings MLflow cannot use
refused before any work.

On a REAL PostgreSQL (skipped without it or without psycopg2: ``pip install -e '.[team]'``),
artifacts on a shared path, two DVC queue workers logging to it; and the bad inputs (a database that
refuses, a wrong password, a server that is down). PostgreSQL is started by the test
(tests/team_servers.py: initdb in a temporary directory, the ``postgres`` user when run as root), the
server by ``scripts/mlflow_server.sh`` with ``EYAS_MLFLOW_BACKEND`` / ``EYAS_MLFLOW_ARTIFACTS``, the
pipeline is tests/tracking/test_experiments.py's tiny one (eyas.tracking.runs in real stage
processes). ``dvc queue start -j 2`` runs two experiments (marked ``slow``: two celery workers
start); then every run is in PostgreSQL (counted there with SQL), FINISHED, every child under its
experiment's parent, each parent carrying the numbers of the stage DVC skipped (prepare-data),
marked reused, and the PNGs are files under the shared artifacts path. On the same server, the real
training epilogue (stages/training.finish_training) on a tiny drafter makes an MLflow logged model
(config, val metrics, datasets whose digest is DVC's; its artifacts on the shared path), the eval
adds the acceptance to it, the training run has system metrics, and the parent run carries every
stage's numbers, ``eyas compare`` showing a reused stage's.

Run: ``python3 -m pytest tests/tracking/test_team.py -q``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import team_servers

pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

from eyas.params.full import parse_params  # noqa: E402
from eyas.tracking import compare as eyas_compare  # noqa: E402
from eyas.tracking import runs as tracking  # noqa: E402
from eyas.tracking import team as team_tracking  # noqa: E402
from tests.tracking.test_experiments import DVC_YAML as QUEUE_DVC_YAML  # noqa: E402
from tests.tracking.test_experiments import EVALUATE, LR_STAGES, PARAMS_YAML, PREPARE, TRAIN, ran_stages  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EVAL_DOC = {"drafter": "scratch",
            "chat": {"accept_len": 1.9, "serving_verdict": {"worth_serving": True},
                     "engine": {"same_precision": {"accept_len": 1.85}}},
            "humaneval": {"accept_len": 1.75, "serving_verdict": {"worth_serving": False}},
            "ngram": {"chat": {"accept_len": 1.91}, "humaneval": {"accept_len": 1.54}}}


# --- without a store ---------------------------------------------------------------------------

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
    # 13 s here, so the server start itself is the `server` fixture below)
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


# --- on a real PostgreSQL ----------------------------------------------------------------------
QUEUED = {"pg-lr-1e-4": "1e-4", "pg-lr-2e-3": "2e-3"}
QUEUE_TIMEOUT_S = 300
FEATURES_MD5 = "0123456789abcdef0123456789abcdef.dir"
CONVERSATIONS_MD5 = "fedcba9876543210fedcba9876543210.dir"
DVC_YAML = """\
stages:
  prepare-data:
    cmd: python -m stages.prepare_data
    outs: [data/conversations]
    metrics: [{metrics/prepare_data.json: {cache: false}}]
  extract:
    cmd: python -m stages.extract
    deps: [data/conversations]
    outs: [data/features]
  train-scratch:
    cmd: python -m eyas.training.launch stages.train_scratch
    deps: [data/features]
    outs: [models/scratch]
    metrics: [{metrics/train_scratch.json: {cache: false}}]
  eval-accept-len:
    foreach: [scratch]
    do:
      cmd: python -m stages.eval_accept_len ${item}
      deps: ["models/${item}"]  # so train-scratch is upstream of the eval (a reused figure shows under it)
      metrics:
        - metrics/eval_${item}.json:
            cache: false
"""
DVC_LOCK = f"""\
schema: '2.0'
stages:
  prepare-data:
    cmd: python -m stages.prepare_data
    outs:
    - path: data/conversations
      hash: md5
      md5: {CONVERSATIONS_MD5}
  extract:
    cmd: python -m stages.extract
    outs:
    - path: data/features
      hash: md5
      md5: {FEATURES_MD5}
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DVC_", "MLFLOW_", "EYAS_"))}
    env.pop("RANK", None)
    env.update(DVC_NO_ANALYTICS="1", GIT_TERMINAL_PROMPT="0", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT),
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), **extra)
    return env


def sh(cwd: Path, *cmd: str, env: dict, check: bool = True, timeout: float = 180):
    r = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture(scope="module")
def pg():
    pytest.importorskip("psycopg2", reason="psycopg2 is absent (pip install -e '.[team]')")
    if team_servers.find_pg_bin() is None:
        pytest.skip("PostgreSQL is absent (Debian's postgresql; scripts/install.sh installs it)")
    with team_servers.postgres() as server:
        yield server


@pytest.fixture(scope="module")
def server(pg, tmp_path_factory):
    """scripts/mlflow_server.sh on the PostgreSQL, artifacts on a shared path."""
    shared = tmp_path_factory.mktemp("shared") / "mlartifacts"
    port = team_servers.free_port()
    log = open(shared.parent / "server.log", "w")
    env = _env(EYAS_MLFLOW_BACKEND=pg["url"], EYAS_MLFLOW_ARTIFACTS=str(shared), EYAS_MLFLOW_PORT=str(port),
               EYAS_MLFLOW_WORKERS="1")
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "mlflow_server.sh")], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        team_servers.wait_healthy(url, proc, 180, shared.parent / "server.log")
        yield {"url": url, "artifacts": shared, "pg": pg}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)  # the server's own process group (uvicorn workers, job runner): a
            proc.wait()             # test server, nothing to keep; PostgreSQL holds every run already
        log.close()


def test_bad_database_inputs_name_the_url(pg, tmp_path):
    good = pg["url"]
    wrong = good.replace(f":{pg['password']}@", ":not-the-password@")
    shown_wrong = f"postgresql+psycopg2://{pg['user']}:***@127.0.0.1:{pg['port']}/{pg['db']}"
    r = subprocess.run([sys.executable, "-m", "eyas.tracking.team", "check-store", wrong], env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and shown_wrong in r.stderr and "wrong or missing password" in r.stderr, r.stderr
    assert "not-the-password" not in r.stderr
    dead = team_servers.free_port()
    refused = f"postgresql+psycopg2://{pg['user']}:x@127.0.0.1:{dead}/{pg['db']}"
    with pytest.raises(team_tracking.StoreError, match=rf"127\.0\.0\.1:{dead}.*refused the connection.*pg_isready"):
        team_tracking.check_store(refused)
    missing_db = good.rsplit("/", 1)[0] + "/nope"
    with pytest.raises(team_tracking.StoreError, match=r"createdb .* nope"):
        team_tracking.check_store(missing_db)
    team_tracking.check_store(good)  # positive control
    plain = good.replace("postgresql+psycopg2://", "postgresql://")  # SQLAlchemy 2.1's default driver is psycopg 3
    import importlib.util

    from sqlalchemy.dialects import postgresql
    if postgresql.dialect.driver != "psycopg2" and importlib.util.find_spec(postgresql.dialect.driver) is None:
        with pytest.raises(team_tracking.StoreError, match=r"postgresql\+psycopg2://eyas:\*\*\*@"):
            team_tracking.check_store(plain)
    # the server script stops at the check, naming the URL, before anything starts
    r = subprocess.run(["bash", str(ROOT / "scripts" / "mlflow_server.sh")], capture_output=True, text=True,
                       env=_env(EYAS_MLFLOW_BACKEND=wrong, EYAS_MLFLOW_ARTIFACTS=str(tmp_path / "a"),
                                EYAS_MLFLOW_PORT=str(team_servers.free_port())), timeout=60)
    assert r.returncode == 1 and shown_wrong in r.stderr and "password" in r.stderr, r.stderr


def test_a_password_mlflow_reads_the_check_reads_too(pg):
    """A password with @ : / # written %40 %3A %2F %23 (the form MLflow documents), or libpq's
    ?password=: the check used to pass it to psycopg2 still escaped, or not at all, and refused a URL
    MLflow itself opens ("wrong or missing password"). Now both answer, as MLflow (the oracle) does;
    a wrong escaped password is still refused, masked."""
    from urllib.parse import quote

    import psycopg2

    pw = "p@ss:w#rd/1"
    conn = psycopg2.connect(host="127.0.0.1", port=pg["port"], user=pg["user"], password=pg["password"],
                            dbname=pg["db"])
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("DROP DATABASE IF EXISTS oddb")
        cur.execute("DROP ROLE IF EXISTS odd")
        cur.execute("CREATE ROLE odd LOGIN PASSWORD %s", (pw,))
        cur.execute("CREATE DATABASE oddb OWNER odd")
    conn.close()
    base = f"127.0.0.1:{pg['port']}/oddb"
    escaped = f"postgresql+psycopg2://odd:{quote(pw, safe='')}@{base}"
    query = f"postgresql+psycopg2://odd@{base}?password={quote(pw, safe='')}"
    for uri in (escaped, query):
        team_tracking.check_store(uri)
        MlflowClient(tracking_uri=uri).search_experiments()  # MLflow opens the same URL
    wrong = f"postgresql+psycopg2://odd:{quote('p@ss:w#rd/2', safe='')}@{base}"
    with pytest.raises(team_tracking.StoreError, match=r"odd:\*\*\*@.*wrong or missing password") as e:
        team_tracking.check_store(wrong)
    assert "rd%2F2" not in str(e.value) and "p%40ss" not in str(e.value)


def test_stage_refuses_a_server_that_is_down_before_compute(tmp_path, monkeypatch):
    dead = f"http://127.0.0.1:{team_servers.free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", dead)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.delenv("EYAS_TRACKING", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(team_tracking.StoreError, match=rf"{dead} does not answer.*mlflow_server\.sh"):
        tracking.start_stage_run("train-scratch", parse_params({}))


@pytest.mark.slow  # two celery workers start
def test_queue_two_workers_on_postgres(server, tmp_path):
    if subprocess.run(["git", "--version"], capture_output=True).returncode != 0:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    (repo / "steps").mkdir(parents=True)
    for name, text in (("prepare.py", PREPARE), ("train.py", TRAIN), ("evaluate.py", EVALUATE)):
        (repo / "steps" / name).write_text(text)
    (repo / "dvc.yaml").write_text(QUEUE_DVC_YAML.format(py=sys.executable))
    (repo / "params.yaml").write_text(PARAMS_YAML)
    (repo / ".gitignore").write_text("__pycache__/\n")
    env = _env(MLFLOW_TRACKING_URI=server["url"])
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "config", "user.name", "eyas test"],
                ["git", "config", "user.email", "eyas-test@example.invalid"],
                ["git", "config", "commit.gpgsign", "false"], ["dvc", "init", "-q"],
                ["dvc", "config", "core.analytics", "false"], ["dvc", "repro"], ["git", "add", "-A"],
                ["git", "commit", "-q", "-m", "baseline"]):
        sh(repo, *cmd, env=env if cmd[:2] != ["dvc", "repro"] else _env(EYAS_TRACKING="off"))  # baseline untracked
    for name, lr in QUEUED.items():
        sh(repo, "dvc", "exp", "run", "--queue", "-S", f"lr={lr}", "-n", name, env=env)
    t0 = time.monotonic()
    sh(repo, "dvc", "queue", "start", "-j", "2", env=env)
    last = t0
    try:
        while True:  # git refs are cheap to poll; `dvc queue status` (a DVC process) only every 30 s
            refs = sh(repo, "git", "for-each-ref", "--format=%(refname)", "refs/exps", env=env).stdout.split()
            if all(any(r.endswith("/" + n) for r in refs) for n in QUEUED):
                break
            status = ""
            if time.monotonic() - last > 30:
                status, last = sh(repo, "dvc", "queue", "status", env=env).stdout, time.monotonic()
            if "Failed" in status or time.monotonic() - t0 > QUEUE_TIMEOUT_S:
                logs = {n: sh(repo, "dvc", "queue", "logs", n, env=env, check=False).stdout for n in QUEUED}
                raise AssertionError(f"queue: {status}\n{logs}")
            time.sleep(2)
    except BaseException:
        sh(repo, "dvc", "queue", "stop", "--kill", env=env, check=False)
        raise
    seconds = time.monotonic() - t0
    logs = {n: sh(repo, "dvc", "queue", "logs", n, env=env, check=False).stdout for n in QUEUED}
    for n in QUEUED:
        assert ran_stages(logs[n]) == LR_STAGES, logs[n]

    client = MlflowClient(tracking_uri=server["url"])
    exp = client.get_experiment_by_name("eyas")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = {r.info.run_id: r for r in runs if "mlflow.parentRunId" not in r.data.tags}
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    # no run lost: two experiments of 2 stages each, one parent each (the baseline ran untracked)
    assert len(parents) == 2 and len(children) == 2 * len(LR_STAGES), [r.info.run_name for r in runs]
    assert all(r.info.status == "FINISHED" for r in runs)
    assert all(c.data.tags["mlflow.parentRunId"] in parents for c in children)  # every child linked
    by_name = {p.data.tags.get("dvc.exp_name") or "workspace": p for p in parents.values()}
    for name, lr in QUEUED.items():
        parent = by_name[name]
        kids = {c.data.tags["dvc.stage"]: c for c in children
                if c.data.tags["mlflow.parentRunId"] == parent.info.run_id}
        assert set(kids) == LR_STAGES
        assert float(parent.data.params["lr"]) == float(lr)
        # prepare-data did not run in this experiment: its numbers on the parent, marked reused
        assert parent.data.tags["eyas.reused.prepare-data"] == "true"
        assert parent.data.tags["eyas.reused.train-scratch"] == "false"
        assert parent.data.metrics["prepare-data/conversations"] == 10
        assert parent.data.metrics["train-scratch/final/acc_0"] == kids["train-scratch"].data.metrics["final/acc_0"]
    # the runs are PostgreSQL's rows, and the PNGs files on the shared path
    import psycopg2

    pg = server["pg"]
    conn = psycopg2.connect(host="127.0.0.1", port=pg["port"], user=pg["user"], password=pg["password"],
                            dbname=pg["db"])
    with conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM runs WHERE experiment_id = %s", (int(exp.experiment_id),))
        assert cur.fetchone()[0] == len(runs)
    conn.close()
    pngs = sorted(p.name for p in server["artifacts"].rglob("*.png"))
    assert pngs.count("train_scratch_curves.png") == 2 and pngs.count("eval_scratch_accept_len.png") == 2
    print(f"\nqueue -j 2 on PostgreSQL: {len(parents)} parents, {len(children)} children, {seconds:.0f} s")


@pytest.fixture
def team_store(tmp_path, monkeypatch, server):
    root = tmp_path / "repo"
    (root / "metrics").mkdir(parents=True)
    (root / "dvc.yaml").write_text(DVC_YAML)
    (root / "dvc.lock").write_text(DVC_LOCK)
    for var in ("DVC_STAGE", "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV", "RANK",
                "EYAS_TRACKING", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DVC_ROOT", str(root))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server["url"])
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-models")  # apart from the queue test's runs
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    monkeypatch.chdir(root)
    return root


def test_drafter_logged_model_datasets_system_metrics_and_reused_stages(team_store, server, monkeypatch):
    import torch

    from eyas.training.loop import train_drafter
    from stages import common, training
    from tests.tiny import tiny_training_setup

    drafter, train, val, lm_head = tiny_training_setup(team_store, common.VOCAB)
    # prepare-data's numbers are in metrics/ (checked out by DVC), but it runs no code here: reused
    (team_store / "metrics" / "prepare_data.json").write_text(json.dumps({"conversations": 600, "train": 460}))
    monkeypatch.setenv("DVC_EXP_NAME", "team-exp")
    p = parse_params({"train": {"max_steps": 2, "batch_tokens": 96, "eval_every": 1}})
    monkeypatch.setenv("DVC_STAGE", "train-scratch")
    with tracking.start_stage_run("train-scratch", p) as t:
        assert t.monitor is not None  # a training stage samples system metrics
        result = train_drafter(drafter, train_store=train, val_store=val, lm_head=lm_head,
                               tp=p.train, lr=1e-3, seed=0, tracker=t, device=torch.device("cpu"))
        training.finish_training("train-scratch", drafter, result, Path("models/scratch"), t)
        time.sleep(2.5)  # > 2 sampling periods
    client = MlflowClient(tracking_uri=tracking.tracking_uri())
    run = client.get_run(t.run_id)

    # system metrics on the training run
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(run.data.metrics)
    assert 0 <= run.data.metrics["system/cpu_utilization_percentage"] <= 100 * 64

    # the logged model: its config, val metrics and datasets
    mid = run.data.tags[team_tracking.MODEL_TAG]
    model = client.get_logged_model(mid)
    assert model.name == "scratch" and str(model.status).endswith("READY") and model.source_run_id == t.run_id
    config = json.loads((team_store / "models/scratch/config.json").read_text())
    assert model.params["hidden_size"] == str(config["hidden_size"])
    assert model.params["draft_vocab_size"] == "64"
    assert model.tags["eyas.weights_sha256"] == team_tracking._weights_sha256(team_store / "models/scratch")
    arts = {a.path for a in client.list_logged_model_artifacts(mid)}
    assert "config.json" in arts
    on_share = [p for p in server["artifacts"].rglob("config.json") if mid in str(p)]
    assert len(on_share) == 1 and json.loads(on_share[0].read_text()) == config  # through the server
    got = {m.key: m for m in model.metrics}
    assert got["final/acc_0"].value == pytest.approx(result.final_val["acc_0"])
    assert got["final/acc_0"].dataset_digest == FEATURES_MD5[:32]
    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    assert inputs["data/features"].dataset.digest == FEATURES_MD5[:32]
    assert json.loads(inputs["data/features"].dataset.source)["md5"] == FEATURES_MD5
    assert inputs["data/conversations"].dataset.digest == CONVERSATIONS_MD5[:32]
    assert inputs["data/features"].tags[0].value == "training"

    # the eval finds the model by its weights and adds the acceptance
    monkeypatch.setenv("DVC_STAGE", "eval-accept-len@scratch")
    with tracking.start_stage_run("eval-accept-len@scratch", p) as ev:
        (team_store / "metrics" / "eval_scratch.json").write_text(json.dumps(EVAL_DOC))
        assert team_tracking.log_acceptance(ev, "models/scratch", EVAL_DOC, "eval-accept-len@scratch") == mid
    got = {m.key: m.value for m in client.get_logged_model(mid).metrics}
    assert got["chat/accept_len"] == 1.9 and got["humaneval/ngram_accept_len"] == 1.54
    assert got["chat/worth_serving"] == 1.0 and got["chat/engine/accept_len"] == 1.85
    assert client.get_run(ev.run_id).inputs.model_inputs[0].model_id == mid
    # negative control: other weights find no model
    other = team_store / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"not the same weights")
    assert team_tracking.find_drafter_model(client, ev.experiment_id, other) is None

    # the parent: every stage's numbers, prepare-data's marked reused
    parent = client.get_run(t.parent_run_id)
    assert parent.data.tags["eyas.reused.prepare-data"] == "true"
    assert parent.data.tags["eyas.reused.train-scratch"] == "false"
    assert parent.data.tags["eyas.reused.eval-accept-len:scratch"] == "false"
    assert parent.data.metrics["prepare-data/conversations"] == 600
    # two stage runs synced; an unchanged number was logged once
    assert len(client.get_metric_history(t.parent_run_id, "prepare-data/conversations")) == 1
    assert parent.data.metrics["train-scratch/final/acc_0"] == pytest.approx(result.final_val["acc_0"])
    assert parent.data.metrics["eval-accept-len:scratch/chat/accept_len"] == 1.9

    # a second experiment in which only the eval ran: compare shows train-scratch's numbers (reused)
    monkeypatch.setenv("DVC_EXP_NAME", "team-exp-2")
    p2 = parse_params({"train": {"max_steps": 2, "batch_tokens": 96, "eval_every": 1}, "eval": {"chat_prompts": 3}})
    with tracking.start_stage_run("eval-accept-len@scratch", p2) as ev2:
        ev2.log_metrics({"chat/accept_len": 1.9})
    text = eyas_compare.compare(server["url"], "team-models")
    row = lambda label: next(line for line in text.splitlines() if line.startswith(f"| {label} |"))  # noqa: E731
    acc = f"{result.final_val['acc_0']:.4g}"
    assert row("train-scratch val acc_0") == f"| train-scratch val acc_0 | {acc} | {acc} |"
    assert row("stages reused (numbers from metrics/)") == \
        "| stages reused (numbers from metrics/) | prepare-data, train-scratch | prepare-data |"
    # negative control: without the metrics file no stage can vouch for it: "–"
    (team_store / "metrics" / "train_scratch.json").unlink()
    monkeypatch.setenv("DVC_EXP_NAME", "team-exp-3")
    p3 = parse_params({"train": {"max_steps": 2, "batch_tokens": 96, "eval_every": 1}, "eval": {"chat_prompts": 4}})
    with tracking.start_stage_run("eval-accept-len@scratch", p3):
        pass
    text = eyas_compare.compare(server["url"], "team-models")
    assert row("train-scratch val acc_0").startswith("| train-scratch val acc_0 | – |")
