"""``train``: TTT training of a drafter (stages train-scratch, train-finetune, stand-in-drafter and remap;
eyas/training/loop.py), and its kernel choices ``train.backend`` (:class:`KernelChoices`).

``train.backend`` is the schema only: what each choice means, and the
:class:`eyas.drafter.backend.Backend` the training entry points build from it (``Backend.of``), are
eyas/drafter/backend.py's (kept apart so that the schema is a dep of the stages that read ``train``
only, not of every stage that imports the backend).
"""

from __future__ import annotations

from dataclasses import dataclass

from eyas.params.schema import EPOCHS_RANGE, MAX_EPOCHS

NAME = "train"

LOSS_TOKENS = ("assistant", "all")  # train.loss_tokens (eyas.training.batches.supervised)

# train.backend.attention, as eyas.drafter.backend.ATTENTION (tests/drafter/test_backend.py holds them equal)
ATTENTION = ("auto", "flex", "dense")


@dataclass(frozen=True, kw_only=True)
class KernelChoices:
    """``train.backend``'s keys (eyas/drafter/backend.py says what each one picks).

    Raises:
        ValueError: ``attention`` is not one of :data:`ATTENTION` (the loader names the key).
    """

    attention: str
    compile: bool
    compile_layers: bool
    triton: bool
    cuda_graphs: bool

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")


@dataclass(kw_only=True)
class TrainParams:
    ttt_length: int
    step_decay: float
    batch_tokens: int
    epochs: int
    warmup_ratio: float
    weight_decay: float
    grad_clip: float
    eval_every: int
    max_steps: int
    checkpoint_every: int  # optimizer steps between resumable checkpoints; 0 = none
    nproc: int  # processes under torchrun (eyas.training.launch); 0 = one per CUDA device
    strategy: str  # data parallelism with nproc > 1: 'ddp' (replicas) or 'fsdp' (FSDP2 shards)
    mode: str  # 'offline': hidden states from extract's shards; 'online': the target computes them
    #            batch by batch, extract stores tokens only (eyas/training/online.py)
    loss_tokens: str  # positions the TTT loss supervises: 'assistant' or 'all' (eyas.training.batches.supervised)
    backend: KernelChoices  # the TTT unroll's kernels (KernelChoices above, eyas/drafter/backend.py)


SCHEMA = TrainParams
RANGES = [
    ("train.ttt_length", lambda v: v >= 1, ">= 1"),
    ("train.step_decay", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("train.batch_tokens", lambda v: v >= 1, ">= 1"),
    ("train.epochs", lambda v: 1 <= v <= MAX_EPOCHS, EPOCHS_RANGE),
    ("train.warmup_ratio", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("train.weight_decay", lambda v: v >= 0, ">= 0"),
    ("train.grad_clip", lambda v: v > 0,
     "> 0 (the gradients' total L2 norm is clipped to it; 0 or less would zero or flip them)"),
    ("train.eval_every", lambda v: v >= 1, ">= 1"),
    ("train.strategy", lambda v: v in ("ddp", "fsdp"),
     "'ddp' or 'fsdp' (eyas/training/distributed.py: DDP replicates the drafter, FSDP2 shards it)"),
    ("train.mode", lambda v: v in ("offline", "online"),
     "'offline' (extract stores the aux hidden states) or 'online' (extract stores tokens only; the train "
     "stages run the target batch by batch: eyas/training/online.py)"),
    ("train.loss_tokens", lambda v: v in LOSS_TOKENS,
     "'assistant' (assistant turns only, as EAGLE-3 and SpecForge) or 'all' (every token: the teacher is the "
     "target's own distribution, prompt tokens included: eyas.training.batches.supervised)"),
    ("train.max_steps", lambda v: v >= 0, ">= 0 (0 = epochs decide)"),
    ("train.checkpoint_every", lambda v: v >= 0, ">= 0 (0 = no checkpoints)"),
    ("train.nproc", lambda v: v >= 0, ">= 0 (0 = one per CUDA device)"),
]
