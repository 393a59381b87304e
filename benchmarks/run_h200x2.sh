#!/bin/bash
# One device call on nvidia-h200-x2 (carry .whl and .devcarry): multi-GPU figures + perf round 2.
# Each piece has its own time limit so one hang does not cost the rest.
set +e
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
L=$OUT/log.txt
nvidia-smi --query-gpu=name,memory.total --format=csv >>$L 2>&1
nvidia-smi topo -m >>$L 2>&1
run() { local lim=$1; shift; echo "=== [$(date +%T)] $*" | tee -a $L; timeout $lim "$@" 2>&1 | grep -v Warning | tee -a $L | tail -40; }
T=python3
run 110 $T benchmarks/bench_train.py --tokens 2048 8192 --ttt 7 --warmup 4 --steps 12 --frozen-only --out bench_train_r2.json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>$L 2>&1
PYTHONPATH=/tmp/site run 90 $T .devcarry/peer_speculators.py --ttt-steps 7 --seq-len 2048 --out $OUT/peer2048_r2.json
run 90 $T benchmarks/bench_ddp.py --out ddp_w1.json
run 100 $T -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_ddp.py --out ddp_w2.json
run 55 $T benchmarks/bench_extract_multi.py --mode data --out extract_w1.json
run 65 $T -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_extract_multi.py --mode data --out extract_w2.json
run 45 $T benchmarks/bench_extract_multi.py --mode split --out extract_split.json
echo "=== [$(date +%T)] done" | tee -a $L
