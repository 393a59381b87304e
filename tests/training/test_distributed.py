"""Data-parallel TTT training: 2 CPU processes (gloo) give the same losses as 1 process on the
same global batch, with DDP and with FSDP2 (whose checkpoints resume and whose export is the
one-process format), plus the helpers of eyas/training/distributed.py and eyas/training/launch.py."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from eyas.drafter.model import DrafterConfig, Eagle3Drafter
from eyas.export.eagle import save_drafter
from eyas.features import FeatureStore, ShardWriter
from eyas.params.full import default_params
from eyas.tracking.runs import Tracker
from eyas.training import distributed as D
from eyas.training import launch
from eyas.training.loop import train_drafter

H, V, DV, AUX = 32, 128, 64, 3
ROW = 24  # longest sample: the packed row length


def write_store(root, n_samples: int, seed: int) -> FeatureStore:
    g = torch.Generator().manual_seed(seed)
    w = ShardWriter(root, shard_samples=7, dtype=torch.bfloat16)
    for i in range(n_samples):
        n = ROW if i == 0 else int(torch.randint(6, ROW + 1, (1,), generator=g))
        w.add(torch.randint(0, V, (n,), generator=g), torch.rand(n, generator=g) > 0.2,
              torch.randn(n, AUX * H, generator=g), torch.randn(n, H, generator=g),
              torch.randint(0, V, (n,), generator=g))
    w.finish(aux_layers=[2, 4, 5])
    return FeatureStore.open(root)


def make_drafter() -> Eagle3Drafter:
    torch.manual_seed(0)
    c = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=V, draft_vocab_size=DV, target_hidden_size=H,
                      num_target_layers=8)
    d = Eagle3Drafter(c)
    d.set_embedding(torch.randn(V, H, generator=torch.Generator().manual_seed(1)))
    # d2t offsets 0: draft id == target id
    d.set_vocab(torch.zeros(DV, dtype=torch.int64), torch.arange(V) < DV)
    return d


class StepRecorder(Tracker):
    """Keeps the optimizer steps at which a train loss was logged (a resumed run logs fewer)."""

    def __init__(self):
        self.train_steps: list[int] = []

    def log_metrics(self, metrics, step=None):
        if "train/loss" in metrics:
            self.train_steps.append(step)


def run_training(root, batch_tokens: int, strategy: str = "ddp", export_to=None, checkpoint_dir=None,
                 checkpoint_every: int = 0, device: str = "cpu") -> dict:
    train = FeatureStore.open(os.path.join(root, "train"))
    val = FeatureStore.open(os.path.join(root, "val"))
    lm_head = torch.randn(V, H, generator=torch.Generator().manual_seed(2))
    tp = dataclasses.replace(default_params().train, ttt_length=3, step_decay=0.8, batch_tokens=batch_tokens,
                             epochs=1, warmup_ratio=0.0, grad_clip=0.5, eval_every=2, max_steps=3,
                             checkpoint_every=0, strategy=strategy)
    d = make_drafter()
    tracker = StepRecorder()
    r = train_drafter(d, train_store=train, val_store=val, lm_head=lm_head, tp=tp, lr=3e-3, seed=0,
                      tracker=tracker, device=torch.device(device), checkpoint_dir=checkpoint_dir,
                      checkpoint_every=checkpoint_every)
    if export_to is not None and D.is_main():
        save_drafter(d, export_to)
    return {"train_loss": [c["loss"] for c in r.curve if c["split"] == "train"],
            "val_loss": [c["loss_0"] for c in r.curve if c["split"] == "val"],
            "step0_val": r.step0_val["loss_0"], "final_val": r.final_val["loss_0"],
            "final_acc": r.final_val["acc_0"], "steps": r.steps, "logged_steps": tracker.train_steps,
            "fc_sum": float(d.fc.weight.detach().double().sum())}


def _worker(rank: int, world: int, port: int, root: str, batch_tokens: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    out = run_training(root, batch_tokens)
    if D.is_main():
        with open(os.path.join(root, "ddp.json"), "w") as f:
            json.dump(out, f)
    D.destroy()


def _fsdp_worker(rank: int, world: int, port: int, root: str, batch_tokens: int) -> None:
    """An FSDP run that checkpoints at step 2 and exports, then a second run in the same
    directory that must resume from that checkpoint (step 3 only)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ck = os.path.join(root, "ckpt_fsdp")
    out = {"full": run_training(root, batch_tokens, "fsdp", os.path.join(root, "fsdp_export"), ck, 2)}
    out["resumed"] = run_training(root, batch_tokens, "fsdp", os.path.join(root, "fsdp_resumed"), ck, 2)
    if D.is_main():
        with open(os.path.join(root, "fsdp.json"), "w") as f:
            json.dump(out, f)
    D.destroy()


def _gpu_worker(rank: int, world: int, port: int, root: str, batch_tokens: int, strategy: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    out = run_training(root, batch_tokens, strategy, device="cuda")
    if D.is_main():
        with open(os.path.join(root, f"{strategy}_gpu.json"), "w") as f:
            json.dump(out, f)
    D.destroy()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")
def test_two_process_ddp_matches_single_process_global_batch(tmp_path):
    root = str(tmp_path)
    write_store(tmp_path / "train", 40, seed=0)
    write_store(tmp_path / "val", 9, seed=1)
    per_rank = 2 * ROW  # 2 rows per rank per step; the single process takes 4 rows per step
    mp.start_processes(_worker, args=(2, _free_port(), root, per_rank), nprocs=2, join=True,
                       start_method="spawn")
    ddp = json.load(open(os.path.join(root, "ddp.json")))
    torch.set_num_threads(1)
    single = run_training(root, 2 * per_rank)
    assert ddp["steps"] == single["steps"] == 3
    assert ddp["step0_val"] == pytest.approx(single["step0_val"], rel=1e-5)
    assert ddp["train_loss"] == pytest.approx(single["train_loss"], rel=1e-4)
    assert ddp["final_val"] == pytest.approx(single["final_val"], rel=1e-4)
    assert ddp["fc_sum"] == pytest.approx(single["fc_sum"], rel=1e-3, abs=1e-4)
    # training moved the weights: the comparison is not vacuous
    assert single["train_loss"][0] != pytest.approx(single["final_val"], rel=1e-3)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")
def test_two_process_fsdp_matches_single_process_and_resumes(tmp_path):
    """FSDP2 (train.strategy: fsdp) on 2 gloo processes vs one process on the same global batch.

    Tolerances: the two runs differ only in float32 summation order (each rank sums its loss
    over half the tokens and FSDP reduce-scatters the two halves of the gradient; one process
    sums all in one pass), ~1e-7 relative per reduction. Measured on torch 2.13 CPU: exported
    weights differ by at most 3.7e-7 (mlp.gate_proj) while 3 AdamW steps at lr 3e-3 move every
    weight tensor by ~6e-3; losses agree to ~1e-7 relative. So 1e-5 absolute on weights and 1e-5
    relative on losses leave ~25x headroom and stay far below the updates (a resume that skips
    restoring the weights fails the step-3 loss comparison: checked by mutating the code).
    The resumed run repeats the uninterrupted one exactly (measured difference 0).
    """
    root = str(tmp_path)
    write_store(tmp_path / "train", 40, seed=0)
    write_store(tmp_path / "val", 9, seed=1)
    per_rank = 2 * ROW
    mp.start_processes(_fsdp_worker, args=(2, _free_port(), root, per_rank), nprocs=2, join=True,
                       start_method="spawn")
    got = json.load(open(os.path.join(root, "fsdp.json")))
    torch.set_num_threads(1)
    single = run_training(root, 2 * per_rank, export_to=tmp_path / "single_export",
                          checkpoint_dir=tmp_path / "ckpt_single", checkpoint_every=2)
    fsdp, resumed = got["full"], got["resumed"]
    assert fsdp["steps"] == single["steps"] == 3
    assert fsdp["logged_steps"] == [1, 2, 3]
    assert fsdp["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)
    assert fsdp["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)  # steps 0, 2, 3
    assert len(single["val_loss"]) == 3
    assert single["train_loss"][0] != pytest.approx(single["final_val"], rel=1e-3)  # weights moved

    # the export: the same files, keys, dtypes and shapes as one process; values within tolerance
    a = load_file(tmp_path / "fsdp_export/model.safetensors")
    b = load_file(tmp_path / "single_export/model.safetensors")
    assert sorted(a) == sorted(b)
    for k in b:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-5), (k, (a[k] - b[k]).abs().max())
    assert not torch.equal(b["fc.weight"], make_drafter().fc.weight.detach())  # trained
    config = lambda d: (tmp_path / d / "config.json").read_text()
    assert config("fsdp_export") == config("single_export")

    # the FSDP checkpoint holds FULL tensors in the one-process layout (the step-2 state)
    ca = load_file(tmp_path / "ckpt_fsdp/state/train_state.safetensors")
    cb = load_file(tmp_path / "ckpt_single/state/train_state.safetensors")
    assert sorted(ca) == sorted(cb)
    for k in cb:
        if k.startswith(("model.", "opt.")):
            assert ca[k].shape == cb[k].shape and ca[k].dtype == cb[k].dtype, k
            assert torch.allclose(ca[k], cb[k], rtol=1e-4, atol=1e-6), (k, (ca[k] - cb[k]).abs().max())
    meta = json.load(open(tmp_path / "ckpt_fsdp/state/train_state.json"))
    opt = meta["optimizer"]
    assert meta["step"] == 2 and opt["param_groups"][0]["params"] == list(range(len(opt["state_keys"])))

    # the second FSDP run resumed from that checkpoint: it trained step 3 only, to the same result
    assert resumed["logged_steps"] == [3]
    assert resumed["train_loss"] == pytest.approx(fsdp["train_loss"], rel=1e-6)
    assert resumed["final_val"] == pytest.approx(fsdp["final_val"], rel=1e-6)
    c = load_file(tmp_path / "fsdp_resumed/model.safetensors")
    for k in a:
        assert torch.allclose(c[k], a[k], rtol=0, atol=1e-6), k


def test_wrap_rejects_unknown_strategy():
    with pytest.raises(ValueError, match="train.strategy"):
        D.wrap_data_parallel(torch.nn.Linear(2, 2), "zero3", torch.device("cpu"))


def test_helpers_are_noops_in_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert D.init_distributed("cpu") == (0, 1, torch.device("cpu"))
    assert D.is_main() and D.world_size() == 1
    D.barrier()
    assert D.all_reduce_counts({"a": 1.0, "b": 2.0}) == {"a": 1.0, "b": 2.0}
    assert D.shard(list(range(7)), 1, 2) == [1, 3, 5]
    assert D.shard(list(range(7)), 0, 2) == [0, 2, 4]


def test_launch_resolves_nproc_and_builds_torchrun_argv(tmp_path):
    assert launch.resolve_nproc(None) == 1
    assert launch.resolve_nproc("3") == 3
    assert launch.resolve_nproc(0) == max(1, torch.cuda.device_count())  # 0 = one per GPU
    with pytest.raises(ValueError):
        launch.resolve_nproc(-2)
    (tmp_path / "params.yaml").write_text("train:\n  nproc: 4\n")
    assert launch.nproc_from_params(tmp_path / "params.yaml") == 4
    argv = launch.torchrun_argv(4, "stages.train_scratch", ["--x"])
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in argv
    assert argv[-2:] == ["stages.train_scratch", "--x"]


@pytest.mark.parametrize("value, message", [
    (2.5, "nproc must be an integer or 'auto', got 2.5"),  # used to run 2 processes
    (2.0, "nproc must be an integer or 'auto', got 2.0"),  # the params schema refuses it too
    (True, "nproc must be an integer or 'auto', got True"),  # used to run 1 (True == 1)
    (False, "nproc must be an integer or 'auto', got False"),  # used to mean auto (False == 0)
    ("2.5", "nproc must be an integer or 'auto', got '2.5'"),
])
def test_launch_refuses_non_integer_nproc(value, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        launch.resolve_nproc(value)
    with pytest.raises(ValueError, match=f"^EYAS_NPROC {re.escape(message.removeprefix('nproc '))}$"):
        launch.resolve_nproc(value, "EYAS_NPROC")


def test_launch_main_names_where_a_bad_nproc_came_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EYAS_NPROC", raising=False)
    monkeypatch.setenv("RANK", "0")  # as if inside torchrun: never exec torchrun, whatever nproc resolves to
    (tmp_path / "params.yaml").write_text("train:\n  nproc: 2.5\n")
    with pytest.raises(ValueError, match=r"^params\.yaml: 'train\.nproc' must be an integer "
                                         r"\(0 = one per CUDA device\), got 2\.5$"):
        launch.main(["no_such_module_eyas"])
    monkeypatch.setenv("EYAS_NPROC", "two")
    with pytest.raises(ValueError, match="^EYAS_NPROC must be an integer or 'auto', got 'two'$"):
        launch.main(["no_such_module_eyas"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_gpus_over_nccl_match_one_gpu(tmp_path, strategy):
    """DDP and FSDP2 on 2 GPUs (NCCL) vs one GPU on the same global batch. Both run under bf16
    autocast (one GPU replays CUDA graphs, two run eagerly), so losses agree to bf16 rounding
    of different reduction orders, not float32's: 1e-2 relative; the runs must still train."""
    root = str(tmp_path)
    write_store(tmp_path / "train", 40, seed=0)
    write_store(tmp_path / "val", 9, seed=1)
    per_rank = 2 * ROW
    mp.start_processes(_gpu_worker, args=(2, _free_port(), root, per_rank, strategy), nprocs=2, join=True,
                       start_method="spawn")
    two = json.load(open(os.path.join(root, f"{strategy}_gpu.json")))
    one = run_training(root, 2 * per_rank, strategy, device="cuda")
    assert two["steps"] == one["steps"] == 3
    assert two["train_loss"] == pytest.approx(one["train_loss"], rel=1e-2)
    assert two["final_val"] == pytest.approx(one["final_val"], rel=1e-2)
    assert one["train_loss"][0] != pytest.approx(one["final_val"], rel=1e-3)  # weights moved
