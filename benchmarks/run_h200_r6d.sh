#!/bin/bash
# Round 6, fourth call (nvidia-h200; carry as r6c): the final code against the peer in the SAME
# call at 8192/7 (eyas profiled), the peer with 270 s.
source "$(dirname "$0")/h200_lib.sh"
run 100 python3 benchmarks/bench_train.py --tokens 8192 --ttt 7 --warmup 4 --steps 12 --frozen-only --modes graphs --profile 3 --skip-checks --out bench_train_r6d_8192.json
PYTHONPATH=/tmp/site run 270 python3 .devcarry/peer_speculators.py --ttt-steps 7 --seq-len 8192 --doc-lens 2048,1536,1024,1024,1024,768,512,256 --out $OUT/peer8192_r6d.json
echo "=== [$(date +%T)] done" | tee -a $L
