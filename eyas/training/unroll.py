"""The training-time test (TTT) unroll: one module that every training and evaluation path calls.

Alignment (one convention, used at every step k = 0 .. ttt_length-1; index t of a packed row):

- the drafter's hidden input is ``fc(aux[t])`` at k = 0, its own step k-1 output at index t after;
- the embedding input is token ``x[t+1+k]``;
- the prediction is token ``x[t+2+k]``; the teacher is the target's distribution at position
  ``t+1+k`` (``softmax(lm_head(final_hidden[t+1+k]))`` restricted to the draft vocab and
  renormalised) and the accuracy reference is the target's full-vocab argmax at ``t+1+k``;
- the loss mask is ``loss_mask[t+2+k]`` (the PREDICTED token is supervised: an assistant token, or
  any token with ``train.loss_tokens: all``, eyas.training.batches.supervised), and index t and ``t+2+k`` must
  lie in the same packed document.

Inputs, teacher, reference and mask therefore shift together (EAGLE and SpecForge shift the mask by
one step less: ``SafeAILab/EAGLE: eagle/traineagle3/cnets.py`` ``dataprepare``,
``sgl-project/SpecForge: specforge/modeling/target/target_head.py``; reported as SpecForge issue
#885 / PR #895 and EAGLE issues #317, #325). The step weight is ``step_decay**k``; each step's loss
is the mean over its supervised positions, so chance level at step 0 is ``ln(draft_vocab_size)``.

Metrics per step k (``loss_k``, ``acc_k``, ``full_acc_k``, ``cond_acc_k``) are defined in
eyas/training/batches.py, from the per-step counts the unroll returns.

:class:`TTTUnroll` owns the computation: its ``forward`` is what the eager training step, the
CUDA-graph step (:class:`eyas.training.loop.GraphedTTT` captures it), DDP and FSDP (they wrap it:
eyas/training/distributed.py) and evaluation (:func:`evaluate`) run. Its kernels are its
:class:`eyas.drafter.backend.Backend`'s choice.
"""

from __future__ import annotations

import torch
from torch import nn

from eyas.drafter.backend import REFERENCE, Backend
from eyas.drafter.compiling import compiled
from eyas.drafter.head_loss import head_loss
from eyas.drafter.model import Eagle3Drafter, rms_norm
from eyas.training.batches import (
    Batch,
    PackedLoader,
    add_counts,
    autocast,
    counts_from_stats,
    pad_batch,
    shift_left,
    static_shape,
    summarise,
)


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


def normed_head_input(drafter: Eagle3Drafter, hidden: torch.Tensor, head_weight: torch.Tensor,
                      backend: Backend = REFERENCE) -> torch.Tensor:
    """The lm_head's input: ``drafter.norm(hidden)`` [B, T, H] in ``head_weight``'s dtype (on CUDA
    through :func:`eyas.drafter.compiling.compiled`: one compiled graph when ``backend.compile`` is on)."""
    fn = _norm_to if hidden.device.type != "cuda" else compiled(backend, "head_norm", _norm_to)
    return fn(hidden, drafter.norm.weight, drafter.config.rms_norm_eps, head_weight.dtype)


def unroll_dtype(device) -> torch.dtype | None:
    """The dtype autocast computes in on ``device`` (None when autocast is off there): the TTT
    unroll casts its weights to it once (:meth:`eyas.drafter.model.MidLayer.weights`)."""
    kind = torch.device(device).type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


class TTTUnroll(nn.Module):
    """``ttt_length`` draft steps of ``drafter`` over a packed batch, scored against the target
    (alignment in the module docstring): the one owner of the TTT computation.

    A module, so DDP and FSDP can wrap it (DDP's gradient hooks and FSDP's all-gather /
    reduce-scatter hooks run around ``forward``; eyas/training/distributed.py strips the ``drafter.``
    prefix from its parameter names). The forward makes no device->host transfer, so a CUDA graph
    can capture it (eyas.training.loop.GraphedTTT).

    Args:
        drafter: the drafter (its trainable parameters are this module's).
        head_rows: [draft_vocab, H_target] the target's lm_head rows of the draft vocab in draft-id
            order (:func:`eyas.training.batches.head_rows_for`), on the batches' device; a plain attribute,
            not a parameter or buffer (frozen; not in ``state_dict``).
        ttt_length: draft steps unrolled; step_decay: step k's loss weight is ``step_decay**k``.
        backend: the kernels (eyas/drafter/backend.py).
    """

    def __init__(self, drafter: Eagle3Drafter, head_rows: torch.Tensor, ttt_length: int, step_decay: float,
                 backend: Backend = REFERENCE):
        super().__init__()
        self.drafter = drafter
        self.head_rows = head_rows
        self.ttt_length, self.step_decay, self.backend = ttt_length, step_decay, backend

    def forward(self, batch: Batch, step_norms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The weighted TTT loss of ``batch`` and its per-step statistics.

        Args:
            batch: a packed :class:`eyas.training.batches.Batch` on the module's device.
            step_norms: optional [ttt_length] denominators of each step's loss. ``None``: this
                batch's supervised positions (clamped to >= 1), i.e. each step's loss is a mean.
                Data-parallel training passes ``max(N_k, 1) / world`` with N_k summed over ranks,
                so that averaging the ranks' gradients gives exactly the gradient of the global
                batch.
        Returns:
            (weighted loss: scalar float32 tensor with grad, stats [ttt_length, 6] float64 on the
            batch's device: per step the supervised positions, the step's mean loss, correct,
            chain-valid, chain-ok and chain-previous-ok counts; :func:`eyas.training.batches.counts_from_stats`
            reads them).
        """
        drafter, ttt_length, step_decay = self.drafter, self.ttt_length, self.step_decay
        T = batch.input_ids.shape[1]
        t_logits, t_lse = teacher_logits(batch.final_hidden, self.head_rows, pad=ttt_length)
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
            hidden = drafter.ttt_step(hidden, ids_in, batch.positions + k, batch.doc_ids, cache, weights,
                                      self.backend)
            n = mask.sum()
            denom = n.clamp(min=1) if step_norms is None else step_norms[k]
            # the step's loss is sum(weight * token loss): mask, mean (or global normaliser) and decay
            # in one weight, so the head loss makes its logits' gradient in its forward pass
            weight = mask * ((step_decay ** k) / denom)
            term, tok_loss, draft_argmax = head_loss(normed_head_input(drafter, hidden, head_weight, self.backend),
                                                     head_weight, t_logits[:, window], t_lse[:, window], weight,
                                                     self.backend)
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


def ttt_forward(drafter: Eagle3Drafter, batch: Batch, head_rows: torch.Tensor, ttt_length: int,
                step_decay: float, step_norms: torch.Tensor | None = None, backend: Backend = REFERENCE
                ) -> tuple[torch.Tensor, dict[str, float], dict]:
    """:class:`TTTUnroll`'s forward with its statistics read back to the host.

    Returns:
        (weighted loss: scalar tensor with grad, metrics {'loss_k', 'acc_k', 'full_acc_k',
        'cond_acc_k'} as floats, counts {'tokens_k': supervised positions at step k, ...} for
        exact averaging over many batches: :func:`eyas.training.batches.counts_from_stats`).
    """
    total, stats = TTTUnroll(drafter, head_rows, ttt_length, step_decay, backend)(batch, step_norms)
    counts = counts_from_stats(stats)
    return total, dict(summarise(counts, ttt_length)), counts


@torch.no_grad()
def evaluate(unroll: TTTUnroll, loader: PackedLoader, device, max_batches: int | None = None, rank: int = 0,
             world: int = 1) -> dict[str, float]:
    """Metrics (:func:`eyas.training.batches.summarise`) of ``unroll`` over (up to ``max_batches`` of) a loader,
    averaged exactly over supervised tokens, in eval mode under :func:`eyas.training.batches.autocast`. With
    ``world`` > 1 each rank evaluates its share of the batches and the counts are summed over ranks
    (every rank returns the same metrics). ``unroll`` must not be wrapped by FSDP (its hooks would
    reshard after every batch): under FSDP pass a plain :class:`TTTUnroll` of the drafter inside
    :func:`eyas.training.distributed.gathered`."""
    was_training = unroll.training
    unroll.eval()
    counts: dict = {}
    # compiled kernels see one shape (eyas.training.batches.static_shape): val batches are as long as their
    # longest row, and each new length would recompile them
    shape = static_shape(loader) if torch.device(device).type == "cuda" and unroll.backend.compile else None
    for i, batch in enumerate(loader.batches(0, rank=rank, world=world, even=False)):
        if max_batches is not None and i * max(world, 1) + rank >= max_batches:
            break
        batch = batch.to(device)
        with autocast(device):
            _, stats = unroll(batch if shape is None else pad_batch(batch, *shape))
        add_counts(counts, counts_from_stats(stats))
    if world > 1:
        from eyas.training.distributed import all_reduce_counts

        keys = [f"{name}_{k}" for k in range(unroll.ttt_length) for name in
                ("tokens", "loss_sum", "correct", "chain", "chain_ok", "chain_prev_ok")]
        counts = all_reduce_counts({key: counts.get(key, 0.0) for key in keys})
    unroll.train(was_training)
    return summarise(counts, unroll.ttt_length)
