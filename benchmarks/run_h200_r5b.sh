#!/bin/bash
# Round 5, second call (nvidia-h200; carry .whl and .devcarry/peer_speculators.py): after the
# merge of diagonal keys became one dynamic-width graph and graph replays write gradients instead
# of zeroing + accumulating, eyas and the peer again in the SAME call at 2048/7 and 8192/7; then
# the GPU tests of eyas/graphed.py (a whole train_drafter run with graphs vs eager).
source "$(dirname "$0")/h200_lib.sh"
run 120 python3 benchmarks/bench_train.py --tokens 2048 --ttt 7 --warmup 4 --steps 12 --frozen-only --modes graphs --profile 3 --out bench_train_r5b_2048.json
PYTHONPATH=/tmp/site run 105 python3 .devcarry/peer_speculators.py --ttt-steps 7 --seq-len 2048 --out $OUT/peer2048_r5b.json
run 75 python3 benchmarks/bench_train.py --tokens 8192 --ttt 7 --warmup 4 --steps 12 --frozen-only --modes graphs --profile 3 --skip-checks --out bench_train_r5b_8192.json
PYTHONPATH=/tmp/site run 118 python3 .devcarry/peer_speculators.py --ttt-steps 7 --seq-len 8192 --doc-lens 2048,1536,1024,1024,1024,768,512,256 --out $OUT/peer8192_r5b.json
run 50 python3 -m pytest -q -x -p no:cacheprovider --tb=short -W ignore tests/test_graphed.py
echo "=== [$(date +%T)] done" | tee -a $L
