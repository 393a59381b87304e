"""Typed parameters: how ``params.yaml`` is read and checked, for any set of its sections.

Every section of ``params.yaml`` is a dataclass in its own module of :mod:`eyas.params` (its
``SCHEMA``, with its value checks ``RANGES`` and ``check``); the top-level ``lr`` and ``seed`` are
checked here. The dataclasses hold types and no default values: the repository's ``params.yaml``
(:data:`DEFAULTS_FILE`) is the single source of default values, so the values DVC tracks are the
values the code runs with. A params mapping or file that leaves keys out (a test's, a preset merged
into params) takes those keys from it. :func:`load_sections` rejects unknown keys, missing keys and
wrong types with the key's dotted path, before any compute, in the sections a stage reads (every
section's name is checked; :mod:`eyas.params.full` checks them all). Params files are read as DVC
reads them (:mod:`eyas.yaml12`: ruamel.yaml, YAML 1.2), so ``050`` is 50, ``5e-05`` (the form ``dvc
exp run -S lr=5e-5`` writes) a float, and ``yes``/``no``/``on``/``off`` strings, which a bool field
refuses: the value a stage runs with is the value DVC hashed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import subprocess
import types
import typing
from pathlib import Path
from typing import Any

from eyas import yaml12


class ParamsError(ValueError):
    """A params file is malformed: the message names the file and the key's dotted path."""


class UnknownKeyError(ParamsError):
    """A params file holds keys the schema does not know (``keys``: their dotted paths)."""

    def __init__(self, msg: str, keys: list[str]):
        super().__init__(msg)
        self.keys = keys


def _coerce(value: Any, tp: Any, path: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, path, source)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ParamsError(f"{source}: '{path}' must be a mapping, got {type(value).__name__}")
        return _build(tp, value, path, source)
    if origin is list:
        if not isinstance(value, list):
            raise ParamsError(f"{source}: '{path}' must be a list, got {value!r}")
        return [_coerce(v, args[0], f"{path}[{i}]", source) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            note = (" (as DVC reads YAML 1.2, yes/no/on/off are strings, not booleans: write true or false)"
                    if isinstance(value, str) and value.lower() in ("yes", "no", "on", "off", "y", "n") else "")
            raise ParamsError(f"{source}: '{path}' must be true or false, got {value!r}{note}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamsError(f"{source}: '{path}' must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool):
            raise ParamsError(f"{source}: '{path}' must be a number, got {value!r}")
        if not isinstance(value, (int, float)):  # a quoted "5e-5" is a string to DVC too
            raise ParamsError(f"{source}: '{path}' must be a number, got {value!r}")
        number = float(value)
        if not math.isfinite(number):  # .inf/.nan (or 'inf', 'nan') break every float param downstream
            raise ParamsError(f"{source}: '{path}' must be a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            kind = "null" if value is None else type(value).__name__
            note = "" if isinstance(value, (dict, list)) else f" (YAML reads it as {kind}: write it in quotes)"
            raise ParamsError(f"{source}: '{path}' must be a string, got {value!r}{note}")
        return value
    raise TypeError(f"unsupported schema type {tp!r} at {path}")  # a bug in this module


def _build(cls: type, raw: dict, prefix: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(raw) - set(names), key=str)  # YAML keys may be ints, dates or None too
    if unknown:
        keys = [f"{prefix + '.' if prefix else ''}{k}" for k in unknown]
        where = ", ".join(f"'{k}'" for k in keys)
        raise UnknownKeyError(f"{source}: unknown key {where} (allowed: {', '.join(sorted(names))})", keys)
    missing = [f"{prefix + '.' if prefix else ''}{k}" for k in names if k not in raw]
    if missing:
        raise ParamsError(f"{source}: missing key {', '.join(repr(k) for k in missing)} (every key of the "
                          f"schema must be set; {DEFAULTS_FILE.name} beside the eyas package has them all)")
    kwargs = {
        k: _coerce(v, hints[k], f"{prefix + '.' if prefix else ''}{k}", source)
        for k, v in raw.items()
    }
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section that checks its own values (eyas.params.train.KernelChoices)
        # named by the key its message starts with ("attention must be ..."), so its line is the key's own
        key = next((f"{prefix}.{k}" for k in raw if str(e).startswith(f"{k} ")), prefix)
        raise ParamsError(f"{source}: '{key}': {e}") from None


DEFAULTS_FILE = Path(__file__).resolve().parents[2] / "params.yaml"
"""The repository's ``params.yaml``: the single source of default values (read on every call, so an
edit or a ``dvc exp run -S`` is seen at once)."""


def _read_yaml(path: Path) -> dict:
    try:
        raw = yaml12.load_file(path)
    except FileNotFoundError:
        raise ParamsError(f"{path}: no such params file") from None
    except yaml12.YamlError as e:
        raise ParamsError(str(e)) from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{path}: the top level must be a mapping")
    return raw or {}


def with_defaults(raw: dict | None) -> dict:
    """``raw`` (a possibly partial params mapping) with every key it leaves out taken from
    :data:`DEFAULTS_FILE`, section by section; ``raw`` is not changed. A section that ``raw`` sets to
    something other than a mapping is kept as is (the schema then names it).

    Raises:
        ParamsError: :data:`DEFAULTS_FILE` is missing or is not a YAML mapping (naming the file).
    """
    def merge(base: Any, over: Any) -> Any:
        if not (isinstance(base, dict) and isinstance(over, dict)):
            return over
        return {**base, **{k: merge(base.get(k), v) for k, v in over.items()}}
    return merge(_read_yaml(DEFAULTS_FILE), raw or {})


SECTION_NAMES = ("lr", "seed", "target", "data", "distill", "extract", "vocab", "stand_in", "remap", "train",
                 "train_finetune", "eval", "serve")
"""The top-level keys of ``params.yaml``, in its order: ``lr`` and ``seed``, then one section per module
of :mod:`eyas.params` (eyas.params.full.SECTIONS, which a test holds equal to these)."""

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
FEATURE_SPLITS = ("train", "val", "publish")
"""The splits self-distill may regenerate (``distill.splits``) and extract turns into features, in
stage order; ``test`` only supplies eval prompts."""
SEED_MAX = 2 ** 63  # torch.Generator.manual_seed takes a signed 64-bit integer
MAX_EPOCHS = 1000
"""Upper bound of ``train.epochs`` and ``stand_in.epochs``: the loop plans every epoch's batches before
its first step (eyas.training.loop: the cosine schedule's length), so a huge count stalled at start-up."""
EPOCHS_RANGE = f"in [1, {MAX_EPOCHS}] (every epoch's batches are planned before the first step)"

# (dotted key, test, what it must be): checked after types, before any compute
TOP_RANGES = [
    ("lr", lambda v: 0 < v < 1, "in (0, 1)"),  # the scratch drafter's learning rate (train-scratch)
    ("seed", lambda v: 0 <= v < SEED_MAX, "in [0, 2**63)"),
]
TOP_TYPES = {"lr": float, "seed": int}


def null_or_nonempty(v) -> bool:
    return v is None or v.strip() != ""


def loaded(p: Any, name: str) -> bool:
    """Whether params ``p`` (from :func:`parse_sections`) hold section ``name``: a check across two
    sections runs where both are loaded (always in :mod:`eyas.params.full`)."""
    return name in {f.name for f in dataclasses.fields(p)}


def check_ranges(p: Any, ranges: list, source: str, suffix: str = "") -> None:
    """Hold each ``(dotted key, test, what)`` of ``ranges`` against params ``p``.

    Raises:
        ParamsError: ``'<key>' must be <what><suffix>, got <value>`` for the first key that fails.
    """
    flat = flatten(p)
    for key, ok, what in ranges:
        if not ok(flat[key]):
            raise ParamsError(f"{source}: '{key}' must be {what}{suffix}, got {flat[key]!r}")


_CLASSES: dict[tuple[str, ...], type] = {}


def params_class(sections: tuple) -> type:
    """The dataclass ``Params`` of ``lr``, ``seed`` and the given section modules' schemas (one class
    per set of sections, so ``dataclasses.replace`` and ``==`` work as on any dataclass)."""
    names = tuple(m.NAME for m in sections)
    if names not in _CLASSES:
        fields = [("lr", float), ("seed", int), *((m.NAME, m.SCHEMA) for m in sections),
                  ("unread", dict, dataclasses.field(default_factory=dict, repr=False, compare=False))]
        _CLASSES[names] = dataclasses.make_dataclass("Params", fields, kw_only=True)
    return _CLASSES[names]


def parse_sections(raw: dict | None, source: str, *sections) -> Any:
    """Validate the top-level keys and the given sections (modules of :mod:`eyas.params`) of a raw
    params mapping, its missing keys taken from :data:`DEFAULTS_FILE` (:func:`with_defaults`).
    The other sections are kept as read, in ``unread`` (what :func:`flatten` reports of them), and
    checked where they are loaded.

    Raises:
        ParamsError: on an unknown top-level key or an unknown key in a loaded section, a wrong type
            or a value out of range (e.g. an empty ``distill.splits``); the message names ``source`` and
            the key's dotted path (e.g. ``params.yaml: 'train.lr' must be a number``); on a key that
            neither ``raw`` nor :data:`DEFAULTS_FILE` sets (``missing key``).
    """
    full = with_defaults(raw)
    unknown = sorted(set(full) - set(SECTION_NAMES), key=str)  # YAML keys may be ints, dates or None too
    if unknown:
        where = ", ".join(f"'{k}'" for k in unknown)
        raise UnknownKeyError(f"{source}: unknown key {where} (allowed: {', '.join(sorted(SECTION_NAMES))})",
                              [str(k) for k in unknown])
    missing = [k for k in SECTION_NAMES if k not in full]
    if missing:
        raise ParamsError(f"{source}: missing key {', '.join(repr(k) for k in missing)} (every key of the "
                          f"schema must be set; {DEFAULTS_FILE.name} beside the eyas package has them all)")
    names = {m.NAME for m in sections}
    kwargs = {k: _coerce(full[k], tp, k, source) for k, tp in TOP_TYPES.items()}
    kwargs.update({m.NAME: _coerce(full[m.NAME], m.SCHEMA, m.NAME, source) for m in sections})
    unread = {k: v for k, v in full.items() if k not in names and k not in TOP_TYPES}
    params = params_class(sections)(**kwargs, unread=unread)
    check_ranges(params, TOP_RANGES + [r for m in sections for r in m.RANGES], source)
    for m in sections:
        if hasattr(m, "check"):
            m.check(params, source)
    return params


def load_sections(*sections, path: str | Path = "params.yaml") -> Any:
    """Read ``params.yaml`` and validate its top-level keys and the given sections (modules of
    :mod:`eyas.params`: ``load_sections(target, eval, serve)``), keys it leaves out taken from
    :data:`DEFAULTS_FILE`.

    Raises:
        ParamsError: the file is missing, is not YAML, or fails :func:`parse_sections`; an error about
            a key the file sets ends with its line (``(line 12 of params.yaml)``).
    """
    path = Path(path)
    raw = _read_yaml(path)
    try:
        return _parse_file(raw, path, sections)
    except ParamsError as e:  # the schema names the keys; say where the file writes them
        where = key_lines(str(e).removeprefix(f"{path}: "), path.read_text(encoding="utf-8"))
        if where:
            e.args = (f"{e} ({where} of {path.name})", *e.args[1:])
        raise


def key_lines(message: str, text: str) -> str:
    """Where the YAML ``text`` writes the keys a params error ``message`` names (each quoted,
    ``'train.epochs'``): ``"line 12"`` for one key, ``"'a.b' line 3, 'c.d' line 9"`` for several,
    ``""`` when the text sets none of them (a default, or not YAML). The keys are those named before
    the value the message reports (``..., got ['lr']``): what it quotes from there on is no key."""
    message = re.split(r",\s+got ", message, maxsplit=1)[0]
    names = list(dict.fromkeys(re.findall(r"'([A-Za-z_][\w.\[\]-]*)'", message)))
    lines = {k: line for k in names if (line := yaml12.key_line(text, k))}
    if len(lines) == 1:
        return f"line {next(iter(lines.values()))}"
    return ", ".join(f"'{k}' line {line}" for k, line in lines.items())


def _parse_file(raw: dict, path: Path, sections: tuple) -> Any:
    try:
        return parse_sections(raw, str(path), *sections)
    except UnknownKeyError as e:
        stray = [k for k in e.keys if not _in_committed(path, k)]
        if not stray:
            raise
        raise UnknownKeyError(
            f"{e} -- {', '.join(repr(k) for k in stray)} is not in the committed {path.name} (git HEAD): "
            f"probably left by `dvc exp run -S +{stray[0]}=...` (DVC writes -S values into {path.name} "
            f"before the stage runs and does not take them out when it fails). Remove the key, or "
            f"`git checkout -- {path.name}` to restore the committed file", e.keys) from None


def _in_committed(path: Path, key: str) -> bool:
    """Whether dotted ``key`` is in git HEAD's version of ``path`` (True when git cannot tell)."""
    try:
        out = subprocess.run(["git", "show", f"HEAD:./{path.name}"], cwd=path.resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return True
    if out.returncode != 0:
        return True
    try:
        node = yaml12.load(out.stdout, f"git HEAD:{path.name}")
    except yaml12.YamlError:
        return True
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten a params dataclass (or dict) to the dotted keys ``dvc exp show`` uses; the sections a
    stage did not load (``unread``) in their place among the rest, as read."""
    if dataclasses.is_dataclass(obj):
        d = dataclasses.asdict(obj)
        unread = d.pop("unread", None) or {}
        order = [k for k in SECTION_NAMES if k in d or k in unread] + [k for k in d if k not in SECTION_NAMES]
        obj = {k: d[k] if k in d else unread[k] for k in order} if unread else d
    out: dict[str, Any] = {}
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _number(v: Any) -> Any:
    """``v`` with a float of integral value as that int (``1.0`` -> ``1``), inside lists too."""
    if isinstance(v, list):
        return [_number(x) for x in v]
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def params_hash(obj: Any) -> str:
    """A short, stable hash of resolved params (sha256 of the sorted flat JSON), for run tags. A
    number hashes by its value: a float key written ``1`` (typed ``1.0`` in the sections a stage
    loads, ``1`` as read in the others) hashes the same in every stage."""
    blob = json.dumps({k: _number(v) for k, v in flatten(obj).items()}, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]
