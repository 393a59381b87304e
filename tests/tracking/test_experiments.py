"""DVC experiments, the queue and MLflow working together, with the REAL dvc and mlflow CLIs.

A tiny three-stage pipeline in a temporary git + DVC repo (no model, trivial work) whose stage
scripts use the real ``eyas.params`` (typed params), ``eyas.tracking.runs`` (MLflow store anchored at
``$DVC_ROOT``, parent/child runs) and ``eyas.tracking.plots`` (PNG artifacts)::

    prepare-data (params: data) -> train-scratch (params: lr) -> eval-accept-len@scratch

It shows (docs/dvc-mlflow.md §2 and §4):
  (a) ``dvc exp run -S lr=5e-5`` reruns exactly the stages downstream of ``lr``, and the stage
      reads ``lr`` as the float 5e-05 although PyYAML reads the written ``5e-05`` as a string;
  (b) two ``dvc exp run --queue -S lr=...`` + ``dvc queue start -j 2`` land in ONE MLflow store:
      a parent per experiment (tag ``dvc.exp_name``), a child per stage, metrics and PNG
      artifacts readable after the queue's temp dirs ``.dvc/tmp/exps/tmp*`` are gone; and
      ``eyas compare`` puts them side by side;
  (c) an unknown key in params.yaml fails before any compute, naming the key's path;
  (d) ``dvc exp show --json`` lists the metrics of the baseline and both experiments.
Plus unit tests of eyas.tracking.plots, eyas.tracking.compare and stages/training.finish_training's artifacts on an
in-process store.

Run: ``python -m pytest tests/tracking/test_experiments.py -q`` (about 2 minutes on 2 CPU cores; the
queue's celery workers take ~10 s each to start).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

from eyas.params.full import flatten, parse_params  # noqa: E402
from eyas.pipeline import dvcfiles  # noqa: E402
from eyas.tracking import compare as eyas_compare  # noqa: E402
from eyas.tracking import plots  # noqa: E402
from eyas.tracking import runs as tracking  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUEUE_TIMEOUT_S = 240

# --------------------------------------------------------------------------------------------
# The tiny pipeline

DVC_YAML = """\
stages:
  prepare-data:
    cmd: {py} steps/prepare.py
    deps: [steps/prepare.py]
    params: [data]
    outs: [out/data.txt]
    metrics: [{{metrics/prepare.json: {{cache: false}}}}]
  train-scratch:
    cmd: {py} steps/train.py
    deps: [steps/train.py, out/data.txt]
    params: [lr]
    outs: [out/model.json]
    metrics: [{{metrics/train.json: {{cache: false}}}}]
  eval-accept-len:
    foreach: [scratch]
    do:
      cmd: {py} steps/evaluate.py ${{item}}
      deps: [steps/evaluate.py, out/model.json]
      metrics:
        - metrics/eval_${{item}}.json: {{cache: false}}
"""

PARAMS_YAML = """\
lr: 1.0e-3
seed: 0
data:
  max_conversations: 10
  val: 2
  test: 2
  publish: 2
train:
  ttt_length: 2
"""

PREPARE = '''\
"""Stage prepare-data: reads params `data`."""
import json
from pathlib import Path
from eyas.params.full import load_params
from eyas.tracking.runs import start_stage_run

p = load_params()  # an unknown key or a wrong type fails HERE, before any compute
print("COMPUTE prepare-data", flush=True)
with start_stage_run("prepare-data", p) as t:
    Path("out").mkdir(exist_ok=True)
    Path("out/data.txt").write_text(f"{p.data.max_conversations}\\n")
    Path("metrics").mkdir(exist_ok=True)
    Path("metrics/prepare.json").write_text(json.dumps({"conversations": p.data.max_conversations}))
    t.log_metrics({"conversations": p.data.max_conversations})
'''

TRAIN = '''\
"""Stage train-scratch: reads params `lr` (top level); a fake curve that depends on lr."""
import json, math
from pathlib import Path
from eyas.params.full import load_params
from eyas.tracking.plots import ttt_curves_figure
from eyas.tracking.runs import start_stage_run

p = load_params()
print("COMPUTE train-scratch", flush=True)
with start_stage_run("train-scratch", p) as t:
    n = int(Path("out/data.txt").read_text())
    acc = 1 - math.exp(-p.lr * 5e3)
    curve = [{"step": s, "split": "train", "loss": 3 - 2 * acc * s / 4, "acc_0": acc * s / 4}
             for s in range(1, 5)]
    curve += [{"step": s, "split": "val", "loss_0": 3 - 2 * acc * s / 4, "acc_0": acc * s / 4}
              for s in (0, 4)]
    for r in curve:
        t.log_metrics({f"{r['split']}/{k}": v for k, v in r.items() if k not in ("step", "split")},
                      step=r["step"])
    t.log_metrics({"final/acc_0": acc}, step=4)
    Path("out/model.json").write_text(json.dumps({"lr": p.lr, "lr_type": type(p.lr).__name__,
                                                  "acc": acc, "n": n}) + "\\n")
    Path("metrics/train.json").write_text(json.dumps({"lr": p.lr, "final": {"acc_0": acc}}))
    t.log_artifact("metrics/train.json")
    t.log_figure(ttt_curves_figure(curve, title="train-scratch"), "train_scratch_curves.png")
'''

EVALUATE = '''\
"""Stage eval-accept-len@<drafter>: reads out/model.json; no params."""
import json, sys
from pathlib import Path
from eyas.params.full import load_params
from eyas.tracking.plots import accept_len_figure
from eyas.tracking.runs import start_stage_run

name = sys.argv[1]
p = load_params()
print("COMPUTE eval-accept-len@" + name, flush=True)
with start_stage_run(f"eval-accept-len@{name}", p) as t:
    acc = json.loads(Path("out/model.json").read_text())["acc"]
    rate = [acc ** (i + 1) for i in range(3)]
    hist = [100 - round(100 * rate[0])] + [round(100 * (rate[i] - (rate[i + 1] if i < 2 else 0)))
                                           for i in range(3)]
    m = {"drafter": name,
         "chat": {"accept_len": 1 + sum(rate), "accepted_histogram": hist,
                  "per_position_accept_rate": rate},
         "ngram": {"chat": {"accept_len": 1.25, "accepted_histogram": [80, 15, 5, 0],
                            "per_position_accept_rate": [0.2, 0.05, 0.0]}}}
    t.log_metrics({"chat/accept_len": m["chat"]["accept_len"], "chat/ngram_accept_len": 1.25})
    Path(f"metrics/eval_{name}.json").write_text(json.dumps(m))
    t.log_artifact(f"metrics/eval_{name}.json")
    t.log_figure(accept_len_figure(m, title=name), f"eval_{name}_accept_len.png")
'''

ALL_STAGES = {"prepare-data", "train-scratch", "eval-accept-len@scratch"}
LR_STAGES = {"train-scratch", "eval-accept-len@scratch"}


def _env(root: Path) -> dict:
    env = dict(os.environ)
    for var in ("MLFLOW_TRACKING_URI", "DVC_ROOT", "DVC_STAGE", "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV",
                "EYAS_TRACKING", "MLFLOW_EXPERIMENT_NAME", "RANK"):
        env.pop(var, None)
    env.update(DVC_NO_ANALYTICS="1", GIT_TERMINAL_PROMPT="0", PYTHONUNBUFFERED="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    return env


def sh(root: Path, *cmd: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), cwd=root, env=_env(root), capture_output=True, text=True,
                       timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
    return r


def ran_stages(output: str) -> set[str]:
    """Stage names from DVC's "Running stage 'x':" lines."""
    return set(re.findall(r"Running stage '([^']+)'", output))


def reset(root: Path) -> None:
    """Back to the committed baseline (params, lock, metrics, outs)."""
    sh(root, "git", "reset", "-q", "--hard", "HEAD")
    sh(root, "dvc", "checkout", "-q", "--force")


def store(root: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")


def runs_by(client: MlflowClient) -> tuple[dict, dict]:
    """(parents by dvc.exp_name or run name, children by parent run id -> {dvc.stage: run})."""
    exp = client.get_experiment_by_name("eyas")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = {(r.data.tags.get("dvc.exp_name") or r.data.tags["mlflow.runName"]): r
               for r in runs if "mlflow.parentRunId" not in r.data.tags}
    children: dict = {}
    for r in runs:
        if "mlflow.parentRunId" in r.data.tags:
            children.setdefault(r.data.tags["mlflow.parentRunId"], {})[r.data.tags["dvc.stage"]] = r
    return parents, children


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """The tiny pipeline, `dvc repro`-ed and committed as the baseline."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path_factory.mktemp("exprepo")
    (root / "steps").mkdir()
    (root / "steps" / "prepare.py").write_text(PREPARE)
    (root / "steps" / "train.py").write_text(TRAIN)
    (root / "steps" / "evaluate.py").write_text(EVALUATE)
    (root / "dvc.yaml").write_text(DVC_YAML.format(py=sys.executable))
    (root / "params.yaml").write_text(PARAMS_YAML)
    (root / ".gitignore").write_text("/mlflow.db\n/mlflow.db-*\n/mlflow.db.lock\n/mlartifacts/\n__pycache__/\n")
    sh(root, "git", "init", "-q", "-b", "main")
    sh(root, "git", "config", "user.name", "eyas test")
    sh(root, "git", "config", "user.email", "eyas-test@example.invalid")
    sh(root, "git", "config", "commit.gpgsign", "false")
    sh(root, "dvc", "init", "-q")
    sh(root, "dvc", "config", "core.analytics", "false")
    sh(root, "dvc", "config", "cache.type", "hardlink,symlink")
    # the MLflow schema made here, in-process (a fresh store's migrations take ~10 s in a
    # subprocess; test_runs.py covers creating one from parallel stages)
    MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}").search_experiments()
    r = sh(root, "dvc", "repro")
    assert ran_stages(r.stdout) == ALL_STAGES, r.stdout
    sh(root, "git", "add", "-A")
    sh(root, "git", "commit", "-q", "-m", "baseline")
    return root


# --------------------------------------------------------------------------------------------
# (a) -S lr=5e-5 reruns exactly what lr feeds; the stage reads a float


def test_exp_run_set_param_reruns_only_lr_stages(repo):
    reset(repo)
    r = sh(repo, "dvc", "exp", "run", "-S", "lr=5e-5", "-n", "lr-5e-5")
    out = r.stdout + r.stderr
    assert ran_stages(out) == LR_STAGES, out
    assert "COMPUTE prepare-data" not in out
    # DVC wrote `lr: 5e-05`, which PyYAML reads as a STRING (docs/dvc-mlflow.md §4) ...
    assert yaml.safe_load((repo / "params.yaml").read_text())["lr"] == "5e-05"
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert lock["stages"]["train-scratch"]["params"]["params.yaml"]["lr"] == "5e-05"
    # ... and eyas.params hands the stage a float
    model = json.loads((repo / "out" / "model.json").read_text())
    assert model["lr"] == 5e-05 and model["lr_type"] == "float"
    assert json.loads((repo / "metrics" / "train.json").read_text())["lr"] == 5e-05
    # the MLflow parent of this experiment holds lr as a param, its children the stage metrics
    parents, children = runs_by(store(repo))
    parent = parents["lr-5e-5"]
    assert parent.data.params["lr"] == "5e-05"
    assert set(children[parent.info.run_id]) == LR_STAGES  # prepare-data did not run: no child


# --------------------------------------------------------------------------------------------
# (c) an unknown key fails before any compute


def test_unknown_param_key_fails_before_compute(repo):
    reset(repo)
    client = store(repo)
    n_runs = len(client.search_runs([client.get_experiment_by_name("eyas").experiment_id]))
    params = yaml.safe_load(PARAMS_YAML)
    params["data"]["max_conversationz"] = 5  # the typo
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    r = sh(repo, "dvc", "repro", check=False)
    out = r.stdout + r.stderr
    try:
        assert r.returncode != 0
        assert "unknown key 'data.max_conversationz'" in r.stderr, out
        assert "COMPUTE" not in out  # no stage got past load_params
        assert ran_stages(out) == {"prepare-data"}  # the first stage failed; nothing after ran
        assert not (repo / "out" / "data.txt").exists()
        assert not (repo / "metrics" / "prepare.json").exists()
        assert len(client.search_runs([client.get_experiment_by_name("eyas").experiment_id])) == n_runs
    finally:
        reset(repo)


# --------------------------------------------------------------------------------------------
# (b) the queue, two workers, one MLflow store


QUEUED = {"q-lr-1e-4": "1e-4", "q-lr-2e-3": "2e-3"}


@pytest.fixture(scope="module")
def queued(repo) -> dict:
    """Queue two experiments, run them with `dvc queue start -j 2`, wait (bounded).

    Waiting polls the experiments' git refs (cheap) and asks `dvc queue status` (a DVC process,
    seconds of CPU on 2 cores, taken from the workers) only every 15 s and at the end.
    """
    reset(repo)
    for name, lr in QUEUED.items():
        sh(repo, "dvc", "exp", "run", "--queue", "-S", f"lr={lr}", "-n", name)
    t0 = time.monotonic()
    sh(repo, "dvc", "queue", "start", "-j", "2")

    def task_status() -> tuple[str, dict]:
        out = sh(repo, "dvc", "queue", "status").stdout
        return out, {line.split()[1]: line.split()[-1] for line in out.splitlines()
                     if len(line.split()) >= 3 and line.split()[1] in QUEUED}

    status, last_status = "", time.monotonic()
    try:
        while True:
            if time.monotonic() - t0 > QUEUE_TIMEOUT_S:
                raise AssertionError(f"queue not done after {QUEUE_TIMEOUT_S}s:\n{task_status()[0]}")
            time.sleep(1)
            refs = sh(repo, "git", "for-each-ref", "--format=%(refname)", "refs/exps").stdout.split()
            done = all(any(r.endswith("/" + n) for r in refs) for n in QUEUED)
            if done or time.monotonic() - last_status > 15:
                status, rows = task_status()
                last_status = time.monotonic()
                if len(rows) == len(QUEUED) and all(v in ("Success", "Failed") for v in rows.values()):
                    break
    except BaseException:
        sh(repo, "dvc", "queue", "stop", "--kill", check=False)
        raise
    seconds = time.monotonic() - t0
    logs = {n: sh(repo, "dvc", "queue", "logs", n, check=False).stdout for n in QUEUED}
    assert all(rows[n] == "Success" for n in QUEUED), f"{status}\n{logs}"
    return {"seconds": seconds, "status": status, "logs": logs}


def test_queue_parallel_runs_land_in_one_mlflow_store(repo, queued):
    # the workers ran in .dvc/tmp/exps/tmpXXXX copies, now deleted
    exps_tmp = repo / ".dvc" / "tmp" / "exps"
    assert not [p for p in exps_tmp.glob("**/tmp*") if p.is_dir() and (p / "dvc.yaml").exists()]
    for name in QUEUED:  # each queued run reran exactly the lr stages
        assert ran_stages(queued["logs"][name]) == LR_STAGES, queued["logs"][name]

    client = store(repo)
    exp = client.get_experiment_by_name("eyas")
    assert exp.artifact_location == str(repo / "mlartifacts")  # absolute, not a temp dir
    parents, children = runs_by(client)
    for name, lr in QUEUED.items():
        parent = parents[name]
        assert parent.data.tags["dvc.exp_name"] == name
        assert parent.data.tags["dvc.baseline_rev"] == sh(repo, "git", "rev-parse", "HEAD").stdout.strip()
        assert float(parent.data.params["lr"]) == float(lr)
        assert parent.info.status == "FINISHED"
        kids = children[parent.info.run_id]
        assert set(kids) == LR_STAGES
        train, ev = kids["train-scratch"], kids["eval-accept-len@scratch"]
        assert train.info.status == ev.info.status == "FINISHED"
        assert train.data.tags["dvc.exp_name"] == name
        assert float(train.data.params["lr"]) == float(lr)
        acc = train.data.metrics["final/acc_0"]
        assert acc == pytest.approx(1 - math.exp(-float(lr) * 5e3))
        steps = [m.step for m in client.get_metric_history(train.info.run_id, "val/acc_0")]
        assert steps == [0, 4]
        assert ev.data.metrics["chat/accept_len"] > 1.0
        # artifacts: readable after the temp dirs are gone, under <repo>/mlartifacts
        names = {a.path for a in client.list_artifacts(train.info.run_id)}
        assert {"train_scratch_curves.png", "train.json"} <= names
        assert train.info.artifact_uri.startswith(str(repo / "mlartifacts"))
        png = Path(client.download_artifacts(train.info.run_id, "train_scratch_curves.png",
                                             str(repo.parent / f"dl-{name}")))
        assert png.read_bytes()[:8] == PNG_MAGIC
        png = Path(client.download_artifacts(ev.info.run_id, "eval_scratch_accept_len.png",
                                             str(repo.parent / f"dl-{name}")))
        assert png.read_bytes()[:8] == PNG_MAGIC
    # different lr, different result
    accs = {n: children[parents[n].info.run_id]["train-scratch"].data.metrics["final/acc_0"] for n in QUEUED}
    assert len(set(accs.values())) == 2

    # `eyas compare` reads the same store (found from cwd) and puts both side by side
    r = sh(repo, sys.executable, "-m", "eyas.cli", "compare", "--out", "compare.md")
    table = (repo / "compare.md").read_text()
    assert table == r.stdout
    header = next(line for line in table.splitlines() if line.startswith("| |"))
    assert "**q-lr-1e-4**" in header and "**q-lr-2e-3**" in header
    lr_row = next(line for line in table.splitlines() if line.startswith("| `lr` |"))
    assert "0.0001" in lr_row and "0.002" in lr_row
    acc_row = next(line for line in table.splitlines() if line.startswith("| train-scratch val acc_0 |"))
    for a in accs.values():
        assert f"{a:.4g}" in acc_row
    (repo / "compare.md").unlink()


# --------------------------------------------------------------------------------------------
# (d) dvc exp show --json


def _exp_rows(data) -> dict:
    """{experiment name or rev: metrics dict by file} from `dvc exp show --json` (DVC 3 layout)."""
    out = {}

    def visit(node):
        if isinstance(node, list):
            for n in node:
                visit(n)
        elif isinstance(node, dict):
            if "rev" in node and isinstance(node.get("data"), dict):
                out[node.get("name") or node["rev"]] = node["data"].get("metrics") or {}
            for v in node.values():
                if isinstance(v, (list, dict)):
                    visit(v)

    visit(data)
    return out


def test_exp_show_json_lists_metrics(repo, queued):
    r = sh(repo, "dvc", "exp", "show", "--json")
    rows = _exp_rows(json.loads(r.stdout))
    for name in ("workspace", *QUEUED):
        assert name in rows, sorted(rows)
        metrics = rows[name]
        train = metrics["metrics/train.json"]["data"]
        assert set(train) == {"lr", "final"} and "acc_0" in train["final"]
        assert metrics["metrics/eval_scratch.json"]["data"]["chat"]["accept_len"] > 1.0
        assert metrics["metrics/prepare.json"]["data"] == {"conversations": 10}
    for name, lr in QUEUED.items():
        assert rows[name]["metrics/train.json"]["data"]["lr"] == float(lr)


# --------------------------------------------------------------------------------------------
# Unit tests: eyas.tracking.plots and eyas.tracking.compare (in-process, no DVC)


def test_plots_render_pngs(tmp_path):
    curve = [{"step": 0, "split": "val", "loss_0": 3.0, "loss_1": 3.2, "acc_0": 0.0, "acc_1": float("nan")},
             {"step": 1, "split": "train", "loss": 2.5, "acc_0": 0.2, "acc_1": 0.1},
             {"step": 2, "split": "train", "loss": 2.0, "acc_0": 0.3, "acc_1": 0.2},
             {"step": 2, "split": "val", "loss_0": 2.1, "loss_1": 2.4, "acc_0": 0.35, "acc_1": 0.15}]
    fig = plots.ttt_curves_figure(curve, title="t")
    ax_loss, ax_acc = fig.axes
    assert [line.get_label() for line in ax_loss.get_lines()] == ["train loss (weighted)", "val loss_0", "val loss_1"]
    assert "val acc_1" in [line.get_label() for line in ax_acc.get_lines()]
    acc1 = next(line for line in ax_acc.get_lines() if line.get_label() == "val acc_1")
    assert list(acc1.get_xdata()) == [2]  # the NaN at step 0 is skipped
    m = {"drafter": "x", "chat": {"accepted_histogram": [2, 1, 1], "per_position_accept_rate": [0.5, 0.25],
                                  "accept_len": 1.75},
         "ngram": {"chat": {"accepted_histogram": [3, 1, 0], "per_position_accept_rate": [0.25, 0.0],
                            "accept_len": 1.25}}}
    fig2 = plots.accept_len_figure(m)
    hist_ax = fig2.axes[0]
    heights = [p.get_height() for p in hist_ax.patches]
    assert heights == pytest.approx([0.5, 0.25, 0.25, 0.75, 0.25, 0.0])  # fractions, drafter then n-gram
    assert "accept_len 1.75" in hist_ax.get_legend().get_texts()[0].get_text()
    for i, f in enumerate((fig, fig2, plots.ttt_curves_figure([]), plots.accept_len_figure({}))):
        path = plots.save_png(f, tmp_path / f"{i}.png")
        assert path.read_bytes()[:8] == PNG_MAGIC


@pytest.fixture
def unit_store(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "dvc.yaml").write_text("stages: {}\n")
    for var in ("MLFLOW_TRACKING_URI", "DVC_STAGE", "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV", "RANK",
                "EYAS_TRACKING", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DVC_ROOT", str(root))
    monkeypatch.chdir(root)
    return root


def _pipeline(monkeypatch, name: str, lr: float, stage_metrics: dict) -> None:
    """One pipeline execution: per DVC stage address (``$DVC_STAGE``: a stage of a subdirectory's
    dvc.yaml carries its file, ``finetune/dvc.yaml:remap``), a stage run logging its metrics."""
    monkeypatch.setenv("DVC_EXP_NAME", name)
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "abcdef0123456789")
    p = parse_params({"lr": lr, "train": {"epochs": 3}})
    for address, metrics in stage_metrics.items():
        monkeypatch.setenv("DVC_STAGE", address)
        with tracking.start_stage_run(address.rpartition(":")[2], p) as t:
            t.log_metrics(metrics)


def test_compare_renders_latest_pipelines_side_by_side(unit_store, monkeypatch):
    # both pipelines: the default DAG and the fine-tune comparison (finetune/dvc.yaml)
    _pipeline(monkeypatch, "exp-a", 1e-3, {
        "train-scratch": {"final/acc_0": 0.41}, "finetune/dvc.yaml:train-finetune": {"final/acc_0": 0.52},
        "eval-accept-len@scratch": {"chat/accept_len": 1.9, "humaneval/accept_len": 2.2,
                                    "chat/ngram_accept_len": 1.3, "humaneval/ngram_accept_len": 1.6},
        "finetune/dvc.yaml:eval-accept-len@finetune": {"chat/accept_len": 2.05, "humaneval/accept_len": 2.4,
                                                       "chat/ngram_accept_len": 1.3,
                                                       "humaneval/ngram_accept_len": 1.6}})
    time.sleep(0.01)
    # `dvc exp run -S lr=5e-5`: only the stages lr feeds ran (the default DAG's; no fine-tune)
    _pipeline(monkeypatch, "exp-b", 5e-5, {
        "train-scratch": {"final/acc_0": 0.47},
        "eval-accept-len@scratch": {"chat/accept_len": 1.95, "humaneval/accept_len": 2.3,
                                    "chat/ngram_accept_len": 1.3, "humaneval/ngram_accept_len": 1.6}})
    text = eyas_compare.compare()
    lines = text.splitlines()
    assert "| | **exp-b** | **exp-a** |" in lines  # latest first

    def row(label):
        return next(line for line in lines if line.startswith(f"| {label} |"))

    assert row("`lr`") == "| `lr` | 5e-05 | 0.001 |"
    assert not [line for line in lines if line.startswith("| `train.epochs`")]  # equal: folded
    n = len(flatten(parse_params({}))) - 1  # every param but lr
    assert f"{n} other params are the same in every column (`--all-params` lists them)." in lines
    full = eyas_compare.compare(all_params=True).splitlines()
    assert "| `train.epochs` | 3 | 3 |" in full and "| `train_finetune.lr` | 0.0003 | 0.0003 |" in full
    assert row("train-scratch val acc_0") == "| train-scratch val acc_0 | 0.47 | 0.41 |"
    assert row("train-finetune val acc_0") == "| train-finetune val acc_0 | – | 0.52 |"
    assert row("scratch humaneval accept_len") == "| scratch humaneval accept_len | 2.3 | 2.2 |"
    assert row("finetune humaneval accept_len") == "| finetune humaneval accept_len | – | 2.4 |"
    assert row("n-gram floor chat accept_len") == "| n-gram floor chat accept_len | 1.3 | 1.3 |"
    assert row("stages logged") == "| stages logged | 2 | 4 |"
    assert "**exp-a**" not in eyas_compare.compare(limit=1)

    # the CLI prints the same table and writes it with --out
    from eyas.cli import main
    assert main(["compare", "--out", str(unit_store / "cmp.md")]) == 0
    assert (unit_store / "cmp.md").read_text() == text


def test_compare_shows_every_param_that_differs(unit_store, monkeypatch):
    """Experiments that differ in extract.aux_layers, data.* or eval.* (not only lr and train.*) get
    those rows; with one column nothing differs and the rest is counted."""
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "abcdef0123456789")
    monkeypatch.setenv("DVC_STAGE", "train-scratch")
    for name, raw in (("base", {}), ("aux", {"extract": {"aux_layers": [2, 5, 9]}, "data": {"val": 3},
                                          "eval": {"chat_prompts": 4}})):
        monkeypatch.setenv("DVC_EXP_NAME", name)
        with tracking.start_stage_run("train-scratch", parse_params(raw)) as t:
            t.log_metrics({"final/acc_0": 0.5})
    lines = eyas_compare.compare().splitlines()
    shown = [line.split(" |")[0][2:] for line in lines if line.startswith("| `")]
    assert shown == ["`lr`", "`data.val`", "`eval.chat_prompts`", "`extract.aux_layers`"]
    assert "| `extract.aux_layers` | [2, 5, 9] | None |" in lines
    one = eyas_compare.compare(limit=1).splitlines()
    assert [line for line in one if line.startswith("| `")] == ["| `lr` | 0.001 |"]
    assert f"{len(flatten(parse_params({}))) - 1} other params not shown (`--all-params` lists them)." in one


def test_compare_shows_a_figure_only_under_the_execution_that_made_it(unit_store, monkeypatch):
    """The workspace's metrics files are logged onto every parent (team_tracking.sync_parent): the
    committed fine-tune's figures were shown under an experiment of the default DAG, which never ran
    the fine-tune. A reused stage's figure shows only where a stage that ran depends on it."""
    for f in dvcfiles.PIPELINES:
        (unit_store / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, unit_store / f)
    metrics = unit_store / "metrics"
    metrics.mkdir()
    (metrics / "train_finetune.json").write_text(json.dumps({"val": {"acc_0": 0.61}}))
    (metrics / "eval_finetune.json").write_text(json.dumps(
        {"chat": {"accept_len": 1.7, "serving_verdict": {"worth_serving": True}}}))
    (metrics / "train_scratch.json").write_text(json.dumps({"val": {"acc_0": 0.44}}))
    # `dvc exp run` of a preset: the default DAG's train-scratch and eval ran, no fine-tune
    _pipeline(monkeypatch, "quick", 1e-3, {"train-scratch": {"final/acc_0": 0.2},
                                           "eval-accept-len@scratch": {"chat/accept_len": 1.1}})
    # an eval-only change: train-scratch reused (its figure from the parent: eval-accept-len@scratch read it)
    _pipeline(monkeypatch, "evalonly", 2e-3, {"eval-accept-len@scratch": {"chat/accept_len": 1.3}})
    lines = eyas_compare.compare().splitlines()

    def row(label):
        return next(line for line in lines if line.startswith(f"| {label} |"))

    assert row("train-finetune val acc_0") == "| train-finetune val acc_0 | – | – |"
    assert row("finetune chat accept_len") == "| finetune chat accept_len | – | – |"
    assert row(f"finetune chat {eyas_compare.WORTH}") == f"| finetune chat {eyas_compare.WORTH} | – | – |"
    assert row("train-scratch val acc_0") == "| train-scratch val acc_0 | 0.44 | 0.2 |"
    reused = row("stages reused (numbers from metrics/)")
    assert reused == "| stages reused (numbers from metrics/) | train-scratch | – |"


def test_compare_errors_without_store(unit_store, capsys):
    from eyas.cli import main

    assert main(["compare"]) == 2
    assert "no MLflow store" in capsys.readouterr().err
    assert not (unit_store / "mlflow.db").exists()  # comparing creates nothing
    tracking.ensure_store(tracking.tracking_uri())
    assert main(["compare", "--experiment", "nope"]) == 2
    assert main(["compare"]) == 1  # the store and experiment exist, no pipeline run yet
    assert "No pipeline runs found." in capsys.readouterr().out


def test_compare_fails_fast_on_a_dead_tracking_server(unit_store, monkeypatch):
    """MLflow's default HTTP retries (7, exponential backoff) used to hang `eyas compare` for minutes."""
    for var in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as s:  # a free port: nothing listens on it once closed
        s.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"
    # the real CLI in a fresh process (imports included) must be done well within 15 s
    r = subprocess.run([sys.executable, "-m", "eyas.cli", "compare", "--tracking-uri", uri],
                       cwd=unit_store, capture_output=True, text=True, timeout=15)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"eyas compare: error: cannot query the MLflow tracking store {uri} ")
    assert "Connection refused" in r.stderr
    t0 = time.monotonic()
    with pytest.raises(eyas_compare.CompareError, match=re.escape(uri)):
        eyas_compare.compare(uri)
    assert time.monotonic() - t0 < 10
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # the probe's settings do not leak


def test_finish_training_logs_pngs_config_and_vocab_report(unit_store, monkeypatch):
    """stages/training.finish_training on a tiny drafter: PNG curves, config.json, vocab report."""
    import torch

    from eyas.training.loop import train_drafter
    from stages import common, training
    from tests.tiny import tiny_training_setup

    drafter, train, val, lm_head = tiny_training_setup(unit_store, common.VOCAB)  # models/vocab/ under cwd = unit_store
    monkeypatch.setenv("DVC_EXP_NAME", "tiny")
    p = parse_params({"train": {"max_steps": 2, "batch_tokens": 96, "eval_every": 1}})
    with tracking.start_stage_run("train-scratch", p) as t:
        result = train_drafter(drafter, train_store=train, val_store=val, lm_head=lm_head,
                               tp=p.train, lr=1e-3, seed=0, tracker=t, device=torch.device("cpu"))
        training.finish_training("train-scratch", drafter, result, Path("models/scratch"), t)
    client = MlflowClient(tracking_uri=tracking.tracking_uri())
    names = {a.path for a in client.list_artifacts(t.run_id)}
    assert {"train_scratch_curves.png", "config.json", "vocab.json", "train_scratch_metrics.json"} <= names
    png = Path(client.download_artifacts(t.run_id, "train_scratch_curves.png", str(unit_store)))
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_compare_times_out_on_a_server_that_does_not_answer(unit_store, monkeypatch):
    """A server that accepts connections and never answers (hung, or a proxy that never forwards):
    `eyas compare` stops within seconds, saying it did not answer in time."""
    for var in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)  # the kernel completes the TCP handshake; nobody ever reads or answers
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "eyas.cli", "compare", "--tracking-uri", uri],
                           cwd=unit_store, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert time.monotonic() - t0 < 40
    assert "did not answer in time" in r.stderr and "timed out" in r.stderr.lower()
