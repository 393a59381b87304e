"""dev/gpu/h200_profile.sh refuses bad arguments before it touches anything: a drafter or variant
name becomes a path under the GPU machine's scratch dir ($HOME), so a name with a slash, dots or a
space is refused by every step that takes one, and an unknown step exits 2. Run here with a temporary
$HOME and $OUT (the steps that reach the GPU are not run)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "dev" / "gpu" / "h200_profile.sh"


def _run(tmp_path: Path, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir(exist_ok=True)
    out.mkdir(exist_ok=True)
    env = {"HOME": str(home), "OUT": str(out), "PATH": str(Path(shutil.which("python3")).parent) + ":/usr/bin:/bin",
           "PWD": str(cwd)}  # as a shell that cd'd there sets it: bash's pwd keeps a path through a symbolic link
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args", [("keep", "../w"), ("keep", "scratch", "a/b"), ("restore", "../.."),
                                  ("engine", "a b"), ("evals", "ok", "../v"), ("variant", "../v", "1"),
                                  ("variant", "v.1", "2")])
def test_a_name_that_is_not_a_plain_word_is_refused(tmp_path, args):
    r = _run(tmp_path, *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{args[0]}: a name is letters, digits, _ and -, got" in r.stdout
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == []  # nothing made or removed


def test_a_plain_name_gets_past_the_check_and_unknown_steps_fail(tmp_path):
    # negative control: the same steps with plain names reach their next check
    r = _run(tmp_path, "keep", "scratch")
    assert r.returncode == 1 and "keep: no " in r.stdout and "models/scratch" in r.stdout
    r = _run(tmp_path, "evals", "ok", "v_2")
    assert r.returncode == 1 and "evals: no drafter in" in r.stdout and "v/ok" in r.stdout
    (tmp_path / "repo").mkdir()  # a checkout without carried parts (this one may hold some)
    r = _run(tmp_path, "restore", "scratch", cwd=tmp_path / "repo")
    assert r.returncode == 1 and "restore: no .devcarry/keep_scratch" in r.stdout
    r = _run(tmp_path, "bogus")
    assert r.returncode == 2 and "unknown step 'bogus'" in r.stdout
    assert _run(tmp_path).returncode == 2


def test_variant_checks_its_presets_before_replacing_an_earlier_variant(tmp_path):
    w, earlier = tmp_path / "home" / "w", tmp_path / "home" / "v" / "v1"
    (w / "data" / "features" / "train").mkdir(parents=True)
    (w / "data" / "features" / "train" / "manifest.json").write_text("{}")
    shutil.copy(ROOT / "params.yaml", w / "params.yaml")
    earlier.mkdir(parents=True)
    (earlier / "kept.txt").write_text("an earlier variant's drafter")
    outside = tmp_path / "outside.yaml"  # a valid preset, outside the repository
    outside.write_text("train:\n  epochs: 2\n")
    link = ROOT / "dev" / "levers" / "_test_link_out.yaml"
    link.symlink_to(outside)
    try:
        r = _run(tmp_path, "variant", "v1", "1", "dev/levers/_test_link_out.yaml")
    finally:
        link.unlink()
    assert r.returncode == 2 and "variant: PRESET is a path under the repository" in r.stdout, r.stdout + r.stderr
    for preset, rc, msg in (("dev/levers/nope.yaml", 2, "variant: no preset dev/levers/nope.yaml"),
                            (str(outside), 2, "variant: PRESET is a path under the repository"),
                            ("benchmarks/../README.md", 2, "variant: preset benchmarks/../README.md refused"),
                            ("README.md", 2, "variant: preset README.md refused")):
        r = _run(tmp_path, "variant", "v1", "1", preset)
        assert r.returncode == rc and msg in r.stdout, r.stdout + r.stderr
        assert (earlier / "kept.txt").read_text() == "an earlier variant's drafter"
    # the repository reached through a symbolic link: its own presets still lie under it (the check reaches README.md)
    (tmp_path / "repo_link").symlink_to(ROOT)
    r = _run(tmp_path, "variant", "v1", "1", "README.md", cwd=tmp_path / "repo_link")
    assert r.returncode == 2 and "variant: preset README.md refused" in r.stdout, r.stdout + r.stderr
    assert (earlier / "kept.txt").read_text() == "an earlier variant's drafter"
    r = _run(tmp_path, "variant", "v1", "0")
    assert r.returncode == 2 and "EVERY is a whole number >= 1, got '0'" in r.stdout


def test_setup_without_parked_inputs_fails_before_anything_is_installed_or_rebuilt(tmp_path):
    """Each input missing in turn: setup names it and exits 1 with the work dir as it was, before its pip
    install and its llama-server unpack touch the machine. Run from an empty checkout dir, so that no
    carried .devcarry/b of this machine lets it past the last check."""
    w, gg, repo = tmp_path / "home" / "w", tmp_path / "home" / "gg", tmp_path / "repo"
    w.mkdir(parents=True)
    (w / "kept.txt").write_text("an earlier setup's work dir")
    gg.mkdir()
    repo.mkdir()
    for name in ("part.aa", "llama-server.xz", "conv.tgz"):
        r = _run(tmp_path, "setup", "extract", cwd=repo)
        assert r.returncode == 1 and f"setup: no {gg / name} (park" in r.stdout, r.stdout + r.stderr
        assert (w / "kept.txt").read_text() == "an earlier setup's work dir"
        (gg / name).write_bytes(b"")  # parked: the next run reaches the next check (negative control)
    r = _run(tmp_path, "setup", "extract", cwd=repo)
    assert r.returncode == 1 and "setup: no .devcarry/b/part.ab (park" in r.stdout, r.stdout + r.stderr
    assert (w / "kept.txt").read_text() == "an earlier setup's work dir"


def test_a_park_with_a_file_missing_leaves_the_parked_set_as_it_was(tmp_path):
    gg, repo = tmp_path / "home" / "gg", tmp_path / "repo"
    gg.mkdir(parents=True)
    for name in ("part.aa", "llama-server.xz", "conv.tgz", "distilled.tar.xz"):
        (gg / name).write_text("parked before")
    (repo / ".devcarry" / "a").mkdir(parents=True)
    (repo / ".devcarry" / "a" / "part.aa").write_text("new")
    (repo / ".devcarry" / "c").mkdir()
    for carried, missing in (("a", "llama-server.xz"), ("c", "conv.tgz")):
        r = _run(tmp_path, "park", cwd=repo)
        assert r.returncode == 1 and f"park: no .devcarry/{carried}/{missing}" in r.stdout, r.stdout + r.stderr
        assert {p.name: p.read_text() for p in gg.iterdir()} == dict.fromkeys(
            ("part.aa", "llama-server.xz", "conv.tgz", "distilled.tar.xz"), "parked before")
        (repo / ".devcarry" / carried / missing).write_text("new")
    # negative control: with every file carried, park replaces the set (c's without distilled data drops the old one)
    r = _run(tmp_path, "park", cwd=repo)
    assert r.returncode == 0, r.stdout + r.stderr
    assert {p.name: p.read_text() for p in gg.iterdir()} == dict.fromkeys((
        "part.aa", "llama-server.xz", "conv.tgz"), "new")
