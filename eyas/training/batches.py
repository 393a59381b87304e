"""Training-time test (TTT) data and metrics: packed batches, their loader, and the per-step metrics.

The unroll itself (alignment, loss) is :class:`eyas.training.unroll.TTTUnroll`. Metrics per step k:
``loss_k``; ``acc_k`` teacher-forced top-1 (draft argmax mapped through d2t equals the target's
full-vocab argmax); ``full_acc_k`` correct at every step <= k; ``cond_acc_k`` correct at k given
correct at every earlier step (speculators' definitions). They are summed as counts over batches
(:func:`counts_from_stats`, :func:`add_counts`) and divided once (:func:`summarise`), so averages
over many batches and ranks are exact.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from eyas.drafter.model import Eagle3Drafter
from eyas.features import FeatureError, FeatureStore, read_tensors

log = logging.getLogger(__name__)

BATCH_KEYS = ("input_ids", "loss_mask", "aux_hidden", "final_hidden", "target_argmax")


def shift_left(x: torch.Tensor, s: int, fill) -> torch.Tensor:
    """x [B, T, ...] -> y with y[:, t] = x[:, t+s], padded with ``fill`` at the end."""
    if s == 0:
        return x
    pad = torch.full_like(x[:, :s], fill)
    return torch.cat([x[:, s:], pad], dim=1)


@dataclass
class Batch:
    """A packed row set: every tensor is [B, T] (or [B, T, D] for hidden states)."""

    input_ids: torch.Tensor      # int64
    loss_mask: torch.Tensor      # bool
    aux_hidden: torch.Tensor     # [B, T, n_aux*H_target]
    final_hidden: torch.Tensor   # [B, T, H_target], post-norm
    target_argmax: torch.Tensor  # int64
    positions: torch.Tensor      # int64, restart at 0 in each packed document
    doc_ids: torch.Tensor        # int64
    sample_ids: list             # (shard, index) of each packed sample, for error messages

    def to(self, device, non_blocking: bool = False) -> "Batch":
        """The batch on ``device``. ``non_blocking`` from pinned memory: each copy is queued on the
        current CUDA stream (kernels issued after it on that stream see the data) and the host
        returns at once; PyTorch keeps the pinned block from reuse until the copy is done."""
        kw = {k: (v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v)
              for k, v in self.__dict__.items()}
        return Batch(**kw)

    def pin_memory(self) -> "Batch":
        """The batch with every tensor in page-locked host memory (needs CUDA)."""
        return Batch(**{k: (v.pin_memory() if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})

    def is_pinned(self) -> bool:
        """Every tensor is in page-locked host memory (False for tensors on a GPU)."""
        return all(getattr(self, k).is_pinned() for k in TENSOR_FIELDS)

    def useful_tokens(self) -> int:
        """Tokens of real samples (doc id >= 0): the batch without the padding of :func:`pack` and
        :func:`pad_batch`."""
        return int((self.doc_ids >= 0).sum())


def pack(rows: list[list[dict]], sample_ids: list) -> Batch:
    """Pack rows of samples into a right-padded batch [len(rows), T_max]: each row is the
    concatenation of its samples, with positions restarting and a new doc id per sample.
    Padding has loss_mask False and doc id -1."""
    T = max(sum(len(s["input_ids"]) for s in row) for row in rows)
    out = {k: [] for k in BATCH_KEYS + ("positions", "doc_ids")}
    for row in rows:
        n = sum(len(s["input_ids"]) for s in row)
        for k in BATCH_KEYS:
            x = torch.cat([s[k] for s in row])
            out[k].append(torch.cat([x, x.new_zeros((T - n, *x.shape[1:]))]))
        out["positions"].append(torch.cat([torch.arange(len(s["input_ids"])) for s in row]
                                          + [torch.zeros(T - n, dtype=torch.int64)]))
        out["doc_ids"].append(torch.cat([torch.full((len(s["input_ids"]),), i) for i, s in enumerate(row)]
                                        + [torch.full((T - n,), -1)]))
    t = {k: torch.stack(v) for k, v in out.items()}
    return Batch(input_ids=t["input_ids"].long(), loss_mask=t["loss_mask"].bool(),
                 aux_hidden=t["aux_hidden"], final_hidden=t["final_hidden"],
                 target_argmax=t["target_argmax"].long(), positions=t["positions"],
                 doc_ids=t["doc_ids"], sample_ids=list(sample_ids))


TENSOR_FIELDS = BATCH_KEYS + ("positions", "doc_ids")  # a Batch's [B, T(, D)] tensors


def pad_batch(batch: Batch, rows: int, tokens: int) -> Batch:
    """``batch`` [B, T] right-padded to [rows, tokens] (rows >= B, tokens >= T): padding has
    loss_mask False, doc id -1, ids/positions 0 and zero hidden states, exactly as :func:`pack`
    pads, so losses and counts are unchanged.

    Raises:
        ValueError: when the batch is larger than [rows, tokens].
    """
    B, T = batch.input_ids.shape
    if B > rows or T > tokens:
        raise ValueError(f"batch of shape [{B}, {T}] does not fit the static shape [{rows}, {tokens}]")
    if (B, T) == (rows, tokens):
        return batch
    kw = {}
    for name in TENSOR_FIELDS:
        x = getattr(batch, name)
        out = x.new_full((rows, tokens, *x.shape[2:]), -1 if name == "doc_ids" else 0)
        out[:B, :T] = x
        kw[name] = out
    return Batch(**kw, sample_ids=batch.sample_ids)


def supervised(batch: Batch, loss_tokens: str) -> Batch:
    """``batch`` with the positions the TTT loss supervises (``train.loss_tokens``) as its loss_mask.

    ``assistant``: the extracted mask, assistant turns only, as EAGLE-3 and SpecForge train
    (``SafeAILab/EAGLE: eagle/traineagle3/cnets.py``, ``sgl-project/SpecForge:
    specforge/data/preprocessing.py``). ``all``: every token of every packed document (not the
    padding). The teacher is the target's own distribution at each position
    (:func:`eyas.training.unroll.teacher_logits`), as defined at a prompt token as at a reply token, so
    prompt positions are supervision the features already hold: on the CPU default they are ~3/4
    of the tokens extracted (docs/data-recipe.md).

    Raises:
        ValueError: ``loss_tokens`` is not one of :data:`eyas.params.train.LOSS_TOKENS`.
    """
    if loss_tokens == "assistant":
        return batch
    if loss_tokens != "all":
        raise ValueError(f"train.loss_tokens must be one of ('assistant', 'all'), got {loss_tokens!r}")
    return dataclasses.replace(batch, loss_mask=batch.doc_ids >= 0)


def static_shape(loader) -> tuple[int, int]:
    """The one shape [rows, tokens] that every batch of ``loader`` (a :class:`PackedLoader` or an
    online loader, eyas/training/online.py: both have ``rows_per_batch`` and ``row_tokens``) fits under
    :func:`pad_batch`: its rows per batch, of its row length rounded up to a multiple of 128.

    Compiled code sees this shape only: torch.compile specialises on shapes, and a packed batch
    is only as long as its longest row, so unpadded batches recompile the layer halves and
    the head norm once per length until Dynamo's recompile limit (8) leaves them eager.
    """
    return loader.rows_per_batch, -(-loader.row_tokens // 128) * 128


class PackedLoader:
    """Deterministic packed batches over a :class:`FeatureStore`, one shard in memory at a time
    (fp8-stored hidden states are dequantised to bfloat16 as a shard loads: features.read_tensors).

    Epoch ``e`` shuffles shard order and the order within each shard with ``Random(seed + e)``,
    packs samples greedily into rows of ``row_tokens`` (the extraction ``max_length``: attention
    cost grows with the row length squared, so rows stay short) and groups
    ``max(1, batch_tokens // row_tokens)`` rows into a batch. ``num_batches(e)`` is exact, so LR
    schedules are too.
    """

    # batches a background thread packs ahead of the training step (:func:`prefetch`)
    prefetch_depth = 2

    def __init__(self, store: FeatureStore, batch_tokens: int, seed: int, shuffle: bool = True):
        self.store, self.seed, self.shuffle = store, seed, shuffle
        self.lengths = []
        for si, s in enumerate(store.manifest["shards"]):
            off = self.read_shard(si, ())["offsets"]
            self.lengths.append((off[1:] - off[:-1]).tolist())
            empty = [i for i, n in enumerate(self.lengths[-1]) if n < 1]
            if empty:  # nothing to train on, and a zero-length row breaks packing and online capture
                raise FeatureError(f"{store.root / s['file']}: sample(s) {empty[:10]} of this shard have no "
                                   f"tokens; rerun `dvc repro extract` (it must not store empty samples)")
        self.row_tokens = max(max(ls) for ls in self.lengths)
        self.rows_per_batch = max(1, batch_tokens // self.row_tokens)

    def plan(self, epoch: int) -> list[list[list[tuple[int, int]]]]:
        """Batches -> rows -> (shard, sample) for ``epoch``."""
        rng = random.Random(self.seed + epoch)
        shard_order = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(shard_order)
        rows, cur, used = [], [], 0
        for si in shard_order:
            order = list(range(len(self.lengths[si])))
            if self.shuffle:
                rng.shuffle(order)
            for i in order:
                n = self.lengths[si][i]
                if cur and used + n > self.row_tokens:
                    rows.append(cur)
                    cur, used = [], 0
                cur.append((si, i))
                used += n
        if cur:
            rows.append(cur)
        k = self.rows_per_batch
        return [rows[i:i + k] for i in range(0, len(rows), k)]

    def num_batches(self, epoch: int, world: int = 1) -> int:
        """Batches of ``epoch`` (per rank when ``world`` > 1: every rank runs the same number)."""
        n = len(self.plan(epoch))
        return n // world if world > 1 else n

    def batches(self, epoch: int, start: int = 0, rank: int = 0, world: int = 1,
                even: bool = True) -> Iterator[Batch]:
        """Yield the batches of ``epoch`` from index ``start`` (for resuming mid-epoch).

        With ``world`` > 1, this rank's disjoint share (:meth:`rank_plans`)."""
        loaded: dict[int, dict] = {}
        for plan_rows in self.rank_plans(epoch, rank, world, even)[start:]:
            rows = [[self.sample(loaded, si, i, BATCH_KEYS) for si, i in refs] for refs in plan_rows]
            yield pack(rows, [r for refs in plan_rows for r in refs])

    def rank_plans(self, epoch: int, rank: int = 0, world: int = 1, even: bool = True) -> list:
        """The planned batches of ``epoch`` this rank takes: all of them with ``world`` 1, else the
        disjoint share ``plan[rank::world]`` (cut to ``len(plan) // world`` batches when ``even``,
        so ranks take equally many steps)."""
        plans = self.plan(epoch)
        if world > 1:
            plans = plans[rank::world][: len(plans) // world] if even else plans[rank::world]
        return plans

    def read_shard(self, si: int, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """``keys`` and ``offsets`` of shard ``si`` (:func:`eyas.features.read_tensors`).

        Raises:
            FeatureError: naming the shard's file when it cannot be read (truncated, not
                safetensors, a tensor missing).
        """
        path = self.store.root / self.store.manifest["shards"][si]["file"]
        try:
            with safe_open(str(path), framework="pt") as f:
                return read_tensors(f, keys + ("offsets",))
        except (SafetensorError, OSError) as e:
            raise FeatureError(f"{path}: cannot read this feature shard ({e}); rerun `dvc repro extract`") from e

    def sample(self, loaded: dict[int, dict], si: int, i: int, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Sample ``i`` of shard ``si``: its ``keys`` sliced from the shard's tensors (fp8 hidden
        states dequantised), the shard read into ``loaded`` (shard index -> tensors) on first use;
        ``loaded`` keeps at most two shards (batches are shard-contiguous but may straddle a border)."""
        if si not in loaded:
            if len(loaded) >= 2:
                loaded.pop(next(iter(loaded)))
            loaded[si] = self.read_shard(si, keys)
        t = loaded[si]
        a, b = int(t["offsets"][i]), int(t["offsets"][i + 1])
        return {k: t[k][a:b] for k in keys}


def prefetch(batches: Iterator[Batch], depth: int, pin: bool, join_timeout_s: float = 30.0) -> Iterator[Batch]:
    """``batches``, produced by a daemon thread up to ``depth`` batches ahead of the consumer.

    The same batches in the same order (the thread only runs the iterator). ``pin``: each batch
    is put in page-locked memory (:meth:`Batch.pin_memory`, so the training step's copy is an
    asynchronous DMA: ``Batch.to(device, non_blocking=True)``), as ``torch.utils.data.DataLoader``'s
    ``pin_memory`` thread does (``pytorch/pytorch: torch/utils/data/_utils/pin_memory.py``); pass it
    for a CUDA device only. An exception of ``batches`` is raised in the consumer, the same object
    with its traceback (e.g. :class:`eyas.features.FeatureError` naming a shard). Closing the
    generator (the consumer stops early, ``contextlib.closing``) stops the thread and joins it for
    up to ``join_timeout_s`` seconds (it finishes the batch it is packing); a warning names a
    thread still alive then.

    Raises:
        ValueError: ``depth`` < 1.
    """
    if depth < 1:
        raise ValueError(f"prefetch depth must be >= 1, got {depth}")
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce():
        try:
            for b in batches:
                b = b.pin_memory() if pin else b
                if stop.is_set():
                    return
                q.put((b, None))
            q.put((None, None))  # the end
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            q.put((None, e))

    thread = threading.Thread(target=produce, name="eyas-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            b, err = q.get()
            if err is not None:
                raise err
            if b is None:
                return
            yield b
    finally:
        stop.set()
        deadline = time.monotonic() + join_timeout_s
        while thread.is_alive() and time.monotonic() < deadline:
            while not q.empty():  # a producer blocked on a full queue wakes, sees stop and returns
                q.get_nowait()
            thread.join(0.05)
        if thread.is_alive():
            log.warning("prefetch thread %s still packing a batch %.0f s after the consumer stopped",
                        thread.name, join_timeout_s)


def counts_from_stats(stats: torch.Tensor) -> dict[str, float]:
    """Counts per TTT step k ('tokens_k': supervised positions, 'loss_sum_k', 'correct_k',
    'chain_k', 'chain_ok_k', 'chain_prev_ok_k') from the [ttt_length, 6] float64 stats of
    :meth:`eyas.training.unroll.TTTUnroll.forward` (one device->host copy); :func:`summarise` turns
    summed counts into metrics."""
    counts: dict[str, float] = {}
    for k, row in enumerate(stats.cpu().tolist()):
        nf, lk, corr, chain, ok, prev = row
        lk = float(torch.tensor(lk, dtype=torch.float32))  # the fp32 value float(loss_k) gave
        counts[f"tokens_{k}"] = nf
        counts[f"loss_sum_{k}"] = lk * nf
        counts[f"correct_{k}"] = corr
        counts[f"chain_{k}"] = chain
        counts[f"chain_ok_{k}"] = ok
        counts[f"chain_prev_ok_{k}"] = prev
    return counts


def summarise(counts: dict, ttt_length: int) -> dict[str, float]:
    """Turn summed counts (from one or many batches) into loss_k / acc_k / full_acc_k / cond_acc_k."""
    out = {}
    for k in range(ttt_length):
        n = counts.get(f"tokens_{k}", 0.0)
        out[f"loss_{k}"] = counts[f"loss_sum_{k}"] / n if n else float("nan")
        out[f"acc_{k}"] = counts[f"correct_{k}"] / n if n else float("nan")
        c = counts.get(f"chain_{k}", 0.0)
        out[f"full_acc_{k}"] = counts[f"chain_ok_{k}"] / c if c else float("nan")
        prev = counts.get(f"chain_prev_ok_{k}", 0.0)
        out[f"cond_acc_{k}"] = counts[f"chain_ok_{k}"] / prev if prev else float("nan")
    return out


def add_counts(acc: dict, new: dict) -> dict:
    for k, v in new.items():
        acc[k] = acc.get(k, 0.0) + v
    return acc


def autocast(device):
    """bf16 autocast on CUDA (softmax and loss stay fp32: they are computed in .float()); off on CPU."""
    dev = torch.device(device)
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")


def chance_loss(draft_vocab_size: int) -> float:
    """Cross-entropy of a uniform draft distribution: ln(draft_vocab_size)."""
    return math.log(draft_vocab_size)


def head_rows_for(lm_head: torch.Tensor, drafter: Eagle3Drafter) -> torch.Tensor:
    """Target lm_head rows of the drafter's draft vocab, in draft-id order: [draft_vocab, H]."""
    return lm_head[drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size,
                                                        device=drafter.d2t.device)).cpu()]
