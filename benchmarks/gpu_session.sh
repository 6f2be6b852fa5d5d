#!/usr/bin/env bash
# Runs on a GPU machine from the repository root: the GPU tests and the benchmarks, in stages, so that one
# batched call does everything that belongs together, e.g.
#   benchmarks/gpu_session.sh tests; benchmarks/gpu_session.sh kernels; benchmarks/gpu_session.sh e2e M I
# Logs and results go to $OUT (default ./gpu-out); after every stage the markdown of the results there is
# regenerated. Back on the development machine, `python3 -m benchmarks.summary --merge-in gpu-out/*-*.json`
# takes the sections a session wrote into benchmarks/results/. BUDGET_S (default 300) bounds each stage;
# MERGE_FROM=<results json> keeps an earlier run's rows beside this one's (kernels, sweeps, sustained, e2e,
# scaling).
#   tests [PATHS]              kernel and model tests on the GPU (gpu-marked ones included)
#   kernels [OPS]              benchmarks.kernels.ops, main shapes, all implementations
#   sweeps [ARGS...]           the shape sweeps, fusetune against torch.compile and Liger; ARGS go to
#                              benchmarks.kernels.ops (--ops fused_linear_cross_entropy --sweep-tokens 65536)
#   sustained [ARGS...]        benchmarks.kernels.sustained (each implementation in its own steady power state)
#   optimizer [IMPLS]          benchmarks.kernels.optimizer (AdamW step at the 1B parameter set)
#   loss-skip                  benchmarks.kernels.loss_skip
#   e2e MODELS IMPLS [ARGS...] benchmarks.step.e2e
#   trainer-step [ARGS...]     benchmarks.step.trainer_step
#   dpo [ARGS...]              benchmarks.step.dpo
#   grpo [ARGS...]             benchmarks.step.grpo (about 8 minutes: BUDGET_S=540)
#   generation [ARGS...]       benchmarks.step.generation (sampling alone, by kernels, KV cache and compilation)
#   estimate [CONFIGS]         benchmarks.step.memory_estimate
#   service [ARGS...]          benchmarks.service.jobs
#   scaling [ARGS...]          benchmarks.scaling.gpus (e.g. --nproc 1,2,4)
#   quality [ARGS...]          benchmarks.quality.precision
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
budget=${BUDGET_S:-300}
merge=()
if [ -n "${MERGE_FROM:-}" ]; then merge=(--merge-from "$MERGE_FROM"); fi

# stage LOG LINES COMMAND...: the command's output appended to $OUT/LOG.log, its last LINES lines shown.
stage() {
  local log=$1 lines=$2
  shift 2
  "$@" 2>&1 | tee -a "$OUT/$log.log" | grep -v -i "warn" | tail -"$lines"
}

name=${1:-}
shift || true
case "$name" in
  tests)
    stage gpu-tests 25 timeout "$budget" python3 -m pytest -q -rfE -p no:cacheprovider ${1:-tests/kernels tests/models} ;;
  kernels)
    stage kernels 60 python3 -m benchmarks.kernels.ops --sweeps none ${1:+--ops "$1"} "${merge[@]}" \
      --out "$OUT" --time-budget-s "$budget" ;;
  sweeps)
    # Rows of the main shapes from an earlier call (committed results) are kept beside the sweep's.
    stage sweeps 30 python3 -m benchmarks.kernels.ops --sweeps only --sweep-impls compile,liger,fusetune "$@" \
      "${merge[@]}" --out "$OUT" --time-budget-s "$budget" ;;
  sustained)
    stage sustained 30 timeout "$budget" python3 -m benchmarks.kernels.sustained --out "$OUT" "${merge[@]}" "$@" ;;
  optimizer)
    stage optimizer 15 timeout "$budget" python3 -m benchmarks.kernels.optimizer ${1:+--impls "$1"} --out "$OUT" ;;
  loss-skip)
    stage loss-skip 20 timeout "$budget" python3 -m benchmarks.kernels.loss_skip --out "$OUT" \
      --budget-s "$((budget - 60))" ;;
  e2e)
    models=$1 impls=$2
    shift 2
    stage e2e 30 python3 -m benchmarks.step.e2e --models "$models" --impls "$impls" --out "$OUT" \
      --time-budget-s "$budget" "${merge[@]}" "$@" ;;
  trainer-step)
    stage trainer-step 30 timeout "$budget" python3 -m benchmarks.step.trainer_step --out "$OUT" "$@" ;;
  dpo)
    stage dpo 30 timeout "$budget" python3 -m benchmarks.step.dpo --out "$OUT" "$@" ;;
  grpo)
    stage grpo 30 timeout "$budget" python3 -m benchmarks.step.grpo --out "$OUT" "$@" ;;
  generation)
    stage generation 40 timeout "$budget" python3 -m benchmarks.step.generation --out "$OUT" "$@" ;;
  estimate)
    stage estimate 20 timeout "$budget" python3 -m benchmarks.step.memory_estimate ${1:+--configs "$1"} --out "$OUT" ;;
  service)
    stage service 20 timeout "$budget" python3 -m benchmarks.service.jobs --out "$OUT" "$@" ;;
  scaling)
    stage scaling 20 timeout "$budget" python3 -m benchmarks.scaling.gpus --out "$OUT" "${merge[@]}" "$@" ;;
  quality)
    stage quality 20 timeout "$budget" python3 -m benchmarks.quality.precision --out "$OUT" "$@" ;;
  *)
    echo "usage: benchmarks/gpu_session.sh STAGE [ARGS...]; the stages are listed at the top of this file" >&2
    exit 2 ;;
esac
python3 -m benchmarks.summary --results "$OUT" >/dev/null
