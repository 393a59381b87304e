#!/bin/bash
# Round 5, one device call on nvidia-h200 (carry .whl and .devcarry/peer_speculators.py): eyas'
# training step and the peer's at 2048/7 and 8192/7 in the SAME call, interleaved, then extraction
# (bf16 and fp8-on-device). Each piece has its own time limit so one hang does not cost the rest.
source "$(dirname "$0")/h200_lib.sh"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv >>$L 2>&1
run 130 python3 benchmarks/bench_train.py --tokens 2048 --ttt 7 --warmup 4 --steps 12 --frozen-only --modes graphs --profile 3 --out bench_train_r5_2048.json
PYTHONPATH=/tmp/site run 110 python3 .devcarry/peer_speculators.py --ttt-steps 7 --seq-len 2048 --out $OUT/peer2048_r5.json
run 90 python3 benchmarks/bench_train.py --tokens 8192 --ttt 7 --warmup 4 --steps 12 --frozen-only --modes graphs --profile 3 --skip-checks --out bench_train_r5_8192.json
PYTHONPATH=/tmp/site run 120 python3 .devcarry/peer_speculators.py --ttt-steps 7 --seq-len 8192 --doc-lens 2048,1536,1024,1024,1024,768,512,256 --out $OUT/peer8192_r5.json
run 140 python3 benchmarks/bench_extract.py --batches 96 --fp8 --out bench_extract_r5.json
echo "=== [$(date +%T)] done" | tee -a $L
