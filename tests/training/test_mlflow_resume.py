"""MLflow history survives ``kill -9``: the real train-scratch stage, tracked in a real sqlite store,
is SIGKILLed after a checkpoint and rerun (tests/training/test_resume.py's workspace and driver).

The killed run ends KILLED and links to its successor; the finished run holds the whole curve
(replayed from the checkpoint, then live), the step-0 validation included, point for point the
rows of ``plots/train_scratch/{train,val}.tsv``.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import pytest
from mlflow import MlflowClient

from eyas.training import checkpoint as ckpt
from tests.training.test_resume import CKPT, DRIVER, _copy, _env, workspace  # noqa: F401 - workspace is a fixture


def _tsv(path) -> list[dict]:
    head, *rows = path.read_text().splitlines()
    cols = head.split("\t")
    return [{c: (float(v) if v else math.nan) for c, v in zip(cols, r.split("\t"))} for r in rows]


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.slow
def test_killed_run_is_closed_and_resumed_run_holds_the_whole_curve(workspace, tmp_path):  # noqa: F811
    ws = _copy(workspace, tmp_path / "ws")
    uri = f"sqlite:///{ws / 'mlflow.db'}"
    env = _env(EYAS_TRACKING="on", MLFLOW_TRACKING_URI=uri)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=ws, env={**env, "EYAS_TEST_STEP_SLEEP": "0.15"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    meta = ws / CKPT / ckpt.STATE / ckpt.META
    deadline = time.time() + 180
    while not meta.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = json.loads(meta.read_text())["step"]

    r = subprocess.run([sys.executable, "-c", DRIVER], cwd=ws, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming at optimizer step" in r.stderr

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("eyas")
    runs = {x.info.status: x for x in client.search_runs([exp.experiment_id], "tags.`dvc.stage` = 'train-scratch'")}
    assert set(runs) == {"KILLED", "FINISHED"}, [x.info.status for x in runs.values()]
    killed, done = runs["KILLED"], runs["FINISHED"]
    assert killed.data.tags["eyas.resumed_by"] == done.info.run_id
    assert done.data.tags["eyas.resumes"] == killed.info.run_id
    # the killed run was flushed at its checkpoint: it holds the curve up to there at least
    assert max(m.step for m in client.get_metric_history(killed.info.run_id, "train/loss")) >= killed_at

    train, val = _tsv(ws / "plots/train_scratch/train.tsv"), _tsv(ws / "plots/train_scratch/val.tsv")
    assert [row["step"] for row in train] == list(range(1, 33)) and val[0]["step"] == 0
    for rows, prefix in ((train, "train/"), (val, "val/")):
        for col in rows[0]:
            if col == "step":
                continue
            hist = sorted((m.step, m.value) for m in client.get_metric_history(done.info.run_id, prefix + col))
            assert [s for s, _ in hist] == [int(row["step"]) for row in rows], (prefix + col, hist)
            for (s, v), row in zip(hist, rows):
                assert _same(v, row[col]), (prefix + col, s, v, row[col])
