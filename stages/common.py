"""Glue shared by the stage scripts: workspace paths and the target head.

Paths are relative to the repository root, where DVC runs every stage (``wdir`` default).
Kept light on purpose: every stage imports it, so what it imports is a code dep of every stage
(eyas/pipeline/stage_deps.py); the train-stage epilogue lives in stages/training.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from eyas import features
from eyas.io import load_safetensors

CONVERSATIONS = Path("data/conversations")
DISTILLED = Path("data/distilled")  # self-distill: the splits extract reads
FEATURES = Path("data/features")
VOCAB = Path("models/vocab")
TARGET_GGUF = Path("models/target_gguf")  # target-gguf: config + tokenizer (+ target.gguf) for llama.cpp
METRICS = Path("metrics")
PLOTS = Path("plots")
# the vocab report logged with each trained drafter: a declared dep of that stage
VOCAB_REPORTS = {"train-scratch": VOCAB / "vocab.json",
                 "train-finetune": Path("models/remapped/remap_report.json")}
# resumable training state: outside every DVC out (DVC deletes outs before a stage runs), git-ignored
CHECKPOINTS = Path(".eyas/checkpoints")


def checkpoint_dir(stage: str) -> Path:
    """Where ``stage`` keeps its resumable training state (eyas/training/checkpoint.py)."""
    return CHECKPOINTS / stage

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")


def target_head() -> dict[str, torch.Tensor]:
    """The target's embedding and lm_head saved by extract ({'embed_tokens', 'lm_head'} [V, H])."""
    return load_safetensors(features.head_path(FEATURES))
