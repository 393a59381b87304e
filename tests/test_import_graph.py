"""The package layering of eyas: imports run one way, from a package to the packages below it.

Every import between eyas modules (top level or inside a function, as
eyas/pipeline/stage_deps.py reads them with :mod:`ast`) is checked against :data:`LAYERS`, lowest
first: a module imports only from its own package or from a package below it, so no import climbs
back up, no two packages import each other, and no two modules either. The checker is shown to fail on a synthetic graph
and on a copy of eyas with one upward import injected.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from eyas.pipeline import stage_deps

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. "ground": eyas.io (atomic files, hashes), eyas.features (the feature store),
# eyas.yaml12 (params YAML read as DVC reads it) and eyas/__init__; "params": the params schema, one module per
# section; "pipeline": DVC (its files, the stage deps, presets, the team remote); "tracking": MLflow and
# `eyas compare`; "cli" sits on top. eyas.urls (a URL's password masked) is ground too.
LAYERS = ("ground", "params", "target", "data", "vocab", "drafter", "training", "export", "eval", "pipeline",
          "tracking", "cli")
GROUND = {"eyas", "eyas.io", "eyas.features", "eyas.yaml12", "eyas.urls"}


def package_of(module: str) -> str:
    """The layer a module belongs to: ``eyas.training.loop`` -> ``training``."""
    if module in GROUND:
        return "ground"
    if module == "eyas.cli":
        return "cli"
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:
        return parts[1]
    raise AssertionError(f"{module}: not in a package of the layering (tests/test_import_graph.py LAYERS)")


def module_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the eyas modules it may import (anywhere in its body), for every module under
    ``root/eyas``."""
    files = {}
    for f in (root / "eyas").rglob("*.py"):
        files[".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = f
    return {m: {d for d in stage_deps._imported_modules(f, m) if d in files and d != m} for m, f in files.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a package into a higher one, as ``'a -> b (pkg_a < pkg_b)'``."""
    out = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            pm, pd = package_of(m), package_of(d)
            if LAYERS.index(pd) > LAYERS.index(pm):
                out.append(f"{m} -> {d} ({pm} < {pd})")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk of ``graph`` meets, as ``[a, b, ..., a]``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    out = []

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                out.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return out


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles in the graph of packages (an edge where a module of one imports a module of another)."""
    pg: dict[str, set[str]] = {}
    for m, deps in graph.items():
        pg.setdefault(package_of(m), set()).update(package_of(d) for d in deps if package_of(d) != package_of(m))
    return cycles(pg)


def test_every_module_has_a_layer_and_the_graph_is_read():
    graph = module_graph(ROOT)
    assert {package_of(m) for m in graph} == set(LAYERS)
    # a lazy import (inside a function) is an edge too
    assert "eyas.target.rope" in graph["eyas.target.model"]
    assert "eyas.drafter.kernels" in graph["eyas.drafter.head_loss"]


def test_no_import_climbs_back_up():
    assert upward_imports(module_graph(ROOT)) == []


def test_no_cycle_between_packages():
    assert package_cycles(module_graph(ROOT)) == []


def test_no_cycle_between_modules():
    """Inside a package too (it held eyas.export <-> eyas.speculators_format and
    eyas.drafter -> eyas.head_loss -> eyas.drafter before the packages)."""
    assert cycles(module_graph(ROOT)) == []


def test_checker_flags_a_synthetic_upward_import_and_cycle():
    graph = {
        "eyas.io": set(),
        "eyas.target.layers": {"eyas.io"},
        "eyas.drafter.model": {"eyas.target.layers"},
        "eyas.target.model": {"eyas.drafter.model"},  # target -> drafter: upward
    }
    assert upward_imports(graph) == ["eyas.target.model -> eyas.drafter.model (target < drafter)"]
    assert package_cycles(graph) == [["drafter", "target", "drafter"]]


def test_checker_flags_an_upward_import_injected_into_a_copy(tmp_path):
    shutil.copytree(ROOT / "eyas", tmp_path / "eyas", ignore=shutil.ignore_patterns("__pycache__"))
    layers = tmp_path / "eyas" / "target" / "layers.py"
    layers.write_text(layers.read_text() + "\n\ndef _injected():\n    from eyas.tracking import runs\n")
    graph = module_graph(tmp_path)
    assert upward_imports(graph) == ["eyas.target.layers -> eyas.tracking (target < tracking)",  # its __init__
                                     "eyas.target.layers -> eyas.tracking.runs (target < tracking)"]
    assert package_cycles(graph)  # tracking reaches target (its logged models load the target's config)


# the product's folders: dev/ (the lab) may import from them, never the reverse
PRODUCT_DIRS = ("eyas", "stages", "benchmarks", "scripts", "tests")


def imports_of_the_lab(root: Path) -> list[str]:
    """Every import of the lab's package ``dev`` (``import dev``, ``from dev.bench import x``) from a
    Python file under :data:`PRODUCT_DIRS`, as ``'path: module'``."""
    out = []
    for d in PRODUCT_DIRS:
        for f in sorted((root / d).rglob("*.py")):
            mods = stage_deps._imported_modules(f, ".".join(f.relative_to(root).with_suffix("").parts))
            out += [f"{f.relative_to(root)}: {m}" for m in sorted(mods) if m == "dev" or m.startswith("dev.")]
    return out


def test_the_product_imports_nothing_from_the_lab():
    assert imports_of_the_lab(ROOT) == []


def test_checker_flags_an_import_of_the_lab_injected_into_a_copy(tmp_path):
    """Negative control: a product file that imports dev/, top level or inside a function."""
    (tmp_path / "stages").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "stages" / "x.py").write_text("def f():\n    from dev.bench.common import RESULTS\n")
    (tmp_path / "benchmarks" / "y.py").write_text("import dev\nimport devtools\n")
    assert imports_of_the_lab(tmp_path) == ["stages/x.py: dev.bench.common", "stages/x.py: dev.bench.common.RESULTS",
                                            "benchmarks/y.py: dev"]


def long_modules(root: Path, limit: int = 500) -> list[str]:
    """Modules of eyas/ and stages/ over ``limit`` lines whose docstring gives no reason for it (a
    paragraph starting "One module past 500 lines")."""
    import ast

    out = []
    for f in sorted([*(root / "eyas").rglob("*.py"), *(root / "stages").rglob("*.py")]):
        text = f.read_text()
        if text.count("\n") > limit and "One module past 500 lines" not in (ast.get_docstring(ast.parse(text)) or ""):
            out.append(str(f.relative_to(root)))
    return out


def test_a_module_over_500_lines_says_why():
    assert long_modules(ROOT) == []
