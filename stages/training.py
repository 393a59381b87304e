"""The train-stage epilogue shared by train-scratch, train-finetune and stand-in-drafter:
export the drafter, write its metrics and plots, log them to MLflow."""

from __future__ import annotations

import logging
from pathlib import Path

from eyas.drafter.model import Eagle3Drafter
from eyas.export.eagle import save_drafter
from eyas.io import write_json, write_tsv
from eyas.pipeline.provenance import FILE as FINGERPRINT
from eyas.tracking import plots
from eyas.tracking.team import log_drafter_model
from eyas.training import checkpoint
from eyas.training.distributed import is_main
from eyas.training.loop import TrainResult
from stages.common import CONVERSATIONS, FEATURES, METRICS, PLOTS, VOCAB_REPORTS, checkpoint_dir

log = logging.getLogger(__name__)


def finish_training(stage: str, drafter: Eagle3Drafter, result: TrainResult, out_dir: Path,
                    tracker, extra: dict | None = None, fingerprint: dict | None = None,
                    curves: bool = True) -> dict:
    """Export the drafter, write ``metrics/<stage>.json`` and, with ``curves``,
    ``plots/<stage>/{train,val}.tsv`` (the stages whose pipeline file declares them as ``plots``),
    and log the same to MLflow (plus ``<stage>_curves.png``, the exported ``config.json`` and the
    vocab report: ``VOCAB_REPORTS[stage]`` or ``extra["vocab"]``). Returns the metrics dict.
    Under torchrun only rank 0 writes (the others return an empty dict)."""
    if not is_main():
        return {}
    # the fingerprint (eyas/pipeline/provenance.py) goes beside the weights: readers refuse a stale drafter
    save_drafter(drafter.cpu(), out_dir, extra_files={FINGERPRINT: fingerprint} if fingerprint else None)
    name = stage.replace("-", "_")
    metrics = {
        "val": result.final_val,
        "step0_val": result.step0_val,
        "train": result.final_train,
        "steps": result.steps,
        "train_tokens": result.train_tokens,
        "seconds": round(result.seconds, 1),
        "tokens_per_second": round(result.train_tokens / max(result.seconds, 1e-9), 1),
        # the training steps alone (batch wait, copy, step; no val, no checkpoints) and the tokens of
        # real samples they trained on, without padding: the throughput figure of record
        "ms_per_step": round(1e3 * result.step_seconds / max(result.steps, 1), 2),
        "useful_tokens": result.useful_tokens,
        "useful_tokens_per_second": round(result.useful_tokens / max(result.step_seconds, 1e-9), 1),
        **(extra or {}),
    }
    write_json(METRICS / f"{name}.json", metrics)
    for split in ("train", "val") if curves else ():
        rows = [{k: v for k, v in r.items() if k != "split"} for r in result.curve if r["split"] == split]
        write_tsv(PLOTS / name / f"{split}.tsv", rows)
    tracker.log_metrics({"final/" + k: v for k, v in result.final_val.items()}, step=result.steps)
    tracker.log_dict(metrics, f"{name}_metrics.json")
    tracker.log_artifact(out_dir / "config.json")
    try:  # the drafter as an MLflow logged model, its datasets DVC's (eyas/tracking/team.py)
        log_drafter_model(tracker, stage, out_dir, result.final_val, step=result.steps,
                          datasets={str(FEATURES): "training", str(CONVERSATIONS): "source"})
    except Exception as err:  # noqa: BLE001 - MLflow's record never fails a finished training
        log.warning("%s: the drafter was not logged as an MLflow model: %s", stage, err)
    if extra and "vocab" in extra:  # a drafter with its own vocab (the stand-in)
        tracker.log_dict(extra["vocab"], "vocab_report.json")
    elif stage in VOCAB_REPORTS and VOCAB_REPORTS[stage].is_file():
        tracker.log_artifact(VOCAB_REPORTS[stage])
    tracker.log_figure(plots.ttt_curves_figure(result.curve, title=f"{stage}: TTT curves"), f"{name}_curves.png")
    checkpoint.clear(checkpoint_dir(stage))  # outputs are written: a rerun starts fresh
    return metrics
