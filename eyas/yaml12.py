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
"""

from __future__ import annotations

import io
from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

__all__ = ["YamlError", "dump", "load", "load_file"]


class YamlError(ValueError):
    """A file is not valid YAML; the message names the file, with ruamel.yaml's line and column."""


def load(text: str, source: str) -> object:
    """``text`` parsed as DVC parses a params file (YAML 1.2 core schema, safe types only).

    Args:
        text: the YAML document.
        source: what to name in an error (a path, or ``"git HEAD:params.yaml"``).

    Returns:
        Plain Python objects (dict, list, str, int, float, bool, None); an empty document is None.

    Raises:
        YamlError: not valid YAML or a duplicate key, naming ``source`` and the line.
    """
    try:
        return YAML(typ="safe").load(text)
    except YAMLError as e:
        raise YamlError(f"{source}: not valid YAML: {e}") from None


def load_file(path: str | Path) -> object:
    """:func:`load` of the file at ``path``.

    Raises:
        FileNotFoundError: no such file.
        YamlError: as :func:`load`, naming ``path``.
    """
    path = Path(path)
    return load(path.read_text(), str(path))


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
