#!/bin/bash
# Round 4, second call (nvidia-h200; carry .whl and .devcarry/peer_speculators.py): the 2048-token
# CUDA-graph step and the peer at 2048 in the SAME call (the first call's peer runs hit their limits).
set +e
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
L=$OUT/log.txt
run() { local lim=$1; shift; echo "=== [$(date +%T)] $*" | tee -a $L; timeout $lim "$@" 2>&1 | grep -v Warning | tee -a $L | tail -8; }
run 70 python3 benchmarks/bench_train.py --tokens 2048 --ttt 7 --warmup 4 --steps 12 --frozen-only --modes graphs --skip-checks --out bench_train_r4b.json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>$L 2>&1
PYTHONPATH=/tmp/site run 175 python3 .devcarry/peer_speculators.py --ttt-steps 7 --seq-len 2048 --out $OUT/peer2048_r4b.json
echo "=== [$(date +%T)] done" | tee -a $L
