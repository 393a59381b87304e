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
                               "extract", "decode", "eval", "ddp", "online", "scale", "profile"}
    r = subprocess.run(["bash", str(REPO / "dev" / "gpu" / "device.sh"), "nope"], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert r.returncode == 2 and "train 2048|8192" in r.stderr  # unknown recipe: the usage, nothing run


def log_dates_out_of_order(text: str) -> list[str]:
    """The headings of a log (``## YYYY-MM-DD · ...``) whose date is later than the heading's above
    it: newest first, every entry dated."""
    heads = [h for h in text.splitlines() if h.startswith("## ")]
    bad = [h for h in heads if not re.match(r"## \d{4}-\d\d-\d\d · ", h)]
    dates = [h[3:13] for h in heads if h not in bad]
    return bad + [f"{b} after {a}" for a, b in zip(dates, dates[1:]) if b > a]


def test_the_log_is_newest_first():
    assert log_dates_out_of_order((REPO / "dev" / "LOG.md").read_text()) == []
    # negative control: an older entry above a newer one, and an undated one
    assert log_dates_out_of_order("## 2026-12-04 · a\n## 2026-12-06 · b\n## c\n") == [
        "## c", "2026-12-06 after 2026-12-04"]
