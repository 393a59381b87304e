"""Glue shared by the stage scripts: workspace paths and the train-stage epilogue.

Paths are relative to the repository root, where DVC runs every stage (``wdir`` default).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from eyas import checkpoint, features, plots
from eyas.distributed import is_main
from eyas.drafter import Eagle3Drafter
from eyas.export import save_drafter
from eyas.io import load_safetensors, write_json, write_tsv
from eyas.train import TrainResult

CONVERSATIONS = Path("data/conversations")
DISTILLED = Path("data/distilled")  # self-distill: the splits extract reads
FEATURES = Path("data/features")
VOCAB = Path("models/vocab")
METRICS = Path("metrics")
PLOTS = Path("plots")
# the vocab report logged with each trained drafter: a declared dep of that stage
VOCAB_REPORTS = {"train-scratch": VOCAB / "vocab.json",
                 "train-finetune": Path("models/remapped/remap_report.json")}
# resumable training state: outside every DVC out (DVC deletes outs before a stage runs), git-ignored
CHECKPOINTS = Path(".eyas/checkpoints")


def checkpoint_dir(stage: str) -> Path:
    """Where ``stage`` keeps its resumable training state (eyas/checkpoint.py)."""
    return CHECKPOINTS / stage

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")


def target_head() -> dict[str, torch.Tensor]:
    """The target's embedding and lm_head saved by extract ({'embed_tokens', 'lm_head'} [V, H])."""
    return load_safetensors(features.head_path(FEATURES))


def finish_training(stage: str, drafter: Eagle3Drafter, result: TrainResult, out_dir: Path,
                    tracker, extra: dict | None = None) -> dict:
    """Export the drafter, write ``metrics/<stage>.json`` and ``plots/<stage>/{train,val}.tsv``,
    and log the same to MLflow (plus ``<stage>_curves.png``, the exported ``config.json`` and the
    vocab report: ``VOCAB_REPORTS[stage]`` or ``extra["vocab"]``). Returns the metrics dict.
    Under torchrun only rank 0 writes (the others return an empty dict)."""
    if not is_main():
        return {}
    save_drafter(drafter.cpu(), out_dir)
    name = stage.replace("-", "_")
    metrics = {
        "val": result.final_val,
        "step0_val": result.step0_val,
        "train": result.final_train,
        "steps": result.steps,
        "train_tokens": result.train_tokens,
        "seconds": round(result.seconds, 1),
        "tokens_per_second": round(result.train_tokens / max(result.seconds, 1e-9), 1),
        **(extra or {}),
    }
    write_json(METRICS / f"{name}.json", metrics)
    for split in ("train", "val"):
        rows = [{k: v for k, v in r.items() if k != "split"} for r in result.curve if r["split"] == split]
        write_tsv(PLOTS / name / f"{split}.tsv", rows)
    tracker.log_metrics({"final/" + k: v for k, v in result.final_val.items()}, step=result.steps)
    tracker.log_dict(metrics, f"{name}_metrics.json")
    tracker.log_artifact(out_dir / "config.json")
    if extra and "vocab" in extra:  # a drafter with its own vocab (the stand-in)
        tracker.log_dict(extra["vocab"], "vocab_report.json")
    elif stage in VOCAB_REPORTS and VOCAB_REPORTS[stage].is_file():
        tracker.log_artifact(VOCAB_REPORTS[stage])
    tracker.log_figure(plots.ttt_curves_figure(result.curve, title=f"{stage}: TTT curves"), f"{name}_curves.png")
    checkpoint.clear(checkpoint_dir(stage))  # outputs are written: a rerun starts fresh
    return metrics
