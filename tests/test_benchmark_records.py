"""benchmarks/: every result file the docs cite exists, every file in benchmarks/results/ is cited
(results of record only), and every recipe the README lists is one that benchmarks/device.sh runs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOCS = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "metrics").glob("h200*/README.md")),
        *sorted((REPO / "docs").glob("*.md"))]


def _cited_results() -> set[str]:
    """Result file names the docs cite: `benchmarks/results/<name>` anywhere, and the backticked
    file names in benchmarks/README.md's results table."""
    names = set()
    for doc in DOCS:
        names |= set(re.findall(r"benchmarks/results/([\w.-]+\.(?:json|txt|csv))", doc.read_text()))
    table = (REPO / "benchmarks" / "README.md").read_text().split("## Results of record")[1].split("\n## ")[0]
    for row in [r for r in table.splitlines() if r.startswith("|")][2:]:
        names |= set(re.findall(r"`([\w.-]+\.(?:json|txt|csv))`", row.split("|")[2]))
    return names


def test_every_cited_result_exists_and_every_result_is_cited():
    cited = _cited_results()
    assert "train_2048.json" in cited and "pipeline_cpu.json" in cited  # the parser reads the table
    on_disk = {p.name for p in RESULTS.iterdir()}
    assert sorted(cited - on_disk) == [], "cited but missing"
    assert sorted(on_disk - cited) == [], "in benchmarks/results/ but no doc cites it: not a result of record"


def test_readme_recipes_are_the_drivers(tmp_path):
    readme = (REPO / "benchmarks" / "README.md").read_text()
    listed = set(re.findall(r"`bash benchmarks/device\.sh ([\w-]+)", readme))
    driver = (REPO / "benchmarks" / "device.sh").read_text()
    cases = set(re.findall(r"^  ([\w-]+)\)$", driver, re.M))
    assert listed == cases == {"gpu-tests", "kernels", "wgrad", "flex", "swiglu", "train", "specforge", "lm-head",
                               "extract", "eval", "ddp", "online", "scale", "profile"}
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "device.sh"), "nope"], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert r.returncode == 2 and "train 2048|8192" in r.stderr  # unknown recipe: the usage, nothing run


@pytest.mark.parametrize("args, message", [
    (["--preset", "{d}/missing.yaml"], "--preset {d}/missing.yaml: {d}/missing.yaml: no such preset"),
    (["--preset", "{d}/empty.yaml"], "--preset {d}/empty.yaml: {d}/empty.yaml: a preset sets at least one key, got "
                                     "only empty sections"),
    (["--growth-shard-samples", "0"], "--growth-shard-samples must be >= 1, got 0"),
])
def test_pipeline_bench_refuses_bad_arguments_before_deleting_its_last_clone(tmp_path, args, message):
    """The benchmark deletes its previous clone (``--workdir``) before cloning again: an argument it
    would refuse after the ~40-minute pipeline, or a preset the clone's params would refuse, stops it
    first, the old clone untouched (before these checks, the clone was gone when the preset failed)."""
    work = tmp_path / "w"
    work.mkdir()
    (work / ".bench_clone").write_text("")
    (work / "kept.txt").write_text("a finished run")
    (tmp_path / "empty.yaml").write_text("train: {}\n")
    args = [a.format(d=tmp_path) for a in args]
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_pipeline_cpu.py"), "--workdir", str(work),
                        "--out", str(tmp_path / "o.json"), *args], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert (r.returncode, r.stderr.strip().splitlines()[-1]) == (1, message.format(d=tmp_path))
    assert (work / "kept.txt").read_text() == "a finished run" and not (tmp_path / "o.json").exists()
