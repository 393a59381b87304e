"""Params presets: a partial ``params.yaml`` (``presets/<name>.yaml``) applied the DVC way.

A preset names only the keys it changes. Applied as ``-S key=value`` overrides of a DVC
experiment, the run is recorded like any other (``dvc exp show``, MLflow, ``eyas compare``); the
workspace holds its params and results until ``git checkout -- params.yaml dvc.lock`` (or ``dvc exp
apply`` of another experiment) brings the committed ones back::

    dvc exp run -n h200 $(python -m eyas.pipeline.preset presets/h200.yaml)

Where DVC is not installed (e.g. a GPU machine without a registry), ``--write params.yaml``
merges the preset into the file instead and the stages run in DAG order by hand
(``dev/gpu/gpu_profile.sh``): only the values the preset changes are rewritten (keys it adds go at
the end of their section), every other line keeps its comments, spelling and line ending; a symbolic
link is written through to its file, whose mode, owner and group the new file keeps. A file that is
read-only, has other hard links (they would keep the old params), lies under /dev or /proc (a
device, or a stream of this process such as /dev/stdout) or exists and is not the ``--params``
file and not empty (its contents would be lost) is refused. Either way the merged params
pass the schema (eyas/params/) first, so a misspelt preset key fails before any compute;
an error names the line of the key at fault, in the preset or, for a value it leaves alone, in the
params file.
DVC parses each ``-S`` value with Hydra's override grammar, not YAML, so values are written in it
(strings quoted: ``'12345e7'`` stays a string), and ``dvc exp run`` gets the preset's own values; a
key the params file lacks goes as ``+key=value``, which Hydra requires to add one. The printed words
reach ``dvc`` through an unquoted ``$(...)``, which splits on whitespace and expands file-name
patterns but removes no quotes, so a value with whitespace, or one the shell would expand to a file
here, is refused.

Run: ``eyas preset PRESET [--params params.yaml] [--write FILE]`` (or ``python -m eyas.pipeline.preset``).

One module past 500 lines on purpose: reading a preset, checking it against the schema and writing
the merged file back in DVC's own layout, line by line, are one round trip; the writer is most of it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import glob
import io
import os
import re
import stat
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Iterator

from ruamel.yaml import YAML
from ruamel.yaml.nodes import MappingNode, Node, SequenceNode

from eyas import yaml12
from eyas.params.full import ParamsError, flatten, key_lines, parse_params

__all__ = ["load_preset", "merge", "set_args"]


class _Located(ParamsError):
    """A params error whose message names the file and line at fault: nothing is added to it."""


def load_preset(path: str | Path) -> dict:
    """The preset's nested mapping. Raises ParamsError naming the file when it is missing, not
    YAML, not a mapping or sets nothing, and its line when a key is written flat (``train.epochs: 3``)."""
    return _preset(_read_text(Path(path), "preset"), str(path))


def _preset(text: str, source: str) -> dict:
    """:func:`load_preset` of the preset file ``source``, read as ``text``."""
    raw = _mapping(text, source, "preset")
    _refuse_dotted_key(text, raw, source, "a preset nests")
    if not flatten(raw):  # nothing set: `dvc exp run $(...)` would quietly run the defaults
        raise ParamsError(f"{source}: a preset sets at least one key, got {'only empty sections' if raw else 'none'}")
    return raw


def _read_text(path: Path, what: str) -> str:
    """The text of ``path``, read once (a pipe such as ``<(cat params.yaml)`` has no second reading)
    as UTF-8, as DVC reads it; ParamsError naming the file when it is missing, unreadable or not UTF-8."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ParamsError(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise ParamsError(f"{path}: is a directory, not a {what} (give a .yaml file)") from None
    except OSError as e:  # unreadable (permissions), a broken mount: name the file, no traceback
        raise ParamsError(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ParamsError(f"{path}: not UTF-8 text (DVC reads params as UTF-8): byte {data[e.start]:#04x} "
                          f"at line {line}") from None


def _mapping(text: str, source: str, what: str) -> dict:
    """The YAML mapping in ``text``, the file ``source`` (``{}`` for an empty one); ParamsError
    naming the file (and line, :mod:`eyas.yaml12`) when it is not YAML or not a mapping at the top level."""
    try:
        raw = yaml12.load(text, source)
    except yaml12.YamlError as e:
        raise ParamsError(str(e)) from None
    except RecursionError:  # the parser recurses once per level
        raise ParamsError(f"{source}: nested too deeply to read (more levels than Python's recursion limit)") from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{source}: a {what} is a mapping of params sections, got {type(raw).__name__}")
    return raw or {}


def _compose(text: str) -> Node | None:
    """The YAML node tree of ``text`` (the file already loaded, so it composes), with each node's
    position in the text."""
    return YAML(typ="safe").compose(text)


def _refuse_dotted_key(text: str, raw: dict, source: str, who: str) -> None:
    """Raise a ParamsError naming the file ``source`` (read as ``text``, loaded as ``raw``), the line
    and the key, with the nested form to write instead, when a mapping key in it has a dot in its name
    (``train.epochs: 3``); ``who``: the message's subject (``"a preset nests"``)."""
    if hit := _dotted_key(_compose(text), raw):
        line, key, nested = hit
        raise _Located(f"{source}: line {line}: key '{key}' has a dot in its name; {who} each section's "
                       f"keys:\n{yaml12.dump(nested).rstrip()}")


def _dotted_key(node: Node | None, raw: dict, trail: tuple = ()) -> tuple[int, str, dict] | None:
    """The first string key written in the mapping ``node`` (loaded as ``raw``) or in a mapping under
    it with a dot in its name, as (its 1-based line, the key, the nested mapping it was meant as from
    the top), or None. A merge key (``<<: *base``) is passed over: the mapping it merges is checked
    where it is written."""
    if not isinstance(node, MappingNode):
        return None
    for k_node, v_node in node.value:
        if k_node.tag != "tag:yaml.org,2002:str":  # a merge key, a number, a collection
            continue
        k = k_node.value
        if "." in k:
            nested = raw[k]
            for part in reversed((*trail, *k.split("."))):
                nested = {part: nested}
            return k_node.start_mark.line + 1, k, nested
        if isinstance(raw[k], dict) and (hit := _dotted_key(v_node, raw[k], (*trail, k))):
            return hit
    return None


def merge(base: dict, preset: dict, source: str) -> dict:
    """``base`` (a raw params mapping) with the preset's keys replaced, checked by the schema.

    Raises:
        ParamsError: the merged params fail :func:`eyas.params.full.parse_params` (the message names
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
            a NUL or a lone surrogate (no command-line argument holds either), ``${`` (Hydra
            interpolates it even in quotes), ``???`` (OmegaConf, under Hydra, reads it as a missing
            value) or a type Hydra has no literal for (a date).
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
    if bad := re.search(r"[\x00\ud800-\udfff]", v):  # repr writes either as an escape: the message encodes
        what = "a NUL" if bad[0] == "\0" else "a lone surrogate"
        raise ParamsError(f"preset key '{key}': {v!r} has {what} ({bad[0]!r}), which no command-line argument "
                          f"holds: it cannot travel as a -S argument")
    if "${" in v:
        raise ParamsError(f"preset key '{key}': {v!r} has '${{': DVC (Hydra) would interpolate it")
    if v == "???":
        raise ParamsError(f"preset key '{key}': '???' is OmegaConf's missing value: DVC (Hydra) would refuse it")
    v = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, v)
    return "'" + v.replace("'", "\\'") + "'"


def set_args(preset: dict, params: dict | None = None) -> list[str]:
    """``["-S", "key=value", ...]`` for ``dvc exp run``, one pair per leaf key of the preset, each
    value in Hydra's override grammar (:func:`_hydra`) so DVC writes the preset's own value; a key
    the raw ``params`` mapping lacks is ``+key=value``, as Hydra adds one (no ``params``: none is).

    Raises:
        ParamsError: a value that cannot travel as a ``-S`` argument (:func:`_hydra`).
    """
    have = None if params is None else flatten(params)
    out: list[str] = []
    for k, v in flatten(preset).items():
        out += ["-S", f"{'' if have is None or k in have else '+'}{k}={_hydra(v, k)}"]
    return out


def _merged_text(text: str, preset: dict, merged: dict, source: str) -> str:
    """The params file ``text`` with the values the preset changes rewritten in place and the keys it
    adds put at the end of their section (a new section at the end of the file); every other
    character, comments, line endings and the spelling of untouched values included, stays as written.

    Args:
        text: the params file that ``merged`` was made from (:func:`merge`).
        preset: the preset's nested mapping.
        merged: :func:`merge` of the file and the preset: the values the returned text must read back as.
        source: the params file's name, for an error.

    Raises:
        ParamsError: naming the key and its line, where the file writes what the preset changes
            through an anchor that an alias shares (setting it would change both); naming the keys
            written and, where the edited text would not read back as ``merged``, the key that would
            differ and its two values (or the YAML error and its line).
    """
    edit = _Edit(text, source)
    edit.section(edit.root, preset, yaml12.load(text, source) or {}, "")
    # from the end, so offsets stay valid; of two insertions at one place the one made first stays first
    for start, end, new, _ in reversed(sorted(edit.out, key=lambda e: e[0])):
        text = text[:start] + new + text[end:]
    written = ", ".join(dict.fromkeys(f"'{key}'" for *_, keys in edit.out for key in keys))
    try:
        got = flatten(yaml12.load(text, source) or {})
    except yaml12.YamlError as e:
        raise ParamsError(f"{source}: cannot set {written} in place: the edited text would not be YAML ({e}); "
                          f"set them by hand") from None
    want = flatten(merged)
    for key in dict.fromkeys([*want, *got]):  # repr: types and the sign of zero compared too
        if repr(got.get(key, ...)) != repr(want.get(key, ...)):
            raise ParamsError(f"{source}: cannot set {written} in place: '{key}' would read back as "
                              f"{got.get(key, 'absent')!r}, not {want.get(key, 'absent')!r}; set them by hand")
    return text


_GAP = re.compile(r"[ \t]+(?=#)")  # between a value and its comment
_KEY_COMMENT = re.compile(r"[ \t]*#[^\r\n]*")  # after a key's colon, on its line


class _Edit:
    """The (start, end, new text, dotted keys written) replacements of a params file's ``text`` that
    write a preset's values into it (:func:`_merged_text`), made by :meth:`section`, in ``out``."""

    def __init__(self, text: str, source: str):
        self.text, self.source = text, source
        first = text.find("\n")
        self.newline = "\r\n" if first > 0 and text[first - 1] == "\r" else "\n"  # as the file's first line ends
        self.root = _compose(text)
        self.shared = _shared(self.root)
        self.out: list[tuple[int, int, str, tuple[str, ...]]] = []

    def section(self, node: Node | None, preset: dict, old: dict, prefix: str) -> None:
        """The replacements that give the mapping ``node`` (None: a file of comments only), which
        reads as ``old``, the values of ``preset``; ``prefix``: its dotted name (``"train."``)."""
        text = self.text
        pairs = {k.value: (k, v) for k, v in node.value} if isinstance(node, MappingNode) else {}
        new = {}
        for key, value in preset.items():
            if key not in pairs:
                new[key] = value
            elif isinstance(value, dict):  # a section in params too (merge checked)
                self._unshared(pairs[key], [pairs[key][1]], prefix + key)
                self.section(pairs[key][1], value, old[key], f"{prefix}{key}.")
            elif repr(old[key]) != repr(value):  # by repr: 0 and 0.0, 0.0 and -0.0 differ (DVC reads them apart)
                self._unshared(pairs[key], _nodes(pairs[key][1]), prefix + key)
                self.value(*pairs[key], value, prefix + key)
        if not new:
            return
        added = tuple(prefix + k for k in new)
        if isinstance(node, MappingNode) and node.flow_style:  # {a: 1}: before the brace
            at = node.end_mark.index - 1
            self.out.append((at, at, (", " if node.value else "") + _flow(new)[1:-1], added))
            return
        indent, at = 0, len(text)  # a file of comments only: at its end
        if isinstance(node, MappingNode):  # on the line after its last entry, as indented as its keys
            indent = node.value[0][0].start_mark.column
            at = text.find("\n", _end(text, *node.value[-1])) + 1 or len(text)
        lead = "" if at == 0 or text[at - 1] == "\n" else self.newline
        self.out.append((at, at, lead + _block(new, indent, self.newline), added))

    def _unshared(self, pair: tuple[Node, Node], nodes, name: str) -> None:
        """Raise ParamsError naming the key ``name`` (``pair``: its key and value node) when one of
        ``nodes``, its value or nodes in it, is an anchored node that an alias also holds."""
        key, value = pair
        if shared := next((n for n in nodes if id(n) in self.shared), None):
            raise ParamsError(f"{self.source}: line {key.start_mark.line + 1}: cannot set '{name}' in place: its "
                              f"value {'is' if shared is value else 'holds'} the anchor &{shared.anchor}, which an "
                              f"alias (*{shared.anchor}) shares: setting it would change both; set it by hand")

    def value(self, key: Node, node: Node, value, name: str) -> None:
        """The replacement that writes ``value`` as the value ``node`` of the mapping key ``key``: a
        block list or mapping from the key's colon to the end of its last item (the key's own comment
        stays on its line, as does one after the last item), else the value's own text; an aligned
        comment after it keeps its column."""
        text = self.text
        colon = text.index(":", key.end_mark.index) + 1
        start = end = _end(text, key, node)
        if isinstance(node, (MappingNode, SequenceNode)) and not node.flow_style:  # items on the lines below
            start = colon
            if comment := _KEY_COMMENT.match(text, colon):  # the value goes before it, the items' lines go
                self.out.append((comment.end(), end, "", (name,)))
                end = colon
        elif node.start_mark.index != node.end_mark.index:  # not a null written as `key:` alone
            start = node.start_mark.index
        new = (" " if start == colon else "") + _flow(value)
        if (gap := _GAP.match(text, end)) and gap.end() - end > 2:  # an aligned comment keeps its column
            column = gap.end() - text.rfind("\n", 0, gap.end()) - 1
            new += " " * max(1, column - (start - text.rfind("\n", 0, start) - 1) - len(new))
            end = gap.end()
        self.out.append((start, end, new, (name,)))


def _children(node: Node) -> list[Node]:
    """The keys and values of a mapping node, the items of a list node, nothing of a scalar."""
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, SequenceNode) else []


def _nodes(node: Node) -> Iterator[Node]:
    """``node`` and every node under it, once each (an alias is the node it names)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if id(n) not in seen:
            seen.add(id(n))
            yield n
            todo += _children(n)


def _shared(root: Node | None) -> set[int]:
    """The ids of the nodes of the tree ``root`` that more than one place holds: an anchored node
    and its aliases (``<<: *base`` included)."""
    held = Counter(id(child) for n in ([] if root is None else _nodes(root)) for child in _children(n))
    return {i for i, count in held.items() if count > 1}


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


def _block(mapping: dict, indent: int, newline: str) -> str:
    """``mapping`` as block-style YAML lines indented by ``indent`` and ended by ``newline``, each
    value in :func:`_flow` form."""
    return "".join(" " * indent + _flow(k) + (f":{newline}{_block(v, indent + 2, newline)}" if isinstance(v, dict)
                                             and v else f": {_flow(v)}{newline}") for k, v in mapping.items())


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


def _write_target(write: str, preset_file: str, params_file: str) -> Path:
    """The file ``--write`` names, through symbolic links. Raises ParamsError naming it when it is
    empty, under /dev or /proc or leads there, the preset itself, an existing file other than
    ``params_file`` and not empty (the merge would replace what it holds with ``params_file`` + the
    preset), not a regular file, not writable, one of several hard links, a path ending in ``/``,
    ``.`` or ``..``, or in a directory that does not exist (as written: ``missing/../x`` too)."""
    if not write:
        raise ParamsError("--write '': give a file path, e.g. --write params.yaml")
    if write.endswith("/") or os.path.basename(write) in (".", ".."):  # realpath would drop it and write a file
        raise ParamsError(f"--write {write}: ends in '{'/' if write.endswith('/') else os.path.basename(write)}', "
                          f"which names a directory; give a file path, e.g. --write params.yaml")
    if special := _special(write):
        via = "" if special == os.path.abspath(write) else f"it leads to {special}, "
        raise ParamsError(f"--write {write}: not a params file: {via}under /dev or /proc (a device, or a stream of "
                          f"this process such as /dev/stdout); give a file path, e.g. --write params.yaml")
    real = Path(os.path.realpath(write))
    if real.is_symlink():
        raise ParamsError(f"--write {write}: a symbolic link that leads back to itself")
    if real.exists():
        if os.path.samefile(real, preset_file):
            raise ParamsError(f"--write {write}: is the preset {preset_file} itself; write the merged params "
                              f"elsewhere, e.g. --write params.yaml")
        st = real.stat()
        if (kind := stat.S_IFMT(st.st_mode)) != stat.S_IFREG:
            raise ParamsError(f"--write {write}: {_NOT_A_FILE.get(kind, 'not a file')}, not a regular file; give "
                              f"a file path, e.g. --write params.yaml")
        if not os.access(real, os.W_OK) or not st.st_mode & 0o222:  # the mode too: root may write anything
            raise ParamsError(f"--write {write}: not writable (mode {stat.S_IMODE(st.st_mode):04o}); make it "
                              f"writable first (chmod u+w) or write elsewhere")
        if st.st_nlink > 1:
            raise ParamsError(f"--write {write}: one of {st.st_nlink} hard links to one file, and a new file takes "
                              f"its place: the other names would keep the old params; give it a file of its own "
                              f"first (cp {write} {write}.new && mv {write}.new {write})")
        if st.st_size and not (os.path.exists(params_file) and os.path.samefile(real, params_file)):
            raise ParamsError(f"--write {write}: an existing file other than --params {params_file}: writing would "
                              f"replace what it holds with {params_file} + the preset. Merge into it with "
                              f"--params {write} --write {write}, or write a new file")
    elif not real.parent.is_dir():
        raise ParamsError(f"--write {write}: no directory {real.parent} to write it in (create it first)")
    if not os.path.isdir(os.path.dirname(write) or "."):  # as written: `missing/../x` or `a_file/../x` opens nowhere
        raise ParamsError(f"--write {write}: {os.path.dirname(write)} is not a directory (the system would not "
                          f"open the path as written); give a file path, e.g. --write params.yaml")
    return real


def _special(write: str) -> str | None:
    """The first path under /dev or /proc that the path ``write`` leads through, or None: the path
    itself, then each symbolic link's target in turn, each as written and with its directories
    resolved (``/dev/fd/1`` is ``/proc/self/fd/1``, which leads to whatever file stdout is)."""
    path = os.path.join(os.getcwd(), write)
    for _ in range(40):  # as many links as Linux follows
        resolved = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
        for p in (os.path.normpath(path), resolved):
            if p.startswith(("/dev/", "/proc/")):
                return p
        if not os.path.islink(resolved):
            return None
        path = os.path.join(os.path.dirname(resolved), os.readlink(resolved))
    return None


def _replace(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8, its line endings as they are) to ``path`` atomically: a temporary file
    beside it, fsynced, renamed over it. An existing file's mode, owner and group carry over; a new
    one gets the usual 0666 less the umask."""
    old = path.stat() if path.exists() else None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
            if old is None:
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(f.fileno(), 0o666 & ~umask)
            else:
                new = os.fstat(f.fileno())
                if (new.st_uid, new.st_gid) != (old.st_uid, old.st_gid):
                    try:
                        os.fchown(f.fileno(), old.st_uid, old.st_gid)
                    except PermissionError as e:
                        raise PermissionError(e.errno, f"it is owned by uid {old.st_uid}, gid {old.st_gid}, which "
                                                       f"a new file of yours cannot keep") from None
                os.fchmod(f.fileno(), stat.S_IMODE(old.st_mode))  # after fchown, which clears set-id bits
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename made durable, where the file system lets a directory open
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def main(argv: list[str] | None = None, prog: str = "python -m eyas.pipeline.preset") -> int:
    """``eyas preset`` (and ``python -m eyas.pipeline.preset``); returns the exit status."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("preset", help="a preset file, e.g. presets/h200.yaml")
    ap.add_argument("--params", default="params.yaml", help="the params file the preset applies to")
    ap.add_argument("--write", default=None, help="write the merged params here instead of printing -S args")
    a = ap.parse_args(argv)
    preset_text = params_text = ""  # each input is read once: a pipe (<(cat p.yaml)) gives nothing the second time
    try:
        preset_text = _read_text(Path(a.preset), "preset")
        preset = _preset(preset_text, a.preset)
        params_text = _read_text(Path(a.params), "params file")
        base = _mapping(params_text, a.params, "params file")
        _refuse_dotted_key(params_text, base, a.params, "params nest")  # DVC reads it as one key the schema lacks
        merged = merge(base, preset, f"{a.params} + {a.preset}")
        if a.write is None:
            args = set_args(preset, base)
            for key, word in zip(flatten(preset), args[1::2]):
                if (hits := glob.glob(word)) and hits != [word]:  # [word]: no pattern, a file of its name
                    raise ParamsError(f"preset key '{key}': the shell would replace -S {word} with the file "
                                      f"{hits[0]} of this directory; run it from another directory")
        else:
            target = _write_target(a.write, a.preset, a.params)
            text = _merged_text(params_text, preset, merged, a.params)
    except ParamsError as e:
        # the keys it names where the preset sets them, else where the params file does (a bad value the
        # preset leaves as it was)
        # the message without the file names it starts with (a quote in one is no key)
        body = next((str(e).removeprefix(p) for p in (f"{a.params} + {a.preset}: ", f"{a.preset}: ", f"{a.params}: ")
                     if str(e).startswith(p)), str(e))
        at = "" if isinstance(e, _Located) else next(
            (f" ({where} of {name})" for text, name in ((preset_text, a.preset), (params_text, a.params))
             if (where := key_lines(body, text))), "")
        sys.stderr.write(f"eyas.pipeline.preset: error: {e}{at}\n")
        return 2
    if a.write is None:
        sys.stdout.write(" ".join(args) + "\n")
        return 0
    try:
        _replace(target, text)
    except OSError as e:
        sys.stderr.write(f"eyas.pipeline.preset: error: --write {a.write}: cannot write the merged params "
                         f"({e.strerror or e}); give a file path, e.g. --write params.yaml\n")
        return 2
    n = len(flatten(preset))
    sys.stderr.write(f"eyas.pipeline.preset: wrote {a.write} ({n} key{'s' * (n != 1)} from {a.preset})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
