"""Params presets: a partial ``params.yaml`` (``presets/<name>.yaml``) applied the DVC way.

A preset names only the keys it changes. Applied as ``-S key=value`` overrides of a DVC
experiment, the run is recorded like any other (``dvc exp show``, MLflow, ``eyas compare``); the
workspace holds its params and results until ``git checkout -- params.yaml dvc.lock`` (or ``dvc exp
apply`` of another experiment) brings the committed ones back::

    dvc exp run -n h200 $(python -m eyas.pipeline.preset presets/h200.yaml)

Where DVC is not installed (e.g. a GPU machine without a registry), ``--write params.yaml``
merges the preset into the file instead and the stages run in DAG order by hand
(``scripts/gpu_profile.sh``). Either way the merged params pass the schema (eyas/training/params.py) first,
so a misspelt preset key fails before any compute. DVC parses each ``-S`` value with Hydra's
override grammar, not YAML, so values are written in it (strings quoted: ``'12345e7'`` stays a
string), and ``dvc exp run`` gets the preset's own values.

Run: ``python -m eyas.pipeline.preset PRESET [--params params.yaml] [--write FILE]``.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

from eyas import yaml12
from eyas.io import write_text
from eyas.training.params import ParamsError, flatten, key_lines, parse_params

__all__ = ["load_preset", "merge", "set_args"]


def load_preset(path: str | Path) -> dict:
    """The preset's nested mapping. Raises ParamsError naming the file when it is missing, not
    YAML or not a mapping."""
    raw = _read_mapping(Path(path), "preset")
    if not flatten(raw):  # nothing set: `dvc exp run $(...)` would quietly run the defaults
        raise ParamsError(f"{path}: a preset sets at least one key, got {'only empty sections' if raw else 'none'}")
    return raw


def _read_mapping(path: Path, what: str) -> dict:
    """The YAML mapping in ``path`` (``{}`` for an empty file); ParamsError naming the file (and
    line, :mod:`eyas.yaml12`) when it is missing, not YAML or not a mapping at the top level."""
    try:
        raw = yaml12.load_file(path)
    except FileNotFoundError:
        raise ParamsError(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise ParamsError(f"{path}: is a directory, not a {what} (give a .yaml file)") from None
    except OSError as e:  # unreadable (permissions), a broken mount: name the file, no traceback
        raise ParamsError(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    except yaml12.YamlError as e:
        raise ParamsError(str(e)) from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{path}: a {what} is a mapping of params sections, got {type(raw).__name__}")
    return raw or {}


def merge(base: dict, preset: dict, source: str) -> dict:
    """``base`` (a raw params mapping) with the preset's keys replaced, checked by the schema.

    Raises:
        ParamsError: the merged params fail :func:`eyas.training.params.parse_params` (the message names
            ``source`` and the key), or the preset sets a section to a scalar.
    """
    out = copy.deepcopy(base)

    def put(dst: dict, src: dict, prefix: str) -> None:
        for k, v in src.items():
            if isinstance(v, dict):
                if not isinstance(dst.get(k, {}), dict):
                    raise ParamsError(f"{source}: '{prefix}{k}' is a section in the preset, a value in params")
                put(dst.setdefault(k, {}), v, f"{prefix}{k}.")
            else:
                dst[k] = v
    put(out, preset, "")
    parse_params(out, source)
    return out


def _hydra(v, key: str) -> str:
    """``v`` in Hydra's override grammar, which DVC parses each ``-S`` value with
    (``dvc/utils/hydra.py`` ``apply_overrides``; grammar: hydra ``OverrideParser.g4``). A string is
    always quoted: unquoted, Hydra reads ``12345e7``, ``nan``, ``nUll`` or ``tRue`` as a number,
    null or boolean, and a comma or ``=`` is syntax. In a quoted value a quote is escaped and so is
    a run of backslashes before a quote or the end.

    Raises:
        ParamsError: naming ``key``, for whitespace (the value could not travel as one shell word),
            ``${`` (Hydra interpolates it even in quotes) or a type Hydra has no literal for (a date).
    """
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return repr(v)  # 5e-05, 1e+16, inf, nan: Hydra's int and float literals
    if isinstance(v, list):
        return "[" + ",".join(_hydra(x, key) for x in v) + "]"
    if not isinstance(v, str):
        raise ParamsError(f"preset key '{key}': {v!r} ({type(v).__name__}) has no dvc exp run -S form: quote it")
    if any(c.isspace() for c in v):
        raise ParamsError(f"preset key '{key}': {v!r} has whitespace: it cannot travel as one -S argument")
    if "${" in v:
        raise ParamsError(f"preset key '{key}': {v!r} has '${{': DVC (Hydra) would interpolate it")
    v = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, v)
    return "'" + v.replace("'", "\\'") + "'"


def set_args(preset: dict) -> list[str]:
    """``["-S", "key=value", ...]`` for ``dvc exp run``, one pair per leaf key of the preset, each
    value in Hydra's override grammar (:func:`_hydra`) so DVC writes the preset's own value.

    Raises:
        ParamsError: a value that cannot travel as a ``-S`` argument (:func:`_hydra`).
    """
    out: list[str] = []
    for k, v in flatten(preset).items():
        out += ["-S", f"{k}={_hydra(v, k)}"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eyas.pipeline.preset", description=__doc__.split("\n")[0])
    ap.add_argument("preset", help="a preset file, e.g. presets/h200.yaml")
    ap.add_argument("--params", default="params.yaml", help="the params file the preset applies to")
    ap.add_argument("--write", default=None, help="write the merged params here instead of printing -S args")
    a = ap.parse_args(argv)
    try:
        preset = load_preset(a.preset)
        base = _read_mapping(Path(a.params), "params file")
        merged = merge(base, preset, f"{a.params} + {a.preset}")
        args = set_args(preset)
    except ParamsError as e:
        where = Path(a.preset).is_file() and key_lines(str(e), Path(a.preset).read_text(encoding="utf-8",
                                                                                        errors="replace"))
        at = f" ({where} of {a.preset})" if where else ""
        sys.stderr.write(f"eyas.pipeline.preset: error: {e}{at}\n")
        return 2
    if a.write:
        try:
            if Path(a.write).is_dir():
                raise IsADirectoryError(21, "is a directory")
            write_text(Path(a.write), yaml12.dump(merged))
        except OSError as e:
            sys.stderr.write(f"eyas.pipeline.preset: error: --write {a.write}: cannot write the merged params "
                             f"({e.strerror or e}); give a file path, e.g. --write params.yaml\n")
            return 2
        sys.stderr.write(f"eyas.pipeline.preset: wrote {a.write} ({len(args) // 2} keys from {a.preset})\n")
    else:
        sys.stdout.write(" ".join(args) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
