#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (an OpenAI-compatible engine that serves GGUF files on CPU) for
# tests/test_serving.py, from the llama.cpp sources vendored in the PyPI sdist of llama-cpp-python
# (pinned below; no other download). Only the server target is built, statically linked, without
# the web UI or HTTPS. The binary goes beside pip's console scripts (where `dvc` and `eyas` are),
# with a stamp naming the version; a second run with the same version does nothing.
# Measured on 2 shared CPU cores: see README.md (Self-distill through a server).
# Built for a portable instruction set (GGML_NATIVE=OFF: AVX2, FMA, F16C on x86-64; no AVX-512 or
# AMX): a -march=native build died with SIGILL (exit 132) at its first matmul on a VM whose CPU
# reports AVX-512 and AMX (2026-12-02), failing tests/test_serving.py. The stamp names the flags,
# so a binary built the old way is rebuilt.
set -euo pipefail
VERSION=0.3.36
STAMP="$VERSION GGML_NATIVE=OFF"
BIN_DIR=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
if [ -x "$BIN_DIR/llama-server" ] && [ "$(cat "$BIN_DIR/llama-server.eyas-version" 2>/dev/null)" = "$STAMP" ]; then
  exit 0
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
  "llama-cpp-python==$VERSION" -d "$WORK"
tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF > "$WORK/cmake.log"
cmake --build "$WORK/build" --target llama-server -j "$(nproc)" > "$WORK/build.log" \
  || { tail -40 "$WORK/build.log"; exit 1; }
install -m 755 "$WORK/build/bin/llama-server" "$BIN_DIR/llama-server"
echo "$STAMP" > "$BIN_DIR/llama-server.eyas-version"
