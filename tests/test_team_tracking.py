"""eyas/team_tracking.py on an in-process sqlite store: a trained drafter as an MLflow logged model
(config, val and acceptance metrics, datasets whose digest is DVC's), system metrics on the training
run, and every stage's numbers on the parent run, the reused ones marked, read back by
``eyas compare``. The real server on a real PostgreSQL: tests/test_team_postgres.py.

Run: ``python3 -m pytest tests/test_team_tracking.py -q``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

from eyas import compare as eyas_compare  # noqa: E402
from eyas import team_tracking, tracking  # noqa: E402
from eyas.config import parse_params  # noqa: E402

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
    outs: [data/features]
  train-scratch:
    cmd: python -m eyas.launch stages.train_scratch
    metrics: [{metrics/train_scratch.json: {cache: false}}]
  eval-accept-len:
    foreach: [scratch]
    do:
      cmd: python -m stages.eval_accept_len ${item}
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
EVAL_DOC = {"drafter": "scratch",
            "chat": {"accept_len": 1.9, "serving_verdict": {"worth_serving": True},
                     "engine": {"same_precision": {"accept_len": 1.85}}},
            "humaneval": {"accept_len": 1.75, "serving_verdict": {"worth_serving": False}},
            "ngram": {"chat": {"accept_len": 1.91}, "humaneval": {"accept_len": 1.54}}}


@pytest.fixture
def team_store(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    (root / "metrics").mkdir(parents=True)
    (root / "dvc.yaml").write_text(DVC_YAML)
    (root / "dvc.lock").write_text(DVC_LOCK)
    for var in ("MLFLOW_TRACKING_URI", "DVC_STAGE", "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV", "RANK",
                "EYAS_TRACKING", "EYAS_EXPERIMENT", "EYAS_SYSTEM_METRICS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DVC_ROOT", str(root))
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    monkeypatch.chdir(root)
    return root


def test_drafter_logged_model_datasets_system_metrics_and_reused_stages(team_store, monkeypatch):
    import torch
    from tiny import tiny_target, write_features

    from eyas.train import new_drafter, train_drafter
    from eyas.vocab import build_mapping, count_tokens, save_mapping
    from stages import common, training

    target = tiny_target()
    train = write_features(target, team_store / "f" / "train", 8, seed=1)
    val = write_features(target, team_store / "f" / "val", 4, seed=2)
    ids, mask = train.token_stats()
    counts = count_tokens(ids, mask, train.manifest["vocab_size"])
    mapping, info = build_mapping(counts, 64)
    save_mapping(common.VOCAB, mapping, counts, info)
    head = {"embed_tokens": target.model.get_input_embeddings().weight.detach(),
            "lm_head": target.model.lm_head.weight.detach()}
    drafter = new_drafter(train.manifest, mapping, head["embed_tokens"], 0)
    # prepare-data's numbers are in metrics/ (checked out by DVC), but it runs no code here: reused
    (team_store / "metrics" / "prepare_data.json").write_text(json.dumps({"conversations": 600, "train": 460}))
    monkeypatch.setenv("DVC_EXP_NAME", "team-exp")
    p = parse_params({"train": {"max_steps": 2, "batch_tokens": 96, "eval_every": 1}})
    monkeypatch.setenv("DVC_STAGE", "train-scratch")
    with tracking.start_stage_run("train-scratch", p) as t:
        assert t.monitor is not None  # a training stage samples system metrics
        result = train_drafter(drafter, train_store=train, val_store=val, lm_head=head["lm_head"],
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
    got = {m.key: m for m in model.metrics}
    assert got["val/acc_0"].value == pytest.approx(result.final_val["acc_0"])
    assert got["val/acc_0"].dataset_digest == FEATURES_MD5[:32]
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
    assert parent.data.metrics["train-scratch/final/acc_0"] == pytest.approx(result.final_val["acc_0"])
    assert parent.data.metrics["eval-accept-len:scratch/chat/accept_len"] == 1.9

    # a second experiment in which only the eval ran: compare shows train-scratch's numbers (reused)
    monkeypatch.setenv("DVC_EXP_NAME", "team-exp-2")
    p2 = parse_params({"train": {"max_steps": 2, "batch_tokens": 96, "eval_every": 1}, "eval": {"chat_prompts": 3}})
    with tracking.start_stage_run("eval-accept-len@scratch", p2) as ev2:
        ev2.log_metrics({"chat/accept_len": 1.9})
    text = eyas_compare.compare()
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
    text = eyas_compare.compare()
    assert row("train-scratch val acc_0").startswith("| train-scratch val acc_0 | – |")


def test_stage_metrics_files_and_run_keys():
    files = team_tracking.stage_metrics_files(Path(__file__).resolve().parents[1] / "dvc.yaml")
    assert files["eval-accept-len@finetune"][0].name == "eval_finetune.json"
    assert files["train-scratch"][0].name == "train_scratch.json"
    assert "target-gguf" not in files  # no metrics declared
    keys = team_tracking.run_keys("eval-accept-len@scratch", EVAL_DOC)
    assert keys["chat/worth_serving"] == 1.0 and keys["humaneval/worth_serving"] == 0.0
    assert keys["chat/ngram_accept_len"] == 1.91 and keys["ngram/chat/accept_len"] == 1.91
    assert team_tracking.run_keys("train-scratch", {"val": {"acc_0": 0.5}, "steps": 3}) == \
        {"val/acc_0": 0.5, "steps": 3.0, "final/acc_0": 0.5}
    assert team_tracking.safe_uri("postgresql://eyas:s3cret@db:5432/mlflow") == "postgresql://eyas:***@db:5432/mlflow"
