#!/bin/bash
# Round 6, second call (nvidia-h200): the Triton head-loss and diagonal-merge kernels
# (eyas/triton_ttt.py): their GPU tests, the kernel benchmark against the torch.compile'd
# definitions, then eyas' training step at 2048/7 (with the flex-vs-dense and graph-vs-eager
# checks) and 8192/7 (profiled).
source "$(dirname "$0")/h200_lib.sh"
run 150 python3 -m pytest -q -x -p no:cacheprovider --tb=short -W ignore tests/test_triton_ttt.py tests/test_head_loss.py tests/test_graphed.py tests/test_ttt.py
run 100 python3 benchmarks/bench_kernels.py --out bench_kernels_r6.json
run 130 python3 benchmarks/bench_train.py --tokens 2048 --ttt 7 --warmup 4 --steps 12 --frozen-only --modes graphs --out bench_train_r6b_2048.json
run 90 python3 benchmarks/bench_train.py --tokens 8192 --ttt 7 --warmup 4 --steps 12 --frozen-only --modes graphs --profile 3 --skip-checks --out bench_train_r6b_8192.json
echo "=== [$(date +%T)] done" | tee -a $L
