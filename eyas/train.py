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

from eyas import checkpoint as ckpt
from eyas import distributed as dist_utils
from eyas.config import TrainParams
from eyas.drafter import Eagle3Drafter
from eyas.features import FeatureStore
from eyas.graphed import GraphedTTT, cuda_graphs_enabled, pad_batch
from eyas.online import loader_for
from eyas.ttt import (
    add_counts,
    autocast,
    evaluate,
    head_rows_for,
    summarise,
    supervised_counts,
    ttt_forward,
)

log = logging.getLogger(__name__)


def new_drafter(manifest: dict, mapping, embed_tokens: torch.Tensor, seed: int,
                mapping_source: str = "the vocab mapping", lm_head: torch.Tensor | None = None) -> Eagle3Drafter:
    """A new drafter shaped for the target that produced ``manifest`` (a feature manifest), using
    its aux layers, the vocab ``mapping`` and the target's ``embed_tokens`` [V, H].

    Its layers start random (seeded with ``seed``). ``lm_head``, the target's lm_head [V, H]:
    the drafter's lm_head starts as the target's rows of the draft vocab (in draft-id order), as
    the speculators trainer does (``speculators/model.py``, ``load_verifier_weights``: the verifier's
    lm_head rows selected by ``t2d``); the drafter then only has to learn a hidden state the
    target's head reads, and every step's gradient is scored against the right tokens from the
    start. None: the lm_head starts random too.

    Raises:
        FeatureError: the mapping, the embedding or ``lm_head`` was built for a target with another
            vocab size.
    """
    from types import SimpleNamespace

    from eyas.drafter import DrafterConfig
    from eyas.features import FeatureError

    if mapping.vocab_size != manifest["vocab_size"]:
        raise FeatureError(f"vocab size mismatch: {mapping_source} covers {mapping.vocab_size} target tokens, "
                           f"the features' target has vocab_size {manifest['vocab_size']}; rebuild the vocab "
                           f"(`dvc repro build-vocab`) from these features")
    for name, w in (("embedding", embed_tokens), ("lm_head", lm_head)):
        if w is not None and w.shape[0] != manifest["vocab_size"]:
            raise FeatureError(f"vocab size mismatch: the target {name} has {w.shape[0]} rows, the "
                               f"features' target has vocab_size {manifest['vocab_size']}; re-run extract")

    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(SimpleNamespace(**manifest["target_config"]), mapping.draft_vocab_size,
                                   aux_layer_ids=manifest["aux_layers"])
    drafter = Eagle3Drafter(cfg)
    drafter.set_embedding(embed_tokens)
    drafter.set_vocab(mapping.d2t, mapping.t2d)
    if lm_head is not None:
        with torch.no_grad():
            drafter.lm_head.weight.copy_(head_rows_for(lm_head, drafter).to(drafter.lm_head.weight.dtype))
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
    """The training loss became NaN/inf; the message names the step, the batch's samples and the
    last good checkpoint."""


class _TTTModule(torch.nn.Module):
    """``ttt_forward`` as a module's forward, so DDP or FSDP can wrap it (DDP's gradient hooks
    and FSDP's all-gather/reduce-scatter hooks need the call to go through ``forward``)."""

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
                  device: torch.device, gate: Callable[[dict], None] | None = None,
                  checkpoint_dir=None, checkpoint_every: int | None = None, capture=None) -> TrainResult:
    """Train ``drafter`` in place with TTT.

    Args:
        lm_head: the target's lm_head [vocab, H_target] (float32); the teacher uses its draft rows.
        tp: TrainParams (ttt_length, step_decay, batch_tokens, epochs, warmup_ratio, ...).
        lr: peak learning rate.
        gate: called with the step-0 val metrics before any update; raise to stop training.
        checkpoint_dir: where resumable state goes (eyas/checkpoint.py; outside DVC outs). When it
            holds a complete checkpoint of the same inputs (params, features, initial drafter),
            training resumes there: weights, optimizer, scheduler, RNG and data position, and
            ``tracker`` gets the metrics logged before the checkpoint (``Tracker.history``, saved
            with it) replayed, so a resumed MLflow run holds the whole curve.
        checkpoint_every: optimizer steps between checkpoints (default ``tp.checkpoint_every``;
            0 = none).
        capture: for token stores (``train.mode: online``): computes each batch's hidden states
            (eyas/online.py ``capture_for``); None for feature stores.
    Raises:
        NonFiniteLossError: at the first non-finite loss, naming the step, samples and the last
            good checkpoint.
    """
    torch.manual_seed(seed)
    # under torchrun: one process group, this rank's device, DDP; otherwise all of this is a no-op
    rank, world, device = dist_utils.init_distributed(device)
    drafter.to(device).train()
    head_rows = head_rows_for(lm_head, drafter).to(device)
    # offline: PackedLoader over the feature shards; online: the same plan, hidden states captured
    train_loader = loader_for(train_store, tp.batch_tokens, seed, capture=capture)
    val_loader = loader_for(val_store, tp.batch_tokens, seed, shuffle=False, capture=capture)
    model = None  # the training module once wrapped; under FSDP evaluation gathers its shards

    def ev() -> dict:
        with dist_utils.gathered(model):
            return evaluate(drafter, val_loader, head_rows, tp.ttt_length, tp.step_decay, device,
                            rank=rank, world=world)

    every = getattr(tp, "checkpoint_every", 0) if checkpoint_every is None else checkpoint_every
    fp = resume_from = None
    if checkpoint_dir is not None:
        # what makes a checkpoint resumable: same params (checkpoint_every aside), features, world
        # size and initial weights
        tp_fp = {k: v for k, v in vars(tp).items() if k not in ("checkpoint_every", "nproc")}
        fp = ckpt.fingerprint(tp_fp, lr, seed, world, train_store.manifest.get("shards"),
                              val_store.manifest.get("shards"), train_store.manifest.get("num_tokens"),
                              *[p.detach() for p in drafter.parameters() if p.requires_grad])
        resume_from = ckpt.find_checkpoint(checkpoint_dir, fp)

    curve: list[dict] = []
    if resume_from is None:
        step0 = ev()
        tracker.log_metrics({f"val/{k}": v for k, v in step0.items()}, step=0)
        curve.append({"step": 0, "split": "val", **step0})
        if gate is not None:
            gate(step0)

    # DDP: rank 0's weights broadcast, gradients averaged in backward; FSDP (eyas/distributed.py):
    # weights, gradients and AdamW state sharded over ranks; one process: unwrapped
    model = dist_utils.wrap_data_parallel(_TTTModule(drafter), tp.strategy, device)
    fsdp = world > 1 and tp.strategy == "fsdp"
    params = [p for p in model.parameters() if p.requires_grad]  # after wrapping: FSDP's DTensors
    # CUDA: the fused AdamW kernel (one launch per step instead of a dozen foreach passes)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=tp.weight_decay,
                            fused=device.type == "cuda")
    # CUDA, one process: forward + backward replayed as one CUDA graph (eyas/graphed.py), every
    # batch padded to one static shape (rows of the loader's row length, rounded up to 128)
    graphed = GraphedTTT(drafter, head_rows, tp.ttt_length, tp.step_decay) \
        if cuda_graphs_enabled(device, world) else None
    static_shape = (train_loader.rows_per_batch, -(-train_loader.row_tokens // 128) * 128)
    per_epoch = [train_loader.num_batches(e, world) for e in range(tp.epochs)]
    total = sum(per_epoch) if tp.max_steps <= 0 else min(tp.max_steps, sum(per_epoch))
    sched = get_cosine_schedule_with_warmup(opt, math.ceil(tp.warmup_ratio * total), total)
    log.info("training %d steps (%s batches per epoch%s), peak lr %.2e", total, per_epoch,
             f" per rank, {world} ranks" if world > 1 else "", lr)

    step, tokens, t0 = 0, 0, time.time()
    last_epoch_counts: dict = {}
    start_epoch, start_batch, last_ckpt, last_ckpt_step = 0, 0, None, 0
    if resume_from is not None:
        install = (lambda w, o: dist_utils.load_full_train_state(model, opt, "drafter.", w, o)) \
            if fsdp else None
        st = ckpt.load_train_state(checkpoint_dir, drafter, opt, sched, fingerprint=fp, install=install)
        if st is None:  # it was complete a moment ago: someone removed it while we started
            raise ckpt.CheckpointError(f"{resume_from}: checkpoint vanished while resuming; rerun")
        step, start_epoch, start_batch, last_ckpt = st.step, st.epoch, st.batch_in_epoch, st.path
        last_ckpt_step = step
        x = st.extra
        # rows were saved as [keys, values] (JSON objects get sorted keys; plots keep column
        # order); JSON null -> NaN
        row = lambda kv: {k: (math.nan if v is None else v) for k, v in zip(*kv)}
        step0, curve, tokens = row(x["step0"]), [row(r) for r in x["curve"]], x["tokens"]
        last_epoch_counts = x["last_epoch_counts"]
        t0 = time.time() - x["seconds"]
        # the metrics the killed run had logged up to this checkpoint (step-0 val, gate, curves):
        # into this run, so it holds the whole history, point for point the DVC plots' rows
        tracker.replay(x.get("mlflow_history", []))
        log.info("resuming at optimizer step %d of %d (epoch %d, batch %d) from %s",
                 step, total, start_epoch, start_batch, st.path)
    val = step0
    for epoch in range(start_epoch, tp.epochs):
        if epoch != start_epoch or resume_from is None:
            last_epoch_counts = {}
        start = start_batch if epoch == start_epoch else 0
        for b_i, batch in enumerate(train_loader.batches(epoch, start=start, rank=rank, world=world), start):
            if step >= total:
                break
            batch = batch.to(device)
            norms = None
            if world > 1:  # normalise by the GLOBAL supervised count: DDP's mean is then exact
                n_glob = dist_utils.all_reduce_sum(supervised_counts(batch, tp.ttt_length))
                norms = n_glob.clamp(min=1).to(torch.float32) / world
            if graphed is not None:  # gradients are already in p.grad
                loss, metrics, counts = graphed.step(pad_batch(batch, *static_shape))
            else:
                with autocast(device):
                    loss, metrics, counts = model(batch, head_rows, tp.ttt_length, tp.step_decay, norms)
            loss_g = loss.detach() if world == 1 else dist_utils.all_reduce_sum(loss.detach()) / world
            if not torch.isfinite(loss_g):
                raise NonFiniteLossError(
                    f"non-finite loss {loss_g.item()} at optimizer step {step + 1} (epoch {epoch}); "
                    f"batch samples (shard, index): {batch.sample_ids[:8]}; last good checkpoint: "
                    f"{f'{last_ckpt} (step {last_ckpt_step})' if last_ckpt else 'none'}")
            if graphed is None:
                opt.zero_grad(set_to_none=True)
                loss.backward()
            # FSDP: the norm over all shards (a replicated DTensor), so every rank clips alike
            grad_norm = torch.nn.utils.clip_grad_norm_(params, tp.grad_clip)
            if fsdp:
                grad_norm = grad_norm.full_tensor()
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
            if checkpoint_dir is not None and every > 0 and step % every == 0 and step < total:
                # FSDP: every rank helps gather the full state; rank 0 writes it
                full = dist_utils.full_train_state(model, opt, "drafter.") if fsdp else None
                if rank == 0:
                    last_ckpt = ckpt.save_train_state(
                        checkpoint_dir, drafter, opt, sched, step=step, epoch=epoch, batch_in_epoch=b_i + 1,
                        fingerprint=fp, extra={"step0": [list(step0), list(step0.values())],
                                               "curve": [[list(r), list(r.values())] for r in curve],
                                               "tokens": tokens,
                                               "last_epoch_counts": last_epoch_counts,
                                               "seconds": time.time() - t0,
                                               "mlflow_history": tracker.history()},
                        full_state=full)
                    tracker.flush()  # the run holds every point up to its checkpoint, even if killed next
                if world > 1:
                    dist_utils.barrier()
                last_ckpt, last_ckpt_step = ckpt.state_dir(checkpoint_dir), step
    seconds = time.time() - t0
    if fsdp:  # the caller gets the drafter with full, plain parameters on every rank (export)
        dist_utils.release(model)
        model = None
    val = ev()
    tracker.log_metrics({f"val/{k}": v for k, v in val.items()}, step=step)
    curve.append({"step": step, "split": "val", **val})
    if world > 1:
        tokens = int(dist_utils.all_reduce_counts({"tokens": tokens})["tokens"])
        dist_utils.barrier()
    return TrainResult(step0_val=step0, final_val=val,
                       final_train=summarise(last_epoch_counts, tp.ttt_length) if last_epoch_counts else {},
                       steps=step, train_tokens=tokens, seconds=seconds, curve=curve)
