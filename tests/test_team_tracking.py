"""eyas/pipeline/team_tracking.py without a store: which metrics files each stage declares, and the names a
stage's numbers get on the parent run and the logged model. The logged model, the system metrics and
the reused stages on the real MLflow server and PostgreSQL: tests/test_team_postgres.py.

Run: ``python3 -m pytest tests/test_team_tracking.py -q``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("mlflow")
from eyas.pipeline import team_tracking  # noqa: E402

EVAL_DOC = {"drafter": "scratch",
            "chat": {"accept_len": 1.9, "serving_verdict": {"worth_serving": True},
                     "engine": {"same_precision": {"accept_len": 1.85}}},
            "humaneval": {"accept_len": 1.75, "serving_verdict": {"worth_serving": False}},
            "ngram": {"chat": {"accept_len": 1.91}, "humaneval": {"accept_len": 1.54}}}


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
