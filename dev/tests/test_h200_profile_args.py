"""dev/gpu/h200_profile.sh refuses bad arguments before it touches anything: a drafter or variant
name becomes a path under the GPU machine's scratch dir ($HOME), so a name with a slash, dots or a
space is refused by every step that takes one, and an unknown step exits 2. A parked or carried file
missing, llama.cpp's CUDA build not whole, or not installed where an eval or `engine` serves with it,
stops the call naming it before anything is replaced or any stage runs. Run here with a temporary
$HOME and $OUT (the steps that reach the GPU are not run); the checks of installed builds run with a
virtual environment's python3 first on PATH (its scripts folder is where they look)."""

import json
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "dev" / "gpu" / "h200_profile.sh"
SYSTEM_PATH = str(Path(shutil.which("python3")).parent) + ":/usr/bin:/bin"


def _run(tmp_path: Path, *args: str, cwd: Path = ROOT, path: str = SYSTEM_PATH) -> subprocess.CompletedProcess:
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir(exist_ok=True)
    out.mkdir(exist_ok=True)
    env = {"HOME": str(home), "OUT": str(out), "PATH": path,
           "PWD": str(cwd)}  # as a shell that cd'd there sets it: bash's pwd keeps a path through a symbolic link
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def _build(d: Path, name: str, data: bytes, backend: str, parts: int = 1) -> list[Path]:
    """A llama.cpp build as a call carries it (dev/gpu/llama_builds.sh): ``data`` xz-compressed, as
    ``llama-server.xz`` or split in ``parts`` files ``cuda.xz.aa``, ``.ab``, ..., and its build record."""
    d.mkdir(parents=True, exist_ok=True)
    z = lzma.compress(data, format=lzma.FORMAT_XZ)
    if name == "llama-server":
        files = [d / "llama-server.xz"]
        files[0].write_bytes(z)
    else:
        step = -(-len(z) // parts)
        files = [d / f"cuda.xz.a{chr(ord('a') + i)}" for i in range(parts)]
        for i, f in enumerate(files):
            f.write_bytes(z[i * step:(i + 1) * step])
    (d / f"{name}.eyas-build.json").write_text(json.dumps({"backend": backend, "sources": "s", "cmake_flags": ""}))
    return files


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    v = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(v)], check=True, timeout=120)
    return v


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
    (gg / "cuda").mkdir(parents=True)
    repo.mkdir()
    for name in ("part.aa", "llama-server.xz", "llama-server.eyas-build.json", "conv.tgz", "cuda/cuda.xz.aa",
                 "cuda/llama-server-cuda.eyas-build.json"):
        r = _run(tmp_path, "setup", "extract", cwd=repo)
        assert r.returncode == 1 and f"setup: no {gg / name} (park" in r.stdout, r.stdout + r.stderr
        assert (w / "kept.txt").read_text() == "an earlier setup's work dir"
        (gg / name).write_bytes(b"")  # parked: the next run reaches the next check (negative control)
    for name in ("part.ab", "converter.tgz", "libgomp.so.1"):
        r = _run(tmp_path, "setup", "extract", cwd=repo)
        assert r.returncode == 1 and f"setup: no .devcarry/b/{name} (park" in r.stdout, r.stdout + r.stderr
        assert (w / "kept.txt").read_text() == "an earlier setup's work dir"
        (repo / ".devcarry" / "b").mkdir(parents=True, exist_ok=True)
        (repo / ".devcarry" / "b" / name).write_bytes(b"")
    r = _run(tmp_path, "setup", "extract", cwd=repo)
    assert r.returncode == 1 and "setup: no .devcarry/b/*.whl (carry" in r.stdout, r.stdout + r.stderr
    assert (w / "kept.txt").read_text() == "an earlier setup's work dir"


PARKED = ("part.aa", "llama-server.xz", "llama-server.eyas-build.json", "conv.tgz", "distilled.tar.xz")


def _parked(gg: Path) -> dict:
    return {str(p.relative_to(gg)): p.read_bytes() for p in sorted(gg.rglob("*")) if p.is_file()}


def test_a_park_with_a_file_missing_leaves_the_parked_set_as_it_was(tmp_path):
    gg, repo = tmp_path / "home" / "gg", tmp_path / "repo"
    gg.mkdir(parents=True)
    for name in PARKED:
        (gg / name).write_bytes(b"parked before")
    before = _parked(gg)
    a = repo / ".devcarry" / "a"
    a.mkdir(parents=True)
    (a / "part.aa").write_bytes(b"new")
    (repo / ".devcarry" / "c").mkdir()
    _build(tmp_path / "cpu", "llama-server", b"the CPU build", "cpu")
    for carried, missing in (("a", "llama-server.xz"), ("a", "llama-server.eyas-build.json"), ("c", "conv.tgz")):
        r = _run(tmp_path, "park", cwd=repo)
        assert r.returncode == 1 and f"park: no .devcarry/{carried}/{missing}" in r.stdout, r.stdout + r.stderr
        assert "nothing parked" in r.stdout and _parked(gg) == before
        src = tmp_path / "cpu" / missing
        (repo / ".devcarry" / carried / missing).write_bytes(src.read_bytes() if src.is_file() else b"new")
    # negative control: with every file carried, park replaces the set (c's without distilled data drops the old one)
    r = _run(tmp_path, "park", cwd=repo)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _parked(gg) == {n: (tmp_path / "cpu" / n).read_bytes() if n.startswith("llama") else b"new"
                           for n in ("part.aa", "llama-server.xz", "llama-server.eyas-build.json", "conv.tgz")}


def test_park_refuses_a_cuda_build_that_is_not_whole_and_replaces_a_whole_one(tmp_path):
    """.devcarry/d, llama.cpp's CUDA build in parts with its record: a part missing (first, middle or last),
    one cut short, or a record of the CPU build stops the park naming it, the parked build as it was
    (before: no .devcarry/d was parked at all, and the profile's eval had no CUDA build to serve with)."""
    gg, d = tmp_path / "home" / "gg", tmp_path / "repo" / ".devcarry" / "d"
    _build(gg / "cuda", "llama-server-cuda", b"the build parked before", "cuda", parts=2)
    before = _parked(gg)
    binary = bytes(range(256)) * 400  # xz leaves it ~100 KB: three parts of real size
    files = _build(tmp_path / "cuda", "llama-server-cuda", binary, "cuda", parts=3)
    record = tmp_path / "cuda" / "llama-server-cuda.eyas-build.json"
    cases = [("no record", [*files], None, "no .devcarry/d/llama-server-cuda.eyas-build.json"),
             ("no first part", files[1:], record, "no .devcarry/d/cuda.xz.aa"),
             ("no middle part", [files[0], files[2]], record, "do not decompress whole"),
             ("no last part", files[:2], record, "do not decompress whole")]
    for what, carried, rec, says in cases:
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for f in carried:
            shutil.copy(f, d)
        if rec is not None:
            shutil.copy(rec, d)
        r = _run(tmp_path, "park", cwd=tmp_path / "repo")
        assert r.returncode == 1 and says in r.stdout and "nothing parked" in r.stdout, (what, r.stdout + r.stderr)
        assert _parked(gg) == before, what
    for f in files:
        shutil.copy(f, d)
    (d / "cuda.xz.ac").write_bytes(files[2].read_bytes()[:-1])  # cut short by one byte
    r = _run(tmp_path, "park", cwd=tmp_path / "repo")
    assert r.returncode == 1 and "do not decompress whole" in r.stdout and _parked(gg) == before, r.stdout + r.stderr
    shutil.copy(files[2], d)
    (d / "llama-server-cuda.eyas-build.json").write_text(json.dumps({"backend": "cpu"}))
    r = _run(tmp_path, "park", cwd=tmp_path / "repo")
    assert r.returncode == 1 and "names backend 'cpu', not 'cuda'" in r.stdout, r.stdout + r.stderr
    assert _parked(gg) == before
    # negative control: the whole set parks, replacing the build parked before
    shutil.copy(record, d)
    r = _run(tmp_path, "park", cwd=tmp_path / "repo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert _parked(gg) == {f"cuda/{f.name}": f.read_bytes() for f in (*files, record)}


def test_an_eval_or_engine_without_the_cuda_build_stops_before_any_stage(tmp_path, venv):
    """`run` with an eval among its stages (or none named: the whole DAG) and `engine` serve with llama.cpp's
    CUDA build: without it installed (setup installs it) they stop naming it, before any stage runs
    (before: the stages before the eval ran, then the eval stopped at its first llama-server)."""
    path = f"{venv}/bin:/usr/bin:/bin"
    w = tmp_path / "home" / "w"
    r = _run(tmp_path, "run", "eval-accept-len@scratch", path=path)
    assert r.returncode == 1 and f"run: no work dir {w} (setup first" in r.stdout, r.stdout + r.stderr
    w.mkdir(parents=True)
    (tmp_path / "home" / "v" / "full" / "metrics").mkdir(parents=True)
    (tmp_path / "home" / "v" / "full" / "metrics" / "eval_scratch.json").write_text("{}")
    says = f"no llama-server-cuda with its build record in {venv}/bin: park .devcarry/d, then setup"
    for args in (("run", "target-gguf", "eval-accept-len@scratch"), ("run", "eval-accept-len@finetune"), ("run",),
                 ("engine", "full")):
        r = _run(tmp_path, *args, path=path)
        assert r.returncode == 1 and f"{args[0]}: {says}" in r.stdout, (args, r.stdout + r.stderr)
        assert "===" not in r.stdout and list(w.iterdir()) == []  # no stage started
    # negative controls: stages without an eval need no CUDA build; with it installed the check passes (the
    # stages then fail here: the work dir is empty)
    r = _run(tmp_path, "run", "target-gguf", path=path)
    assert "llama-server-cuda" not in r.stdout and "gpu_profile.sh" in r.stdout + r.stderr, r.stdout + r.stderr
    _build(tmp_path / "cuda", "llama-server-cuda", b"#!/bin/sh\n", "cuda")
    (venv / "bin" / "llama-server-cuda").write_text("#!/bin/sh\n")
    (venv / "bin" / "llama-server-cuda").chmod(0o755)
    try:
        r = _run(tmp_path, "run", "eval-accept-len@scratch", path=path)
        assert r.returncode == 1 and "no llama-server-cuda" in r.stdout, "a binary without its record is not a build"
        shutil.copy(tmp_path / "cuda" / "llama-server-cuda.eyas-build.json", venv / "bin")
        for args in (("run", "eval-accept-len@scratch"), ("engine", "full")):
            r = _run(tmp_path, *args, path=path)
            assert "llama-server-cuda" not in r.stdout and r.returncode != 0, (args, r.stdout + r.stderr)
    finally:
        for f in ("llama-server-cuda", "llama-server-cuda.eyas-build.json"):
            (venv / "bin" / f).unlink(missing_ok=True)
