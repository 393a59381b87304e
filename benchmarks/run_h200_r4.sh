#!/bin/bash
# Round 4, one device call on nvidia-h200 (carry .whl and .devcarry): the CUDA-graph training step
# and the peer in the SAME call, then extraction with the direct shard writer.
# Each piece has its own time limit so one hang does not cost the rest.
set +e
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
L=$OUT/log.txt
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv >>$L 2>&1
run() { local lim=$1; shift; echo "=== [$(date +%T)] $*" | tee -a $L; timeout $lim "$@" 2>&1 | grep -v Warning | tee -a $L | tail -25; }
T=python3
# (tests/test_graphed.py runs on CUDA too: bench_train.py check_graph covers the 8B shape)
run 200 $T benchmarks/bench_train.py --tokens 2048 8192 --ttt 7 --warmup 4 --steps 12 --frozen-only --out bench_train_r4.json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>$L 2>&1
PYTHONPATH=/tmp/site run 100 $T .devcarry/peer_speculators.py --ttt-steps 7 --seq-len 2048 --out $OUT/peer2048_r4.json
PYTHONPATH=/tmp/site run 112 $T .devcarry/peer_speculators.py --ttt-steps 7 --seq-len 8192 --doc-lens 2048,1536,1024,1024,1024,768,512,256 --out $OUT/peer8192_r4.json
run 90 $T benchmarks/bench_extract.py --batches 48 --out bench_extract_r4.json
echo "=== [$(date +%T)] done" | tee -a $L
