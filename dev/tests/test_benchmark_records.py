"""dev/: every result file the docs cite exists, every file in dev/results/ is cited
(results of record only), and every recipe the README lists is one that dev/gpu/device.sh runs."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "dev" / "results"
DOCS = [REPO / "README.md", *sorted((REPO / "dev").glob("*.md")),
        *sorted((REPO / "dev" / "records").glob("*/README.md")), *sorted((REPO / "docs").glob("*.md"))]


def _cited_results() -> set[str]:
    """Result file names the docs cite: `dev/results/<name>` anywhere, and the backticked
    file names in dev/README.md's results table."""
    names = set()
    for doc in DOCS:
        names |= set(re.findall(r"dev/results/([\w.-]+\.(?:json|txt|csv))", doc.read_text()))
    table = (REPO / "dev" / "README.md").read_text().split("## Results of record")[1].split("\n## ")[0]
    for row in [r for r in table.splitlines() if r.startswith("|")][2:]:
        names |= set(re.findall(r"`([\w.-]+\.(?:json|txt|csv))`", row.split("|")[2]))
    return names


def test_every_cited_result_exists_and_every_result_is_cited():
    cited = _cited_results()
    assert "train_2048.json" in cited and "pipeline_cpu.json" in cited  # the parser reads the table
    on_disk = {p.name for p in RESULTS.iterdir()}
    assert sorted(cited - on_disk) == [], "cited but missing"
    assert sorted(on_disk - cited) == [], "in dev/results/ but no doc cites it: not a result of record"


def test_readme_recipes_are_the_drivers(tmp_path):
    readme = (REPO / "dev" / "README.md").read_text()
    listed = set(re.findall(r"`bash dev/gpu/device\.sh ([\w-]+)", readme))
    driver = (REPO / "dev" / "gpu" / "device.sh").read_text()
    cases = set(re.findall(r"^  ([\w-]+)\)$", driver, re.M))
    assert listed == cases == {"gpu-tests", "kernels", "wgrad", "flex", "swiglu", "train", "specforge", "lm-head",
                               "extract", "eval", "ddp", "online", "scale", "profile"}
    r = subprocess.run(["bash", str(REPO / "dev" / "gpu" / "device.sh"), "nope"], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert r.returncode == 2 and "train 2048|8192" in r.stderr  # unknown recipe: the usage, nothing run
