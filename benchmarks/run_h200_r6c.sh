#!/bin/bash
# Round 6, third call (nvidia-h200; carry .whl and .devcarry/peer_speculators.py): the final code
# (autotuned Triton kernels, strided merge with o in o_proj's layout, no fp32 round trip of the
# aux states) against the peer in the SAME call at 2048/7, after the GPU tests and the kernel
# benchmark. The peer gets 240 s: its imports + compile took 105-150 s on earlier machines.
source "$(dirname "$0")/h200_lib.sh"
run 150 python3 -m pytest -q -x -p no:cacheprovider --tb=short -W ignore tests/test_triton_ttt.py tests/test_head_loss.py tests/test_graphed.py tests/test_ttt.py
if tail -n 3 $L | grep -q "failed\|rror"; then export EYAS_TRITON=0; echo "GPU tests failed: EYAS_TRITON=0 from here" | tee -a $L; fi
run 60 python3 benchmarks/bench_kernels.py --out bench_kernels_r6c.json
run 120 python3 benchmarks/bench_train.py --tokens 2048 --ttt 7 --warmup 4 --steps 12 --frozen-only --modes graphs --profile 3 --out bench_train_r6c_2048.json
PYTHONPATH=/tmp/site run 240 python3 .devcarry/peer_speculators.py --ttt-steps 7 --seq-len 2048 --out $OUT/peer2048_r6c.json
echo "=== [$(date +%T)] done" | tee -a $L
