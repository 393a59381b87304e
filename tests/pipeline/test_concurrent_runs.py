"""Two runs of one stage in one workspace: the second refuses at its start, naming the first (pid
and command), and the first finishes untouched (eyas/pipeline/runlock.py).

The real ``train-scratch`` stage runs on tests/training/test_resume.py's tiny workspace, slowed down, while a
second ``python -m stages.train_scratch`` starts beside it. Without the lock both train into the same
checkpoint directory and one of them dies; with it the second stops before it writes anything. A
lock's holder killed with ``kill -9`` leaves no stale lock. Every stage of the pipeline files takes
its lock before anything else.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.pipeline import dvcfiles, runlock
from eyas.training import checkpoint as ckpt
from tests.training.test_resume import CKPT, DRIVER, _copy, _env, workspace  # noqa: F401 - workspace is a fixture

ROOT = Path(__file__).resolve().parents[2]
HOLDER = ("import sys, time\nfrom eyas.pipeline import runlock\nfor s in sys.argv[1:]:\n    runlock.hold(s)\n"
          "print('held', flush=True)\ntime.sleep(120)\n")


def _holder(cwd: Path, *stages: str) -> subprocess.Popen:
    """A process that holds the locks of ``stages`` in ``cwd`` until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, *stages], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.strip() == "held", proc.stderr.read()
    return proc


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()


def _step(meta: Path, first: subprocess.Popen) -> int:
    """The step of the running first run's checkpoint. A save swaps the state directory in place
    (eyas.io.atomic_dir: the old one renamed away, then the new one in), so ``meta`` is briefly absent."""
    deadline = time.time() + 10
    while True:
        try:
            return json.loads(meta.read_bytes())["step"]
        except FileNotFoundError:
            if first.poll() is not None or time.time() > deadline:
                raise
            time.sleep(0.01)


def test_a_second_train_scratch_refuses_naming_the_first_which_finishes(workspace, tmp_path):  # noqa: F811
    ws = _copy(workspace, tmp_path / "ws")
    shutil.copy(ROOT / "dvc.yaml", ws / "dvc.yaml")  # the outputs train-scratch declares
    # 32 steps of 0.5 s: the first still trains while the second starts (its imports take seconds on a
    # busy machine), so the second meets the lock with the first's checkpoint in place
    first = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=ws, env=_env(EYAS_TEST_STEP_SLEEP="0.5"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        meta = ws / CKPT / ckpt.STATE / ckpt.META
        deadline = time.time() + 120
        while not meta.exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended before the second could start"
        step_before = _step(meta, first)
        second = subprocess.run([sys.executable, "-m", "stages.train_scratch"], cwd=ws, env=_env(),
                                capture_output=True, text=True, timeout=120)
        msg = second.stderr.strip().splitlines()[-1] if second.stderr.strip() else ""
        assert second.returncode != 0, "the second run did not refuse: it trained beside the first"
        assert msg.startswith("eyas.pipeline.runlock.StageBusy: train-scratch: another run holds this stage"), msg
        assert first.poll() is None, "the first run ended while the second ran: the race was not tested"
        assert f"pid {first.pid} (" in msg and "-c" in msg and "running train-scratch since" in msg, msg
        assert "train_drafter" not in second.stderr and "resuming" not in second.stderr
        # it wrote nothing: the first run's checkpoint is the first run's
        assert _step(meta, first) >= step_before
        err = first.communicate(timeout=180)[1]
    finally:
        _kill(first)
    assert first.returncode == 0, err[-3000:]
    assert (ws / "models/scratch/model.safetensors").is_file() and (ws / "metrics/train_scratch.json").is_file()
    assert not (ws / CKPT).exists()  # cleared by the first run at its end


def test_a_killed_holder_leaves_no_stale_lock(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    holder = _holder(tmp_path, "build-vocab")
    with pytest.raises(runlock.StageBusy) as e:
        runlock.hold("build-vocab")
    assert f"pid {holder.pid} (" in str(e.value) and "build-vocab" in str(e.value)
    _kill(holder)  # kill -9: nothing ran its cleanup
    files = runlock.hold("build-vocab")
    assert files == [Path(".eyas/locks/stage/build-vocab.lock")]
    info = json.loads(files[0].read_text())
    assert info["pid"] == os.getpid() and info["stage"] == "build-vocab"
    assert runlock.hold("build-vocab") == files  # again in the same process: a no-op, not a refusal


def test_two_stages_declaring_one_output_exclude_each_other(tmp_path, monkeypatch):
    (tmp_path / "dvc.yaml").write_text("stages:\n  a:\n    cmd: x\n    outs: [data/shared]\n"
                                       "  b:\n    cmd: y\n    outs: [data/shared, data/b]\n"
                                       "  c:\n    cmd: z\n    outs: [data/c]\n")
    monkeypatch.chdir(tmp_path)
    holder = _holder(tmp_path, "a")
    try:
        with pytest.raises(runlock.StageBusy) as e:
            runlock.hold("b")
        assert "an output of b (data/shared)" in str(e.value) and f"pid {holder.pid} (" in str(e.value)
        assert not any(str(f.resolve()) in runlock._held for f in Path(".eyas/locks").rglob("*.lock"))  # none kept
        assert runlock.hold("c")  # another output: no conflict
    finally:
        _kill(holder)


def test_every_stage_takes_its_lock_before_anything_else(tmp_path, monkeypatch):
    """Each stage of the pipeline files, its lock held by another process, refuses in its first line
    (before reading params.yaml: there is none here)."""
    stages = dvcfiles.stages(ROOT)
    for f in dvcfiles.PIPELINES:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / f)
    monkeypatch.chdir(tmp_path)
    holder = _holder(tmp_path, *stages)
    try:
        for name, body in stages.items():
            cmd = body["cmd"].split()
            module, args = (cmd[3], cmd[4:]) if cmd[2] == "eyas.training.launch" else (cmd[2], cmd[3:])
            main = importlib.import_module(module).main
            with pytest.raises(runlock.StageBusy) as e:
                main(*args)
            assert str(e.value).startswith(f"{name}: another run holds this stage"), (name, str(e.value))
    finally:
        _kill(holder)
