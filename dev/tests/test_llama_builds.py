"""dev/gpu/llama_builds.sh, the one install path of llama.cpp's builds on a lent GPU machine (sourced by
dev/gpu/engine_gpu.sh and dev/gpu/h200_profile.sh): a build installs whole, binary and build record, where
eyas looks for it (python3's console scripts), from its xz file or its parts in order; a set that is not
whole, or a record of another backend, installs nothing and leaves the build installed before in place.
Run with a virtual environment's python3 first on PATH: its scripts folder takes the installs."""

import json
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "dev" / "gpu" / "llama_builds.sh"


@pytest.fixture()
def venv(tmp_path) -> Path:
    v = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(v)], check=True, timeout=120)
    return v


def _sh(venv: Path, cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {"PATH": f"{venv}/bin:/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run(["bash", "-c", f'set -uo pipefail; . "{LIB}"; {cmd}'], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def _cuda_set(d: Path, binary: bytes, parts: int, backend: str = "cuda") -> list[Path]:
    d.mkdir(parents=True, exist_ok=True)
    z = lzma.compress(binary, format=lzma.FORMAT_XZ)
    step = -(-len(z) // parts)
    files = [d / f"cuda.xz.a{chr(ord('a') + i)}" for i in range(parts)]
    for i, f in enumerate(files):
        f.write_bytes(z[i * step:(i + 1) * step])
    (d / "llama-server-cuda.eyas-build.json").write_text(json.dumps({"backend": backend, "sources": "s"}))
    return files


def test_a_build_installs_whole_from_its_parts_in_order(tmp_path, venv):
    binary = b"#!/bin/sh\necho llama-server-cuda\n" + bytes(range(256)) * 300
    files = _cuda_set(tmp_path / "d", binary, parts=3)
    # written in reverse, so a listing in the folder's own order (compgen -G gave ab ac aa here) would be wrong
    for f in reversed(files):
        data = f.read_bytes()
        f.unlink()
        f.write_bytes(data)
    r = _sh(venv, "llama_install d llama-server-cuda && llama_installed llama-server-cuda", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (venv / "bin" / "llama-server-cuda").read_bytes() == binary
    assert (venv / "bin" / "llama-server-cuda").stat().st_mode & 0o111
    assert json.loads((venv / "bin" / "llama-server-cuda.eyas-build.json").read_text())["backend"] == "cuda"
    # the CPU build: one file, its own record
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "llama-server.xz").write_bytes(lzma.compress(b"cpu build", format=lzma.FORMAT_XZ))
    (tmp_path / "c" / "llama-server.eyas-build.json").write_text(json.dumps({"backend": "cpu"}))
    r = _sh(venv, "llama_install c llama-server", tmp_path)
    assert r.returncode == 0 and (venv / "bin" / "llama-server").read_bytes() == b"cpu build", r.stdout + r.stderr


def test_a_set_that_is_not_whole_installs_nothing_and_keeps_the_build_before(tmp_path, venv):
    _cuda_set(tmp_path / "old", b"the build before", parts=1)
    assert _sh(venv, "llama_install old llama-server-cuda", tmp_path).returncode == 0
    binary = bytes(range(256)) * 300
    files = _cuda_set(tmp_path / "d", binary, parts=3)
    files[1].unlink()  # the middle part missing: the rest still starts and ends like a set
    r = _sh(venv, "llama_install d llama-server-cuda", tmp_path)
    assert r.returncode == 1 and "d/cuda.xz.aa d/cuda.xz.ac do not decompress whole" in r.stdout, r.stdout + r.stderr
    (tmp_path / "d2").mkdir()
    _cuda_set(tmp_path / "d2", binary, parts=2, backend="cpu")
    r = _sh(venv, "llama_install d2 llama-server-cuda", tmp_path)
    assert r.returncode == 1 and "names backend 'cpu', not 'cuda'" in r.stdout, r.stdout + r.stderr
    shutil.rmtree(tmp_path / "d2")
    r = _sh(venv, "llama_install d2 llama-server-cuda", tmp_path)
    assert r.returncode == 1 and r.stdout.startswith("no d2/cuda.xz.aa"), r.stdout + r.stderr
    assert (venv / "bin" / "llama-server-cuda").read_bytes() == b"the build before"
    assert sorted(p.name for p in (venv / "bin").iterdir() if p.name.startswith("llama")) == [
        "llama-server-cuda", "llama-server-cuda.eyas-build.json"]  # no .tmp left
    # negative control: the same set whole installs
    _cuda_set(tmp_path / "d", binary, parts=3)
    assert _sh(venv, "llama_install d llama-server-cuda", tmp_path).returncode == 0
    assert (venv / "bin" / "llama-server-cuda").read_bytes() == binary
