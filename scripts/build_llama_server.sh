#!/usr/bin/env bash
# Install llama.cpp from the sources vendored in the PyPI sdist of llama-cpp-python (pinned below;
# no other download):
# - `llama-server` (an OpenAI-compatible engine that serves GGUF files, EAGLE-3 drafters with
#   `--spec-type draft-eagle3`), built statically, without the web UI or HTTPS, beside pip's console
#   scripts (where `dvc` and `eyas` are): the CPU build, the default (CI's);
# - with `--cuda`, also `llama-server-cuda` beside it: the same sources built with GGML_CUDA for the GPU
#   architectures `--cuda-arch` names (default 90: H100 and H200). No GPU is needed to build it. The CUDA
#   toolkit is the one at $CUDA_HOME (else /usr/local/cuda) when it holds nvcc and cuBLAS, else the pinned
#   CUDA 13.0 wheels from PyPI (below), installed once into <python data dir>/share/eyas/cuda-13.0/;
#   the binary finds their libraries through its run path. It is built with GGML_CUDA_NO_VMM (the
#   wheels have no libcuda stub to link against; the pool then comes from cudaMalloc) and without NCCL
#   (one GPU per server);
# - llama.cpp's own HF -> GGUF converter (`convert_hf_to_gguf.py` with its `conversion/` and `gguf-py/`)
#   into `<python data dir>/share/eyas/llama.cpp/`, where eyas.export.gguf finds it.
# Each binary has a build record beside it, `<binary>.eyas-build.json` (the sdist version, the llama.cpp
# commit the sdist's CHANGELOG names, the backend, the flags, the CUDA toolkit and architectures), which
# the eval copies into every figure it serves (eyas.eval.llamacpp.build_info); a second run with the same
# record does nothing. Built for a portable CPU instruction set (GGML_NATIVE=OFF: AVX2, FMA, F16C on
# x86-64; no AVX-512 or AMX): a -march=native build dies with SIGILL at its first matmul on a VM whose CPU
# reports AVX-512 and AMX it cannot run.
#
#   bash scripts/build_llama_server.sh [--cuda] [--cuda-arch LIST] [--sources DIR] [--configure-only]
#
# --sources DIR: build from the sdist already unpacked at DIR (its PKG-INFO must name this version), for a
# machine that reaches no package index; the sdist's models/, docs/ and UI may be left out of that copy.
# --configure-only (with --cuda): configure the CUDA build, print CMake's CUDA lines, and stop (tests/ run it).
set -euo pipefail
VERSION=0.3.36
CUDA_WHEELS="nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
  nvidia-cuda-crt==13.0.88 nvidia-cublas==13.0.2.14"
CUDA=0 ARCH=90 ARCH_GIVEN=0 SOURCES="" CONFIGURE_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) CUDA=1 ;;
    --configure-only) CONFIGURE_ONLY=1 ;;
    --cuda-arch) [ $# -ge 2 ] || { echo "build_llama_server.sh: --cuda-arch needs a value (e.g. 90)" >&2; exit 2; }
                 ARCH=$2 ARCH_GIVEN=1; shift ;;
    --sources) [ $# -ge 2 ] || { echo "build_llama_server.sh: --sources needs a directory" >&2; exit 2; }
               SOURCES=$(cd "$2" 2>/dev/null && pwd) \
                 || { echo "build_llama_server.sh: --sources: no directory '$2'" >&2; exit 2; }
               grep -qxF "Version: $VERSION" "$SOURCES/PKG-INFO" 2>/dev/null || { echo "build_llama_server.sh:" \
                 "--sources $2: its PKG-INFO does not name llama-cpp-python $VERSION" >&2; exit 2; }
               [ -f "$SOURCES/CHANGELOG.md" ] || { echo "build_llama_server.sh: --sources $2: no CHANGELOG.md (the" \
                 "build record's llama.cpp commit comes from it: keep it in the copy)" >&2; exit 2; }
               shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build_llama_server.sh: unknown argument '$1' (usage: [--cuda] [--cuda-arch LIST] [--sources DIR]" \
            "[--configure-only]; --help)" >&2
       exit 2 ;;
  esac
  shift
done
[ $CONFIGURE_ONLY = 0 ] || [ $CUDA = 1 ] || { echo "build_llama_server.sh: --configure-only needs --cuda" >&2; exit 2; }
[ $ARCH_GIVEN = 0 ] || [ $CUDA = 1 ] || { echo "build_llama_server.sh: --cuda-arch needs --cuda" >&2; exit 2; }
[[ "$ARCH" =~ ^[0-9]+[a-z]?(-real|-virtual)?(\;[0-9]+[a-z]?(-real|-virtual)?)*$ ]] \
  || { echo "build_llama_server.sh: --cuda-arch '$ARCH' is not a CMAKE_CUDA_ARCHITECTURES list (e.g. 90 or '89;90')" >&2; exit 2; }
BIN_DIR=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
DATA_DIR=$(python3 -c 'import sysconfig; print(sysconfig.get_path("data"))')/share/eyas
CONVERTER_DIR=$DATA_DIR/llama.cpp
CPU_FLAGS="-DGGML_NATIVE=OFF"
CUDA_FLAGS="-DGGML_NATIVE=OFF -DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON -DGGML_CUDA_NCCL=OFF -DCMAKE_CUDA_ARCHITECTURES=$ARCH"

# the build record: what the eval copies beside every served figure
record() {  # record BACKEND FLAGS TOOLKIT -> JSON on stdout (TOOLKIT: "" on CPU)
  python3 - "$VERSION" "${COMMIT:-unknown}" "$1" "$2" "$3" <<'EOF'
import json, sys
version, commit, backend, flags, toolkit = sys.argv[1:]
print(json.dumps({"sources": f"llama-cpp-python=={version} (sdist, vendor/llama.cpp)",
                  "llama_cpp_commit": commit, "backend": backend, "cmake_flags": flags,
                  "cuda_toolkit": toolkit or None}, sort_keys=True))
EOF
}
built_as() { cat "$BIN_DIR/$1.eyas-build.json" 2>/dev/null || true; }
cpu_ok() { [ -x "$BIN_DIR/llama-server" ] && [ -n "$(built_as llama-server)" ] \
           && python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); sys.exit(r["cmake_flags"]!=sys.argv[2] or
              not r["sources"].startswith("llama-cpp-python=="+sys.argv[3]+" "))' \
              "$BIN_DIR/llama-server.eyas-build.json" "$CPU_FLAGS" "$VERSION"; }
cuda_ok() { [ -x "$BIN_DIR/llama-server-cuda" ] && [ -n "$(built_as llama-server-cuda)" ] \
           && python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); sys.exit(r["cmake_flags"]!=sys.argv[2] or
              not r["sources"].startswith("llama-cpp-python=="+sys.argv[3]+" "))' \
              "$BIN_DIR/llama-server-cuda.eyas-build.json" "$CUDA_FLAGS" "$VERSION"; }
converter_ok() { [ "$(cat "$CONVERTER_DIR/eyas-version" 2>/dev/null)" = "$VERSION" ]; }
if [ $CONFIGURE_ONLY = 0 ] && cpu_ok && converter_ok && { [ $CUDA = 0 ] || cuda_ok; }; then
  exit 0
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ -z "$SOURCES" ]; then
  python3 -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$WORK"
  tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
  SOURCES=$WORK/llama_cpp_python-$VERSION
fi
SRC="$SOURCES/vendor/llama.cpp"
# the sdist carries no git history: the commit is the one its CHANGELOG names for this version
COMMIT=$(awk -v v="## [$VERSION]" '$0==v {f=1; next} /^## \[/ {f=0} f && match($0, /ggml-org\/llama\.cpp@[0-9a-f]+/) \
  {print substr($0, RSTART+19, RLENGTH-19); exit}' "$SOURCES/CHANGELOG.md")
[ -n "$COMMIT" ] || echo "build_llama_server.sh: warning: $SOURCES/CHANGELOG.md names no llama.cpp commit under" \
  "## [$VERSION]: the build record says unknown" >&2

if [ $CONFIGURE_ONLY = 0 ] && ! converter_ok; then
  rm -rf "$CONVERTER_DIR.tmp" && mkdir -p "$CONVERTER_DIR.tmp"
  cp -r "$SRC/convert_hf_to_gguf.py" "$SRC/conversion" "$SRC/gguf-py" "$SRC/LICENSE" "$CONVERTER_DIR.tmp/"
  echo "$VERSION" > "$CONVERTER_DIR.tmp/eyas-version"
  rm -rf "$CONVERTER_DIR" && mv "$CONVERTER_DIR.tmp" "$CONVERTER_DIR"
fi

COMMON="-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF"
build() {  # build NAME FLAGS TOOLKIT [EXTRA CMAKE ARGS...]: configure, build, install NAME + its record
  local name=$1 flags=$2 toolkit=$3; shift 3
  # shellcheck disable=SC2086
  cmake -S "$SRC" -B "$WORK/build-$name" $COMMON $flags "$@" > "$WORK/cmake-$name.log" 2>&1 \
    || { tail -40 "$WORK/cmake-$name.log"; exit 1; }  # its warnings (no web UI: none is built) stay in the log
  if [ $CONFIGURE_ONLY = 1 ]; then
    grep -i "cuda" "$WORK/cmake-$name.log"; echo "configured: $name ($toolkit)"; exit 0
  fi
  cmake --build "$WORK/build-$name" --target llama-server -j "$(nproc)" > "$WORK/build-$name.log" 2>&1 \
    || { tail -40 "$WORK/build-$name.log"; exit 1; }
  install -m 755 "$WORK/build-$name/bin/llama-server" "$BIN_DIR/$name.tmp"
  mv "$BIN_DIR/$name.tmp" "$BIN_DIR/$name"
  record "$([ "$name" = llama-server ] && echo cpu || echo cuda)" "$flags" "$toolkit" > "$BIN_DIR/$name.eyas-build.json"
  rm -f "$BIN_DIR/$name.eyas-version"  # the record's predecessor
}

[ $CONFIGURE_ONLY = 1 ] || cpu_ok || build llama-server "$CPU_FLAGS" ""

if [ $CUDA = 1 ] && { [ $CONFIGURE_ONLY = 1 ] || ! cuda_ok; }; then
  # the toolkit: a local one with nvcc and cuBLAS, else the pinned wheels (no GPU needed either way)
  LOCAL=${CUDA_HOME:-/usr/local/cuda}
  if [ -x "$LOCAL/bin/nvcc" ] && [ -f "$LOCAL/include/cublas_v2.h" ] \
     && ls "$LOCAL"/lib*/libcublas.so >/dev/null 2>&1; then
    TK=$LOCAL TOOLKIT="local $LOCAL, $("$LOCAL/bin/nvcc" --version | grep -o 'V[0-9][0-9.]*' | head -1)"
  else
    TK=$DATA_DIR/cuda-13.0/nvidia/cu13
    if [ ! -x "$TK/bin/nvcc" ] || [ "$(cat "$DATA_DIR/cuda-13.0/eyas-wheels" 2>/dev/null)" != "$CUDA_WHEELS" ]; then
      rm -rf "$DATA_DIR/cuda-13.0.tmp"
      # shellcheck disable=SC2086
      python3 -m pip install -q --disable-pip-version-check --no-deps --target "$DATA_DIR/cuda-13.0.tmp" $CUDA_WHEELS
      echo "$CUDA_WHEELS" > "$DATA_DIR/cuda-13.0.tmp/eyas-wheels"
      rm -rf "$DATA_DIR/cuda-13.0" && mv "$DATA_DIR/cuda-13.0.tmp" "$DATA_DIR/cuda-13.0"
    fi
    for l in cudart cublas cublasLt; do ln -sf "lib$l.so.13" "$TK/lib/lib$l.so"; done  # the linker's names
    ln -sfn lib "$TK/lib64"  # where nvcc's profile looks for the runtime
    TOOLKIT="PyPI wheels: $(echo $CUDA_WHEELS)"
  fi
  build llama-server-cuda "$CUDA_FLAGS" "$TOOLKIT" -DCMAKE_CUDA_COMPILER="$TK/bin/nvcc" -DCUDAToolkit_ROOT="$TK" \
    -DCMAKE_BUILD_RPATH="$(cd "$TK" && pwd -P)/$([ -d "$TK/lib64" ] && echo lib64 || echo lib)"  # installed: the build tree's
fi
