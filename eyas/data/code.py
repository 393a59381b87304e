"""Code conversations: documented Python functions and methods of pinned pure-Python PyPI packages.

The eval's code benchmark (HumanEval, :func:`eyas.data.conversations.humaneval_prompts`) asks the target to
complete a function from its signature + docstring; a drafter trained on chat alone has never
seen code. ``data.code_prompts: N`` adds N conversations in that same format to the train and val
splits (never to test or publish), built from real functions of the packages of
:data:`PACKAGES`:

- ``more-itertools==11.2.1``, ``boltons==26.2.0``: small utility libraries;
- ``networkx==3.6.1``, ``sympy==1.14.0``: also dependencies of torch (which needs
  ``networkx>=2.5.1``, ``sympy>=1.13.3``), so they cost no extra download next to it
  (py3-none-any wheels of 2.1 and 6.3 MB; sympy needs mpmath),
- ``mlflow==3.17.2``, ``dvc==3.67.1``: eyas' own pinned requirements,
- thirty more, dependencies of eyas' requirements pinned at the versions they resolve to in
  pyproject.toml's extra ``code``: dulwich, SQLAlchemy, pydantic, rich, Jinja2, Werkzeug, GitPython
  (import name ``git``) and fsspec (of mlflow and dvc); matplotlib, pandas, scipy, fonttools
  (``fontTools``), celery, scikit-learn (``sklearn``), numpy, kombu, gunicorn, pillow (``PIL``),
  graphql-core (``graphql``), platformdirs, docker, aiohttp, mpmath, psutil, funcy, alembic, Flask,
  Pygments, requests and click.

``code.<package>.usable`` in ``metrics/prepare_data.json`` (when ``data.code_prompts`` > 0) counts each
package's usable functions. ``data.code_packages`` names the packages the prompts come from
(params.yaml's default: the first six; ``presets/h200.yaml`` all thirty-six). All are pinned in
``pyproject.toml`` and installed by ``scripts/install.sh``, so the data is the same
on every machine (the running Python's stdlib is not used: it differs between versions). Every
``*.py`` file under a package's directory is read, except those under a ``tests`` directory (the
package's own test suite); the files are parsed with :mod:`ast` (the same prompts on
Python 3.11, 3.12 and 3.13), never imported.

A *candidate* is a ``def`` at module level, or directly in the body of a module-level class (a
method; its signature keeps ``self``/``cls`` and its qualified name is ``Class.method``). It is
*usable* when neither its name nor its class's name starts with ``_``; its body is a docstring
followed by at least one statement; no other candidate of its file has the same qualified name
(redefinitions, property setters); its prompt (decorator lines, the def line(s) through the
docstring) is at most :data:`MAX_PROMPT_CHARS` and its whole source at most
:data:`MAX_SOURCE_CHARS` characters; and it does not overlap HumanEval (the test set): its name is
not a HumanEval ``entry_point``, and its docstring shares no run of :data:`OVERLAP_WORDS` words
with a HumanEval prompt, words being the lowercased runs of letters ``a-z`` (so punctuation,
digits, spacing and case are ignored; :func:`humaneval_word_runs`). A method is dedented by its
``def``'s column; a method with a non-blank line indented less (a multi-line string or a comment at
column 0, tab indentation) is skipped and counted (``skipped_undedentable``). The
limits are in characters, so this stage needs no tokenizer; self-distill drops (and counts) the
few prompts that still exceed its token budget. Each becomes::

    user:      eyas.data.conversations.code_user_turn(<decorators + def line(s) through the docstring> + "\\n")
    assistant: "```python\\n" + <the whole function, decorators included> + "\\n```"

both verbatim apart from the method dedent, so the pair is usable with ``distill.enabled: false``;
with self-distill on, the target rewrites the assistant turn as it does for chat. Selection and
order: ascending ``sha256(f"{seed}:{id}")`` with
``id = "code:<package>/<file path under the package>:<qualified name>"``, the first N taken.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
import re
import warnings
from pathlib import Path
from typing import NamedTuple

from eyas.data.conversations import DataError, code_user_turn, humaneval_problems

__all__ = ["PACKAGES", "MAX_PROMPT_CHARS", "MAX_SOURCE_CHARS", "OVERLAP_WORDS", "CodeFunction",
           "humaneval_word_runs", "usable_functions", "code_conversations", "add_to_splits"]

# import name -> (distribution name, pinned version); keep in step with pyproject.toml. data.code_packages
# picks among them (params.yaml's default: the first six); mlflow and dvc are eyas' own pinned requirements,
# the rest are dependencies of eyas' requirements, pinned at the versions they resolve to in the extra
# `code` (pyproject.toml; scripts/install.sh installs it)
PACKAGES = {"more_itertools": ("more-itertools", "11.2.1"), "boltons": ("boltons", "26.2.0"),
            "networkx": ("networkx", "3.6.1"), "sympy": ("sympy", "1.14.0"),
            "mlflow": ("mlflow", "3.17.2"), "dvc": ("dvc", "3.67.1"),
            "dulwich": ("dulwich", "1.2.21"), "sqlalchemy": ("SQLAlchemy", "2.1.9"),
            "pydantic": ("pydantic", "2.13.4"), "rich": ("rich", "15.0.0"), "jinja2": ("Jinja2", "3.1.6"),
            "werkzeug": ("Werkzeug", "3.1.8"), "git": ("GitPython", "3.2.1"), "fsspec": ("fsspec", "2026.9.0"),
            "matplotlib": ("matplotlib", "3.11.2"), "pandas": ("pandas", "3.1.1"), "scipy": ("scipy", "1.17.1"),
            "fontTools": ("fonttools", "4.69.1"), "celery": ("celery", "5.7.0"),
            "sklearn": ("scikit-learn", "1.9.1"), "numpy": ("numpy", "2.4.6"), "kombu": ("kombu", "5.7.0"),
            "gunicorn": ("gunicorn", "26.2.0"), "PIL": ("pillow", "13.0.0"), "graphql": ("graphql-core", "3.2.8"),
            "platformdirs": ("platformdirs", "4.14.9"), "docker": ("docker", "7.1.0"),
            "aiohttp": ("aiohttp", "3.14.5"), "mpmath": ("mpmath", "1.3.0"), "psutil": ("psutil", "7.2.2"),
            "funcy": ("funcy", "2.1"), "alembic": ("alembic", "1.20.1"), "flask": ("Flask", "3.1.3"),
            "pygments": ("Pygments", "2.20.0"), "requests": ("requests", "2.34.2"), "click": ("click", "8.5.1")}
# rendered with SmolLM2's chat template, the 4,613 usable prompts of the first four are 122 tokens on
# average and 323 at most; 54 (52 of them sympy's, dense doctests) exceed the default distill prompt
# budget of 256 (extract.max_length 320 - distill.max_new_tokens 64), and self-distill drops them
# (counted)
MAX_PROMPT_CHARS = 600
MAX_SOURCE_CHARS = 1200
# a docstring sharing this many consecutive words with a HumanEval prompt overlaps it (8-word runs,
# as in common benchmark-contamination checks; shorter runs catch generic English phrases)
OVERLAP_WORDS = 8


class CodeFunction(NamedTuple):
    """One usable function: ``id`` (``code:<package>/<file>:<qualname>``), ``prompt`` (ends with
    ``"\\n"``) and ``source`` (no trailing newline), as in the module docstring."""

    id: str
    prompt: str
    source: str


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def humaneval_word_runs(text: str) -> set[tuple[str, ...]]:
    """The runs of :data:`OVERLAP_WORDS` consecutive words of ``text`` (lowercased runs of the
    letters ``a-z``) that also occur in some HumanEval prompt; empty when ``text`` does not
    overlap HumanEval."""
    return _runs(_words(text)) & _humaneval_runs()


def _runs(words: list[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + OVERLAP_WORDS]) for i in range(len(words) - OVERLAP_WORDS + 1)}


@functools.cache
def _humaneval_runs() -> frozenset[tuple[str, ...]]:
    return frozenset().union(*(_runs(_words(p["prompt"])) for p in humaneval_problems()))


def _package_dir(module: str) -> Path:
    dist, pin = PACKAGES[module]
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        raise DataError(f"data.code_packages: the package {dist}=={pin} ('{module}') is not installed "
                        f"(bash scripts/install.sh, or pip install -e '.[code]', or drop '{module}' from "
                        "data.code_packages)") from None
    if version != pin:
        raise DataError(f"data.code_packages: {dist} {version!r} is installed, the code data is pinned to "
                        f"{dist}=={pin} (pip install {dist}=={pin}, or drop '{module}' from data.code_packages)")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise DataError(f"data.code_prompts: {dist} is installed but '{module}' is not importable")
    return Path(spec.origin).parent


def usable_functions(module: str) -> tuple[list[CodeFunction], dict]:
    """The usable functions (see the module docstring) of one package of :data:`PACKAGES`.

    Args:
        module: an import name, a key of :data:`PACKAGES`.

    Returns:
        ``(functions, stats)``: functions in file (path order) then line order, methods after
        the module-level functions of their file; ``stats`` counts ``files`` read,
        ``skipped_test_files``, ``defs`` (candidates seen) and each reason for skipping one.
        Computed once per process (the sympy scan takes seconds); the lists are new each call.

    Raises:
        DataError: the package is missing, not at its pinned version, or a file does not parse.
    """
    funcs, stats = _scan(module)
    return list(funcs), dict(stats)


@functools.cache
def _scan(module: str) -> tuple[tuple[CodeFunction, ...], tuple[tuple[str, int], ...]]:
    root = _package_dir(module)
    names = {p["entry_point"] for p in humaneval_problems()}
    out: list[CodeFunction] = []
    stats = dict.fromkeys(["files", "skipped_test_files", "defs", "skipped_private",
                           "skipped_no_docstring", "skipped_docstring_only",
                           "skipped_duplicate_name", "skipped_too_long",
                           "skipped_humaneval_name", "skipped_humaneval_docstring",
                           "skipped_undedentable"], 0)
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "tests" in rel.parts[:-1]:
            stats["skipped_test_files"] += 1
            continue
        stats["files"] += 1
        text = path.read_text(encoding="utf-8-sig")  # a BOM is not source (Python's own reader drops it)
        try:
            with warnings.catch_warnings():  # invalid escapes in old strings: not our concern
                warnings.simplefilter("ignore", SyntaxWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                tree = ast.parse(text, filename=str(path))
        except SyntaxError as e:
            raise DataError(f"{path}: does not parse: {e}") from None
        # ast numbers lines at \n alone (read_text made \r\n and \r into \n); str.splitlines also splits at
        # \f, \v, \x1c-\x1e, \x85, \u2028 and \u2029, which would shift every later function's lines
        lines = text.split("\n")
        defs = [(n, n.name, False) for n in tree.body if isinstance(n, ast.FunctionDef)]
        defs += [(n, f"{c.name}.{n.name}", c.name.startswith("_"))
                 for c in tree.body if isinstance(c, ast.ClassDef)
                 for n in c.body if isinstance(n, ast.FunctionDef)]
        seen: dict[str, int] = {}
        for _, qualname, _ in defs:
            seen[qualname] = seen.get(qualname, 0) + 1
        for node, qualname, private_class in defs:
            stats["defs"] += 1
            docstring = ast.get_docstring(node, clean=False)
            if private_class or node.name.startswith("_"):
                stats["skipped_private"] += 1
            elif docstring is None:
                stats["skipped_no_docstring"] += 1
            elif len(node.body) < 2:
                stats["skipped_docstring_only"] += 1
            elif seen[qualname] > 1:
                stats["skipped_duplicate_name"] += 1
            elif node.name in names:
                stats["skipped_humaneval_name"] += 1
            elif humaneval_word_runs(docstring):
                stats["skipped_humaneval_docstring"] += 1
            else:
                start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                indent = " " * node.col_offset
                block = lines[start - 1 : node.end_lineno]
                if any(line.strip() and not line.startswith(indent) for line in block):
                    stats["skipped_undedentable"] += 1  # a method with a line left of its def (a column-0 string)
                    continue
                block = [line[len(indent):] for line in block]
                source = "\n".join(block)
                prompt = "\n".join(block[: node.body[0].end_lineno - start + 1]) + "\n"
                if len(prompt) > MAX_PROMPT_CHARS or len(source) > MAX_SOURCE_CHARS:
                    stats["skipped_too_long"] += 1
                    continue
                out.append(CodeFunction(f"code:{module}/{rel.as_posix()}:{qualname}", prompt, source))
    return tuple(out), tuple(stats.items())


def code_conversations(n: int, seed: int, packages: list[str]) -> tuple[list[dict], dict]:
    """``n`` code conversations from ``packages``, in the order that selects them.

    Args:
        n: how many (``data.code_prompts``, >= 0; 0 reads nothing).
        seed: ``seed`` of params.yaml; the order is ascending ``sha256(f"{seed}:{id}")`` over the
            usable functions of all ``packages`` together.
        packages: import names, keys of :data:`PACKAGES` (``data.code_packages``).

    Returns:
        ``(conversations, stats)``: each ``{"id", "messages": [user, assistant]}`` as in the module
        docstring; ``stats`` has ``packages`` (their pins), ``usable`` (candidates over ``packages``),
        per package (import name) the counts of :func:`usable_functions` plus its ``usable``,
        and ``taken`` (= n).

    Raises:
        DataError: naming ``data.code_prompts`` when n is negative or exceeds the usable functions,
            ``data.code_packages`` for a name not in :data:`PACKAGES`, or as :func:`usable_functions`.
    """
    if n < 0:
        raise DataError(f"data.code_prompts must be >= 0, got {n}")
    unknown = [m for m in packages if m not in PACKAGES]
    if unknown:
        named = ", ".join(f"{m} for {d}" for m, (d, _) in PACKAGES.items() if m != d.replace("-", "_"))
        raise DataError(f"data.code_packages: {unknown} are not among the pinned packages {list(PACKAGES)} "
                        f"(import names, not the distributions': {named})")
    stats: dict = {"taken": 0}
    if n == 0:
        return [], stats
    funcs: list[CodeFunction] = []
    stats["packages"] = {PACKAGES[m][0]: PACKAGES[m][1] for m in packages}
    for module in packages:
        got, s = usable_functions(module)
        funcs += got
        stats[module] = {**s, "usable": len(got)}
    stats["usable"] = len(funcs)
    if n > len(funcs):
        raise DataError(f"data.code_prompts: {n} requested, only {len(funcs)} usable functions "
                        f"in {stats['packages']}")
    funcs.sort(key=lambda f: hashlib.sha256(f"{seed}:{f.id}".encode()).hexdigest())
    convs = [{"id": f.id,
              "messages": [code_user_turn(f.prompt),
                           {"role": "assistant", "content": f"```python\n{f.source}\n```"}]}
             for f in funcs[:n]]
    stats["taken"] = n
    return convs, stats


def add_to_splits(splits: dict[str, list[dict]], code: list[dict],
                  key: str = "data.code_prompts") -> dict[str, list[dict]]:
    """Append code (or synthesized) conversations to ``train`` and ``val``, in proportion to their sizes.

    ``val`` gets the first ``len(code) * len(val) // (len(val) + len(train))`` (floor), ``train``
    the rest, each after its own conversations; ``test`` and ``publish`` are returned unchanged.
    Returns a new dict with the same keys; the input lists are not modified.

    Raises:
        DataError: an id of ``code`` already occurs in ``splits`` (the message names ``key``, the
            params key they come from).
    """
    seen = {c["id"] for rows in splits.values() for c in rows}
    clash = sorted(seen & {c["id"] for c in code})
    if clash:
        raise DataError(f"{key}: ids already used by the source: {clash[:3]}")
    n_val = len(code) * len(splits["val"]) // (len(splits["val"]) + len(splits["train"]))
    out = dict(splits)
    out["val"] = splits["val"] + code[:n_val]
    out["train"] = splits["train"] + code[n_val:]
    return out
