"""Params YAML read exactly as DVC reads it.

DVC tracks ``params.yaml`` through ruamel.yaml's safe loader, which follows YAML 1.2
(``dvc/utils/serialize/_yaml.py`` ``parse_yaml``: ``YAML(typ="safe").load(text)``). PyYAML follows
YAML 1.1, and the two disagree on scalars a user or ``dvc exp run -S`` writes:

==========  ==================  ========================
text        YAML 1.2 (DVC)      YAML 1.1 (PyYAML)
==========  ==================  ========================
``050``     50                  40 (octal)
``5e-5``    0.00005             the string ``"5e-5"``
``0o10``    8                   the string ``"0o10"``
``1:30``    the string          90 (base 60)
``yes``     the string          True
==========  ==================  ========================

Every reader of a params or preset file in eyas calls :func:`load`, so the value a stage runs with is
the value DVC hashed into ``dvc.lock`` and MLflow logged (one reading, never a silent disagreement).
ruamel.yaml also refuses a key given twice in one mapping, where PyYAML keeps the last silently.
A file is read as UTF-8, as DVC reads it (``dvc/utils/serialize/_common.py``).
"""

from __future__ import annotations

import io
import re
from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

__all__ = ["YamlError", "dump", "key_line", "load", "load_file"]


class YamlError(ValueError):
    """A file is not valid YAML; the message names the file, with ruamel.yaml's line and column."""


def load(text: str, source: str) -> object:
    """``text`` parsed as DVC parses a params file (YAML 1.2 core schema, safe types only).

    Args:
        text: the YAML document.
        source: what to name in an error (a path, or ``"git HEAD:params.yaml"``).

    Returns:
        Python objects as ruamel.yaml's safe constructor makes them: dict, list, str, int, float,
        bool, None, and for the scalars and tags YAML 1.2 also resolves, ``datetime.date`` /
        ``datetime.datetime`` (an unquoted ``2026-12-01``), ``bytes`` (``!!binary``), ``set``
        (``!!set``); an empty document (or only comments) is None. A schema that wants a string
        refuses the others by type (:mod:`eyas.params`).

    Raises:
        YamlError: not valid YAML, a duplicate key, several documents, or a scalar its tag or form
            cannot construct (``2026-13-45``, ``!!int x``), naming ``source`` and the line.
    """
    try:
        return YAML(typ="safe").load(text)
    except MarkedYAMLError as e:
        raise YamlError(f"{source}: not valid YAML: {_describe(e)}") from None
    except YAMLError as e:
        raise YamlError(f"{source}: not valid YAML: {e}") from None
    except (ValueError, TypeError, KeyError) as e:  # raised by a scalar's constructor, without a line
        where = _failing_node(text)
        at = "" if where is None else f" at line {where.line + 1}, column {where.column + 1}"
        raise YamlError(f"{source}: not valid YAML: {type(e).__name__}: {e}{at}") from None


def _describe(e: MarkedYAMLError) -> str:
    """ruamel.yaml's problem and context with 1-based lines, without its advice to turn checks off."""
    out = re.sub(r' with value "([^"]*)" \(original value: "([^"]*)"\)', _twice, e.problem or str(e))
    if e.problem_mark is not None:
        out += f" at line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}"
    if e.context:
        out += f" ({e.context}" + ("" if e.context_mark is None else f" at line {e.context_mark.line + 1}") + ")"
    return out


def _twice(m: re.Match) -> str:
    """ruamel.yaml's account of a key given twice, where it shows a section or list as ``"{}"`` or
    ``"[]"`` (its value is not built yet when the check runs): what the repeated key is instead."""
    shown = {m.group(1), m.group(2)}
    if "{}" in shown:
        return " (a section given twice: put all its keys under one)"
    return " (a list given twice: keep one)" if "[]" in shown else m.group(0)


def _failing_node(text: str):
    """The start mark of the first node (children first) that ruamel.yaml's safe constructor
    refuses, or None; only called once loading has failed, so its cost is no concern."""
    def walk(node: Node):
        kids = ([n for pair in node.value for n in pair] if isinstance(node, MappingNode)
                else node.value if isinstance(node, SequenceNode) else [])
        for k in kids:
            if (m := walk(k)) is not None:
                return m
        try:
            YAML(typ="safe").constructor.construct_document(node)
        except Exception:  # noqa: BLE001 -- any refusal locates the node
            return node.start_mark
        return None
    try:
        root = YAML(typ="safe").compose(text)
    except YAMLError:
        return None
    return None if root is None else walk(root)


def load_file(path: str | Path) -> object:
    """:func:`load` of the file at ``path``, read as UTF-8 (a byte-order mark is skipped).

    Raises:
        FileNotFoundError: no such file.
        YamlError: as :func:`load`, naming ``path``; or not UTF-8 (naming the line).
    """
    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise YamlError(f"{path}: not UTF-8 text (DVC reads params as UTF-8): byte {data[e.start]:#04x} "
                        f"at line {line}") from None
    return load(text, str(path))


def key_line(text: str, key: str) -> int | None:
    """The 1-based line of dotted ``key`` (``train.lr``, ``eval.seeds[1]``) in the YAML ``text``:
    the line of the key itself, or of the list item; None when the text does not set it or is not
    YAML. For error messages: the schema names a key, this names where it is written.
    """
    try:
        node = YAML(typ="safe").compose(text)
    except YAMLError:
        return None
    line = None
    for part in key.split("."):
        m = re.fullmatch(r"(.*?)((?:\[\d+\])*)", part)
        if not isinstance(node, MappingNode):
            return None
        hits = [(k, v) for k, v in node.value if _key_name(k) == m.group(1)]
        if not hits:
            return None
        k, node = hits[-1]
        line = k.start_mark.line + 1
        for i in re.findall(r"\[(\d+)\]", m.group(2)):
            if not isinstance(node, SequenceNode) or int(i) >= len(node.value):
                return line
            node = node.value[int(i)]
            line = node.start_mark.line + 1
    return line


def _key_name(node: object) -> str | None:
    """A mapping key's node as the schema names it: ``str`` of the value a plain scalar loads as
    (``~`` -> ``"None"``, ``true`` -> ``"True"``), a quoted scalar's own text; None for a
    collection key."""
    if not isinstance(node, ScalarNode):
        return None
    if node.style in ("'", '"'):
        return node.value
    try:
        return str(load(node.value, "a key"))
    except YamlError:
        return node.value


def dump(obj: object) -> str:
    """``obj`` (plain Python objects) as block-style YAML 1.2 that :func:`load` reads back equal,
    mapping keys in their given order. PyYAML's ``safe_dump`` is not safe here: it writes the string
    ``"5e-5"`` unquoted (a string to YAML 1.1, a float to DVC) and ``"yes"`` quoted (the reverse).
    """
    y = YAML(typ="safe")
    y.default_flow_style = False
    y.sort_base_mapping_type_on_output = False
    buf = io.StringIO()
    y.dump(obj, buf)
    return buf.getvalue()
