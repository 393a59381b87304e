"""Params presets: a partial ``params.yaml`` (``presets/<name>.yaml``) applied the DVC way.

A preset names only the keys it changes. Applied as ``-S key=value`` overrides of a DVC
experiment, the run is recorded like any other (``dvc exp show``, MLflow, ``eyas compare``); the
workspace holds its params and results until ``git checkout -- params.yaml dvc.lock`` (or ``dvc exp
apply`` of another experiment) brings the committed ones back::

    dvc exp run -n h200 $(python -m eyas.pipeline.preset presets/h200.yaml)

Where DVC is not installed (e.g. a GPU machine without a registry), ``--write params.yaml``
merges the preset into the file instead and the stages run in DAG order by hand
(``scripts/gpu_profile.sh``): only the values the preset changes are rewritten (keys it adds go at
the end of their section), every other line keeps its comments and spelling; a symbolic link is
written through to its file. Either way the merged params pass the schema (eyas/training/params.py) first,
so a misspelt preset key fails before any compute. DVC parses each ``-S`` value with Hydra's
override grammar, not YAML, so values are written in it (strings quoted: ``'12345e7'`` stays a
string), and ``dvc exp run`` gets the preset's own values. The printed words reach ``dvc`` through
an unquoted ``$(...)``, which splits on whitespace and expands file-name patterns but removes no
quotes, so a value with whitespace, or one the shell would expand to a file here, is refused.

Run: ``python -m eyas.pipeline.preset PRESET [--params params.yaml] [--write FILE]``.
"""

from __future__ import annotations

import argparse
import copy
import glob
import io
import os
import re
import stat
import sys
from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.nodes import MappingNode, Node, SequenceNode

from eyas import yaml12
from eyas.io import write_text
from eyas.training.params import ParamsError, flatten, key_lines, parse_params

__all__ = ["load_preset", "merge", "set_args"]


def load_preset(path: str | Path) -> dict:
    """The preset's nested mapping. Raises ParamsError naming the file when it is missing, not
    YAML, not a mapping or sets nothing, and its line when a key is written flat (``train.epochs: 3``)."""
    raw = _read_mapping(Path(path), "preset")
    if hit := _dotted_key(_compose(Path(path).read_text(encoding="utf-8")), raw):
        line, key, nested = hit
        raise ParamsError(f"{path}: line {line}: key '{key}' has a dot in its name; a preset nests each "
                          f"section's keys:\n{yaml12.dump(nested).rstrip()}")
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


def _compose(text: str) -> Node | None:
    """The YAML node tree of ``text`` (the file already loaded, so it composes), with each node's
    position in the text."""
    return YAML(typ="safe").compose(text)


def _dotted_key(node: Node | None, raw: dict, trail: tuple = ()) -> tuple[int, str, dict] | None:
    """The first mapping key in ``raw`` (composed as ``node``) with a dot in its name, as (its
    1-based line, the key, the nested mapping it was meant as from the top), or None."""
    if not isinstance(node, MappingNode):
        return None
    for (k_node, v_node), (k, v) in zip(node.value, raw.items()):
        if isinstance(k, str) and "." in k:
            nested = v
            for part in reversed((*trail, *k.split("."))):
                nested = {part: nested}
            return k_node.start_mark.line + 1, k, nested
        if isinstance(v, dict) and (hit := _dotted_key(v_node, v, (*trail, k))):
            return hit
    return None


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


def _merged_text(text: str, preset: dict, merged: dict, source: str) -> str:
    """The params file ``text`` with the values the preset changes rewritten in place and the keys it
    adds put at the end of their section (a new section at the end of the file); every other
    character, comments and the spelling of untouched values included, stays as written.

    Args:
        text: the params file that ``merged`` was made from (:func:`merge`).
        preset: the preset's nested mapping.
        merged: :func:`merge` of the file and the preset: the values the returned text must read back as.
        source: the params file's name, for an error.

    Raises:
        ParamsError: the file's layout where the preset writes (an anchor, an empty list item) kept the
            text from reading back as ``merged``.
    """
    edits: list[tuple[int, int, str]] = []
    _edits(text, _compose(text), preset, yaml12.load(text, source) or {}, edits)
    # from the end, so offsets stay valid; of two insertions at one place the one made first stays first
    for start, end, new in reversed(sorted(edits, key=lambda e: e[0])):
        text = text[:start] + new + text[end:]
    try:
        same = repr(yaml12.load(text, source)) == repr(merged)  # repr: types and key order compared too
    except yaml12.YamlError:
        same = False
    if not same:
        raise ParamsError(f"{source}: cannot set the preset's keys in place (an anchor or an empty list item "
                          f"where it writes?); set them by hand")
    return text


_GAP = re.compile(r"[ \t]+(?=#)")  # between a value and its comment


def _edits(text: str, node: Node | None, preset: dict, old: dict, out: list[tuple[int, int, str]]) -> None:
    """Append to ``out`` the (start, end, new text) replacements of ``text`` that give the mapping
    ``node`` (None: a file of comments only), which reads as ``old``, the preset's values."""
    pairs = {k.value: (k, v) for k, v in node.value} if isinstance(node, MappingNode) else {}
    new = {}
    for key, value in preset.items():
        if key not in pairs:
            new[key] = value
        elif isinstance(value, dict):  # a section in params too (merge checked)
            _edits(text, pairs[key][1], value, old[key], out)
        elif type(old[key]) is not type(value) or old[key] != value:
            k, v = pairs[key]
            end = _end(text, k, v)
            start = v.start_mark.index if v.start_mark.index != v.end_mark.index else end
            new_value = ("" if start < end else " ") + _flow(value)
            if (gap := _GAP.match(text, end)) and gap.end() - end > 2:  # an aligned comment keeps its column
                column = gap.end() - text.rfind("\n", 0, gap.end()) - 1
                new_value += " " * max(1, column - (start - text.rfind("\n", 0, start) - 1) - len(new_value))
                end = gap.end()
            out.append((start, end, new_value))
    if not new:
        return
    if isinstance(node, MappingNode) and node.flow_style:  # {a: 1}: before the brace
        at = node.end_mark.index - 1
        out.append((at, at, (", " if node.value else "") + _flow(new)[1:-1]))
        return
    indent, at = 0, len(text)  # a file of comments only: at its end
    if isinstance(node, MappingNode):  # on the line after its last entry, as indented as its keys
        indent = node.value[0][0].start_mark.column
        at = text.find("\n", _end(text, *node.value[-1])) + 1 or len(text)
    out.append((at, at, ("" if at == 0 or text[at - 1] == "\n" else "\n") + _block(new, indent)))


def _end(text: str, key: Node | None, node: Node) -> int:
    """Where the text of ``node``, the value of the mapping key ``key`` (None: a list item), ends:
    after its last entry for a block list or mapping, before the blank lines after a block scalar
    (``|``), after the colon for ``key:`` alone (a null, which ruamel.yaml places at the next token)."""
    if isinstance(node, MappingNode) and not node.flow_style:
        return _end(text, *node.value[-1])
    if isinstance(node, SequenceNode) and not node.flow_style:
        return _end(text, None, node.value[-1])
    if key is not None and node.start_mark.index == node.end_mark.index:
        return text.index(":", key.end_mark.index) + 1
    return node.start_mark.index + len(text[node.start_mark.index:node.end_mark.index].rstrip())


def _block(mapping: dict, indent: int) -> str:
    """``mapping`` as block-style YAML lines indented by ``indent``, each value in :func:`_flow` form."""
    return "".join(" " * indent + _flow(k) + (f":\n{_block(v, indent + 2)}" if isinstance(v, dict) and v
                                             else f": {_flow(v)}\n") for k, v in mapping.items())


def _flow(value) -> str:
    """``value`` as one line of YAML 1.2 that :func:`eyas.yaml12.load` reads back equal (a list or
    mapping in flow style, ``[a, b]``)."""
    y = YAML(typ="safe")
    y.default_flow_style = True
    y.sort_base_mapping_type_on_output = False
    y.width = 1 << 16  # never fold a line
    buf = io.StringIO()
    y.dump({"_": value}, buf)  # not a list: [{a: 1}] is written [a: 1]
    return buf.getvalue()[len("{_: "):-len("}\n")]


_NOT_A_FILE = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFCHR: "a character device",
               stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def _write_target(write: str, preset_file: str) -> Path:
    """The file ``--write`` names, through symbolic links. Raises ParamsError naming it when it is
    empty, the preset itself, not a regular file, or in a directory that does not exist."""
    if not write:
        raise ParamsError("--write '': give a file path, e.g. --write params.yaml")
    real = Path(os.path.realpath(write))
    if real.is_symlink():
        raise ParamsError(f"--write {write}: a symbolic link that leads back to itself")
    if real.exists():
        if os.path.samefile(real, preset_file):
            raise ParamsError(f"--write {write}: is the preset {preset_file} itself; write the merged params "
                              f"elsewhere, e.g. --write params.yaml")
        kind = stat.S_IFMT(real.stat().st_mode)
        if kind != stat.S_IFREG:
            raise ParamsError(f"--write {write}: {_NOT_A_FILE.get(kind, 'not a file')}, not a regular file; give "
                              f"a file path, e.g. --write params.yaml")
    elif not real.parent.is_dir():
        raise ParamsError(f"--write {write}: no directory {real.parent} to write it in (create it first)")
    return real


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
        if a.write is None:
            args = set_args(preset)
            for key, word in zip(flatten(preset), args[1::2]):
                if (hits := glob.glob(word)) and hits != [word]:  # [word]: no pattern, a file of its name
                    raise ParamsError(f"preset key '{key}': the shell would replace -S {word} with the file "
                                      f"{hits[0]} of this directory; run it from another directory")
        else:
            target = _write_target(a.write, a.preset)
            text = _merged_text(Path(a.params).read_text(encoding="utf-8"), preset, merged, a.params)
    except ParamsError as e:
        where = Path(a.preset).is_file() and key_lines(str(e), Path(a.preset).read_text(encoding="utf-8",
                                                                                        errors="replace"))
        at = f" ({where} of {a.preset})" if where else ""
        sys.stderr.write(f"eyas.pipeline.preset: error: {e}{at}\n")
        return 2
    if a.write is None:
        sys.stdout.write(" ".join(args) + "\n")
        return 0
    try:
        write_text(target, text)
    except OSError as e:
        sys.stderr.write(f"eyas.pipeline.preset: error: --write {a.write}: cannot write the merged params "
                         f"({e.strerror or e}); give a file path, e.g. --write params.yaml\n")
        return 2
    sys.stderr.write(f"eyas.pipeline.preset: wrote {a.write} ({len(flatten(preset))} keys from {a.preset})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
