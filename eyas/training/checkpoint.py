"""Resumable training state: safetensors + a JSON sidecar, written atomically (no pickle).

Layout of a checkpoint directory (``<checkpoint_dir>/state/``)::

    train_state.safetensors   model.<name>      trainable drafter parameters
                              opt.<i>.<key>     optimizer state tensors of parameter i (exp_avg, ...)
                              rng.torch         torch.get_rng_state() (uint8)
                              rng.cuda.<d>      torch.cuda.get_rng_state(d) per visible device
    train_state.json          step, epoch, batch_in_epoch, fingerprint, code, optimizer scalars and
                              param groups, scheduler state_dict, caller extras, and the sha256 of
                              the safetensors file; ``"complete": true``

The directory is built under a temporary name and renamed into place (:func:`eyas.io.atomic_dir`),
so ``state/`` is either the previous complete checkpoint or the new one. A kill inside the rename
leaves the previous one at ``.state.old``; :func:`load_train_state` falls back to it. Anything else
(a temporary ``.state.*.tmp`` directory, a truncated file, a hash mismatch, a checkpoint written for
other inputs: a different ``fingerprint``, or by other code: a different ``code`` digest) is ignored
with a one-line warning naming what differs, never loaded; it stays in place until the new run's
first checkpoint replaces it. The code digest (:func:`eyas.pipeline.resume.code_digest` of the stage) is
there because a stage whose code changed reruns under DVC with the same params and data: resuming
would finish a run begun by other code (the DVC ``checkpoint`` outputs had the same hole:
``treeverse/dvc`` issue 4821).

Python's ``random`` and numpy RNGs are not used by training, so only torch's are saved.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from eyas.io import atomic_dir, load_safetensors, read_json, save_safetensors, sha256_file, write_json

log = logging.getLogger(__name__)

STATE = "state"
TENSORS = "train_state.safetensors"
META = "train_state.json"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint exists but cannot be used (incomplete, corrupted, or for other inputs)."""


@dataclass
class TrainState:
    """What :func:`load_train_state` restored (the drafter/optimizer/scheduler in place)."""

    step: int
    epoch: int
    batch_in_epoch: int
    extra: dict
    path: Path


def state_dir(checkpoint_dir: str | Path) -> Path:
    """Where the latest complete checkpoint lives (what error messages name)."""
    return Path(checkpoint_dir) / STATE


def _trainable(drafter: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in drafter.named_parameters() if p.requires_grad}


def _json_default(o):
    if isinstance(o, torch.Tensor):
        if o.numel() == 1:
            return o.item()
        raise TypeError("non-scalar tensor in JSON state")
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def save_train_state(checkpoint_dir: str | Path, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler, *, step: int, epoch: int, batch_in_epoch: int, fingerprint: str,
                     code: str | None = None, extra: dict | None = None,
                     full_state: tuple[dict[str, torch.Tensor], dict] | None = None) -> Path:
    """Atomically write the full training state after optimizer step ``step``.

    Args:
        epoch, batch_in_epoch: the data position: the next batch to train on is batch
            ``batch_in_epoch`` of epoch ``epoch`` (``PackedLoader.batches(epoch, start=...)``).
        fingerprint: identifies the run's inputs (params, features, initial drafter); a checkpoint
            with another fingerprint is never resumed.
        code: the digest of the code that trains (:func:`eyas.pipeline.resume.code_digest`); a checkpoint
            with another one is never resumed by a caller that passes its own.
        extra: JSON-serialisable state of the caller (curves, running counts, ...).
        full_state: (trainable weights {name: full tensor}, optimizer state dict in the
            one-process layout) written instead of ``drafter``'s parameters and
            ``optimizer.state_dict()``: for FSDP, whose own are sharded
            (:func:`eyas.training.distributed.full_train_state` gathers them). The files are the same.
    Returns:
        the checkpoint's directory.
    """
    weights, sd = full_state if full_state is not None else (
        {n: p.detach() for n, p in _trainable(drafter).items()}, optimizer.state_dict())
    tensors: dict[str, torch.Tensor] = {f"model.{n}": t.cpu() for n, t in weights.items()}
    opt_scalars: dict[str, dict] = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                tensors[f"opt.{idx}.{k}"] = v.detach().cpu()
            elif isinstance(v, torch.Tensor):  # 0-d (AdamW's step): keep its dtype exactly
                tensors[f"opt.{idx}.{k}"] = v.detach().cpu().reshape(1)
                opt_scalars.setdefault(str(idx), {})[k] = "__scalar_tensor__"
            else:
                opt_scalars.setdefault(str(idx), {})[k] = v
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for d, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{d}"] = s
    meta = {
        "format_version": FORMAT_VERSION,
        "complete": True,
        "step": step,
        "epoch": epoch,
        "batch_in_epoch": batch_in_epoch,
        "fingerprint": fingerprint,
        "code": code,
        "optimizer": {"param_groups": sd["param_groups"], "scalars": opt_scalars,
                      "state_keys": sorted(str(i) for i in sd["state"])},
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "extra": extra or {},
    }
    meta = json.loads(json.dumps(meta, default=_json_default))  # fail BEFORE writing anything
    dest = state_dir(checkpoint_dir)
    with atomic_dir(dest) as tmp:
        save_safetensors(tensors, tmp / TENSORS)
        meta["tensors_sha256"] = sha256_file(tmp / TENSORS)
        write_json(tmp / META, meta)  # last: its presence + the hash mark the directory complete
    return dest


def _read_complete(d: Path, fingerprint: str | None, code: str | None = None) -> tuple[dict, dict]:
    """(meta, tensors) of a complete checkpoint directory ``d`` written for ``fingerprint`` (None:
    any) by ``code`` (None: any); CheckpointError otherwise, naming what differs."""
    if not (d / META).is_file() or not (d / TENSORS).is_file():
        raise CheckpointError(f"{d}: incomplete checkpoint (no {META} or {TENSORS})")
    try:
        meta = read_json(d / META)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if meta.get("format_version") != FORMAT_VERSION or meta.get("complete") is not True:
        raise CheckpointError(f"{d / META}: not a complete eyas checkpoint (format {meta.get('format_version')})")
    if sha256_file(d / TENSORS) != meta.get("tensors_sha256"):
        raise CheckpointError(f"{d / TENSORS}: sha256 differs from {META} (truncated or corrupted)")
    changed = []
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        changed.append(f"written for other inputs (fingerprint {meta.get('fingerprint')} != {fingerprint}: "
                       f"params, features or the initial drafter changed)")
    if code is not None and meta.get("code") != code:
        changed.append(f"written by other code (digest {str(meta.get('code'))[:12]} != {code[:12]}: a file the "
                       f"stage imports changed)")
    if changed:
        raise CheckpointError(f"{d}: {' and '.join(changed)}: not resumed, training "
                              f"starts afresh (this checkpoint stays until the new run's first one replaces it)")
    try:
        tensors = load_safetensors(d / TENSORS)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return meta, tensors


def find_checkpoint(checkpoint_dir: str | Path, fingerprint: str | None = None,
                    code: str | None = None) -> Path | None:
    """The newest complete checkpoint usable for ``fingerprint`` and ``code`` (None: any):
    ``state/``, else ``.state.old`` (left by a kill during the rename); ``None`` when there is
    none. Unusable ones are logged, one warning line each naming why."""
    root = Path(checkpoint_dir)
    for d in (root / STATE, root / f".{STATE}.old"):
        if not d.exists():
            continue
        try:
            _read_complete(d, fingerprint, code)
            return d
        except CheckpointError as e:
            log.warning("ignoring checkpoint: %s", e)
    return None


def load_train_state(checkpoint_dir: str | Path, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler, *, fingerprint: str, code: str | None = None,
                     install: Callable[[dict[str, torch.Tensor], dict], None] | None = None
                     ) -> TrainState | None:
    """Restore the newest complete checkpoint for ``fingerprint`` and ``code``
    (:func:`find_checkpoint`) into ``drafter``, ``optimizer``, ``scheduler`` and torch's RNG.
    Returns ``None`` (and changes nothing) when there is none; incomplete, corrupted or foreign
    checkpoints (other inputs, other code) are ignored with a warning, never loaded.
    Temporary directories of interrupted writes are removed.

    ``install(weights, optimizer_state)`` puts the full trainable weights {name: tensor} and the
    one-process optimizer state dict in place (FSDP: :func:`eyas.training.distributed.load_full_train_state`
    keeps each rank's shards); by default they are copied into ``drafter``'s parameters and
    ``optimizer.load_state_dict``. Names and shapes are checked against ``drafter`` first.

    Raises:
        CheckpointError: the checkpoint's parameters differ from the drafter's (names or shapes).
    """
    root = Path(checkpoint_dir)
    if root.is_dir():
        for tmp in root.glob(f".{STATE}.*.tmp"):
            log.warning("removing an interrupted checkpoint write: %s", tmp)
            shutil.rmtree(tmp, ignore_errors=True)
    d = find_checkpoint(root, fingerprint, code)
    if d is None:
        return None
    meta, tensors = _read_complete(d, fingerprint, code)
    params = _trainable(drafter)
    want = {f"model.{n}" for n in params}
    have = {k for k in tensors if k.startswith("model.")}
    if want != have:
        raise CheckpointError(f"{d / TENSORS}: parameters {sorted(have ^ want)[:4]} differ from the drafter's")
    for n, p in params.items():  # a DTensor's shape is its full shape
        t = tensors[f"model.{n}"]
        if t.shape != p.shape:
            raise CheckpointError(f"{d / TENSORS}: model.{n} has shape {tuple(t.shape)}, drafter {tuple(p.shape)}")
    weights = {n: tensors[f"model.{n}"] for n in params}
    om = meta["optimizer"]
    state: dict[int, dict] = {}
    for idx in om["state_keys"]:
        st: dict = {}
        prefix = f"opt.{idx}."
        for k, v in tensors.items():
            if k.startswith(prefix):
                st[k[len(prefix):]] = v
        for k, v in om["scalars"].get(idx, {}).items():
            st[k] = st[k].reshape(()) if v == "__scalar_tensor__" else v
        state[int(idx)] = st
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
              for g in om["param_groups"]]
    (install or _install_plain(params, optimizer))(weights, {"state": state, "param_groups": groups})
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng.torch"])
    if torch.cuda.is_available():
        cuda = [tensors[f"rng.cuda.{i}"] for i in range(torch.cuda.device_count()) if f"rng.cuda.{i}" in tensors]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    log.info("resumed from %s: step %d (epoch %d, batch %d)", d, meta["step"], meta["epoch"], meta["batch_in_epoch"])
    return TrainState(step=meta["step"], epoch=meta["epoch"], batch_in_epoch=meta["batch_in_epoch"],
                      extra=meta["extra"], path=d)


def _install_plain(params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer):
    def install(weights: dict[str, torch.Tensor], optim_state: dict) -> None:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(weights[n])
        optimizer.load_state_dict(optim_state)

    return install


def clear(checkpoint_dir: str | Path) -> None:
    """Remove a run's checkpoints (after its outputs are safely written)."""
    shutil.rmtree(checkpoint_dir, ignore_errors=True)


def fingerprint(*parts) -> str:
    """A stable sha256 (16 hex) of JSON-serialisable ``parts`` (tensors hashed by their bytes)."""
    import hashlib

    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, torch.Tensor):
            t = p.detach().cpu().contiguous()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\x00")
    return h.hexdigest()[:16]
