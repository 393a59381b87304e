"""dev/gpu/engine_gpu.sh refuses bad arguments and a missing carry before it installs anything: a mode with
an argument too many, engine's PARTS empty, unknown or repeated, and each mode's carried files (the CUDA
build's cuda.xz.a* parts among them) named when absent. Run here in an empty checkout with a temporary
$HOME and $OUT, and a virtual environment's python3 first on PATH (the script installs builds into its
scripts folder, so nothing of this machine's is touched even by a script that gets past its checks)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "dev" / "gpu" / "engine_gpu.sh"


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    v = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(v)], check=True, timeout=120)
    return v


def _run(tmp_path: Path, venv: Path, *args: str) -> subprocess.CompletedProcess:
    home, out, repo = tmp_path / "home", tmp_path / "out", tmp_path / "repo"
    for d in (home, out, repo):
        if not d.is_file():
            d.mkdir(exist_ok=True)
    env = {"HOME": str(home), "OUT": str(out), "PATH": f"{venv}/bin:/usr/bin:/bin", "PWD": str(repo)}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=repo, env=env, capture_output=True, text=True, timeout=60)


def _carry(tmp_path: Path, folder: str, *names: str) -> None:
    d = tmp_path / "repo" / ".devcarry" / folder
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / n).write_bytes(b"carried")


def _untouched(tmp_path: Path, venv: Path) -> None:
    assert not (tmp_path / "home" / "gg").exists() and not (tmp_path / "home" / "src").exists()
    assert sorted(p.name for p in (venv / "bin").iterdir() if p.name.startswith("llama")) == []


@pytest.mark.parametrize("args, says", [
    (("engine", ""), "engine: PARTS '' names no part"),  # before: '' ran all three
    (("engine", "  "), "engine: PARTS '  ' names no part"),  # before: ran none, after unpacking the target
    (("engine", "tests tests"), "engine: part 'tests' twice in 'tests tests'"),
    (("engine", "tests,bench"), "engine: unknown part 'tests,bench' (tests, bench, distill)"),  # held before
    (("engine", "tests", "bench"), "engine: takes at most 1 argument(s) after 'engine', got: tests bench"),
    (("park", "extra"), "park: takes at most 0 argument(s) after 'park', got: extra"),
    (("kept", "x", "y"), "kept: takes at most 0 argument(s) after 'kept', got: x y"),
    (("park-build", "x"), "park-build: takes at most 0 argument(s)"),
    (("decode", "x"), "decode: takes at most 0 argument(s)"),
    (("tiny", "x"), "tiny: takes at most 0 argument(s)"),
])
def test_bad_arguments_are_refused_first(tmp_path, venv, args, says):
    r = _run(tmp_path, venv, *args)
    assert r.returncode == 2 and r.stdout.startswith(f"engine_gpu.sh {says}"), r.stdout + r.stderr
    _untouched(tmp_path, venv)


def test_an_out_that_is_a_file_stops_first(tmp_path, venv):
    (tmp_path / "out").write_text("a file")  # before: mkdir's words, then every mode ran on with no log
    r = _run(tmp_path, venv, "park")
    assert r.returncode == 2 and f"OUT {tmp_path / 'out'} is no directory" in r.stdout, r.stdout + r.stderr
    assert (tmp_path / "out").read_text() == "a file"


def test_a_missing_carry_is_named_before_anything_is_installed(tmp_path, venv):
    # kept: each part of its carry named in turn (before: the wheels skipped in silence, then xz's "No such file",
    # the installed llama-server already emptied by the redirection)
    have = ["llama-server.xz", "llama-server.eyas-build.json", "eyas-0.whl"]
    _carry(tmp_path, "engine-kept", *have)
    r = _run(tmp_path, venv, "kept")
    assert r.returncode == 2 and "kept: no .devcarry/engine-kept/cuda.xz.aa: carry it" in r.stdout, r.stdout + r.stderr
    _carry(tmp_path, "engine-kept", "cuda.xz.aa", "cuda.xz.ab")
    r = _run(tmp_path, venv, "kept")
    assert r.returncode == 2 and "kept: no .devcarry/engine-kept/llama-server-cuda.eyas-build.json" in r.stdout, \
        r.stdout
    os.remove(tmp_path / "repo" / ".devcarry" / "engine-kept" / "eyas-0.whl")
    _carry(tmp_path, "engine-kept", "llama-server-cuda.eyas-build.json")
    r = _run(tmp_path, venv, "kept")
    assert r.returncode == 2 and "kept: no .devcarry/engine-kept/*.whl" in r.stdout, r.stdout
    _untouched(tmp_path, venv)
    # negative control: the whole carry gets past the checks, to the first install: the fake wheels refused by pip
    _carry(tmp_path, "engine-kept", "eyas-0.whl")
    r = _run(tmp_path, venv, "kept")
    assert r.returncode == 1 and "kept: the wheels of .devcarry/engine-kept did not install" in r.stdout, \
        r.stdout + r.stderr
    for mode, says in (("park-build", "no .devcarry/engine-build/part.aa"),
                       ("tiny", "no .devcarry/engine-tiny/llama-src.tar.xz"),
                       ("park", "no .devcarry/engine-park/part.aa"), ("decode", "no .devcarry/engine-decode/*.whl")):
        r = _run(tmp_path, venv, mode)
        assert r.returncode == 2 and r.stdout.startswith(f"engine_gpu.sh {mode}: {says}"), r.stdout + r.stderr
    _untouched(tmp_path, venv)


def test_engine_names_what_the_earlier_calls_left_missing(tmp_path, venv):
    r = _run(tmp_path, venv, "engine", "tests")
    assert r.returncode == 2 and "engine: no parked part.aa in" in r.stdout, r.stdout  # held before
    (tmp_path / "home" / "gg").mkdir(parents=True)
    (tmp_path / "home" / "gg" / "part.aa").write_bytes(b"parked")
    r = _run(tmp_path, venv, "engine", "tests")  # before: cat's "No such file", after writing half the GGUF
    assert r.returncode == 2 and "engine: no .devcarry/engine-rest/part.ab: carry it" in r.stdout, r.stdout + r.stderr
    if not Path("/tmp/eyas-deps").exists():  # (a machine where park-build or kept ran has them)
        _carry(tmp_path, "engine-rest", "part.ab", "chitchat.tar.xz")
        r = _run(tmp_path, venv, "engine")
        assert r.returncode == 2 and "engine: no wheels installed in /tmp/eyas-deps" in r.stdout, r.stdout
