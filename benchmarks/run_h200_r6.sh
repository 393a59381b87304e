#!/bin/bash
# Round 6, first call (nvidia-h200; carry .whl and .devcarry/peer_speculators.py): after the head
# loss makes its logits' gradient in its forward (eyas/head_loss.py) and RoPE's cos/sin are made
# once per step outside the compiled layer: the GPU tests of both, eyas at 2048/7 (with the
# flex-vs-dense and graph-vs-eager checks) and 8192/7 (profiled), and the peer at 8192/7.
source "$(dirname "$0")/h200_lib.sh"
run 100 python3 -m pytest -q -x -p no:cacheprovider --tb=short -W ignore tests/test_head_loss.py tests/test_graphed.py tests/test_ttt.py
run 130 python3 benchmarks/bench_train.py --tokens 2048 --ttt 7 --warmup 4 --steps 12 --frozen-only --modes graphs --out bench_train_r6_2048.json
run 90 python3 benchmarks/bench_train.py --tokens 8192 --ttt 7 --warmup 4 --steps 12 --frozen-only --modes graphs --profile 3 --skip-checks --out bench_train_r6_8192.json
PYTHONPATH=/tmp/site run 150 python3 .devcarry/peer_speculators.py --ttt-steps 7 --seq-len 8192 --doc-lens 2048,1536,1024,1024,1024,768,512,256 --out $OUT/peer8192_r6.json
echo "=== [$(date +%T)] done" | tee -a $L
