"""Training-time test (TTT): the unrolled EAGLE-3 loss, its metrics, and packed batches.

Alignment (one convention, used at every step k = 0 .. ttt_length-1; index t of a packed row):

- the drafter's hidden input is ``fc(aux[t])`` at k = 0, its own step k-1 output at index t after;
- the embedding input is token ``x[t+1+k]``;
- the prediction is token ``x[t+2+k]``; the teacher is the target's distribution at position
  ``t+1+k`` (``softmax(lm_head(final_hidden[t+1+k]))`` restricted to the draft vocab and
  renormalised) and the accuracy reference is the target's full-vocab argmax at ``t+1+k``;
- the loss mask is ``loss_mask[t+2+k]`` (the PREDICTED token is an assistant token), and index t
  and ``t+2+k`` must lie in the same packed document.

Inputs, teacher, reference and mask therefore shift together (EAGLE and SpecForge shift the mask by
one step less: ``SafeAILab/EAGLE: eagle/traineagle3/cnets.py`` ``dataprepare``,
``sgl-project/SpecForge: specforge/modeling/target/target_head.py``; reported as SpecForge issue
#885 / PR #895 and EAGLE issues #317, #325). The step weight is ``step_decay**k``; each step's loss
is the mean over its supervised positions, so chance level at step 0 is ``ln(draft_vocab_size)``.

Metrics per step k: ``loss_k``; ``acc_k`` teacher-forced top-1 (draft argmax mapped through d2t
equals the target's full-vocab argmax); ``full_acc_k`` correct at every step <= k;
``cond_acc_k`` correct at k given correct at every earlier step (speculators' definitions).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterator

import torch
from safetensors import safe_open

from eyas.drafter import Eagle3Drafter, compiled, rms_norm
from eyas.features import FeatureStore, read_tensors
from eyas.head_loss import head_loss

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

    def to(self, device) -> "Batch":
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return Batch(**kw)


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


class PackedLoader:
    """Deterministic packed batches over a :class:`FeatureStore`, one shard in memory at a time
    (fp8-stored hidden states are dequantised to bfloat16 as a shard loads: features.read_tensors).

    Epoch ``e`` shuffles shard order and the order within each shard with ``Random(seed + e)``,
    packs samples greedily into rows of ``row_tokens`` (the extraction ``max_length``: attention
    cost grows with the row length squared, so rows stay short) and groups
    ``max(1, batch_tokens // row_tokens)`` rows into a batch. ``num_batches(e)`` is exact, so LR
    schedules are too.
    """

    def __init__(self, store: FeatureStore, batch_tokens: int, seed: int, shuffle: bool = True):
        self.store, self.seed, self.shuffle = store, seed, shuffle
        self.lengths = []
        for s in store.manifest["shards"]:
            with safe_open(str(store.root / s["file"]), framework="pt") as f:
                off = f.get_tensor("offsets")
            self.lengths.append((off[1:] - off[:-1]).tolist())
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

        With ``world`` > 1, this rank's disjoint share ``plan[rank::world]`` (cut to
        ``len(plan) // world`` batches when ``even``, so ranks take equally many steps)."""
        plans = self.plan(epoch)
        if world > 1:
            plans = plans[rank::world][: len(plans) // world] if even else plans[rank::world]
        loaded: dict[int, dict] = {}
        for plan_rows in plans[start:]:
            rows = []
            for refs in plan_rows:
                row = []
                for si, i in refs:
                    if si not in loaded:
                        if len(loaded) >= 2:  # batches are shard-contiguous but may straddle a border
                            loaded.pop(next(iter(loaded)))
                        path = self.store.root / self.store.manifest["shards"][si]["file"]
                        with safe_open(str(path), framework="pt") as f:
                            loaded[si] = read_tensors(f, BATCH_KEYS + ("offsets",))
                    t = loaded[si]
                    a, b = int(t["offsets"][i]), int(t["offsets"][i + 1])
                    row.append({k: t[k][a:b] for k in BATCH_KEYS})
                rows.append(row)
            yield pack(rows, [r for refs in plan_rows for r in refs])


def teacher_logits(final_hidden: torch.Tensor, head_rows: torch.Tensor, pad: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits over the draft vocab and their log-sum-exp: the teacher distribution
    is ``exp(logits - lse)``, the target's softmax restricted to the draft vocab and renormalised.

    Args:
        final_hidden: [B, T, H] the target's post-norm final hidden states.
        head_rows: [draft_vocab, H] the target lm_head rows of the draft vocab, in draft-id order.
        pad: zero rows appended after T (uniform teachers, never supervised), so every TTT step
            can take a [B, T] window of the teacher (static shapes for torch.compile).
    Returns:
        (logits [B, T + pad, draft_vocab] in the matmul's dtype: bf16 under autocast, the
        precision the teacher always had; lse [B, T + pad] float32).
    """
    h = final_hidden.to(head_rows.dtype)
    if pad:
        h = torch.cat([h, h.new_zeros(h.shape[0], pad, h.shape[2])], dim=1)
    logits = torch.matmul(h, head_rows.T)
    return logits, logits.float().logsumexp(-1)


def step_mask(batch: Batch, k: int) -> torch.Tensor:
    """Supervised positions of TTT step ``k`` (alignment in the module docstring): [B, T] bool."""
    return shift_left(batch.loss_mask, 2 + k, False) & (shift_left(batch.doc_ids, 2 + k, -1) == batch.doc_ids)


def supervised_counts(batch: Batch, ttt_length: int) -> torch.Tensor:
    """Supervised positions per TTT step: [ttt_length] int64 (for global loss normalisation)."""
    return torch.stack([step_mask(batch, k).sum() for k in range(ttt_length)])


def _norm_to(h: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    return rms_norm(h, weight, eps).to(dtype)


def normed_head_input(drafter: Eagle3Drafter, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """The lm_head's input: ``drafter.norm(hidden)`` [B, T, H] in ``head_weight``'s dtype (one
    torch.compile'd graph on CUDA, unless EYAS_COMPILE=0)."""
    fn = _norm_to if hidden.device.type != "cuda" else compiled("head_norm", _norm_to)
    return fn(hidden, drafter.norm.weight, drafter.config.rms_norm_eps, head_weight.dtype)


def unroll_dtype(device) -> torch.dtype | None:
    """The dtype autocast computes in on ``device`` (None when autocast is off there): the TTT
    unroll casts its weights to it once (:meth:`eyas.drafter.MidLayer.weights`)."""
    kind = torch.device(device).type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def ttt_forward(drafter: Eagle3Drafter, batch: Batch, head_rows: torch.Tensor, ttt_length: int,
                step_decay: float, step_norms: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, float], dict]:
    """Unroll ``ttt_length`` draft steps over a packed batch (alignment in the module docstring).

    Args:
        step_norms: optional [ttt_length] denominators of each step's loss. ``None``: this batch's
            supervised positions (clamped to >= 1), i.e. each step's loss is a mean. Data-parallel
            training passes ``max(N_k, 1) / world`` with N_k summed over ranks, so that averaging
            the ranks' gradients gives exactly the gradient of the global batch.
    Returns:
        (weighted loss: scalar tensor with grad, metrics {'loss_k', 'acc_k', 'full_acc_k',
        'cond_acc_k'} as floats, counts {'tokens_k': supervised positions at step k, ...} for
        exact averaging over many batches).
    """
    total, stats = ttt_loss_stats(drafter, batch, head_rows, ttt_length, step_decay, step_norms)
    counts = counts_from_stats(stats)
    return total, dict(summarise(counts, ttt_length)), counts


def ttt_loss_stats(drafter: Eagle3Drafter, batch: Batch, head_rows: torch.Tensor, ttt_length: int,
                   step_decay: float, step_norms: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ttt_forward` without any device->host transfer (so it can run inside a CUDA graph).

    Returns:
        (weighted loss: scalar float32 tensor with grad, stats [ttt_length, 6] float64 on the
        batch's device: per step the supervised positions, the step's mean loss, correct,
        chain-valid, chain-ok and chain-previous-ok counts; :func:`counts_from_stats` reads them).
    """
    T = batch.input_ids.shape[1]
    t_logits, t_lse = teacher_logits(batch.final_hidden, head_rows, pad=ttt_length)
    cast = unroll_dtype(batch.aux_hidden.device)
    # under autocast the aux states enter fc in the autocast dtype (no fp32 round trip)
    hidden = drafter.project(batch.aux_hidden.to(cast or drafter.fc.weight.dtype))
    weights = drafter.midlayer.weights(cast)
    head_weight = drafter.lm_head.weight if cast is None else drafter.lm_head.weight.to(cast)
    cache: list = []
    total = hidden.new_zeros((), dtype=torch.float32)
    chain_ok = torch.ones_like(batch.loss_mask)
    chain_valid = torch.ones_like(batch.loss_mask)
    per_step = []  # device tensors; read back once at the end (no host sync inside the unroll)
    for k in range(ttt_length):
        ids_in = shift_left(batch.input_ids, 1 + k, 0)
        # the teacher of index t is row t+1+k: a [B, T] window, not a shifted copy; positions
        # without one (t >= T-1-k: padding rows) are never supervised (the step mask is False)
        window = slice(1 + k, 1 + k + T)
        ref = shift_left(batch.target_argmax, 1 + k, -1)
        mask = step_mask(batch, k)
        hidden = drafter.ttt_step(hidden, ids_in, batch.positions + k, batch.doc_ids, cache, weights)
        n = mask.sum()
        denom = n.clamp(min=1) if step_norms is None else step_norms[k]
        # the step's loss is sum(weight * token loss): mask, mean (or global normaliser) and decay
        # in one weight, so the head loss makes its logits' gradient in its forward pass
        weight = mask * ((step_decay ** k) / denom)
        term, tok_loss, draft_argmax = head_loss(normed_head_input(drafter, hidden, head_weight), head_weight,
                                                 t_logits[:, window], t_lse[:, window], weight)
        total = total + term
        with torch.no_grad():
            # a where-sum, not boolean indexing: no device->host sync (nonzero) inside the unroll
            loss_k = torch.where(mask, tok_loss, 0.0).sum() / n.clamp(min=1)
            correct = drafter.draft_to_target(draft_argmax) == ref
            chain_valid = chain_valid & mask
            prev_ok = chain_ok & chain_valid
            chain_ok = chain_ok & correct
            now_ok = chain_ok & chain_valid
            per_step.append(torch.stack([n.double(), loss_k.detach().double(),
                                         (correct & mask).sum().double(), chain_valid.sum().double(),
                                         now_ok.sum().double(), prev_ok.sum().double()]))
    return total, (torch.stack(per_step) if per_step else hidden.new_zeros((0, 6), dtype=torch.float64))


def counts_from_stats(stats: torch.Tensor) -> dict[str, float]:
    """The counts dict of :func:`ttt_forward` ('tokens_k', 'loss_sum_k', 'correct_k', 'chain_k',
    'chain_ok_k', 'chain_prev_ok_k') from :func:`ttt_loss_stats`' [ttt_length, 6] stats (one
    device->host copy)."""
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


@torch.no_grad()
def evaluate(drafter: Eagle3Drafter, loader: PackedLoader, head_rows: torch.Tensor, ttt_length: int,
             step_decay: float, device, max_batches: int | None = None, rank: int = 0,
             world: int = 1) -> dict[str, float]:
    """Metrics over (up to ``max_batches`` of) a loader, averaged exactly over supervised tokens.
    With ``world`` > 1 each rank evaluates its share of the batches and the counts are summed
    over ranks (every rank returns the same metrics)."""
    was_training = drafter.training
    drafter.eval()
    counts: dict = {}
    for i, batch in enumerate(loader.batches(0, rank=rank, world=world, even=False)):
        if max_batches is not None and i * max(world, 1) + rank >= max_batches:
            break
        with autocast(device):
            _, _, c = ttt_forward(drafter, batch.to(device), head_rows, ttt_length, step_decay)
        add_counts(counts, c)
    if world > 1:
        from eyas.distributed import all_reduce_counts

        keys = [f"{name}_{k}" for k in range(ttt_length) for name in
                ("tokens", "loss_sum", "correct", "chain", "chain_ok", "chain_prev_ok")]
        counts = all_reduce_counts({key: counts.get(key, 0.0) for key in keys})
    drafter.train(was_training)
    return summarise(counts, ttt_length)


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
