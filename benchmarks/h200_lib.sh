# Sourced by the round-5 and round-6 device drivers (run_h200_r5*.sh, run_h200_r6*.sh): environment, log file, the peer's
# wheels (carried in .whl) and run LIMIT CMD... (its own time limit; the full output goes to the
# log under $OUT, the result lines to stdout).
set +e
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
L=$OUT/log.txt
run() { local lim=$1; shift; echo "=== [$(date +%T)] $*" | tee -a $L; timeout $lim "$@" 2>&1 | grep -v "Warning\|warn\|softmax\|reduction\|^$" | tee -a $L | grep "^eyas\|^head loss\|^merge\|vs dense\|vs eager\|^ *[0-9]\|Error\|bare\|e2e\|done in\|passed\|failed" | cut -c1-400; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>$L 2>&1
