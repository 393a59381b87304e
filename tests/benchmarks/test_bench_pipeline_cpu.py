"""benchmarks/bench_pipeline_cpu.py refuses bad arguments before it deletes its last clone."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


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
