"""The TTT forward + backward of one training step, captured in a CUDA graph and replayed.

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

One graph (one batch shape) at a time: :func:`eyas.training.batches.pad_batch` pads batches to a fixed shape with rows
that carry no loss and attend only to themselves, so a training run captures once.
"""

from __future__ import annotations

import torch

from eyas.training.batches import TENSOR_FIELDS, Batch, autocast, counts_from_stats, summarise
from eyas.training.unroll import TTTUnroll


class GraphedTTT:
    """Forward + backward of the TTT loss over a batch as one CUDA graph replay.

    ``step(batch)`` runs ``unroll``'s forward and backward on ``batch``, leaves the gradient in
    ``p.grad`` of every trainable parameter (overwritten, not accumulated) and returns (loss:
    detached scalar float32 tensor on the device, metrics as in :func:`eyas.training.unroll.ttt_forward`,
    counts as there). The first batch of a new shape is run ``warmup`` times eagerly on a side
    stream (compilation, cuBLAS workspaces) before capture; its shape then replaces any earlier
    graph. Whether training uses it at all is :meth:`eyas.drafter.backend.Backend.graphs`: on CUDA, one
    process (DDP's gradient hooks are not captured); a whole train_drafter run with graphs
    matches eager (tests/training/test_graphed.py, on a GPU).
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
