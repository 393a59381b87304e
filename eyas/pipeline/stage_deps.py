"""Code deps of each DVC stage, derived from what its script imports (so the ``dvc.yaml`` files
cannot drift).

A stage's command runs a module (``python -m stages.build_vocab``, ``python -m eyas.training.launch
stages.train_scratch``); the Python files it can execute are that module plus every ``eyas``/
``stages`` module reachable through ``import`` statements, found statically with :mod:`ast` (also
imports inside functions, which run lazily: a conservative superset). A package's ``__init__.py``
counts when it holds code. Every stage of every pipeline file (eyas.pipeline.dvcfiles.PIPELINES:
the default DAG and the fine-tune comparison) must list exactly these files as its code deps
(``tests/pipeline/test_stage_deps.py``); ``python3 -m eyas.pipeline.stage_deps`` prints the differences and
``--tradeoff`` what an edit of each module costs in reruns, derived deps against one
whole-package dep.

The walk follows the imports Python itself would resolve (``importlib`` semantics for
``from pkg import name``: ``pkg/name.py`` when it exists, else an attribute of ``pkg``).
"""

from __future__ import annotations

import ast
import json
import shlex
import sys
from pathlib import Path

PACKAGES = ("eyas", "stages")  # first-party top-level packages; everything else is third party


def module_file(root: Path, module: str) -> Path | None:
    """The file of first-party ``module`` (``eyas.training.loop`` -> ``eyas/training/loop.py``) or None."""
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    base = root.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _imported_modules(path: Path, module: str) -> set[str]:
    """Dotted names of modules ``path`` (module ``module``) may import, anywhere in its body."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from eyas import train`
    return out


def _has_code(init: Path) -> bool:
    """Whether a package ``__init__.py`` does anything beyond a docstring."""
    body = ast.parse(init.read_text()).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body)


def closure(root: Path, modules: list[str]) -> list[str]:
    """Repo-relative paths (sorted) of every first-party file that running ``modules`` can import."""
    root = Path(root)
    seen: dict[str, Path] = {}
    todo = list(modules)
    while todo:
        mod = todo.pop()
        parts = mod.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ first
            name = ".".join(parts[:i])
            f = module_file(root, name)
            if f is None or name in seen:
                continue
            seen[name] = f
            todo.extend(_imported_modules(f, name))
    files = {f for f in seen.values() if f.name != "__init__.py" or _has_code(f)}
    return sorted(str(f.relative_to(root)) for f in files)


def cmd_modules(cmd: str) -> list[str]:
    """The first-party modules a stage command runs: every ``-m`` module and every first-party
    dotted argument (``python -m eyas.training.launch stages.train_scratch`` -> both)."""
    args = shlex.split(cmd.replace("${item}", "ITEM"))
    mods = []
    for i, a in enumerate(args):
        if a.split(".")[0] in PACKAGES and (i > 0 and args[i - 1] == "-m" or "." in a):
            mods.append(a)
    return mods


def _dep_paths(st: dict) -> list[str]:
    return [d if isinstance(d, str) else next(iter(d)) for d in st.get("deps", [])]


def derived_deps(root: Path, stages: dict[str, dict]) -> dict[str, list[str]]:
    """Stage name -> the code files (sorted) its command can import; ``stages``: stage name ->
    definition (eyas.pipeline.dvcfiles.stages)."""
    return {name: closure(root, cmd_modules(st["cmd"])) for name, st in stages.items()}


def declared_code_deps(stages: dict[str, dict]) -> dict[str, list[str]]:
    """Stage name -> the ``.py`` deps under eyas/ or stages/ that its ``dvc.yaml`` declares."""
    return {name: sorted(d for d in _dep_paths(st) if d.endswith(".py") and d.split("/")[0] in PACKAGES)
            for name, st in stages.items()}


def differences(root: Path, stages: dict[str, dict]) -> dict[str, dict[str, list[str]]]:
    """Per stage whose declared code deps differ from the derived ones: ``{'missing': [...],
    'extra': [...]}`` (missing: a change there would leave the stage "up to date"; extra: an
    edit there reruns a stage that cannot run it)."""
    want, have = derived_deps(root, stages), declared_code_deps(stages)
    out = {}
    for name in want:
        missing = sorted(set(want[name]) - set(have[name]))
        extra = sorted(set(have[name]) - set(want[name]))
        if missing or extra:
            out[name] = {"missing": missing, "extra": extra}
    return out


def tradeoff(root: Path, stages: dict[str, dict], stage_seconds: dict[str, float]) -> dict:
    """What an edit of one code file costs, derived deps vs a whole-package dep.

    For each first-party file: the stages that rerun (those that import it) and their seconds
    from ``stage_seconds`` (a measured ``dvc repro``); under a whole-package dep every edit reruns
    every stage that runs code. Downstream stages rerun too only when the edit changes an output
    (a comment or refactor does not).
    """
    deps = derived_deps(root, stages)
    files = sorted({f for fs in deps.values() for f in fs})
    total = sum(stage_seconds.get(s, 0.0) for s in deps)
    rows = {}
    for f in files:
        stages = [s for s, fs in deps.items() if f in fs]
        rows[f] = {"stages": stages, "seconds": round(sum(stage_seconds.get(s, 0.0) for s in stages), 1)}
    mean = sum(r["seconds"] for r in rows.values()) / max(len(rows), 1)
    return {"per_file": rows, "whole_package_seconds": round(total, 1),
            "derived_mean_seconds": round(mean, 1), "files": len(files)}


def main(argv: list[str] | None = None) -> int:
    import argparse

    from eyas.pipeline import dvcfiles

    ap = argparse.ArgumentParser(prog="python3 -m eyas.pipeline.stage_deps", description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=".")
    ap.add_argument("--tradeoff", metavar="PIPELINE_JSON",
                    help="per-file rerun cost from a measured run (dev/results/pipeline_cpu.json)")
    a = ap.parse_args(argv)
    root = Path(a.root)
    stages = dvcfiles.stages(root)
    if a.tradeoff:
        st = json.loads(Path(a.tradeoff).read_text())["pipeline"]["stages"]
        print(json.dumps(tradeoff(root, stages, {k: v["seconds"] for k, v in st.items()}), indent=1))
        return 0
    diff = differences(root, stages)
    for name, d in diff.items():
        print(f"{name}: missing {d['missing']}, extra {d['extra']}")
    if not diff:
        print(f"the code deps of {', '.join(dvcfiles.PIPELINES)} match the imports")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
