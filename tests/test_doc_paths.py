"""Current docs and docstrings name only eyas modules and paths that exist.

The package move (eyas/ in packages by concept) left module names such as ``eyas.tracking``,
``eyas/train.py`` or ``python -m eyas.preset`` in a few docs and docstrings; those now fail with
ModuleNotFoundError. Every ``eyas.<a>.<b>`` and ``eyas/<path>`` in the docs, the READMEs (dev/LOG.md and
dev/CHANGELOG.md excepted: they are history), and the sources under eyas/, stages/, scripts/, benchmarks/ and dev/ must
resolve to a module, a name defined in that module, or a file. MLflow tag and GGUF key names that
start with ``eyas.`` are listed in :data:`NOT_MODULES`. The checker is shown to flag old names.
"""

from __future__ import annotations

import re
from pathlib import Path

from eyas.pipeline.dvcfiles import PIPELINES

ROOT = Path(__file__).resolve().parents[1]

# ``eyas.<x>`` names that are not modules: MLflow tags and keys eyas writes.
NOT_MODULES = {"pipeline_key", "params_hash", "host", "pid", "resumes", "resumed_by", "reused",
               "weights_sha256", "model_id", "num_target_layers", "telemetry",
               "started_offline"}
PHRASES = {"eyas/stages"}  # "the eyas/ and stages/ modules"

DOTTED = re.compile(r"(?<![\w/.-])eyas\.([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")
SLASHED = re.compile(r"(?<![\w/.-])eyas/([a-z_][a-z0-9_]*(?:/[a-z_][a-z0-9_]*)*(?:\.py|/)?)")


def _dotted_ok(root: Path, name: str) -> bool:
    parts = name.split(".")
    if parts[0] in NOT_MODULES:
        return True
    base = root / "eyas"
    for i, p in enumerate(parts):
        if (base / p).is_dir():
            base = base / p
            continue
        if (base / f"{p}.py").is_file():
            rest = parts[i + 1:]
            if not rest:
                return True
            src = (base / f"{p}.py").read_text()
            return re.search(rf"\b{rest[0]}\b", src) is not None  # a name or key the module defines
        if i == 0:
            return False
        src = (base / "__init__.py").read_text() if (base / "__init__.py").is_file() else ""  # a name in a package
        return re.search(rf"\b{p}\b", src) is not None
    return True


def stale_refs(root: Path) -> list[str]:
    files = sorted((root / "docs").glob("*.md"))
    files += [root / "README.md", root / "benchmarks" / "README.md", root / "dev" / "README.md",
              *(root / f for f in PIPELINES)]
    for d in ("eyas", "stages", "scripts", "benchmarks", "dev"):
        files += sorted((root / d).rglob("*.py")) + sorted((root / d).rglob("*.sh"))
    out = []
    for f in files:
        if not f.is_file():
            continue
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for m in DOTTED.finditer(line):
                name = m.group(1).rstrip(".")
                if not _dotted_ok(root, name):
                    out.append(f"{f.relative_to(root)}:{n}: eyas.{name}")
            for m in SLASHED.finditer(line):
                path = "eyas/" + m.group(1)
                if path.rstrip("/") not in PHRASES and not (root / path).exists():
                    out.append(f"{f.relative_to(root)}:{n}: {path}")
    return out


def test_docs_and_docstrings_name_no_module_that_moved():
    assert stale_refs(ROOT) == []


def test_the_checker_flags_the_old_module_names(tmp_path):
    """Negative control: a copy of the tree's layout whose doc names pre-move paths."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "eyas" / "pipeline").mkdir(parents=True)
    (tmp_path / "eyas" / "pipeline" / "tracking.py").write_text("def start_stage_run():\n    pass\n")
    (tmp_path / "docs" / "x.md").write_text(
        "`python3 -m eyas.preset`, eyas/train.py, eyas/formats/, `from eyas.tracking import x`,\n"
        "eyas.pipeline.tracking.no_such_fn; fine: eyas.pipeline.tracking.start_stage_run,\n"
        "eyas/pipeline/tracking.py, tag eyas.reused.<stage>\n")
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "LOG.md").write_text("history may keep eyas/train.py\n")
    assert stale_refs(tmp_path) == [
        "docs/x.md:1: eyas.preset", "docs/x.md:1: eyas.tracking", "docs/x.md:1: eyas/train.py",
        "docs/x.md:1: eyas/formats/", "docs/x.md:2: eyas.pipeline.tracking.no_such_fn"]


# the lab's words: how the project's own GPU runs were lent and carried (dev/ keeps them)
LAB_WORDS = re.compile(r"device (?:minutes?|seconds?|calls?|time)|\bsessions?'s?\b|\blent\b|\.devcarry|device\.sh|"
                       r"h200_profile\.sh|\$OUT\b", re.I)
COMMIT = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}(?![\w/-])")
NOT_COMMITS = {"12345e7"}  # docs/dvc-mlflow.md: a string YAML 1.2 reads as a float


def lab_refs(root: Path) -> list[str]:
    """Lab words and commit hashes in the product's docs (README.md, docs/, benchmarks/README.md):
    the runs' history and provenance belong in dev/LOG.md."""
    out = []
    for f in [root / "README.md", root / "benchmarks" / "README.md", *sorted((root / "docs").glob("*.md"))]:
        if not f.is_file():
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            out += [f"{f.relative_to(root)}:{n}: {m.group(0)}" for m in LAB_WORDS.finditer(line)]
            out += [f"{f.relative_to(root)}:{n}: {m.group(0)}" for m in COMMIT.finditer(line)
                    if m.group(0) not in NOT_COMMITS]
    return out


def test_the_product_docs_hold_no_lab_words_and_no_commits():
    assert lab_refs(ROOT) == []


def test_the_lab_words_check_flags_them(tmp_path):
    """Negative control: the phrases the docs held before the lab moved to dev/."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text(
        "both evals must fit one session's 30 device minutes; run at 8a4d5af (`dev/records/h200_2026-12-02/`)\n"
        "2-GPU machines were not lent; `bash dev/gpu/device.sh online`; 12345e7 is a float; sha deadbeef1\n")
    assert lab_refs(tmp_path) == ["docs/x.md:1: session's", "docs/x.md:1: device minutes", "docs/x.md:1: 8a4d5af",
                                  "docs/x.md:2: lent", "docs/x.md:2: device.sh", "docs/x.md:2: deadbeef1"]
