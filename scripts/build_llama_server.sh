#!/usr/bin/env bash
# Install llama.cpp from the sources vendored in the PyPI sdist of llama-cpp-python (pinned below;
# no other download):
# - `llama-server` (an OpenAI-compatible engine that serves GGUF files on CPU, EAGLE-3 drafters with
#   `--spec-type draft-eagle3`), built statically, without the web UI or HTTPS, beside pip's console
#   scripts (where `dvc` and `eyas` are);
# - llama.cpp's own HF -> GGUF converter (`convert_hf_to_gguf.py` with its `conversion/` and `gguf-py/`)
#   into `<python data dir>/share/eyas/llama.cpp/`, where eyas.export.gguf finds it.
# Each part carries a stamp naming the version; a second run with the same version does nothing.
# Built for a portable instruction set (GGML_NATIVE=OFF: AVX2, FMA, F16C on x86-64; no AVX-512 or
# AMX): a -march=native build dies with SIGILL at its first matmul on a VM whose CPU reports
# AVX-512 and AMX it cannot run. The stamp names the flags, so a binary built the old way is rebuilt.
set -euo pipefail
VERSION=0.3.36
STAMP="$VERSION GGML_NATIVE=OFF"
BIN_DIR=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
CONVERTER_DIR=$(python3 -c 'import sysconfig; print(sysconfig.get_path("data"))')/share/eyas/llama.cpp
server_ok() { [ -x "$BIN_DIR/llama-server" ] && [ "$(cat "$BIN_DIR/llama-server.eyas-version" 2>/dev/null)" = "$STAMP" ]; }
converter_ok() { [ "$(cat "$CONVERTER_DIR/eyas-version" 2>/dev/null)" = "$VERSION" ]; }
if server_ok && converter_ok; then
  exit 0
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
  "llama-cpp-python==$VERSION" -d "$WORK"
tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
if ! converter_ok; then
  rm -rf "$CONVERTER_DIR.tmp" && mkdir -p "$CONVERTER_DIR.tmp"
  cp -r "$SRC/convert_hf_to_gguf.py" "$SRC/conversion" "$SRC/gguf-py" "$SRC/LICENSE" "$CONVERTER_DIR.tmp/"
  echo "$VERSION" > "$CONVERTER_DIR.tmp/eyas-version"
  rm -rf "$CONVERTER_DIR" && mv "$CONVERTER_DIR.tmp" "$CONVERTER_DIR"
fi
if ! server_ok; then
  cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF > "$WORK/cmake.log" 2>&1 \
    || { tail -40 "$WORK/cmake.log"; exit 1; }  # its warnings (no web UI: none is built) stay in the log
  cmake --build "$WORK/build" --target llama-server -j "$(nproc)" > "$WORK/build.log" 2>&1 \
    || { tail -40 "$WORK/build.log"; exit 1; }
  install -m 755 "$WORK/build/bin/llama-server" "$BIN_DIR/llama-server"
  echo "$STAMP" > "$BIN_DIR/llama-server.eyas-version"
fi
