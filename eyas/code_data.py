"""Code conversations: documented Python functions of pinned pure-Python PyPI packages.

The eval's code benchmark (HumanEval, :func:`eyas.data.humaneval_prompts`) asks the target to
complete a function from its signature + docstring; a drafter trained on chat alone has never
seen code. ``data.code_prompts: N`` adds N conversations in that same format to the train and val
splits (never to test or publish), built from real functions of:

- ``more-itertools==11.2.1`` (``more_itertools/more.py``, ``recipes.py``),
- ``boltons==26.2.0`` (``boltons/*utils.py``),

both pinned in ``pyproject.toml`` and installed by ``scripts/install.sh``, so the data is the same
on every machine (the running Python's stdlib is not used: it differs between versions). The
source files are parsed with :mod:`ast`, never imported.

A *usable* function is a module-level, undecorated, public (no leading ``_``) ``def`` whose
body is a docstring followed by at least one statement, whose prompt (signature + docstring) is
at most :data:`MAX_PROMPT_CHARS` and whole source at most :data:`MAX_SOURCE_CHARS` characters, and
whose name is not a HumanEval ``entry_point`` (HumanEval is the test set). The limits are in
characters, so this stage needs no tokenizer; self-distill drops (and counts) the few prompts that
still exceed its token budget. Each becomes::

    user:      eyas.data.code_user_turn(<the def line(s) through the docstring, verbatim> + "\\n")
    assistant: "```python\\n" + <the whole function, verbatim> + "\\n```"

so the pair is usable with ``distill.enabled: false``; with self-distill on, the target rewrites
the assistant turn as it does for chat. Selection and order: ascending
``sha256(f"{seed}:{id}")`` with ``id = "code:<package>/<file>:<function>"``, the first N taken.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path

from eyas.data import DataError, code_user_turn, humaneval_problems

__all__ = ["PACKAGES", "MAX_PROMPT_CHARS", "MAX_SOURCE_CHARS", "usable_functions", "code_conversations", "add_to_splits"]

# import name -> (distribution name, pinned version); keep in step with pyproject.toml
PACKAGES = {"more_itertools": ("more-itertools", "11.2.1"), "boltons": ("boltons", "26.2.0")}
# ~3.2 characters per SmolLM2 token on this code; the chat template adds 48 tokens to a prompt, so
# a 600-character prompt is ~240 tokens, inside the default distill prompt budget of 256
MAX_PROMPT_CHARS = 600
MAX_SOURCE_CHARS = 1200


def _package_dir(module: str) -> Path:
    dist, pin = PACKAGES[module]
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        raise DataError(f"data.code_prompts: the package {dist}=={pin} is not installed "
                        "(bash scripts/install.sh)") from None
    if version != pin:
        raise DataError(f"data.code_prompts: {dist} {version} is installed, the code data is "
                        f"pinned to {dist}=={pin} (pip install {dist}=={pin})")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise DataError(f"data.code_prompts: {dist} is installed but '{module}' is not importable")
    return Path(spec.origin).parent


def usable_functions(module: str, exclude_names: set[str]) -> tuple[list[dict], dict]:
    """The usable functions (see the module docstring) of one package of :data:`PACKAGES`.

    Args:
        module: an import name, a key of :data:`PACKAGES`.
        exclude_names: function names to leave out (HumanEval entry points).

    Returns:
        ``(functions, stats)``: functions in file then line order, each ``{"id": "code:<module>/
        <file>:<name>", "prompt": str, "source": str}`` (``prompt`` ends with ``"\\n"``);
        ``stats`` counts ``defs`` (module-level defs seen) and each reason for skipping one.

    Raises:
        DataError: the package is missing, not at its pinned version, or a file does not parse.
    """
    root = _package_dir(module)
    out: list[dict] = []
    stats = {"defs": 0, "skipped_private_or_decorated": 0, "skipped_no_docstring": 0,
             "skipped_docstring_only": 0, "skipped_too_long": 0, "skipped_humaneval_name": 0}
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        try:
            tree = ast.parse(text, filename=str(path))
        except SyntaxError as e:
            raise DataError(f"{path}: does not parse: {e}") from None
        lines = text.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            stats["defs"] += 1
            if node.name.startswith("_") or node.decorator_list:
                stats["skipped_private_or_decorated"] += 1
            elif ast.get_docstring(node) is None:
                stats["skipped_no_docstring"] += 1
            elif len(node.body) < 2:
                stats["skipped_docstring_only"] += 1
            elif node.name in exclude_names:
                stats["skipped_humaneval_name"] += 1
            else:
                source = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                prompt = "\n".join(lines[node.lineno - 1 : node.body[0].end_lineno]) + "\n"
                if len(prompt) > MAX_PROMPT_CHARS or len(source) > MAX_SOURCE_CHARS:
                    stats["skipped_too_long"] += 1
                    continue
                out.append({"id": f"code:{module}/{path.name}:{node.name}", "prompt": prompt,
                            "source": source})
    return out, stats


def code_conversations(n: int, seed: int) -> tuple[list[dict], dict]:
    """``n`` code conversations from :data:`PACKAGES`, in the order that selects them.

    Args:
        n: how many (``data.code_prompts``, >= 0; 0 reads nothing).
        seed: ``seed`` of params.yaml; the order is ascending ``sha256(f"{seed}:{id}")``.

    Returns:
        ``(conversations, stats)``: each ``{"id", "messages": [user, assistant]}`` as in the module
        docstring; ``stats`` has ``packages`` (pins), ``usable`` (candidates), per-package skip
        counts, and ``taken`` (= n).

    Raises:
        DataError: naming ``data.code_prompts`` when n is negative or exceeds the usable functions,
            or as :func:`usable_functions`.
    """
    if n < 0:
        raise DataError(f"data.code_prompts must be >= 0, got {n}")
    stats: dict = {"taken": 0}
    if n == 0:
        return [], stats
    exclude = {p["entry_point"] for p in humaneval_problems()}
    funcs: list[dict] = []
    stats["packages"] = {dist: pin for dist, pin in PACKAGES.values()}
    for module in PACKAGES:
        got, s = usable_functions(module, exclude)
        funcs += got
        stats[module] = {**s, "usable": len(got)}
    stats["usable"] = len(funcs)
    if n > len(funcs):
        raise DataError(f"data.code_prompts: {n} requested, only {len(funcs)} usable functions "
                        f"in {stats['packages']}")
    funcs.sort(key=lambda f: hashlib.sha256(f"{seed}:{f['id']}".encode()).hexdigest())
    convs = [{"id": f["id"],
              "messages": [code_user_turn(f["prompt"]),
                           {"role": "assistant", "content": f"```python\n{f['source']}\n```"}]}
             for f in funcs[:n]]
    stats["taken"] = n
    return convs, stats


def add_to_splits(splits: dict[str, list[dict]], code: list[dict]) -> dict[str, list[dict]]:
    """Append code conversations to ``train`` and ``val``, in proportion to their sizes.

    ``val`` gets the first ``len(code) * len(val) // (len(val) + len(train))`` (floor), ``train``
    the rest, each after its own conversations; ``test`` and ``publish`` are returned unchanged.
    Returns a new dict with the same keys; the input lists are not modified.

    Raises:
        DataError: an id of ``code`` already occurs in ``splits``.
    """
    seen = {c["id"] for rows in splits.values() for c in rows}
    clash = sorted(seen & {c["id"] for c in code})
    if clash:
        raise DataError(f"data.code_prompts: ids already used by the source: {clash[:3]}")
    n_val = len(code) * len(splits["val"]) // (len(splits["val"]) + len(splits["train"]))
    out = dict(splits)
    out["val"] = splits["val"] + code[:n_val]
    out["train"] = splits["train"] + code[n_val:]
    return out
