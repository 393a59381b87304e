"""Process-group helpers for running the training stages under ``torchrun``.

One process per GPU (or a few CPU processes with gloo for tests): ``init_distributed`` reads the
``torchrun`` environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), starts the process group
(nccl on CUDA, gloo on CPU) and picks this rank's device. Without ``WORLD_SIZE`` > 1 every helper
is a no-op, so single-process code paths need no branches.

Data parallelism in :func:`eyas.training.loop.train_drafter`: rank r takes packed batches r, r+W, r+2W, ...
of each epoch (a global batch = W x ``batch_tokens``), the per-step loss is normalised by the
GLOBAL number of supervised tokens (so W ranks compute exactly the gradient one process computes
on the union of their batches), DDP all-reduces (averages) the gradients, and only rank 0 logs
and writes files.

The module DDP or FSDP wraps is :class:`eyas.training.unroll.TTTUnroll` (its ``forward`` is the TTT loss;
its parameters are the drafter's under the ``drafter.`` prefix).

``train.strategy: fsdp`` (:func:`wrap_data_parallel`) replaces DDP with PyTorch's FSDP2
(``torch.distributed.fsdp.fully_shard``): the trainable parameters (``fc``, the decoder layer, the
norm and ``lm_head``), their gradients and the AdamW state are sharded over the ranks (dim 0), so
each rank holds 1/W of them between steps instead of a full replica. They form one FSDP unit:
every TTT step calls the decoder layer (through its methods, not ``forward``) and ``lm_head``, so
both must stay gathered for the whole forward; per-module units would re-gather them on every
step. So FSDP divides the persistent bytes per fp32 trainable parameter (weight 4 + gradient 4 +
AdamW moments 8 = 16 under DDP) by W, while a step transiently adds the gathered weights and
their full gradients before the reduce-scatter: a peak of about 8 + 16/W bytes instead of 16.
The frozen target embedding (``ignored_params``) and the ``d2t``/``t2d`` buffers stay
replicated. FSDP2's reduce-scatter averages gradients like DDP's all-reduce, so the same global
loss normalisation gives the same gradient. Code that calls the drafter's methods outside the
wrapped ``forward`` (evaluation) runs inside :func:`gathered`; checkpoints store the FULL state
(:func:`full_train_state`, ``torch.distributed.checkpoint.state_dict`` with
``full_state_dict=True, cpu_offload=True``) in the single-process layout, and :func:`release`
hands the drafter back with full plain parameters on every rank, so the exported drafter is the
same format as a DDP or single-process one.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

STRATEGIES = ("ddp", "fsdp")


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


def _fsdp_mesh(device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def wrap_data_parallel(model: torch.nn.Module, strategy: str, device: torch.device) -> torch.nn.Module:
    """Wrap ``model`` (already on ``device``) for data-parallel training; a no-op in one process.

    ``ddp``: ``DistributedDataParallel`` (rank 0's weights broadcast at construction, gradients
    all-reduced and averaged). ``fsdp``: rank 0's trainable weights are broadcast (the same start
    as DDP), then ``fully_shard`` makes them DTensors sharded on dim 0 over a 1-D mesh of all ranks,
    one FSDP unit; frozen parameters are ``ignored_params`` (replicated, no gradient), buffers stay
    replicated. The returned module is ``model`` itself (its class swapped by FSDP2).

    Raises:
        ValueError: ``strategy`` is not one of :data:`STRATEGIES`.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"train.strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not is_distributed():
        return model
    if strategy == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    from torch.distributed.fsdp import fully_shard

    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                dist.broadcast(p, src=0)
    frozen = {p for p in model.parameters() if not p.requires_grad}
    fully_shard(model, mesh=_fsdp_mesh(device), ignored_params=frozen or None)
    return model


def _is_fsdp(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextmanager
def gathered(model: torch.nn.Module | None):
    """Within the block, an FSDP ``model``'s parameters are all-gathered (plain full tensors), so
    code may call its submodules' methods directly (evaluation); resharded on exit. A no-op for
    anything else. Collective: every rank must enter."""
    if model is None or not _is_fsdp(model):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def _full_options(cpu_offload: bool, strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload, strict=strict)


def full_train_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, prefix: str
                     ) -> tuple[dict[str, torch.Tensor], dict]:
    """The FULL (unsharded) trainable weights and optimizer state of an FSDP ``model``, on CPU, in
    the single-process layout that :mod:`eyas.training.checkpoint` writes. Collective: every rank must call;
    only rank 0 gets the tensors (``cpu_offload=True``), the others get empty dicts.

    Args:
        prefix: the name prefix of the drafter inside ``model`` (``"drafter."``), removed.
    Returns:
        (weights {drafter param name: float tensor of its full shape}, optimizer state dict
        {"state": {i: {"step", "exp_avg", ...}}, "param_groups": [{..., "params": [i, ...]}]})
        with ``i`` the parameter's position among the trainable parameters, as
        ``optimizer.state_dict()`` numbers them in one process.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    msd = get_model_state_dict(model, options=_full_options(True))
    osd = get_optimizer_state_dict(model, optimizer, options=_full_options(True))
    if not msd:  # ranks > 0
        return {}, {}
    index = {n: i for i, n in enumerate(names)}
    weights = {n[len(prefix):]: msd[n] for n in names}
    state = {index[n]: st for n, st in osd["state"].items()}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]
    return weights, {"state": state, "param_groups": groups}


def load_full_train_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, prefix: str,
                          weights: dict[str, torch.Tensor], optim_state: dict) -> None:
    """Install full state (the layout :func:`full_train_state` returns, read by every rank from a
    checkpoint) into an FSDP ``model`` and its ``optimizer``: each rank keeps its own shards.
    Collective: every rank must call."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    set_model_state_dict(model, {prefix + n: t for n, t in weights.items()},
                         options=_full_options(False, strict=False))  # buffers, frozen embedding: kept
    osd = {"state": {names[i]: st for i, st in optim_state["state"].items()},
           "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                            for g in optim_state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, osd, options=_full_options(False))


def release(model: torch.nn.Module) -> None:
    """Turn every sharded (DTensor) parameter of ``model`` back into a plain ``nn.Parameter``
    holding the full tensor, on every rank, so the module trains no further under FSDP but can be
    evaluated, exported or reused as in one process. Collective under FSDP; a no-op otherwise."""
    from torch.distributed.tensor import DTensor

    if not _is_fsdp(model):
        return
    with torch.no_grad():
        for mod in model.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                if isinstance(p, DTensor):
                    mod._parameters[name] = torch.nn.Parameter(p.full_tensor().detach().clone(),
                                                               requires_grad=p.requires_grad)
