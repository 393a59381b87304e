"""Process-group helpers for running the training stages under ``torchrun``.

One process per GPU (or a few CPU processes with gloo for tests): ``init_distributed`` reads the
``torchrun`` environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), starts the process group
(nccl on CUDA, gloo on CPU) and picks this rank's device. Without ``WORLD_SIZE`` > 1 every helper
is a no-op, so single-process code paths need no branches.

Data parallelism in :func:`eyas.train.train_drafter`: rank r takes packed batches r, r+W, r+2W, ...
of each epoch (a global batch = W x ``batch_tokens``), the per-step loss is normalised by the
GLOBAL number of supervised tokens (so W ranks compute exactly the gradient one process computes
on the union of their batches), DDP all-reduces (averages) the gradients, and only rank 0 logs
and writes files.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """True on rank 0 (and in a plain single process)."""
    return rank() == 0


def init_distributed(device: torch.device | str | None = None) -> tuple[int, int, torch.device]:
    """Start the process group when launched by torchrun with WORLD_SIZE > 1 (idempotent).

    Args:
        device: the device the caller would use in a single process (``cuda`` or ``cpu``);
            ``None`` picks CUDA when present.
    Returns:
        (rank, world, device): under torchrun on CUDA the device is ``cuda:LOCAL_RANK``.
    """
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if env_world() <= 1:
        return 0, 1, dev
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kw = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend=backend, **kw)
    return dist.get_rank(), dist.get_world_size(), dev


def destroy() -> None:
    """Tear the process group down (safe to call when none exists)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def _comm_device() -> torch.device:
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_counts(counts: dict[str, float]) -> dict[str, float]:
    """Sum a dict of counts over ranks (exact metric averaging: sums of losses, tokens, hits).
    Keys must be the same on every rank. Returns a new dict of floats (float64 sums)."""
    if not is_distributed() or not counts:
        return dict(counts)
    keys = sorted(counts)
    t = torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dict(zip(keys, t.cpu().tolist()))


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (returned; the input is not modified). No-op in one process."""
    if not is_distributed():
        return t
    out = t.detach().clone().to(_comm_device())
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(t.device)


def shard(items: list, rank_: int | None = None, world: int | None = None) -> list:
    """This rank's disjoint slice ``items[rank::world]``, cut to a length every rank shares
    (ranks must run the same number of steps)."""
    r = rank() if rank_ is None else rank_
    w = world_size() if world is None else world
    n = len(items) // w if w > 1 else len(items)
    return items[r::w][:n]
