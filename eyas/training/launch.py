"""Run a stage module in one process, or under ``torchrun`` with ``nproc`` processes.

    python -m eyas.training.launch stages.train_scratch            # nproc from params.yaml train.nproc
    python -m eyas.training.launch --nproc 8 stages.train_scratch  # explicit

``nproc``: an int; ``0`` or ``auto`` = one process per visible CUDA device (1 without CUDA). With
nproc <= 1 the module runs in this process; otherwise this process is replaced by
``python -m torch.distributed.run --standalone --nproc-per-node N -m MODULE ARGS...``.
The environment variable ``EYAS_NPROC`` overrides params.yaml.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path


def resolve_nproc(value, source: str = "nproc") -> int:
    """The process count for ``value`` (an int, a string of one, ``'auto'``, ``0`` or ``None``).

    ``None`` / ``''`` = 1; ``0`` / ``'0'`` / ``'auto'`` = one per visible CUDA device (1 without).

    Raises:
        ValueError: ``value`` is a bool, a float (``2.5`` would silently become 2; the params schema
            takes no float for ``train.nproc`` either), a string that is not an integer, or < 0.
            The message names ``source`` (e.g. ``EYAS_NPROC``) and the value.
    """
    if isinstance(value, (bool, float)):  # before the `in` test: False == 0 and 0.0 == 0
        raise ValueError(f"{source} must be an integer or 'auto', got {value!r}")
    if value in (None, "", "auto", 0, "0"):
        try:
            import torch

            return max(1, torch.cuda.device_count()) if value in ("auto", 0, "0") else 1
        except ImportError:
            return 1
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source} must be an integer or 'auto', got {value!r}") from None
    if n < 1:
        raise ValueError(f"{source} must be >= 1 or 'auto', got {value!r}")
    return n


def nproc_from_params(path: str | Path = "params.yaml", section: str = "train") -> int | None:
    """``section.nproc`` of the params file at ``path`` as DVC reads it (:mod:`eyas.yaml12`), or
    None when the file or the key is absent (the stage then takes params.yaml's default).

    Raises:
        ValueError: the file is not valid YAML (:class:`eyas.yaml12.YamlError`, naming its line), the
            top level or ``section`` is not a mapping, or ``nproc`` is not an integer (the params
            schema's type, :class:`eyas.params.train.TrainParams`: ``auto``, ``'8'`` or null would launch
            processes whose stage then refuses the params); each names the file and key.
    """
    p = Path(path)
    if not p.is_file():
        return None
    from eyas import yaml12

    doc = yaml12.load_file(p) or {}
    sec = doc.get(section, {}) if isinstance(doc, dict) else doc
    if not isinstance(sec, dict):
        where = f"'{section}'" if isinstance(doc, dict) else "the top level"
        raise ValueError(f"{p}: {where} must be a mapping, got {sec!r}")
    if "nproc" not in sec:
        return None
    n = sec["nproc"]
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"{p}: '{section}.nproc' must be an integer (0 = one per CUDA device), got {n!r}")
    return n


def torchrun_argv(nproc: int, module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", module, *args]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", default=None, help="processes (int or 'auto'); default params train.nproc")
    ap.add_argument("--params-section", default="train")
    ap.add_argument("module")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.nproc:
        raw, source = a.nproc, "--nproc"
    elif os.environ.get("EYAS_NPROC"):
        raw, source = os.environ["EYAS_NPROC"], "EYAS_NPROC"
    else:
        raw, source = nproc_from_params(section=a.params_section), f"params.yaml {a.params_section}.nproc"
    n = resolve_nproc(raw, source)
    if n <= 1 or "RANK" in os.environ:  # already inside torchrun: just run
        sys.argv = [a.module, *a.args]
        runpy.run_module(a.module, run_name="__main__", alter_sys=True)
        return
    argv2 = torchrun_argv(n, a.module, a.args)
    os.execv(argv2[0], argv2)


if __name__ == "__main__":
    main()
