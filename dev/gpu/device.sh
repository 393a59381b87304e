#!/usr/bin/env bash
# One benchmark recipe per device call on a lent GPU machine: run from the repository root; the
# machine has no package registry and returns what is written under $OUT (results JSON + log.txt).
#
#   bash dev/gpu/device.sh RECIPE [ARG]
#
#   gpu-tests         the `gpu`-marked tests (python3 -m pytest -m gpu); 2 GPUs for the NCCL ones
#   kernels           Triton kernels' GPU tests, then bench_kernels.py            -> kernels.json
#   train 2048|8192   eyas' TTT step (lm_head trainable and frozen; batch on the GPU, in pageable and in
#                     pinned host memory, and pinned by the prefetch thread), then the peer's (its train_epoch loop body and its real
#                     Trainer.train_epoch, log_freq 1000 and 1), in the SAME call  -> train_<T>.json, peer_<T>.json,
#                     gpu_eyas_<T>.csv, gpu_peer_<T>.csv (SM clock, power, temperature, utilisation every 0.5 s)
#   specforge 2048|8192  the second peer, SpecForge's EAGLE-3 trainer (peer_specforge.py: one document of T
#                     tokens per step, lm_head trainable), after eyas' step at T (lm_head trainable and
#                     frozen, batch on the GPU and pageable) in the SAME call      -> train_sf_<T>.json,
#                     peer_specforge_<T>.json, gpu_eyas_sf_<T>.csv, gpu_specforge_<T>.csv
#   wgrad             bench_wgrad.py: the 7 TTT steps' weight-gradient sum, bf16 adds vs fp32 in-GEMM
#                     accumulation vs one GEMM over all steps                      -> wgrad.json
#   flex              bench_flex.py: the step-0 flex attention (fwd + bwd) under kernel settings -> flex.json
#   swiglu            bench_swiglu.py: the SwiGLU forward + backward, Inductor vs a plain Triton kernel -> swiglu.json
#   lm-head           eyas' TTT step at 2048 and 8192 tokens, lm_head trainable and frozen (the peer
#                     freezes it: no peer run)                                   -> train_lm_head.json
#   extract           bench_extract.py, bf16 and fp8 aux states, 96 batches         -> extract.json
#   eval              bench_eval.py (chain step vs decode), profile_eval_gpu.py     -> eval_step.json, eval_profile.json
#   decode            bench_decode.py: the target's decode, transformers' vs eyas' graphed, same call: self-distill
#                     tok/s at batch 64 and 256, the batch-1 decode/verify step of the 135M and an 8B-shaped
#                     target                                                      -> decode_selfdistill.json, decode_step.json
#   ddp               (2 GPUs) DDP weak scaling and multi-GPU extraction            -> ddp_w{1,2}.json, extract_{w1,w2,split}.json
#   online            bench_online.py: train.mode online vs extract + train (2 GPUs: + target on cuda:1) -> online_h200.json
#   scale N [PART]    (N = 2, 4 or 8 GPUs) PART ddp or fsdp: bench_ddp.py at W = 1, 2, .., N (weak scaling at
#                     8,192 tokens/GPU, then 10 losses of one 8-row global batch) -> scale_<PART>_w<W>.json;
#                     PART extract: bench_extract_multi.py data-sharded at W = 1 and N -> scale_extract_w{1,N}.json,
#                     and (N >= 4) a 70B-shaped target split over 4 GPUs -> scale_extract_split70b.json.
#                     No PART: all three (over 10 min at N = 8: one call per part there)
#   profile STEP ...  the GPU profile of presets/h200.yaml (dev/gpu/h200_profile.sh: park, setup, run, keep, restore;
#                     the lever runs: setup --lever, variant, evals, engine, distilled)
#
# Carried files (the device `run` tool's `carry`; git-ignored, made on the workstation):
#   .devcarry/w/  eyas' own dependencies the device lacks (ruamel.yaml: eyas/yaml12.py), installed with
#           --no-deps into /tmp/eyas-deps when the device cannot import them:
#           pip download --no-deps -d .devcarry/w ruamel.yaml==0.19.1
#   .whl/   train and specforge only: the peer's wheels, installed with --no-deps into /tmp/site
#           (dev/README.md, "The peer", says how to make it), and in .whl/specforge/ the second
#           peer's, into /tmp/site-sf ("The second peer"); without them a peer is skipped and says so.
# Each piece has its own time limit, so one hang does not cost the rest of the call; each prints its
# time and exit status when it ends. The full output goes to $OUT/log.txt and the result lines to stdout.
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
LOG=$OUT/log.txt

step() {  # step LIMIT_S CMD...: run CMD under its own time limit, then say how long it took
  local lim=$1 t0=$SECONDS rc; shift
  echo "=== [$(date +%T)] $*" | tee -a "$LOG"
  timeout "$lim" "$@" 2>&1 | grep -v "Warning\|warn(\|^$" | tee -a "$LOG" \
    | grep "^eyas\|^peer\|^head loss\|^merge\|vs dense\|vs eager\|bare\|e2e\|Error\|passed\|failed\|skipped\|tok/s\|^decode step" \
    | cut -c1-400
  rc=${PIPESTATUS[0]}
  echo "--- $((SECONDS - t0)) s (limit $lim s), exit $rc$([ "$rc" = 124 ] && echo ': time limit reached')" | tee -a "$LOG"
}

gpu_log() {  # gpu_log NAME: sample the GPU's SM clock, power, temperature, utilisation into $OUT/gpu_NAME.csv
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -lms 500 >"$OUT/gpu_$1.csv" 2>&1 &
  GPU_LOG_PID=$!
}

gpu_log_stop() {  # ends the sampler gpu_log started (by its process id)
  [ -n "${GPU_LOG_PID:-}" ] && { kill "$GPU_LOG_PID" 2>/dev/null; wait "$GPU_LOG_PID" 2>/dev/null; }
  GPU_LOG_PID=
}

peer_wheels() {  # install the carried peer wheels; fails (and says why) when they are absent
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "peer skipped: no .whl/*.whl carried (dev/README.md, 'The peer')" | tee -a "$LOG"; return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >>"$LOG" 2>&1
  PYTHONPATH=/tmp/site:${PYTHONPATH:-} python3 -c "import speculators.train.trainer" >>"$LOG" 2>&1 \
    || { echo "peer skipped: speculators does not import with the carried wheels (see $LOG)" | tee -a "$LOG"; return 1; }
}

specforge_wheels() {  # the second peer: .whl/specforge/ into /tmp/site-sf, beside /tmp/site (its pydantic, datasets, ...)
  peer_wheels || return 1
  if ! ls .whl/specforge/*.whl >/dev/null 2>&1; then
    echo "SpecForge skipped: no .whl/specforge/*.whl carried (dev/README.md, 'The second peer')" | tee -a "$LOG"
    return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-sf \
    .whl/specforge/*.whl >>"$LOG" 2>&1
  PYTHONPATH=/tmp/site-sf:/tmp/site:${PYTHONPATH:-} python3 -c \
    "import accelerate.utils, specforge.training.trainer, specforge.algorithms.eagle3.model" >>"$LOG" 2>&1 \
    || { echo "SpecForge skipped: it does not import with the carried wheels (see $LOG)" | tee -a "$LOG"; return 1; }
}

eyas_deps() {  # eyas' own dependencies the device lacks, from .devcarry/w (eyas.params reads params with ruamel.yaml)
  python3 -c "import ruamel.yaml" 2>/dev/null && return 0
  if ! ls .devcarry/w/*.whl >/dev/null 2>&1; then
    echo "ruamel.yaml does not import here: carry .devcarry/w with its wheel (this file's header)" | tee -a "$LOG"; exit 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/eyas-deps .devcarry/w/*.whl >>"$LOG" 2>&1
  export PYTHONPATH=/tmp/eyas-deps${PYTHONPATH:+:$PYTHONPATH}
}

nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv >>"$LOG" 2>&1
recipe=${1:-}; shift || true
case "$recipe" in gpu-tests|kernels|wgrad|flex|swiglu|train|specforge|lm-head|extract|eval|ddp|online|scale) eyas_deps ;; esac  # profile: its setup installs them
case "$recipe" in
  gpu-tests)
    step 540 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore -m gpu $(grep -rl --include="test_*.py" "mark.gpu" tests) ;;  # the files with gpu tests: the device has no mlflow/dvc to collect the rest
  wgrad)
    step 120 python3 dev/bench/bench_wgrad.py --out wgrad.json ;;
  flex)
    step 420 python3 dev/bench/bench_flex.py --out flex.json ;;
  swiglu)
    step 180 python3 dev/bench/bench_swiglu.py --out swiglu.json ;;
  kernels)
    step 150 python3 -m pytest -q -x -p no:cacheprovider --tb=short -W ignore tests/drafter/test_triton_ttt.py tests/drafter/test_head_loss.py
    step 100 python3 dev/bench/bench_kernels.py --out kernels.json ;;
  train)
    T=${1:?usage: device.sh train 2048|8192}
    case "$T" in  # each piece's limit (s); the flex/graph checks at 2048 only
      2048) checks=(); eyas_s=260; peer_s=240 ;;
      8192) checks=(--skip-checks); eyas_s=230; peer_s=320 ;;
      *) echo "train: tokens per step must be 2048 or 8192, got $T" >&2; exit 2 ;;
    esac
    gpu_log "eyas_$T"
    step "$eyas_s" python3 benchmarks/bench_train.py --tokens "$T" --ttt 7 --warmup 4 --steps 12 --modes graphs \
      --batch-on device host-pinned host host-prefetched --profile 3 "${checks[@]}" --out "$OUT/train_$T.json"
    gpu_log_stop
    # the peer compiles for 60-90 s before its first timed step: it gets the longer limit
    if peer_wheels; then
      gpu_log "peer_$T"
      PYTHONPATH=/tmp/site:${PYTHONPATH:-} step "$peer_s" python3 dev/bench/peer_speculators.py --ttt-steps 7 --seq-len "$T" \
        --out "peer_$T.json"
      gpu_log_stop
    fi ;;
  specforge)
    T=${1:?usage: device.sh specforge 2048|8192}
    case "$T" in 2048|8192) ;; *) echo "specforge: tokens per step must be 2048 or 8192, got $T" >&2; exit 2 ;; esac
    gpu_log "eyas_sf_$T"
    step 130 python3 benchmarks/bench_train.py --tokens "$T" --ttt 7 --warmup 4 --steps 12 --modes graphs \
      --batch-on device host --skip-checks --out "$OUT/train_sf_$T.json"
    gpu_log_stop
    if specforge_wheels; then  # its first log window (50 steps) includes compilation
      gpu_log "specforge_$T"
      PYTHONPATH=/tmp/site-sf:/tmp/site:${PYTHONPATH:-} step 330 python3 dev/bench/peer_specforge.py --tokens "$T" \
        --out "peer_specforge_$T.json"
      gpu_log_stop
    fi ;;
  lm-head)
    step 470 python3 benchmarks/bench_train.py --tokens 2048 8192 --ttt 7 --warmup 4 --steps 12 --modes graphs \
      --profile 3 --skip-checks --out "$OUT/train_lm_head.json" ;;
  extract)
    step 150 python3 benchmarks/bench_extract.py --batches 96 --fp8 --out "$OUT/extract.json" ;;
  decode)
    step 200 python3 benchmarks/bench_decode.py --parts selfdistill --out-selfdistill "$OUT/decode_selfdistill.json"
    step 200 python3 benchmarks/bench_decode.py --parts step --out-step "$OUT/decode_step.json" ;;
  eval)
    step 120 python3 benchmarks/bench_eval.py --out "$OUT/eval_step.json"
    step 240 python3 dev/bench/profile_eval_gpu.py ;;
  ddp)
    step 90 python3 dev/bench/bench_ddp.py --out ddp_w1.json
    step 100 python3 -m torch.distributed.run --standalone --nproc-per-node 2 dev/bench/bench_ddp.py --out ddp_w2.json
    step 55 python3 dev/bench/bench_extract_multi.py --mode data --out extract_w1.json
    step 65 python3 -m torch.distributed.run --standalone --nproc-per-node 2 dev/bench/bench_extract_multi.py \
      --mode data --out extract_w2.json
    step 45 python3 dev/bench/bench_extract_multi.py --mode split --out extract_split.json ;;
  online)
    step 560 python3 dev/bench/bench_online.py --out online_h200.json ;;
  scale)
    N=${1:?usage: device.sh scale 2|4|8 [ddp|fsdp|extract]}; shift || true
    case "$N" in 2|4|8) ;; *) echo "scale: N must be 2, 4 or 8 GPUs, got $N" >&2; exit 2 ;; esac
    have=$(nvidia-smi -L | wc -l)
    [ "$have" -ge "$N" ] || { echo "scale $N: only $have GPUs here" | tee -a "$LOG"; exit 2; }
    parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=(ddp fsdp extract)
    for part in "${parts[@]}"; do
      case "$part" in
        ddp|fsdp)  # W = 1 in the same call: efficiencies are ratios within one call
          for W in 1 2 4 8; do
            [ "$W" -le "$N" ] || break
            step 140 python3 -m torch.distributed.run --standalone --nproc-per-node "$W" dev/bench/bench_ddp.py \
              --strategy "$part" --global-rows 8 --out "scale_${part}_w$W.json" \
              $([ "$W" -gt 1 ] && echo --reference "scale_${part}_w1.json")
          done ;;
        extract)
          step 60 python3 dev/bench/bench_extract_multi.py --mode data --out scale_extract_w1.json
          step 120 python3 -m torch.distributed.run --standalone --nproc-per-node "$N" \
            dev/bench/bench_extract_multi.py --mode data --out "scale_extract_w$N.json"
          if [ "$N" -ge 4 ]; then
            step 150 python3 dev/bench/bench_extract_multi.py --mode split --shape 70b --gpus 4 \
              --out scale_extract_split70b.json
          fi ;;
        *) echo "scale: PART must be ddp, fsdp or extract, got $part" >&2; exit 2 ;;
      esac
    done ;;
  profile)
    exec bash dev/gpu/h200_profile.sh "$@" ;;
  *)
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
echo "=== [$(date +%T)] done" | tee -a "$LOG"
