"""Atomic file writes and safetensors I/O (no pickle anywhere in eyas).

Every file eyas writes goes to a temporary name in the same directory, is fsynced and then renamed
over the destination (``os.replace`` is atomic on POSIX), so a killed stage never leaves a partial
file under a final name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(dest: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``dest``; on success fsync it and rename it to ``dest``."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the usual permissions
        os.replace(tmp, dest)
        _fsync_dir(dest.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(d: Path) -> None:
    """Make a rename durable (best effort: not every filesystem allows opening a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8", newline="\n")


def write_json(path: str | Path, obj) -> None:
    """Atomic JSON: sorted keys, indent 2, trailing newline (stable hashes for DVC). NaN and inf
    (e.g. a conditional accuracy with no eligible positions) become ``null``: strict JSON readers
    reject them."""
    text = json.dumps(_finite(json.loads(json.dumps(obj, default=_jsonable))), indent=2, sort_keys=True,
                      allow_nan=False)
    write_text(path, text + "\n")


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _jsonable(o: Any) -> Any:
    if hasattr(o, "tolist"):  # numpy arrays/scalars, torch tensors
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, os.PathLike):
        return os.fspath(o)
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _tsv_cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)  # shortest round-trip form
    s = str(v.item() if hasattr(v, "item") else v)
    return s.replace("\t", " ").replace("\r", " ").replace("\n", " ")


def write_tsv(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    """Write a DVC plots file (e.g. ``x: step``): a header from the first row's keys, one line
    per row, tab-separated, ``\\n`` line endings, atomic (a stage-level ``plots`` output with
    ``cache: false``; docs/dvc-mlflow.md §5). Missing values are empty cells; an empty ``rows``
    writes an empty file."""
    if not rows:
        write_text(path, "")
        return
    cols = list(rows[0].keys())
    lines = ["\t".join(cols)]
    lines += ["\t".join(_tsv_cell(r.get(c)) for c in cols) for r in rows]
    write_text(path, "\n".join(lines) + "\n")


def read_json(path: str | Path) -> dict:
    """Read a JSON file whose top level is an object; errors name the file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not valid JSON (with the line) or not UTF-8 text, or the top level is not an
            object (a list, a number, ...).
        OSError: a directory or an unreadable file (its message names the path).
    """
    path = Path(path)
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}): {e.msg}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}), so not a JSON file") from None
    if not isinstance(out, dict):
        what = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(out), "a number")
        raise ValueError(f"{path}: the top level is {what} ({json.dumps(out)[:60]}), expected a JSON object")
    return out


@contextlib.contextmanager
def open_safetensors(path: str | Path) -> Iterator:
    """``safetensors.safe_open`` on ``path`` (torch tensors, CPU), for reading some tensors without
    loading all.

    Raises:
        FileNotFoundError / ValueError: naming the file when it is missing or not safetensors
            (truncated, another format), on opening or on reading a tensor.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as h:
            yield h
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file: {e}") from None


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> None:
    """Atomically write ``tensors`` (made contiguous) as safetensors."""
    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3"}


def save_safetensors_parts(parts: dict[str, list[torch.Tensor]], path: str | Path) -> int:
    """Atomically write ``{name: torch.cat(parts[name])}`` as safetensors WITHOUT concatenating or
    serialising in memory: the header is computed from the shapes, then each part's bytes go
    straight from its (CPU, e.g. pinned) memory to the file. Same bytes as ``save_safetensors``
    of the concatenated tensors without metadata: the layout follows the safetensors format
    (8-byte little-endian header length, compact JSON header padded with spaces to 8 bytes, data
    ordered by dtype size descending then name, so every tensor is aligned to its item size).

    Args:
        parts: name -> non-empty list of CPU tensors that agree in dtype and in every dim but the
            first (concatenated along dim 0).
    Returns:
        bytes of tensor data written.
    Raises:
        ValueError: naming ``path`` and the tensor when parts disagree or live off the CPU.
    """
    import json
    import struct

    meta, order = {}, []
    for name, ts in parts.items():
        if not ts or any(t.device.type != "cpu" or t.dtype != ts[0].dtype or t.shape[1:] != ts[0].shape[1:]
                         for t in ts):
            raise ValueError(f"{path}: parts of {name!r} must be CPU tensors of one dtype and trailing shape")
        if ts[0].dtype not in _ST_DTYPES:
            raise ValueError(f"{path}: {name!r} has dtype {ts[0].dtype}, which safetensors cannot store")
        order.append((-ts[0].element_size(), name))
    start = 0
    for _, name in sorted(order):
        ts = parts[name]
        nbytes = sum(t.numel() for t in ts) * ts[0].element_size()
        meta[name] = {"dtype": _ST_DTYPES[ts[0].dtype], "shape": [sum(t.shape[0] for t in ts), *ts[0].shape[1:]],
                      "data_offsets": [start, start + nbytes]}
        start += nbytes
    header = json.dumps(meta, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for name in meta:
            for t in parts[name]:
                f.write(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return start


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a safetensors file on CPU.

    Raises:
        FileNotFoundError / ValueError: naming the file when it is missing or not safetensors.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file: {e}") from None


@contextlib.contextmanager
def atomic_dir(dest: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary directory next to ``dest``; on success replace ``dest`` with it."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_UMASK)
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
