"""scripts/build_llama_server.sh: its arguments, and the CUDA build's configure step where a toolkit is here.

The configure step runs CMake on the pinned sources with GGML_CUDA (no GPU needed) against the toolkit the
script picks: a local one with nvcc and cuBLAS, else the pinned CUDA 13.0 wheels once they are installed
under the Python data dir (``bash scripts/build_llama_server.sh --cuda`` installs them; the test does not
download them). The negative controls: an architecture list CMake would not take, and a sources directory
of another version, are refused before anything runs.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_llama_server.sh"
WHEELS = Path(sysconfig.get_path("data")) / "share" / "eyas" / "cuda-13.0" / "nvidia" / "cu13"


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, says", [
    (["--bogus"], "unknown argument '--bogus'"),
    (["--cuda", "--cuda-arch", "sm_90"], "--cuda-arch 'sm_90' is not a CMAKE_CUDA_ARCHITECTURES list"),
    (["--cuda", "--cuda-arch"], "--cuda-arch needs a value"),
    (["--configure-only"], "--configure-only needs --cuda"),
    (["--cuda-arch", "89;90"], "--cuda-arch needs --cuda"),
    (["--sources", "/nonexistent-eyas-dir"], "--sources: no directory"),
])
def test_bad_arguments_are_refused_by_name(args, says):
    r = _run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert says in r.stderr, r.stderr


def test_sources_of_another_version_are_refused(tmp_path):
    (tmp_path / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 0.3.35\n")
    r = _run("--sources", str(tmp_path))
    assert r.returncode == 2 and "does not name llama-cpp-python 0.3.36" in r.stderr, r.stderr
    (tmp_path / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 0.3.36\n")
    r = _run("--sources", str(tmp_path))  # the right version passes that check; the commit's source is missing
    assert r.returncode == 2 and "no CHANGELOG.md" in r.stderr and "does not name" not in r.stderr, r.stderr
    (tmp_path / "CHANGELOG.md").write_text("## [0.3.36]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098\n")
    r = _run("--sources", str(tmp_path), "--cuda", "--cuda-arch", "x")
    assert "CHANGELOG" not in r.stderr and "--cuda-arch 'x'" in r.stderr, r.stderr


def _toolkit() -> str | None:
    local = Path("/usr/local/cuda")
    if (local / "bin" / "nvcc").is_file() and (local / "include" / "cublas_v2.h").is_file() \
            and any(local.glob("lib*/libcublas.so")):
        return "local"
    if (WHEELS / "bin" / "nvcc").is_file():
        return "wheels"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_toolkit() is None or shutil.which("cmake") is None,
                    reason="no CUDA toolkit here (nvcc + cuBLAS, or the pinned wheels: "
                           "bash scripts/build_llama_server.sh --cuda installs them) or no cmake")
def test_the_cuda_build_configures_without_a_gpu():
    r = _run("--cuda", "--configure-only", timeout=900)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert "Including CUDA backend" in r.stdout, r.stdout
    assert "Using CMAKE_CUDA_ARCHITECTURES=90" in r.stdout, r.stdout
    assert "configured: llama-server-cuda (" + ("local" if _toolkit() == "local" else "PyPI wheels") in r.stdout


def test_help_prints_the_usage_and_builds_nothing():
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    usage = "bash scripts/build_llama_server.sh [--cuda] [--cuda-arch LIST] [--sources DIR] [--configure-only]"
    assert usage in r.stdout, r.stdout
