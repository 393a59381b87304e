"""The TTT training loop: AdamW, cosine schedule with warmup, grad clipping, val evaluation.

Used by train-scratch, train-finetune and the stand-in drafter stage. The loss and metrics are in
eyas/ttt.py; logging goes through a :class:`eyas.tracking.Tracker` (a no-op one when logging is
off), so the loop has no logging branches.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import get_cosine_schedule_with_warmup

from eyas.config import TrainParams
from eyas.drafter import Eagle3Drafter
from eyas.features import FeatureStore
from eyas import distributed as dist_utils
from eyas.ttt import (PackedLoader, add_counts, autocast, evaluate, head_rows_for, summarise,
                      supervised_counts, ttt_forward)

log = logging.getLogger(__name__)


def new_drafter(manifest: dict, mapping, embed_tokens: torch.Tensor, seed: int) -> Eagle3Drafter:
    """A randomly initialised drafter shaped for the target that produced ``manifest`` (a feature
    manifest), using its aux layers, the vocab ``mapping`` and the target's ``embed_tokens``."""
    from types import SimpleNamespace

    from eyas.drafter import DrafterConfig

    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(SimpleNamespace(**manifest["target_config"]), mapping.draft_vocab_size,
                                   aux_layer_ids=manifest["aux_layers"])
    drafter = Eagle3Drafter(cfg)
    drafter.set_embedding(embed_tokens)
    drafter.set_vocab(mapping.d2t, mapping.t2d)
    return drafter


class GateError(RuntimeError):
    """Fine-tuning a trained drafter started at chance level: training would be wasted."""


def step0_gate(draft_vocab_size: int, margin: float, min_acc: float, override: bool,
               tracker=None) -> Callable[[dict], None]:
    """A gate for :func:`train_drafter`: before the first update, a drafter fine-tuned from a
    trained source must beat chance. It fires when val ``loss_0 > ln(draft_vocab_size) - margin``
    or ``acc_0 < min_acc``; ``override`` turns the error into a warning.

    Raises (from the returned callable):
        GateError: naming the numbers and the usual causes.
    """
    chance = math.log(draft_vocab_size)

    def gate(m: dict) -> None:
        fired = m["loss_0"] > chance - margin or m["acc_0"] < min_acc
        if tracker is not None:
            tracker.log_metrics({"gate/fired": float(fired), "gate/chance_loss": chance})
        if not fired:
            return
        msg = (f"step-0 gate: val loss_0 {m['loss_0']:.3f} (chance ln({draft_vocab_size}) = {chance:.3f}, "
               f"margin {margin}) and acc_0 {m['acc_0']:.3f} (floor {min_acc}) say this trained drafter "
               f"predicts at chance on these features. Likely causes: a vocab mapping that does not "
               f"match its lm_head rows (run the remap stage; compare d2t with `eyas inspect --vocab`), "
               f"aux hidden-state layer ids that differ from the extraction, or a different target "
               f"model/version. Set train_finetune.gate_override: true to train anyway.")
        if not override:
            raise GateError(msg)
        log.warning("%s (overridden)", msg)

    return gate


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN/inf; the message names the step and the batch's samples."""


class _TTTModule(torch.nn.Module):
    """``ttt_forward`` as a module's forward, so DDP can wrap it (its gradient hooks and the
    bucketed all-reduce overlapping backward need the call to go through ``forward``)."""

    def __init__(self, drafter: Eagle3Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch, head_rows, ttt_length, step_decay, step_norms=None):
        return ttt_forward(self.drafter, batch, head_rows, ttt_length, step_decay, step_norms=step_norms)


@dataclass
class TrainResult:
    step0_val: dict   # val metrics before the first optimizer step
    final_val: dict   # val metrics after training
    final_train: dict  # train metrics averaged over the last epoch
    steps: int
    train_tokens: int
    seconds: float
    curve: list       # rows for the DVC plots file: step, split, metrics


def train_drafter(drafter: Eagle3Drafter, *, train_store: FeatureStore, val_store: FeatureStore,
                  lm_head: torch.Tensor, tp: TrainParams, lr: float, seed: int, tracker,
                  device: torch.device, gate: Callable[[dict], None] | None = None) -> TrainResult:
    """Train ``drafter`` in place with TTT.

    Args:
        lm_head: the target's lm_head [vocab, H_target] (float32); the teacher uses its draft rows.
        tp: TrainParams (ttt_length, step_decay, batch_tokens, epochs, warmup_ratio, ...).
        lr: peak learning rate.
        gate: called with the step-0 val metrics before any update; raise to stop training.
    Raises:
        NonFiniteLossError: at the first non-finite loss, naming the step and samples.
    """
    torch.manual_seed(seed)
    # under torchrun: one process group, this rank's device, DDP; otherwise all of this is a no-op
    rank, world, device = dist_utils.init_distributed(device)
    drafter.to(device).train()
    head_rows = head_rows_for(lm_head, drafter).to(device)
    train_loader = PackedLoader(train_store, tp.batch_tokens, seed)
    val_loader = PackedLoader(val_store, tp.batch_tokens, seed, shuffle=False)
    ev = lambda: evaluate(drafter, val_loader, head_rows, tp.ttt_length, tp.step_decay, device,
                          rank=rank, world=world)

    curve: list[dict] = []
    step0 = ev()
    tracker.log_metrics({f"val/{k}": v for k, v in step0.items()}, step=0)
    curve.append({"step": 0, "split": "val", **step0})
    if gate is not None:
        gate(step0)

    params = [p for p in drafter.parameters() if p.requires_grad]
    model = _TTTModule(drafter)
    if world > 1:
        # broadcasts rank 0's weights at construction; averages gradients during backward
        model = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=tp.weight_decay)
    per_epoch = [train_loader.num_batches(e, world) for e in range(tp.epochs)]
    total = sum(per_epoch) if tp.max_steps <= 0 else min(tp.max_steps, sum(per_epoch))
    sched = get_cosine_schedule_with_warmup(opt, math.ceil(tp.warmup_ratio * total), total)
    log.info("training %d steps (%s batches per epoch%s), peak lr %.2e", total, per_epoch,
             f" per rank, {world} ranks" if world > 1 else "", lr)

    step, tokens, t0 = 0, 0, time.time()
    last_epoch_counts: dict = {}
    val = step0
    for epoch in range(tp.epochs):
        last_epoch_counts = {}
        for batch in train_loader.batches(epoch, rank=rank, world=world):
            if step >= total:
                break
            batch = batch.to(device)
            norms = None
            if world > 1:  # normalise by the GLOBAL supervised count: DDP's mean is then exact
                n_glob = dist_utils.all_reduce_sum(supervised_counts(batch, tp.ttt_length))
                norms = n_glob.clamp(min=1).to(torch.float32) / world
            with autocast(device):
                loss, metrics, counts = model(batch, head_rows, tp.ttt_length, tp.step_decay, norms)
            loss_g = loss.detach() if world == 1 else dist_utils.all_reduce_sum(loss.detach()) / world
            if not torch.isfinite(loss_g):
                raise NonFiniteLossError(
                    f"non-finite loss {loss_g.item()} at optimizer step {step + 1} (epoch {epoch}); "
                    f"batch samples (shard, index): {batch.sample_ids[:8]}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, tp.grad_clip)
            opt.step()
            sched.step()
            step += 1
            tokens += int(batch.input_ids.numel())
            if world > 1:
                counts = dist_utils.all_reduce_counts(counts)
                metrics = summarise(counts, tp.ttt_length)
            add_counts(last_epoch_counts, counts)
            loss_f = loss_g.item()
            tracker.log_metrics({"train/loss": loss_f, "train/grad_norm": grad_norm.item(),
                                 "train/lr": sched.get_last_lr()[0],
                                 **{f"train/{k}": v for k, v in metrics.items()}}, step=step)
            curve.append({"step": step, "split": "train", "loss": loss_f, **metrics})
            if step % tp.eval_every == 0 and step < total:
                val = ev()
                tracker.log_metrics({f"val/{k}": v for k, v in val.items()}, step=step)
                curve.append({"step": step, "split": "val", **val})
    seconds = time.time() - t0
    val = ev()
    tracker.log_metrics({f"val/{k}": v for k, v in val.items()}, step=step)
    curve.append({"step": step, "split": "val", **val})
    if world > 1:
        tokens = int(dist_utils.all_reduce_counts({"tokens": tokens})["tokens"])
        dist_utils.barrier()
    return TrainResult(step0_val=step0, final_val=val,
                       final_train=summarise(last_epoch_counts, tp.ttt_length) if last_epoch_counts else {},
                       steps=step, train_tokens=tokens, seconds=seconds, curve=curve)
