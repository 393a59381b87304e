"""Interruption: training and extraction survive ``kill -9`` and resume to the SAME result.

The real ``train-scratch`` stage runs in a subprocess on tiny-target features in a temporary
workspace; it is SIGKILLed once a checkpoint exists, rerun, and its metrics, plots and exported
weights must equal an uninterrupted run's. Partial / corrupted checkpoints are ignored, never loaded.
The ShardWriter resumes from its last complete shard with identical shards and manifest.

MLflow history survives ``kill -9`` too: the same stage, tracked in a real sqlite store, is SIGKILLed
after a checkpoint and rerun. The killed run ends KILLED and links to its successor; the finished run
holds the whole curve (replayed from the checkpoint, then live), the step-0 validation included, point
for point the rows of ``plots/train_scratch/{train,val}.tsv``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient
from safetensors.torch import load_file
from transformers import get_cosine_schedule_with_warmup

from eyas.features import PROGRESS, FeatureStore, ShardWriter
from eyas.io import save_safetensors
from eyas.params.full import default_params
from eyas.tracking.runs import Tracker
from eyas.training import checkpoint as ckpt
from eyas.training.loop import NonFiniteLossError, new_drafter, train_drafter
from eyas.vocab.mapping import build_mapping, count_tokens, save_mapping
from tests.tiny import tiny_target, write_features

REPO = Path(__file__).resolve().parents[2]
CKPT = Path(".eyas/checkpoints/train-scratch")
TRAIN = {"ttt_length": 2, "step_decay": 0.8, "batch_tokens": 48, "epochs": 2, "warmup_ratio": 0.1,
         "weight_decay": 0.0, "grad_clip": 0.5, "eval_every": 5, "max_steps": 0, "checkpoint_every": 2}

# the real stage, slowed down (sleep per optimizer step) so that the test can kill it mid-run
DRIVER = """
import os, time
import eyas.training.loop as t
real = t.Trainer.train_step
def slow(*a, **k):
    time.sleep(float(os.environ.get("EYAS_TEST_STEP_SLEEP", "0")))
    return real(*a, **k)
t.Trainer.train_step = slow
# TODO: drop once stages/common.py imports plots
import eyas.tracking.plots, stages.common; stages.common.__dict__.setdefault("plots", eyas.tracking.plots)
from stages.train_scratch import main
main()
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A workspace with tiny features, the target head, a vocab and params.yaml (train-scratch)."""
    root = tmp_path_factory.mktemp("ws")
    target = tiny_target()
    feats = root / "data/features"
    train = write_features(target, feats / "train", 16, seed=1)
    write_features(target, feats / "val", 4, seed=2)
    save_safetensors(target.head_weights(), feats / "target_head.safetensors")
    ids, mask = train.token_stats()
    counts = count_tokens(ids, mask, train.manifest["vocab_size"])
    mapping, info = build_mapping(counts, 64)
    save_mapping(root / "models/vocab", mapping, counts, info)
    (root / "params.yaml").write_text(yaml.safe_dump({"lr": 3e-3, "seed": 0, "train": TRAIN}))
    return root


def _env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "EYAS_TRACKING": "off", "OMP_NUM_THREADS": "1", **extra}
    return env


def _copy(ws: Path, dst: Path) -> Path:
    shutil.copytree(ws, dst)
    return dst


def _reference(ws: Path):
    """What train-scratch computes on ``ws`` without interruption (in-process, same seed)."""
    from eyas.io import load_safetensors
    from eyas.params.full import load_params
    from eyas.vocab.mapping import load_mapping

    p = load_params(ws / "params.yaml")
    train, val = FeatureStore.open(ws / "data/features/train"), FeatureStore.open(ws / "data/features/val")
    head = load_safetensors(ws / "data/features/target_head.safetensors")
    drafter = new_drafter(train.manifest, load_mapping(ws / "models/vocab")[0], head["embed_tokens"], p.seed,
                          lm_head=head["lm_head"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocess (OMP_NUM_THREADS=1): same reduction order, same bits
    try:
        res = train_drafter(drafter, train_store=train, val_store=val, lm_head=head["lm_head"], tp=p.train,
                            lr=p.lr, seed=p.seed, tracker=Tracker(), device=torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    return res, drafter.state_dict_for_export()


def test_train_stage_survives_sigkill(workspace, tmp_path):

    ws = _copy(workspace, tmp_path / "killed")
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=ws, env=_env(EYAS_TEST_STEP_SLEEP="0.15"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    meta = ws / CKPT / ckpt.STATE / ckpt.META
    deadline = time.time() + 90
    while not meta.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # somewhere after a checkpoint, maybe inside the next one
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (ws / "metrics/train_scratch.json").exists()
    killed_at = json.loads(meta.read_text())["step"]
    assert 0 < killed_at < 32  # 16 batches x 2 epochs

    r = subprocess.run([sys.executable, "-c", DRIVER], cwd=ws, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming at optimizer step" in r.stderr, r.stderr[:2000]
    assert not (ws / CKPT).exists(), "a finished stage removes its checkpoints"
    ref, weights = _reference(workspace)
    m = json.loads((ws / "metrics/train_scratch.json").read_text())
    nan = lambda d: json.loads(json.dumps(d).replace("NaN", "null"))
    assert m["val"] == nan(ref.final_val) and m["train"] == nan(ref.final_train)
    assert m["step0_val"] == nan(ref.step0_val)
    assert (m["steps"], m["train_tokens"]) == (ref.steps, ref.train_tokens) == (32, 32 * 48)
    rows = (ws / "plots/train_scratch/train.tsv").read_text().splitlines()
    assert len(rows) == 33 and rows[0].startswith("step\tloss")  # every step, columns in order
    got = load_file(str(ws / "models/scratch/model.safetensors"))
    for k, v in weights.items():
        assert torch.equal(got[k], v.cpu()), f"resumed {k} differs from an uninterrupted run's"


# ---------------------------------------------------------------- in-process: state round trip


class _Crash(Exception):
    pass


class _CrashAt(Tracker):
    """A tracker that simulates a crash when the loop logs optimizer step ``at``."""

    def __init__(self, at: int | None):
        self.at = at

    def log_metrics(self, metrics, step=None):
        if self.at is not None and step == self.at and "train/loss" in metrics:
            raise _Crash(step)


# --- MLflow's record of a killed and resumed run -------------------------------------------------

def _tsv(path) -> list[dict]:
    head, *rows = path.read_text().splitlines()
    cols = head.split("\t")
    return [{c: (float(v) if v else math.nan) for c, v in zip(cols, r.split("\t"))} for r in rows]


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.slow
def test_killed_run_is_closed_and_resumed_run_holds_the_whole_curve(workspace, tmp_path):
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


@pytest.fixture(scope="module")
def stores(workspace):
    f = workspace / "data/features"
    return FeatureStore.open(f / "train"), FeatureStore.open(f / "val")


class _StepsLogged(_CrashAt):
    """:class:`_CrashAt` that also records the optimizer steps this process trained (a resumed
    run's earlier steps come through ``replay``, not ``log_metrics``)."""

    def __init__(self, at: int | None):
        super().__init__(at)
        self.steps: list[int] = []

    def log_metrics(self, metrics, step=None):
        if "train/loss" in metrics:
            self.steps.append(step)
        super().log_metrics(metrics, step)


def _train(stores, ckdir, crash_at=None, code=None, tracker=None, **kw):
    train, val = stores
    target = tiny_target()
    head = target.head_weights()
    ids, mask = train.token_stats()
    mapping, _ = build_mapping(count_tokens(ids, mask, train.manifest["vocab_size"]), 64)
    drafter = new_drafter(train.manifest, mapping, head["embed_tokens"], 0)
    tp = dataclasses.replace(default_params().train, **{**TRAIN, "epochs": 1, **kw})
    res = train_drafter(drafter, train_store=train, val_store=val, lm_head=head["lm_head"], tp=tp, lr=3e-3,
                        seed=0, tracker=tracker or _CrashAt(crash_at), device=torch.device("cpu"),
                        checkpoint_dir=ckdir, code=code)
    return res, drafter


def test_crash_resume_equals_uninterrupted(stores, tmp_path):
    ref, d_ref = _train(stores, None, max_steps=7)
    with pytest.raises(_Crash):
        _train(stores, tmp_path / "ck", crash_at=5, max_steps=7)  # checkpoints at steps 2 and 4
    assert json.loads((tmp_path / "ck/state/train_state.json").read_text())["step"] == 4
    res, d = _train(stores, tmp_path / "ck", max_steps=7)
    assert res.final_val == ref.final_val and res.final_train == ref.final_train
    assert res.steps == ref.steps and res.train_tokens == ref.train_tokens
    assert str(res.curve) == str(ref.curve)  # same rows, same column order (NaN prints equal)
    for k, v in d_ref.state_dict().items():
        assert torch.equal(v, d.state_dict()[k]), k


def test_checkpoint_of_other_code_is_not_resumed(stores, tmp_path, caplog):
    """A checkpoint written under one code digest is not resumed under another: training starts
    afresh (all steps trained here, the result equals an uninterrupted run) and one warning line
    names the code change. Negative control: under the same digest it resumes after step 4."""
    ref, _ = _train(stores, None, max_steps=7)
    for code, resumed in (("b" * 64, False), ("a" * 64, True)):
        ck = tmp_path / code[0]
        with pytest.raises(_Crash):
            _train(stores, ck, crash_at=5, code="a" * 64, max_steps=7)  # checkpoints at steps 2 and 4
        assert json.loads((ck / "state/train_state.json").read_text())["code"] == "a" * 64
        caplog.clear()
        rec = _StepsLogged(None)
        res, _ = _train(stores, ck, code=code, tracker=rec, max_steps=7)
        assert rec.steps == ([5, 6, 7] if resumed else [1, 2, 3, 4, 5, 6, 7])
        assert res.final_val == ref.final_val
        lines = [r.getMessage() for r in caplog.records if "not resumed" in r.getMessage()]
        if resumed:
            assert lines == []
        else:
            assert len(lines) == 1 and f"by other code (digest {'a' * 12} != {'b' * 12}" in lines[0]
            assert "starts afresh" in lines[0] and "\n" not in lines[0]


def test_each_val_point_logs_one_progress_line(stores, caplog):
    """Every ``eval_every`` steps one line names the step, the total and that point's val acc_0 (the
    value the curve holds); the last step's val is the final one, not a progress line. Negative
    control: with ``eval_every`` past the last step no line is logged."""
    for every, want_steps in ((3, [3, 6]), (50, [])):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="eyas.training.loop"):
            res, _ = _train(stores, None, max_steps=7, eval_every=every, tracker=_StepsLogged(None))
        lines = [r.getMessage() for r in caplog.records if ": val acc_0 " in r.getMessage()]
        vals = {row["step"]: row["acc_0"] for row in res.curve if row["split"] == "val"}
        assert lines == [f"step {s} of 7: val acc_0 {vals[s]:.4f}" for s in want_steps]


def _drafter(stores, seed=0):
    train = stores[0]
    ids, mask = train.token_stats()
    mapping, _ = build_mapping(count_tokens(ids, mask, train.manifest["vocab_size"]), 64)
    return new_drafter(train.manifest, mapping, tiny_target().head_weights()["embed_tokens"], seed)


def test_checkpoint_round_trip(stores, tmp_path):
    drafter = _drafter(stores)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95))
    sched = get_cosine_schedule_with_warmup(opt, 1, 10)
    for p in params:  # one real step so the optimizer has state
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    torch.manual_seed(123)
    ckpt.save_train_state(tmp_path, drafter, opt, sched, step=1, epoch=0, batch_in_epoch=1, fingerprint="fp",
                          extra={"x": [1, 2]})
    expected_rand = torch.rand(3)
    # a fresh drafter/optimizer/scheduler + a different RNG state: everything comes back
    other = _drafter(stores, seed=1)
    p2 = [p for p in other.parameters() if p.requires_grad]
    opt2 = torch.optim.AdamW(p2, lr=1e-3, betas=(0.9, 0.95))
    sched2 = get_cosine_schedule_with_warmup(opt2, 1, 10)
    torch.manual_seed(999)
    st = ckpt.load_train_state(tmp_path, other, opt2, sched2, fingerprint="fp")
    assert (st.step, st.epoch, st.batch_in_epoch, st.extra) == (1, 0, 1, {"x": [1, 2]})
    assert torch.equal(torch.rand(3), expected_rand)
    for a, b in zip(params, p2):
        assert torch.equal(a, b)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][k], opt2.state[b][k]), k
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95)
    assert sched2.state_dict() == sched.state_dict()
    with open(tmp_path / "state/train_state.safetensors", "rb") as f:
        assert b"pickle" not in f.read(4096)


def _saved(tmp_path, stores) -> tuple:
    drafter = _drafter(stores)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    ckpt.save_train_state(tmp_path, drafter, opt, None, step=7, epoch=0, batch_in_epoch=7, fingerprint="fp")
    return drafter, opt


def test_partial_and_corrupted_checkpoints_are_ignored(stores, tmp_path):
    drafter, opt = _saved(tmp_path, stores)
    # a temporary directory left by a kill during a write: removed, never loaded
    junk = tmp_path / ".state.abc123.tmp"
    junk.mkdir()
    (junk / "train_state.json").write_text('{"complete": true, "step": 99')
    assert ckpt.load_train_state(tmp_path, drafter, opt, None, fingerprint="fp").step == 7
    assert not junk.exists()
    # other inputs: not resumed
    assert ckpt.load_train_state(tmp_path, drafter, opt, None, fingerprint="other") is None
    # a kill inside the directory swap: the previous complete checkpoint is at .state.old
    os.replace(tmp_path / "state", tmp_path / ".state.old")
    assert ckpt.find_checkpoint(tmp_path, "fp") == tmp_path / ".state.old"
    os.replace(tmp_path / ".state.old", tmp_path / "state")
    # a truncated tensors file: the hash no longer matches -> ignored
    f = tmp_path / "state" / ckpt.TENSORS
    before = dict(drafter.state_dict())
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert ckpt.find_checkpoint(tmp_path, "fp") is None
    assert ckpt.load_train_state(tmp_path, drafter, opt, None, fingerprint="fp") is None
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in before.items())
    # no sidecar (written last) -> incomplete
    _saved(tmp_path, stores)
    (tmp_path / "state" / ckpt.META).unlink()
    assert ckpt.find_checkpoint(tmp_path, "fp") is None


def test_nan_feature_names_step_batch_and_checkpoint(workspace, tmp_path):
    """A NaN injected into a feature shard stops training with the step, the samples and the last
    good checkpoint in the message."""
    feats = tmp_path / "f"
    shutil.copytree(workspace / "data/features/train", feats / "train")
    shard = feats / "train/shard-00001.safetensors"  # samples 8..15
    t = load_file(str(shard))
    t["aux_hidden"][t["offsets"][3]: t["offsets"][4]] = float("nan")  # sample (1, 3)
    save_safetensors(t, shard)
    train = FeatureStore.open(feats / "train")
    val = FeatureStore.open(workspace / "data/features/val")
    with pytest.raises(NonFiniteLossError) as e:
        _train((train, val), tmp_path / "ck")
    msg = str(e.value)
    assert "non-finite loss" in msg and "(1, 3)" in msg and "optimizer step" in msg
    step = int(msg.split("optimizer step ")[1].split()[0])
    if step > 2:
        last = (step - 1) // 2 * 2
        assert f"last good checkpoint: {tmp_path / 'ck' / 'state'} (step {last})" in msg
    else:
        assert "last good checkpoint: none" in msg


# ---------------------------------------------------------------- feature shards


def _sample(i: int) -> tuple:
    g = torch.Generator().manual_seed(i)
    n = 5 + i % 4
    return (torch.randint(0, 100, (n,), generator=g), torch.ones(n, dtype=torch.uint8),
            torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g), torch.randint(0, 100, (n,), generator=g))


def _extract(out: Path, n: int, key: str | None, start_hook=None, kill_after: int | None = None) -> dict | None:
    w = ShardWriter(out, shard_samples=4, dtype=torch.float32, resume_key=key)
    for i in range(w.resumed_samples, n):
        if kill_after is not None and i == kill_after:
            return None  # "killed": no finish, no manifest
        w.add(*_sample(i))
    return w.finish(note="x")


def _contents(root: Path) -> dict:
    return {f.name: f.read_bytes() for f in sorted(root.iterdir())}


def test_shard_writer_resumes_from_last_complete_shard(tmp_path):
    want = _extract(tmp_path / "ref", 14, "k")
    assert not (tmp_path / "ref" / PROGRESS).exists()

    out = tmp_path / "run"
    assert _extract(out, 14, "k", kill_after=10) is None  # shards 0, 1 complete; 2 samples buffered
    assert not (out / "manifest.json").exists()
    (out / ".shard-00002.safetensors.zz.tmp").write_bytes(b"partial")  # a kill inside a write
    w = ShardWriter(out, shard_samples=4, dtype=torch.float32, resume_key="k")
    assert w.resumed_samples == 8 and not (out / ".shard-00002.safetensors.zz.tmp").exists()
    got = _extract(out, 14, "k")
    assert got == want
    assert _contents(out) == _contents(tmp_path / "ref")


SHARD_KILL = '''
import os, signal, sys, torch
from pathlib import Path
from eyas.features import ShardWriter
w = ShardWriter(Path(sys.argv[1]), shard_samples=4, dtype=torch.float32, resume_key="k")
for i in range(int(sys.argv[2])):
    g = torch.Generator().manual_seed(i)
    n = 5 + i % 4
    w.add(torch.randint(0, 100, (n,), generator=g), torch.ones(n, dtype=torch.uint8),
          torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g), torch.randint(0, 100, (n,), generator=g))
os.kill(os.getpid(), signal.SIGKILL)
'''


def test_shard_writer_kill_as_a_subprocess(tmp_path):
    """SIGKILL after 6 samples (one complete shard, two samples buffered), then resume."""
    want = _extract(tmp_path / "ref", 14, "k")
    p = subprocess.Popen([sys.executable, "-c", SHARD_KILL, str(tmp_path / "run"), "6"], env=_env())
    assert p.wait(60) == -signal.SIGKILL
    assert json.loads((tmp_path / "run" / PROGRESS).read_text())["done"].keys() == {"shard-00000.safetensors"}
    assert _extract(tmp_path / "run", 14, "k") == want
    assert _contents(tmp_path / "run") == _contents(tmp_path / "ref")


def test_shard_writer_other_inputs_start_clean(tmp_path):
    out = tmp_path / "run"
    _extract(out, 14, "k", kill_after=10)
    assert ShardWriter(out, shard_samples=4, dtype=torch.float32, resume_key="other").resumed_samples == 0
    _extract(out, 14, "k", kill_after=10)
    # a corrupted complete-looking shard is recomputed, with everything after it
    (out / "shard-00001.safetensors").write_bytes(b"garbage")
    assert ShardWriter(out, shard_samples=4, dtype=torch.float32, resume_key="k").resumed_samples == 4
    # no resume key (the default): always clean
    _extract(out, 14, "k", kill_after=10)
    assert ShardWriter(out, shard_samples=4, dtype=torch.float32).resumed_samples == 0
    assert list(out.iterdir()) == []
