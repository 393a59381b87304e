"""The on-disk feature store: sharded safetensors plus a ``manifest.json``.

Layout of one split directory (``data/features/<split>/``)::

    shard-00000.safetensors   input_ids [N] int32, loss_mask [N] uint8, target_argmax [N] int32,
                              aux_hidden [N, n_aux*H] (storage dtype), final_hidden [N, H],
                              offsets [S+1] int64 (sample s = rows offsets[s]:offsets[s+1])
    ...
    manifest.json             written LAST: what produced the features and what they hold

Shards are written atomically as they fill, so memory stays bounded by one shard, and a reader
never sees a partial shard. Bytes per token = (n_aux + 1) * H * itemsize + 9.

With storage dtype ``float8_e4m3fn`` the aux hidden states are stored scaled: each token's row of
each aux layer (H values) is divided by its own scale ``amax(|row|) / 448`` (448 = e4m3's largest
finite value), cast to fp8, and the scales are stored beside them in float32 as
``aux_hidden_scale`` [N, n_aux]. The final hidden state stays bfloat16: it is the teacher
(``lm_head(final_hidden)``), and in fp8 the target's greedy token changes on a few percent of
tokens (dev/results/fp8_features_cpu.json). Per token and per layer, because Llama hidden
states carry a few massive activations (rows whose largest values are hundreds of times the
median row's, past e4m3's 448): one scale per tensor would flush most values to zero, a per-row
scale confines an outlier's cost to its own row.
Readers (:func:`read_tensors`) dequantise to bfloat16 transparently. Bytes per token then =
n_aux * (H + 4) + 2 * H + 9.

A token store (``train.mode: online``, manifest ``"contents": "tokens"``) has the same layout
with ``input_ids``, ``loss_mask`` and ``offsets`` only (:data:`TOKEN_BYTES` = 5 bytes per token):
the train stages compute the hidden states from the target batch by batch (eyas/training/online.py), in
the storage dtype the manifest names, so they equal what a feature store would hold.

One module past 500 lines on purpose: it is the one on-disk format of features (the writer, the
reader, the manifest and its checks, fp8 storage, the size estimate, the token store), and a reader
split from its writer could drift from it.
"""

from __future__ import annotations

import math
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from eyas.io import read_json, save_safetensors_parts, write_json

MANIFEST = "manifest.json"
PROGRESS = "progress.json"  # resumable extraction: the complete shards so far (removed at finish)
FORMAT_VERSION = 1
LAYER_CONVENTION = "hf_hidden_states_index"  # see eyas/target/layers.py
# manifest key: what aux layer id L (the layer count) holds: PRE_NORM, the residual before the final
# norm, as the engines serve it (eyas/target/layers.py capture_aux); manifests without the key held HF's
# post-norm hidden_states[L] there (refused on open)
AUX_AT_L, PRE_NORM = "aux_layer_L", "pre_norm_residual"


class FeatureError(ValueError):
    """Features are missing, incomplete, or disagree with what a stage expects."""


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max (OCP FP8 spec: E4M3, no infinities)
SCALE_SUFFIX = "_scale"  # fp8 storage: "aux_hidden_scale" holds the per-token, per-layer scales
DISK_HEADROOM = 0.10  # check_disk_space wants this fraction more free than the estimate
TOKEN_BYTES = 4 + 1  # a token store's bytes per token: int32 input_ids, uint8 loss_mask
FEATURES, TOKENS = "features", "tokens"  # manifest "contents": hidden states stored, or tokens only


def bytes_per_token(num_aux: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Storage per token: aux + final hidden states in ``dtype`` ((n_aux + 1) * H values), int32
    ids and argmax, uint8 mask. fp8 (module docstring): the aux states in fp8 plus one float32
    scale per aux layer, the final hidden state in bfloat16."""
    if dtype == FP8:
        return num_aux * (hidden_size + 4) + 2 * hidden_size + 4 + 4 + 1
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (num_aux + 1) * hidden_size * itemsize + 4 + 4 + 1


def estimate_split_bytes(lengths: list[int], shard_samples: int, num_aux: int, hidden_size: int,
                         dtype: torch.dtype, contents: str = FEATURES) -> int:
    """Bytes of tensor data one split's shards will hold (safetensors headers, a few hundred bytes
    per shard, are left to the headroom of :func:`check_disk_space`).

    ``sum(lengths) * bytes_per_token(num_aux, hidden_size, dtype) + 8 * (S + n_shards)``: the
    per-token tensors plus each shard's int64 ``offsets`` [samples + 1], with S = len(lengths)
    samples of ``lengths[s]`` tokens and n_shards = ceil(S / shard_samples); a token store
    (``contents`` :data:`TOKENS`) holds :data:`TOKEN_BYTES` per token instead.
    Equals :attr:`ShardWriter.bytes_written` for the same samples.
    """
    n_shards = math.ceil(len(lengths) / shard_samples)
    per_token = TOKEN_BYTES if contents == TOKENS else bytes_per_token(num_aux, hidden_size, dtype)
    return sum(lengths) * per_token + 8 * (len(lengths) + n_shards)


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (where the disk usage can be asked)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def check_disk_space(out_dir: str | Path, out_bytes: int, staging_dir: str | Path, staging_bytes: int,
                     headroom: float = DISK_HEADROOM, free_bytes=None) -> dict:
    """Refuse to start an extraction that would fill the disk (call before any compute).

    ``out_bytes`` (all splits, plus anything else written under ``out_dir``) must fit the free
    space of ``out_dir``'s filesystem. Shards are first written to ``staging_dir`` and renamed into
    ``out_dir`` split by split: on the same filesystem the rename costs nothing, on another one
    ``staging_dir`` must also hold ``staging_bytes`` (the largest split). Each need is multiplied
    by ``1 + headroom`` (default 10%: safetensors headers, the manifests, and other writers).
    The DVC cache links (``cache.type = hardlink,symlink`` in eyas' ``.dvc/config``), so it needs
    no second copy; with ``copy`` it would.

    Args:
        free_bytes: ``f(path) -> free bytes`` (default ``shutil.disk_usage(path).free`` of the
            path's nearest existing ancestor); tests pass a fake figure.
    Returns:
        {"needed": {path: bytes incl. headroom}, "free": {path: bytes}} for each filesystem checked.
    Raises:
        FeatureError: naming the path, the bytes needed and the bytes free.
    """
    free_bytes = free_bytes or (lambda p: shutil.disk_usage(_existing(p)).free)
    needs = {str(out_dir): out_bytes}
    if os.stat(_existing(staging_dir)).st_dev != os.stat(_existing(out_dir)).st_dev:
        needs[str(staging_dir)] = staging_bytes
    report = {"needed": {}, "free": {}}
    for path, nbytes in needs.items():
        need, free = math.ceil(nbytes * (1 + headroom)), int(free_bytes(Path(path)))
        report["needed"][path], report["free"][path] = need, free
        if need > free:
            raise FeatureError(
                f"{path}: not enough disk for the features: need {need} bytes ({need / 2**30:.2f} GiB, "
                f"estimate {nbytes} + {headroom:.0%} headroom), {free} bytes ({free / 2**30:.2f} GiB) free. "
                f"Free space, lower data.max_conversations or extract.max_length, or store "
                f"extract.dtype: float8_e4m3fn")
    return report


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-group fp8 (e4m3) quantisation (the module docstring says why per row).

    Args:
        x: [N, groups * H] float (any float dtype, any device).
        groups: layers concatenated along the last dim (n_aux for ``aux_hidden``).
    Returns:
        (q [N, groups * H] float8_e4m3fn, scale [N, groups] float32) with
        ``x[n, g*H:(g+1)*H] ~= q[n, g*H:(g+1)*H].float() * scale[n, g]``, scale = amax / 448
        (1 for an all-zero row; inf/NaN for a row holding inf/NaN). Relative error per value
        <= 2**-4 where |x| >= scale * 2**-6 (e4m3's smallest normal); smaller values are
        subnormal or flush to zero.
    Raises:
        ValueError: the last dim is not a multiple of ``groups``.
    """
    n, d = x.shape
    if d % groups:
        raise ValueError(f"quantize_fp8: last dim {d} is not a multiple of {groups} groups")
    xg = x.float().reshape(n, groups, d // groups)
    amax = xg.abs().amax(-1)
    # all-zero rows get scale 1; inf/NaN rows keep an inf/NaN scale (the writer refuses them)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
    q = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(n, d), scale


class NonFiniteFeatureError(FeatureError):
    """A hidden state is inf/NaN as it would be stored (after the cast to the storage dtype)."""


def check_finite(sample: dict[str, torch.Tensor], n_aux: int, dtype: torch.dtype, where: str,
                 aux_layers: list[int] | None = None) -> None:
    """Refuse a sample whose hidden states, as stored, hold inf or NaN: whatever the storage dtype,
    such a value reaches the training loss and turns it NaN at the first optimizer step.

    float16 holds |x| <= 65504 (``torch.finfo(torch.float16).max``), and Llama-family targets carry
    a few massive activations on the first token (``SafeAILab/EAGLE`` PR #69 rescales them before a
    float16 cast), so a cast of a finite state can give inf; bfloat16 and float32 cover the range
    of any finite state, and fp8 rows are scaled into range (an inf/NaN scale means the target's
    own forward was not finite).

    Args:
        sample: as stored by :class:`ShardWriter`: ``aux_hidden`` [T, n_aux*H] (fp8 with
            ``aux_hidden_scale`` [T, n_aux] float32) and ``final_hidden`` [T, H].
        n_aux: aux layers concatenated in ``aux_hidden``.
        dtype: the storage dtype (``extract.dtype``).
        where: the split directory, shard and sample, for the message.
        aux_layers: the HF ``hidden_states`` indices of the aux layers (named in the message),
            or None (their positions are named).
    Raises:
        NonFiniteFeatureError: naming ``where``, the token, the layer (aux HF index or the final
            hidden state), the storage dtype and what to store instead.
    """
    T = sample["final_hidden"].shape[0]
    scale = sample.get("aux_hidden" + SCALE_SUFFIX)
    aux = scale if scale is not None else sample["aux_hidden"].reshape(T, n_aux, -1)
    bad_aux = ~torch.isfinite(aux.float()) if scale is not None else ~torch.isfinite(aux).all(-1)
    bad_final = ~torch.isfinite(sample["final_hidden"]).all(-1)
    if not bool(bad_aux.any()) and not bool(bad_final.any()):
        return
    if bad_aux.any():
        t, g = bad_aux.nonzero()[0].tolist()
        layer = (f"aux layer {g} (HF hidden_states index {aux_layers[g]})" if aux_layers
                 else f"aux layer {g} of {n_aux}")
        stored = sample["aux_hidden"].dtype
    else:
        t, layer, stored = int(bad_final.nonzero()[0]), "the final hidden state", sample["final_hidden"].dtype
    stored = str(stored).removeprefix("torch.")
    if dtype == torch.float16:
        why = ("float16 holds |x| <= 65504, and a larger activation (a massive activation, e.g. on "
               "the first token) becomes inf: store extract.dtype: bfloat16 (or float32)")
    else:
        why = ("the target's own forward gave inf/NaN (no storage dtype can hold it): check the "
               "target and target.dtype")
    raise NonFiniteFeatureError(f"{where}: token {t}, {layer}: inf/NaN as stored in {stored} "
                                f"(extract.dtype {str(dtype).removeprefix('torch.')}); {why}")


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: q [N, G*H] fp8, scale [N, G] float32 -> [N, G*H] ``dtype``."""
    n, d = q.shape
    g = scale.shape[-1]
    return (q.float().reshape(n, g, d // g) * scale.float()[..., None]).reshape(n, d).to(dtype)


def read_tensors(f, names) -> dict[str, torch.Tensor]:
    """Read ``names`` from an open safetensors file (``safe_open``), dequantising fp8 hidden
    states that have a ``<name>_scale`` beside them (to bfloat16); other tensors as stored."""
    stored = set(f.keys())
    out = {}
    for k in names:
        t = f.get_tensor(k)
        if k + SCALE_SUFFIX in stored:
            t = dequantize_fp8(t, f.get_tensor(k + SCALE_SUFFIX))
        out[k] = t
    return out


class ShardWriter:
    """Accumulate samples and write a shard every ``shard_samples`` samples.

    Call :meth:`add` per sample and :meth:`finish` with the manifest fields at the end; the
    manifest is written last so an interrupted extraction never looks complete.

    With ``background=True`` shards are concatenated and written (fsync + rename, as always) by
    ``writers`` threads while the caller keeps computing; at most ``max_pending`` shards wait in
    memory. :meth:`finish` waits for every write and re-raises the first error. Shard names and
    the manifest's shard order are fixed at submission, so the output is identical either way.
    """

    def __init__(self, out_dir: str | Path, shard_samples: int, dtype: torch.dtype,
                 background: bool = False, writers: int = 2, max_pending: int = 4,
                 resume_key: str | None = None, aux_layers: list[int] | None = None):
        """``aux_layers`` (HF ``hidden_states`` indices) only names layers in errors (:func:`check_finite`).

        With ``resume_key`` (a fingerprint of everything that determines the samples and their
        order), complete shards are recorded in ``progress.json`` (atomic) as they land; a new
        writer on the same directory with the same key keeps the leading run of complete, full,
        readable shards and sets :attr:`resumed_samples` (the caller skips that many samples).
        Any other key, or no record, starts clean; partial files are never reused."""
        import threading

        self.out = Path(out_dir)
        self.shard_samples = shard_samples
        self.dtype = dtype
        self.resume_key = resume_key
        self.aux_layers = aux_layers
        self._lock = threading.Lock()
        self._done: dict[str, dict] = {}
        kept = self._resumable() if resume_key is not None else []
        if kept:
            names = {s["file"] for s in kept} | {PROGRESS}
            for f in self.out.iterdir():  # later shards, temporary files, a stale manifest
                if f.name not in names:
                    shutil.rmtree(f) if f.is_dir() else f.unlink()
        else:
            if self.out.exists():
                shutil.rmtree(self.out)
            self.out.mkdir(parents=True)
        self.buf: list[dict] = []
        self.shards: list[dict] = [{k: s[k] for k in ("file", "samples", "tokens")} for s in kept]
        self._done = {s["file"]: s for s in kept}
        self.num_samples = self.resumed_samples = sum(s["samples"] for s in kept)
        self.num_tokens = sum(s["tokens"] for s in kept)
        self.supervised_tokens = sum(s["supervised_tokens"] for s in kept)
        self.bytes_written = sum(s["bytes"] for s in kept)
        if resume_key is not None:
            self._save_progress()
        self._queue = None
        self._threads: list = []
        self._errors: list[BaseException] = []
        if background:
            import queue
            import threading

            self._queue = queue.Queue(maxsize=max_pending)
            for _ in range(max(1, writers)):
                t = threading.Thread(target=self._worker, daemon=True)
                t.start()
                self._threads.append(t)

    def add(self, input_ids, loss_mask, aux_hidden, final_hidden, target_argmax, aux_scale=None) -> None:
        """One sample: input_ids/loss_mask/target_argmax [T]; aux_hidden [T, n_aux*H]; final_hidden [T, H].
        With fp8 storage aux_hidden is quantised here (:func:`quantize_fp8`) when it comes in a
        wider float dtype, or arrives quantised (float8_e4m3fn, with ``aux_scale`` [T, n_aux]
        float32: :func:`quantize_capture` on the GPU, before the host copy); final_hidden is stored
        as bfloat16.

        Raises:
            ValueError: pre-quantised input that does not fit: fp8 ``aux_hidden`` other than
                e4m3, or for non-fp8 storage; ``aux_scale`` missing, not float32 [T, n_aux], or
                given with unquantised ``aux_hidden``.
            NonFiniteFeatureError: a hidden state is inf/NaN after the cast to the storage dtype
                (:func:`check_finite`; names the split directory, shard, sample, token and layer).
        """
        sample = {
            "input_ids": input_ids.to(torch.int32).cpu(),
            "loss_mask": loss_mask.to(torch.uint8).cpu(),
            "target_argmax": target_argmax.to(torch.int32).cpu(),
        }
        n_aux = aux_hidden.shape[-1] // final_hidden.shape[-1]
        if aux_hidden.dtype.itemsize == 1 or aux_scale is not None:  # arrives quantised: check it
            where = f"{self.out}: sample {self.num_samples}"
            if self.dtype != FP8 or aux_hidden.dtype != FP8:
                raise ValueError(f"{where}: pre-quantised aux_hidden must be {FP8} for {FP8} storage, got "
                                 f"{aux_hidden.dtype} for {self.dtype} storage")
            want = (aux_hidden.shape[0], n_aux)
            if aux_scale is None or aux_scale.dtype != torch.float32 or tuple(aux_scale.shape) != want:
                got = None if aux_scale is None else (aux_scale.dtype, tuple(aux_scale.shape))
                raise ValueError(f"{where}: fp8 aux_hidden needs aux_scale float32 {list(want)}, got {got}")
        if self.dtype == FP8:
            if aux_hidden.dtype == FP8:
                q, scale = aux_hidden, aux_scale
            else:
                q, scale = quantize_fp8(aux_hidden, n_aux)
            sample["aux_hidden"], sample["aux_hidden" + SCALE_SUFFIX] = q.cpu(), scale.cpu()
            sample["final_hidden"] = final_hidden.to(torch.bfloat16).cpu()
        else:
            sample["aux_hidden"] = aux_hidden.to(self.dtype).cpu()
            sample["final_hidden"] = final_hidden.to(self.dtype).cpu()
        check_finite(sample, n_aux, self.dtype, aux_layers=self.aux_layers,
                     where=f"{self.out} (split {self.out.name}): shard-{len(self.shards):05d}.safetensors, "
                           f"sample {self.num_samples} ({len(self.buf)} in its shard)")
        self.buf.append(sample)
        self.num_samples += 1
        self.num_tokens += int(input_ids.numel())
        self.supervised_tokens += int(loss_mask.sum())
        if len(self.buf) >= self.shard_samples:
            self._flush()

    def add_tokens(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
        """One sample of a token store (``train.mode: online``): input_ids and loss_mask [T], stored
        as int32 / uint8; no hidden states. Do not mix with :meth:`add` in one writer."""
        self.buf.append({"input_ids": input_ids.to(torch.int32).cpu(), "loss_mask": loss_mask.to(torch.uint8).cpu()})
        self.num_samples += 1
        self.num_tokens += int(input_ids.numel())
        self.supervised_tokens += int(loss_mask.sum())
        if len(self.buf) >= self.shard_samples:
            self._flush()

    def _write(self, buf: list[dict], name: str) -> None:
        # each sample's tensors go straight from their (pinned) host memory to the file: no
        # torch.cat of the shard and no in-memory serialisation (same bytes as save_safetensors)
        lengths = torch.tensor([b["input_ids"].numel() for b in buf], dtype=torch.int64)
        parts = {k: [b[k] for b in buf] for k in buf[0]}
        parts["offsets"] = [torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]
        nbytes = save_safetensors_parts(parts, self.out / name)
        with self._lock:
            self.bytes_written += nbytes
            if self.resume_key is not None:
                self._done[name] = {"file": name, "samples": len(buf), "tokens": int(lengths.sum()),
                                    "supervised_tokens": int(sum(int(b["loss_mask"].sum()) for b in buf)),
                                    "bytes": nbytes}
                self._save_progress()

    def _save_progress(self) -> None:
        write_json(self.out / PROGRESS, {"resume_key": self.resume_key, "shard_samples": self.shard_samples,
                                         "dtype": str(self.dtype), "done": self._done})

    def _resumable(self) -> list[dict]:
        """The leading complete, full shards recorded for this ``resume_key`` (see __init__)."""
        try:
            rec = read_json(self.out / PROGRESS)
        except (FileNotFoundError, ValueError):
            return []
        if (rec.get("resume_key"), rec.get("shard_samples"), rec.get("dtype")) != \
                (self.resume_key, self.shard_samples, str(self.dtype)):
            return []
        kept = []
        for i in range(len(rec.get("done", {}))):
            s = rec["done"].get(f"shard-{i:05d}.safetensors")
            if s is None or s["samples"] != self.shard_samples:
                break
            try:  # a listed shard must still open and hold what the record says
                with safe_open(str(self.out / s["file"]), framework="pt") as f:
                    if f.get_slice("offsets").get_shape() != [s["samples"] + 1]:
                        break
            except Exception:  # noqa: BLE001 - missing / unreadable: stop here, recompute the rest
                break
            kept.append(s)
        return kept

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if not self._errors:
                    self._write(*item)
            except BaseException as e:  # noqa: BLE001 - re-raised by finish()
                self._errors.append(e)
            finally:
                self._queue.task_done()

    def _flush(self) -> None:
        if not self.buf:
            return
        if self._errors:
            raise self._errors[0]
        name = f"shard-{len(self.shards):05d}.safetensors"
        tokens = sum(b["input_ids"].numel() for b in self.buf)
        self.shards.append({"file": name, "samples": len(self.buf), "tokens": int(tokens)})
        buf, self.buf = self.buf, []
        if self._queue is not None:
            self._queue.put((buf, name))
        else:
            self._write(buf, name)

    def close(self) -> None:
        """Wait for pending background writes; re-raise the first error."""
        if self._queue is not None:
            for _ in self._threads:
                self._queue.put(None)
            for t in self._threads:
                t.join()
            self._queue, self._threads = None, []
        if self._errors:
            raise self._errors[0]

    def finish(self, **manifest_fields) -> dict:
        self._flush()
        self.close()
        if self.num_samples == 0:
            raise FeatureError(f"{self.out}: no samples to write")
        manifest = {
            "format_version": FORMAT_VERSION,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "supervised_tokens": self.supervised_tokens,
            "storage_dtype": str(self.dtype).removeprefix("torch."),
            "shards": self.shards,
            "aux_layers_convention": LAYER_CONVENTION,
            AUX_AT_L: PRE_NORM,
            **manifest_fields,
        }
        write_json(self.out / MANIFEST, manifest)
        (self.out / PROGRESS).unlink(missing_ok=True)  # after the manifest: complete either way
        return manifest


def quantize_capture(out: dict[str, torch.Tensor], n_aux: int) -> dict[str, torch.Tensor]:
    """A capture (``Target.capture``: aux_hidden [B, T, n_aux*H], ...) with aux_hidden quantised
    where it lies (:func:`quantize_fp8`, per token and layer) and its scales added as
    ``aux_scale`` [B, T, n_aux] float32: on a GPU, fp8 crosses to the host instead of bf16."""
    aux = out["aux_hidden"]
    B, T, D = aux.shape
    q, scale = quantize_fp8(aux.reshape(B * T, D), n_aux)
    return {**out, "aux_hidden": q.view(B, T, D), "aux_scale": scale.view(B, T, n_aux)}


class HostCopy:
    """Device -> host copies that overlap compute: each :meth:`submit` casts the tensors on the
    device, copies them into fresh pinned host buffers on a side stream (``non_blocking``) and
    returns a handle; :meth:`HostCopy.Handle.wait` blocks until that copy is done. Pinned buffers
    come from PyTorch's caching host allocator and are recycled once the writer drops them.
    On CPU tensors it is a plain (synchronous) conversion."""

    class Handle:
        def __init__(self, tensors: dict, event):
            self.tensors, self.event = tensors, event

        def wait(self) -> dict:
            if self.event is not None:
                self.event.synchronize()
            return self.tensors

    def __init__(self, device: torch.device | str):
        dev = torch.device(device)
        self.cuda = dev.type == "cuda"
        self.stream = torch.cuda.Stream(device=dev) if self.cuda else None

    def submit(self, tensors: dict[str, torch.Tensor],
               dtypes: dict[str, torch.dtype] | None = None) -> "HostCopy.Handle":
        dtypes = dtypes or {}
        if not self.cuda:
            return HostCopy.Handle({k: v.to(dtypes.get(k, v.dtype)).cpu() for k, v in tensors.items()}, None)
        src = {k: v.to(dtypes.get(k, v.dtype)) for k, v in tensors.items()}  # cast on the device
        self.stream.wait_stream(torch.cuda.current_stream())
        out = {}
        with torch.cuda.stream(self.stream):
            for k, v in src.items():
                v.record_stream(self.stream)
                out[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                out[k].copy_(v, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return HostCopy.Handle(out, ev)


@dataclass
class FeatureStore:
    """Read access to one split directory written by :class:`ShardWriter` (fp8 hidden states
    come back dequantised to bfloat16)."""

    root: Path
    manifest: dict

    @classmethod
    def open(cls, root: str | Path) -> "FeatureStore":
        """Raises FeatureError when the manifest is missing (extraction incomplete) or a shard is, or
        when the features hold aux layer id L (the layer count) captured other than
        :data:`PRE_NORM` (manifests before :data:`AUX_AT_L` stored HF's post-norm
        ``hidden_states[L]``, which no engine serves)."""
        root = Path(root)
        if not (root / MANIFEST).is_file():
            raise FeatureError(f"{root}: no {MANIFEST}; extraction did not finish (rerun `dvc repro extract`)")
        m = read_json(root / MANIFEST)
        if m.get("format_version") != FORMAT_VERSION:
            raise FeatureError(f"{root / MANIFEST}: format_version {m.get('format_version')} != {FORMAT_VERSION}")
        L = m.get("num_layers")
        if m.get("contents", FEATURES) == FEATURES and L in m.get("aux_layers", []) and m.get(AUX_AT_L) != PRE_NORM:
            was = m.get(AUX_AT_L, "post-norm hidden_states[L]")
            raise FeatureError(
                f"{root / MANIFEST}: aux layer id {L} (L) was captured as {was!r}, "
                f"but vLLM, llama.cpp and SGLang (PR #32334) serve the residual before the final norm there "
                f"({AUX_AT_L}: {PRE_NORM!r}): re-extract (`dvc repro extract`)")
        for s in m["shards"]:
            if not (root / s["file"]).is_file():
                raise FeatureError(f"{root / s['file']}: listed in the manifest but missing")
        return cls(root, m)

    @property
    def aux_layers(self) -> list[int]:
        return self.manifest["aux_layers"]

    @property
    def contents(self) -> str:
        """:data:`FEATURES` (hidden states stored) or :data:`TOKENS` (a token store: input_ids and
        loss_mask only, for ``train.mode: online``); manifests from before token stores hold features."""
        return self.manifest.get("contents", FEATURES)

    def iter_shards(self, keys: tuple[str, ...] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Yield one shard's tensors at a time (memory bounded by a shard)."""
        for s in self.manifest["shards"]:
            with safe_open(str(self.root / s["file"]), framework="pt") as f:
                names = keys + ("offsets",) if keys else [k for k in f.keys() if not k.endswith(SCALE_SUFFIX)]
                yield read_tensors(f, names)

    def iter_samples(self, keys: tuple[str, ...] | None = None, shuffle_seed: int | None = None
                     ) -> Iterator[dict[str, torch.Tensor]]:
        """Yield samples as dicts of per-token tensors. With ``shuffle_seed``, shard order and
        the order within each shard are shuffled deterministically (bounded-memory shuffle)."""
        shards = list(range(len(self.manifest["shards"])))
        rng = random.Random(shuffle_seed)
        if shuffle_seed is not None:
            rng.shuffle(shards)
        for si in shards:
            s = self.manifest["shards"][si]
            with safe_open(str(self.root / s["file"]), framework="pt") as f:
                names = list(keys) if keys else [k for k in f.keys()
                                                 if k != "offsets" and not k.endswith(SCALE_SUFFIX)]
                t = read_tensors(f, names + ["offsets"])
            off = t.pop("offsets")
            order = list(range(len(off) - 1))
            if shuffle_seed is not None:
                rng.shuffle(order)
            for i in order:
                a, b = int(off[i]), int(off[i + 1])
                yield {k: v[a:b] for k, v in t.items()}

    def token_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All (input_ids, loss_mask) concatenated: two [N_tokens] tensors (int32 / uint8)."""
        ids, mask = [], []
        for t in self.iter_shards(("input_ids", "loss_mask")):
            ids.append(t["input_ids"])
            mask.append(t["loss_mask"])
        return torch.cat(ids), torch.cat(mask)


def head_path(features_root: str | Path) -> Path:
    """Where extract stores the target's embedding and lm_head (``target_head.safetensors``)."""
    return Path(features_root) / "target_head.safetensors"


def check_compatible(manifest: dict, *, aux_layers: list[int], hidden_size: int, vocab_size: int,
                     source: str) -> None:
    """Refuse features whose manifest disagrees with a drafter config (before any compute).

    Raises:
        FeatureError: naming ``source``, the manifest and the mismatching field.
    """
    if manifest.get("aux_layers_convention") != LAYER_CONVENTION:
        raise FeatureError(f"features manifest: aux layer convention {manifest.get('aux_layers_convention')!r}, "
                           f"eyas expects {LAYER_CONVENTION!r}")
    if list(manifest["aux_layers"]) != list(aux_layers):
        raise FeatureError(
            f"aux layer mismatch: the features were extracted at HF hidden_states indices "
            f"{manifest['aux_layers']} but {source} expects {aux_layers}. Re-extract, or build the "
            f"drafter with extract.aux_layers = {manifest['aux_layers']}")
    if manifest["hidden_size"] != hidden_size:
        raise FeatureError(f"hidden size mismatch: features {manifest['hidden_size']}, {source} {hidden_size}")
    if manifest["vocab_size"] != vocab_size:
        raise FeatureError(f"vocab size mismatch: features {manifest['vocab_size']}, {source} {vocab_size}")
