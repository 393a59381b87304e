"""The TTT training loop: AdamW, cosine schedule with warmup, grad clipping, val evaluation, and on
one GPU the training step's forward + backward replayed as one CUDA graph (:class:`GraphedTTT`).

Used by train-scratch, train-finetune and the stand-in drafter stage. :func:`train_drafter` is a
short loop over the named pieces of a :class:`Trainer` (setup, resume, step, log, checkpoint,
finish); the computation is :class:`eyas.training.unroll.TTTUnroll` (loss and alignment) and the metrics
are eyas/training/batches.py's; the kernels are ``tp.backend`` (eyas/drafter/backend.py). Logging goes through a
:class:`eyas.tracking.runs.Tracker` (a no-op one when logging is off), so the loop has no logging
branches.

One module past 500 lines: the :class:`Trainer`'s pieces share its state (the step, the resume point,
the batch stream and its background loader, the throughput counters), and each is short; split apart
they would pass that state around. :class:`GraphedTTT` is the Trainer's step on one GPU, used nowhere
else.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from transformers import get_cosine_schedule_with_warmup

from eyas.drafter.backend import Backend
from eyas.drafter.model import Eagle3Drafter
from eyas.features import FeatureStore
from eyas.params.train import TrainParams
from eyas.training import checkpoint as ckpt
from eyas.training import distributed as dist_utils
from eyas.training.batches import (
    TENSOR_FIELDS,
    Batch,
    add_counts,
    autocast,
    counts_from_stats,
    head_rows_for,
    pad_batch,
    prefetch,
    static_shape,
    summarise,
    supervised,
)
from eyas.training.online import loader_for
from eyas.training.unroll import TTTUnroll, evaluate, supervised_counts

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

    from eyas.drafter.model import DrafterConfig
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


# accuracy at most this many times uniform chance (1 / V) counts as chance level: always 2x; with a loss
# near chance 10x (skewed token frequencies put rows scored against the wrong tokens at 2-4x)
CHANCE_MULTIPLE, CHANCE_MULTIPLE_NEAR_CHANCE_LOSS = 2, 10


def step0_gate(draft_vocab_size: int, margin: float, min_acc: float, override: bool,
               tracker=None, remap_step0: dict | None = None) -> Callable[[dict], None]:
    """A gate for :func:`train_drafter`: before the first update, a drafter fine-tuned from a
    trained source must predict above chance. It refuses when val ``acc_0`` is under ``min_acc``, or
    at chance level whatever the floor: at most 2 / ``draft_vocab_size``, or at most 10 /
    ``draft_vocab_size`` with a loss near chance (``loss_0 > ln(draft_vocab_size) - margin``; token
    frequencies are skewed, so rows scored against the wrong tokens still hit 2-4x uniform chance,
    while a small vocab's trained drafter can sit at 6x with a low loss; never above 0.5, so a vocab of
    2-20 ids keeps a reachable bar), or when the loss or the
    accuracy is not finite; ``override`` turns the refusal into a warning.

    A loss near chance with accuracy above those bars only warns (and logs
    ``gate/loss_near_chance``): a correct mapping gives it on data the source
    never saw. The remap stage measures the cases (metrics/remap.json, ``step0_val``): the remapped
    rows keep the source's accuracy under its own mapping exactly while the loss rises by a fraction
    of a nat, the rows initialised from the target's lm_head taking probability mass (on data the
    source never saw, up to just under the bar); rows left in place score a few times uniform
    chance. A partly wrong mapping can
    also raise the loss at equal accuracy (rows of rarely predicted tokens), so the warning names both.

    ``remap_step0``: the remap stage's ``step0_val`` on the same val features (``source_own_mapping``
    and ``remapped``, each ``{"loss_0", "acc_0"}``). When the remapped drafter kept at least 0.9 of
    the source's own accuracy there, the mapping carried the rows and the refusal says the cause is
    elsewhere instead of naming the mapping.

    Raises (from the returned callable):
        GateError: naming the numbers and the causes that remain: at chance level, a vocab mapping
            that does not match its lm_head rows (not named when ``remap_step0`` clears it), a
            source trained with tensors of its own that eyas replaced by the target's, aux layers
            that differ from the extraction, another target; under the floor but above chance,
            those or a source trained on other data.
        ValueError: (at once) ``draft_vocab_size`` < 2, or ``margin`` outside [0, ln(draft_vocab_size)):
            a margin past chance flags every drafter.
    """
    if draft_vocab_size < 2 or not 0 <= margin < math.log(draft_vocab_size):
        raise ValueError(f"step-0 gate: needs draft_vocab_size >= 2 and 0 <= gate_margin < ln(draft_vocab_size); got "
                         f"draft_vocab_size {draft_vocab_size}, gate_margin {margin}")
    chance = math.log(draft_vocab_size)

    def gate(m: dict) -> None:
        loss, acc = m["loss_0"], m["acc_0"]
        finite = math.isfinite(loss) and math.isfinite(acc)
        near_chance = loss > chance - margin  # NaN: False; inf: True
        multiple = CHANCE_MULTIPLE_NEAR_CHANCE_LOSS if near_chance else CHANCE_MULTIPLE
        chance_acc = min(multiple / draft_vocab_size, 0.5)  # a tiny vocab: at most a coin flip is chance
        at_chance = finite and acc <= chance_acc
        fired = not finite or at_chance or acc < min_acc
        if tracker is not None:
            tracker.log_metrics({"gate/fired": float(fired), "gate/loss_near_chance": float(near_chance),
                                 "gate/chance_loss": chance})
        head = (f"step-0 gate: val loss_0 {loss:.3f} (chance ln({draft_vocab_size}) = {chance:.3f}, margin {margin}) "
                f"and acc_0 {acc:.5f} (floor {min_acc}; chance level <= {multiple} / {draft_vocab_size} = "
                f"{chance_acc:.5f}{' with the loss near chance' if near_chance else ''})")
        mapping = _mapping_cause(remap_step0)
        if not fired:
            if near_chance:
                log.warning("%s: the loss is near chance while the accuracy is not. Causes: a source trained on "
                            "other data, or a partly wrong vocab mapping; %s. Training goes on.", head, _DATA_SHIFT)
            return
        msg = head + _why(finite, at_chance, mapping) + " Set train_finetune.gate_override: true to train anyway."
        if not override:
            raise GateError(msg)
        log.warning("%s (overridden)", msg)

    return gate


_OTHER_CAUSES = ("tensors of the source's own that eyas replaced by the target's (an embed_tokens.weight of its "
                 "own: `eyas inspect <source>`), aux hidden-state layer ids that differ from the extraction, or a "
                 "different target model/version")
"""The causes of a low step-0 accuracy besides the vocab mapping and the data, as the gate names them."""

_DATA_SHIFT = ("remap's step0_val (metrics/remap.json) has the source's loss and accuracy under its own mapping "
               "on these features: near chance there too means the data differ (a domain shift, e.g. a chat-only "
               "drafter on code-heavy features); a remapped accuracy far below the source's own, or a loss far "
               "above it, points at the mapping")
"""How to tell a source trained on other data from a wrong mapping, as the gate says it."""


def _mapping_cause(remap_step0: dict | None) -> str:
    """The causes a step-0 refusal names besides the data: the vocab mapping and :data:`_OTHER_CAUSES`, or,
    when ``remap_step0`` (see :func:`step0_gate`) shows the remapped drafter kept at least 0.9 of the
    source's own accuracy, :data:`_OTHER_CAUSES` alone, saying why the mapping is cleared.

    Raises:
        KeyError: ``remap_step0`` has both entries and one lacks ``acc_0``.
    """
    own, rem = (remap_step0 or {}).get("source_own_mapping"), (remap_step0 or {}).get("remapped")
    if own and rem and math.isfinite(rem["acc_0"]) and rem["acc_0"] >= 0.9 * own["acc_0"]:
        return (f"not the vocab mapping (remap measured the source under its own mapping at acc_0 "
                f"{own['acc_0']:.5f} and the remapped drafter at {rem['acc_0']:.5f} on these features: the "
                f"new mapping kept its rows); the source itself predicts this poorly as eyas runs it: "
                f"{_OTHER_CAUSES}")
    return ("a vocab mapping that does not match its lm_head rows (run the remap stage; compare d2t with "
            f"`eyas inspect --vocab`), {_OTHER_CAUSES}")


def _why(finite: bool, at_chance: bool, mapping: str) -> str:
    """The part of a step-0 refusal after its numbers: what failed (not finite, at chance level, or
    under the floor) and the causes that remain (``mapping``: :func:`_mapping_cause`)."""
    if not finite:
        return ": not finite: a NaN/inf in the source drafter's weights or in the features."
    if at_chance:
        return f" say this trained drafter predicts at chance on these features. Causes: {mapping}."
    return (f": the accuracy is above chance but under the floor. Causes: {mapping}; or a source trained on "
            f"other data: {_DATA_SHIFT}.")


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN/inf; the message names the step, the batch's samples and the
    last good checkpoint."""


@dataclass
class TrainResult:
    step0_val: dict   # val metrics before the first optimizer step
    final_val: dict   # val metrics after training
    final_train: dict  # train metrics averaged over the last epoch
    steps: int
    train_tokens: int  # tokens of the packed batches, their row padding included
    seconds: float
    curve: list       # rows for the DVC plots file: step, split, metrics
    useful_tokens: int  # tokens of real samples (Batch.useful_tokens): no padding
    step_seconds: float  # wall time of the steps: waiting for the batch, its copy, the step (no val, no checkpoints)


def clip_in_step(opt: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``opt``'s parameters to total L2 norm ``max_norm`` inside the next
    ``opt.step()``.

    ``torch.nn.utils.clip_grad_norm_``'s rule (the gradients times
    ``min(1, max_norm / (norm + 1e-6))``), with the multiplication left to a fused optimizer:
    its kernel divides each gradient by ``opt.grad_scale`` as it reads it and writes the result
    back (the hook ``torch.amp.GradScaler`` uses: ``pytorch/pytorch: torch/optim/adam.py``,
    ``_fused_adam``), so the gradients are not read and written once more only to be scaled
    (a full pass over the fp32 gradients: ``dev/results/profile_train.json``). The norm is over
    every parameter of every group that has a gradient, the set the scale applies to. Equal to
    clipping first up to float32 rounding (tests/training/test_loop.py).

    Args:
        opt: an optimizer built with ``fused=True`` (others reject ``grad_scale``).
        max_norm: the clip threshold.
    Returns:
        The total norm of the gradients before clipping: 0-dim float32 tensor on their device.
    Raises:
        ValueError: ``max_norm`` <= 0 (``clip_grad_norm_`` would zero or flip the gradients), or an
            optimizer whose step does not apply ``grad_scale`` (not fused, or a kind without the
            hook: it would fail at ``step()`` or silently not clip).
    """
    if not max_norm > 0:
        raise ValueError(f"clip_in_step: max_norm must be > 0, got {max_norm}")
    if not (opt.defaults.get("fused") and getattr(opt, "_step_supports_amp_scaling", False)):
        raise ValueError(f"clip_in_step: {type(opt).__name__} (fused={opt.defaults.get('fused')}) does not apply "
                         f"grad_scale in its step; build it with fused=True (AdamW, Adam, SGD, Adagrad) or clip "
                         f"with torch.nn.utils.clip_grad_norm_")
    grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads).float()
    opt.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0)
    return norm


# --- the CUDA-graph step -------------------------------------------------------------------------
# The TTT forward + backward of one training step, captured in a CUDA graph and replayed.

class GraphedTTT:
    """Forward + backward of the TTT loss over a batch as one CUDA graph replay.

    ``step(batch)`` runs ``unroll``'s forward and backward on ``batch``, leaves the gradient in
    ``p.grad`` of every trainable parameter (overwritten, not accumulated) and returns (loss:
    detached scalar float32 tensor on the device, metrics as in :func:`eyas.training.unroll.ttt_forward`,
    counts as there). The first batch of a new shape is run ``warmup`` times eagerly on a side
    stream (compilation, cuBLAS workspaces) before capture; its shape then replaces any earlier
    graph. Whether training uses it at all is :meth:`eyas.drafter.backend.Backend.graphs`: on CUDA, one
    process (DDP's gradient hooks are not captured); a whole train_drafter run with graphs
    matches eager (tests/training/test_loop.py, on a GPU).

    At a few thousand tokens per step the TTT unroll is launch/overhead-bound: 7 steps of compiled
    layer halves, flex attention, the compiled head+loss and the eager bookkeeping between them issue
    a few thousand kernels, each behind Python, Dynamo guard checks and the autograd engine. Shapes
    are static for a given batch shape, so the whole forward (block masks included) and backward can
    be recorded once and replayed as one launch (PyTorch's "whole network capture",
    https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs).

    What the graph holds: :class:`eyas.training.unroll.TTTUnroll`'s forward under bf16 autocast (the flex block mask of
    the batch is rebuilt from the static ``doc_ids`` inside the graph, so every batch gets its own
    mask) and ``loss.backward()``, whose gradients are allocated in the graph's memory pool during
    capture and rewritten by every replay (no zeroing pass, no accumulation into old gradients). Not
    in the graph: copying the batch into the static inputs, the finiteness check, clipping and the
    optimizer step (eager, unchanged), so a non-finite loss still stops training before any update.
    The caller must not replace ``.grad`` (``zero_grad(set_to_none=True)``) between steps: the
    optimizer must read the tensors the graph writes.

    One graph (one batch shape) at a time: :func:`eyas.training.batches.pad_batch` pads batches to a
    fixed shape with rows that carry no loss and attend only to themselves, so a training run captures
    once.
    """

    def __init__(self, unroll: TTTUnroll, warmup: int = 3):
        self.unroll, self.warmup = unroll, warmup
        self.params = [p for p in unroll.parameters() if p.requires_grad]
        self.graph = self.static = self.loss = self.stats = None
        self.captures = 0

    def _body(self):
        # gradients are written, not accumulated: during capture backward allocates them in the
        # graph's pool and every replay rewrites that memory (no zeroing pass, no add into it)
        for p in self.params:
            p.grad = None
        with autocast(self.static.input_ids.device):
            loss, stats = self.unroll(self.static)
        loss.backward()
        return loss.detach(), stats

    def _load(self, batch: Batch) -> None:
        for name in TENSOR_FIELDS:
            getattr(self.static, name).copy_(getattr(batch, name), non_blocking=True)

    def _capture(self, batch: Batch) -> None:
        self.graph = self.loss = self.stats = None
        self.static = Batch(**{n: getattr(batch, n).clone() for n in TENSOR_FIELDS}, sample_ids=[])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        # copy_ bumps doc_ids' version, so the block-mask memo (eyas.drafter.attention.doc_causal_block_mask)
        # misses and the mask is built INSIDE the graph, from the static doc_ids
        self._load(batch)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the loader's thread (eyas.training.batches.prefetch) may pin a batch meanwhile;
        # pin_memory queries CUDA events, which "global" mode forbids in every thread during a capture
        # (pytorch/pytorch PR #146924); nothing of that thread touches the captured stream
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.loss, self.stats = self._body()
        self.captures += 1

    def step(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float], dict]:
        if self.static is None or self.static.input_ids.shape != batch.input_ids.shape \
                or self.static.aux_hidden.shape != batch.aux_hidden.shape:
            self._capture(batch)
        else:
            self._load(batch)
        self.graph.replay()
        counts = counts_from_stats(self.stats)
        return self.loss, dict(summarise(counts, self.unroll.ttt_length)), counts


class Trainer:
    """The pieces of one training run, torchtitan-style: setup (:meth:`__init__`, :meth:`build`),
    resume (:meth:`resume`), step (:meth:`train_step`), log (:meth:`log_val`) and checkpoint
    (:meth:`checkpoint`), then :meth:`finish`. :func:`train_drafter` is the loop that calls them.

    The computation is one :class:`eyas.training.unroll.TTTUnroll` over ``drafter``: wrapped by DDP or FSDP
    under torchrun (eyas/training/distributed.py), replayed as a CUDA graph on one GPU (:class:`GraphedTTT`,
    when ``tp.backend`` allows), called eagerly otherwise; evaluation runs a second, never-wrapped
    unroll of the same drafter (under FSDP inside :func:`eyas.training.distributed.gathered`).
    """

    def __init__(self, drafter: Eagle3Drafter, *, lm_head: torch.Tensor, tp: TrainParams, lr: float, tracker,
                 device: torch.device, rank: int, world: int, val_loader):
        self.drafter, self.tp, self.lr, self.tracker = drafter, tp, lr, tracker
        self.device, self.rank, self.world, self.val_loader = device, rank, world, val_loader
        self.backend = Backend.of(tp.backend)
        drafter.to(device).train()
        self.head_rows = head_rows_for(lm_head, drafter).to(device)
        self.eval_unroll = TTTUnroll(drafter, self.head_rows, tp.ttt_length, tp.step_decay, self.backend)
        self.model = None  # the training module once built; under FSDP evaluation gathers its shards
        self.fsdp = world > 1 and tp.strategy == "fsdp"
        self.step, self.tokens, self.t0 = 0, 0, time.time()
        self.useful_tokens, self.step_seconds = 0, 0.0
        self.asked_at = time.perf_counter()  # when the loop asked for the current step's batch
        self.curve: list[dict] = []
        self.step0: dict = {}
        self.last_epoch_counts: dict = {}
        self.start_epoch, self.start_batch, self.resumed = 0, 0, False
        self.last_ckpt, self.last_ckpt_step = None, 0

    # --- setup ------------------------------------------------------------------------------
    def build(self, train_loader) -> None:
        """The training module, AdamW, the cosine schedule and (one GPU) the CUDA-graph step."""
        tp, device = self.tp, self.device
        # DDP: rank 0's weights broadcast, gradients averaged in backward; FSDP (eyas/training/distributed.py):
        # weights, gradients and AdamW state sharded over ranks; one process: unwrapped
        unroll = TTTUnroll(self.drafter, self.head_rows, tp.ttt_length, tp.step_decay, self.backend)
        self.model = dist_utils.wrap_data_parallel(unroll, tp.strategy, device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # after wrapping: FSDP's DTensors
        # CUDA: the fused AdamW kernel (one launch per step instead of a dozen foreach passes);
        # unsharded, it also applies the clip (clip_in_step)
        self.opt = torch.optim.AdamW(self.params, lr=self.lr, betas=(0.9, 0.95), weight_decay=tp.weight_decay,
                                     fused=device.type == "cuda")
        self.clip_in_kernel = device.type == "cuda" and not self.fsdp
        # CUDA, one process: forward + backward replayed as one CUDA graph (GraphedTTT)
        self.graphed = GraphedTTT(unroll) if self.backend.graphs(device, self.world) else None
        # compiled code (and the graph) sees one batch shape: every batch padded to it
        # (eyas.training.batches.static_shape)
        self.static_shape = static_shape(train_loader) if device.type == "cuda" and self.backend.compile else None
        per_epoch = [train_loader.num_batches(e, self.world) for e in range(tp.epochs)]
        self.total = sum(per_epoch) if tp.max_steps <= 0 else min(tp.max_steps, sum(per_epoch))
        self.sched = get_cosine_schedule_with_warmup(self.opt, math.ceil(tp.warmup_ratio * self.total), self.total)
        log.info("training %d steps (%s batches per epoch%s), peak lr %.2e", self.total, per_epoch,
                 f" per rank, {self.world} ranks" if self.world > 1 else "", self.lr)

    # --- resume -----------------------------------------------------------------------------
    def resume(self, checkpoint_dir, fp: str, found, code: str | None = None) -> None:
        """Restore weights, optimizer, schedule, RNG, data position, curve and the MLflow history
        from the checkpoint ``found`` (``ckpt.find_checkpoint``) in ``checkpoint_dir``.

        Raises:
            eyas.training.checkpoint.CheckpointError: the checkpoint vanished since it was found.
        """
        install = (lambda w, o: dist_utils.load_full_train_state(self.model, self.opt, "drafter.", w, o)) \
            if self.fsdp else None
        st = ckpt.load_train_state(checkpoint_dir, self.drafter, self.opt, self.sched, fingerprint=fp,
                                   code=code, install=install)
        if st is None:  # it was complete a moment ago: someone removed it while we started
            raise ckpt.CheckpointError(f"{found}: checkpoint vanished while resuming; rerun")
        self.step, self.start_epoch, self.start_batch, self.last_ckpt = st.step, st.epoch, st.batch_in_epoch, st.path
        self.last_ckpt_step, self.resumed = self.step, True
        x = st.extra
        # rows were saved as [keys, values] (JSON objects get sorted keys; plots keep column
        # order); JSON null -> NaN
        row = lambda kv: {k: (math.nan if v is None else v) for k, v in zip(*kv)}
        self.step0, self.curve, self.tokens = row(x["step0"]), [row(r) for r in x["curve"]], x["tokens"]
        self.useful_tokens, self.step_seconds = x["useful_tokens"], x["step_seconds"]
        self.last_epoch_counts = x["last_epoch_counts"]
        self.t0 = time.time() - x["seconds"]
        # the metrics the killed run had logged up to this checkpoint (step-0 val, gate, curves):
        # into this run, so it holds the whole history, point for point the DVC plots' rows
        self.tracker.replay(x.get("mlflow_history", []))
        log.info("resuming at optimizer step %d of %d (epoch %d, batch %d) from %s",
                 self.step, self.total, self.start_epoch, self.start_batch, st.path)

    def batches(self, train_loader) -> Iterator[tuple[int, int, Batch]]:
        """(epoch, batch index in the epoch, batch) from the resume point to the last step; the
        last epoch's counts (``final_train``) restart at every epoch boundary.

        Packed by a background thread ``train_loader.prefetch_depth`` batches ahead (0: in this
        thread), in pinned memory on CUDA (:func:`eyas.training.batches.prefetch`); the batches
        and their order are the loader's. Close the generator when stopping early
        (``contextlib.closing``): that stops the thread."""
        depth = train_loader.prefetch_depth
        for epoch in range(self.start_epoch, self.tp.epochs):
            if epoch != self.start_epoch or not self.resumed:
                self.last_epoch_counts = {}
            start = self.start_batch if epoch == self.start_epoch else 0
            self.asked_at = time.perf_counter()
            it = train_loader.batches(epoch, start=start, rank=self.rank, world=self.world)
            with contextlib.closing(prefetch(it, depth, pin=self.device.type == "cuda") if depth else it) as it:
                for b_i, batch in enumerate(it, start):
                    if self.step >= self.total:
                        break
                    yield epoch, b_i, batch
                    self.asked_at = time.perf_counter()

    # --- step -------------------------------------------------------------------------------
    def train_step(self, batch: Batch, epoch: int) -> None:
        """One optimizer step on ``batch``, logged.

        Raises:
            NonFiniteLossError: a non-finite loss (before any update), naming the step, the batch's
                samples and the last good checkpoint.
        """
        tp, world = self.tp, self.world
        useful = batch.useful_tokens()  # from the host's doc ids, before the copy: no sync
        batch = supervised(batch.to(self.device, non_blocking=batch.is_pinned()), tp.loss_tokens)
        norms = None
        if world > 1:  # normalise by the GLOBAL supervised count: DDP's mean is then exact
            n_glob = dist_utils.all_reduce_sum(supervised_counts(batch, tp.ttt_length))
            norms = n_glob.clamp(min=1).to(torch.float32) / world
        padded = batch if self.static_shape is None else pad_batch(batch, *self.static_shape)
        if self.graphed is not None:  # gradients are already in p.grad
            loss, metrics, counts = self.graphed.step(padded)
        else:
            with autocast(self.device):
                loss, stats = self.model(padded, norms)
            counts = counts_from_stats(stats)
            metrics = dict(summarise(counts, tp.ttt_length))
        loss_g = loss.detach() if world == 1 else dist_utils.all_reduce_sum(loss.detach()) / world
        if not torch.isfinite(loss_g):
            raise NonFiniteLossError(
                f"non-finite loss {loss_g.item()} at optimizer step {self.step + 1} (epoch {epoch}); "
                f"batch samples (shard, index): {batch.sample_ids[:8]}; last good checkpoint: "
                f"{f'{self.last_ckpt} (step {self.last_ckpt_step})' if self.last_ckpt else 'none'}")
        if self.graphed is None:
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
        if self.clip_in_kernel:
            grad_norm = clip_in_step(self.opt, tp.grad_clip)
        else:
            # FSDP: the norm over all shards (a replicated DTensor), so every rank clips alike
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, tp.grad_clip)
            if self.fsdp:
                grad_norm = grad_norm.full_tensor()
        self.opt.step()
        self.sched.step()
        self.step += 1
        self.tokens += int(batch.input_ids.numel())
        if world > 1:  # every rank's useful tokens ride along with the counts' reduction
            counts = dist_utils.all_reduce_counts({**counts, "useful_tokens": useful})
            useful = int(counts.pop("useful_tokens"))
            metrics = summarise(counts, tp.ttt_length)
        add_counts(self.last_epoch_counts, counts)
        loss_f, grad_norm_f = loss_g.item(), grad_norm.item()  # the step's end: the host waits for the device
        step_s = time.perf_counter() - self.asked_at
        self.useful_tokens += useful
        self.step_seconds += step_s
        self.tracker.log_metrics({"train/loss": loss_f, "train/grad_norm": grad_norm_f,
                                  "train/lr": self.sched.get_last_lr()[0],
                                  **{f"train/{k}": v for k, v in metrics.items()},
                                  "train/ms_per_step": step_s * 1e3,
                                  "train/useful_tokens_per_second": useful / step_s}, step=self.step)
        self.curve.append({"step": self.step, "split": "train", "loss": loss_f, **metrics})

    # --- log --------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Val metrics of the drafter as it is now (every rank gets the same)."""
        with dist_utils.gathered(self.model):
            return evaluate(self.eval_unroll, self.val_loader, self.device, rank=self.rank, world=self.world)

    def log_val(self) -> dict:
        """Evaluate, log ``val/*`` at the current step and add the row to the curve."""
        val = self.evaluate()
        self.tracker.log_metrics({f"val/{k}": v for k, v in val.items()}, step=self.step)
        self.curve.append({"step": self.step, "split": "val", **val})
        return val

    # --- checkpoint -------------------------------------------------------------------------
    def checkpoint(self, checkpoint_dir, fp: str, epoch: int, batch_in_epoch: int, code: str | None = None) -> None:
        """Write the resumable state after the current step (rank 0 writes; collective under
        FSDP, which gathers the full state) and flush the tracker, so the run holds every point
        up to it even if killed next."""
        full = dist_utils.full_train_state(self.model, self.opt, "drafter.") if self.fsdp else None
        if self.rank == 0:
            ckpt.save_train_state(
                checkpoint_dir, self.drafter, self.opt, self.sched, step=self.step, epoch=epoch,
                batch_in_epoch=batch_in_epoch, fingerprint=fp, code=code,
                extra={"step0": [list(self.step0), list(self.step0.values())],
                       "curve": [[list(r), list(r.values())] for r in self.curve],
                       "tokens": self.tokens,
                       "useful_tokens": self.useful_tokens,
                       "step_seconds": self.step_seconds,
                       "last_epoch_counts": self.last_epoch_counts,
                       "seconds": time.time() - self.t0,
                       "mlflow_history": self.tracker.history()},
                full_state=full)
            self.tracker.flush()
        if self.world > 1:
            dist_utils.barrier()
        self.last_ckpt, self.last_ckpt_step = ckpt.state_dir(checkpoint_dir), self.step

    def finish(self) -> TrainResult:
        """Hand the drafter back unwrapped (under FSDP: full, plain parameters on every rank, for
        export), evaluate it once more and return the run's results."""
        seconds = time.time() - self.t0
        if self.fsdp:
            dist_utils.release(self.model)
            self.model = None
        val = self.log_val()
        tokens = self.tokens
        if self.world > 1:
            tokens = int(dist_utils.all_reduce_counts({"tokens": tokens})["tokens"])
            dist_utils.barrier()
        final_train = summarise(self.last_epoch_counts, self.tp.ttt_length) if self.last_epoch_counts else {}
        return TrainResult(step0_val=self.step0, final_val=val, final_train=final_train, steps=self.step,
                           train_tokens=tokens, seconds=seconds, curve=self.curve,
                           useful_tokens=self.useful_tokens, step_seconds=self.step_seconds)


def train_drafter(drafter: Eagle3Drafter, *, train_store: FeatureStore, val_store: FeatureStore,
                  lm_head: torch.Tensor, tp: TrainParams, lr: float, seed: int, tracker,
                  device: torch.device, gate: Callable[[dict], None] | None = None,
                  checkpoint_dir=None, checkpoint_every: int | None = None, capture=None,
                  code: str | None = None) -> TrainResult:
    """Train ``drafter`` in place with TTT.

    Args:
        lm_head: the target's lm_head [vocab, H_target] (float32); the teacher uses its draft rows.
        tp: TrainParams (ttt_length, step_decay, batch_tokens, epochs, warmup_ratio, ...; its
            ``backend`` picks the kernels: eyas/drafter/backend.py).
        lr: peak learning rate.
        gate: called with the step-0 val metrics before any update; raise to stop training.
        checkpoint_dir: where resumable state goes (eyas/training/checkpoint.py; outside DVC outs). When it
            holds a complete checkpoint of the same inputs (params, features, initial drafter),
            training resumes there: weights, optimizer, scheduler, RNG and data position, and
            ``tracker`` gets the metrics logged before the checkpoint (``Tracker.history``, saved
            with it) replayed, so a resumed MLflow run holds the whole curve.
        checkpoint_every: optimizer steps between checkpoints (default ``tp.checkpoint_every``;
            0 = none).
        capture: for token stores (``train.mode: online``): computes each batch's hidden states
            (eyas/training/online.py ``capture_for``); None for feature stores.
        code: the digest of the code the stage runs (:func:`eyas.pipeline.resume.code_digest`), kept with
            each checkpoint: one written by other code is not resumed (a warning line names the
            change and training starts afresh); None resumes whatever code wrote it.
    Raises:
        NonFiniteLossError: at the first non-finite loss, naming the step, samples and the last
            good checkpoint.
    """
    torch.manual_seed(seed)
    # under torchrun: one process group, this rank's device, DDP; otherwise all of this is a no-op
    rank, world, device = dist_utils.init_distributed(device)
    # offline: PackedLoader over the feature shards; online: the same plan, hidden states captured
    train_loader = loader_for(train_store, tp.batch_tokens, seed, capture=capture)
    val_loader = loader_for(val_store, tp.batch_tokens, seed, shuffle=False, capture=capture)
    t = Trainer(drafter, lm_head=lm_head, tp=tp, lr=lr, tracker=tracker, device=device, rank=rank, world=world,
                val_loader=val_loader)
    every = tp.checkpoint_every if checkpoint_every is None else checkpoint_every
    fp = found = None
    if checkpoint_dir is not None:
        # what makes a checkpoint resumable: same params (how it runs aside), features, world size
        # and initial weights
        tp_fp = {k: v for k, v in vars(tp).items() if k not in ("checkpoint_every", "nproc", "backend")}
        fp = ckpt.fingerprint(tp_fp, lr, seed, world, train_store.manifest.get("shards"),
                              val_store.manifest.get("shards"), train_store.manifest.get("num_tokens"),
                              *[p.detach() for p in drafter.parameters() if p.requires_grad])
        found = ckpt.find_checkpoint(checkpoint_dir, fp, code)
    if found is None:
        t.step0 = t.log_val()
        if gate is not None:
            gate(t.step0)
    t.build(train_loader)
    if found is not None:
        t.resume(checkpoint_dir, fp, found, code)
    with contextlib.closing(t.batches(train_loader)) as batches:  # an exception stops the loader's thread
        for epoch, b_i, batch in batches:
            t.train_step(batch, epoch)
            if t.step % tp.eval_every == 0 and t.step < t.total:
                val = t.log_val()
                if t.rank == 0:  # a line per val point: long CPU runs otherwise print nothing for minutes
                    acc = val.get("acc_0")
                    log.info("step %d of %d: val acc_0 %s", t.step, t.total, "n/a" if acc is None else f"{acc:.4f}")
            if checkpoint_dir is not None and every > 0 and t.step % every == 0 and t.step < t.total:
                t.checkpoint(checkpoint_dir, fp, epoch, b_i + 1, code)
    return t.finish()
