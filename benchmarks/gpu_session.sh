#!/usr/bin/env bash
# Runs on a GPU machine from the repository root: the GPU tests and the benchmarks, in stages, so one batched
# call can do everything that belongs together. Logs and results go to $OUT (default ./gpu-out).
#   benchmarks/gpu_session.sh tests [PATHS]   # kernel and model tests on the GPU (gpu-marked ones included)
#   benchmarks/gpu_session.sh kernels [OPS]   # benchmarks/kernels.py, main shapes, all implementations
#   benchmarks/gpu_session.sh sweeps [ARGS]  # the shape sweeps, fusetune against torch.compile and Liger; ARGS go
#                                          # to kernels.py (--ops fused_linear_cross_entropy --sweep-tokens 65536)
#   benchmarks/gpu_session.sh e2e MODELS IMPLS
#   benchmarks/gpu_session.sh estimate [CONFIGS]   # benchmarks/memory_estimate.py
#   benchmarks/gpu_session.sh scaling ARGS...      # benchmarks/scaling.py ARGS (e.g. --nproc 1,2,4)
#   benchmarks/gpu_session.sh optimizer [IMPLS]    # benchmarks/optimizer.py (AdamW step at the 1B parameter set)
#   benchmarks/gpu_session.sh sustained ARGS...    # benchmarks/sustained.py ARGS (each implementation in its own
#                                                  # steady power state); MERGE_FROM=<results json> keeps its groups
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
budget=${BUDGET_S:-300}

case "$1" in
  tests)
    timeout "$budget" python3 -m pytest -q -rfE -p no:cacheprovider ${2:-tests/kernels tests/models} 2>&1 \
      | tee -a "$OUT/gpu-tests.log" | tail -25 ;;
  kernels)
    python3 benchmarks/kernels.py --sweeps none ${2:+--ops "$2"} ${MERGE_FROM:+--merge-from "$MERGE_FROM"} \
      --out "$OUT" --time-budget-s "$budget" 2>&1 | tee -a "$OUT/kernels.log" | tail -60 ;;
  sweeps)
    # Rows of the main shapes from an earlier call (committed results) are kept beside the sweep's.
    shift
    python3 benchmarks/kernels.py --sweeps only --sweep-impls compile,liger,fusetune "$@" \
      ${MERGE_FROM:+--merge-from "$MERGE_FROM"} --out "$OUT" --time-budget-s "$budget" 2>&1 \
      | tee "$OUT/sweeps.log" | tail -30 ;;
  e2e)
    python3 benchmarks/e2e.py --models "$2" --impls "$3" --out "$OUT" --time-budget-s "$budget" \
      ${MERGE_FROM:+--merge-from "$MERGE_FROM"} 2>&1 \
      | tee -a "$OUT/e2e.log" | tail -30 ;;
  estimate)
    timeout "$budget" python3 benchmarks/memory_estimate.py ${2:+--configs "$2"} --out "$OUT" 2>&1 \
      | tee -a "$OUT/estimate.log" | tail -20 ;;
  scaling)
    shift
    timeout "$budget" python3 benchmarks/scaling.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/scaling.log" | tail -20 ;;
  sustained)
    shift
    if [ -n "${MERGE_FROM:-}" ]; then cp "$MERGE_FROM" "$OUT/"; fi
    timeout "$budget" python3 benchmarks/sustained.py --out "$OUT" ${MERGE_FROM:+--merge} "$@" 2>&1 \
      | tee -a "$OUT/sustained.log" | grep -v -i warn | tail -30 ;;
  optimizer)
    timeout "$budget" python3 benchmarks/optimizer.py ${2:+--impls "$2"} --out "$OUT" 2>&1 \
      | tee -a "$OUT/optimizer.log" | tail -15 ;;
esac
