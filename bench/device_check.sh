#!/usr/bin/env bash
# Both device checks in one call of the device tool: issue 15's bench/cores_check.sh first, on a
# CPU build of llama-cpp-python of its own, then bench/gpu_check.sh with what is left.
#
# A session's device time is 900 s, each start of a machine costs a minute or more and a call
# may run 600 s, so one call that does both is what fits (2026-12-05: a start, the pair in
# 457 s and four short follow-ups used 693 s). Issue 15, the open one, goes first and does not
# wait on the CUDA build (309-311 s on the H100 and H200 machines; a failed or slow one would
# have left it nothing): its CPU build on 16 cores, the stand-in model and one
# bench/concurrency.py of four meshes are sized to fit CORES_CHECK_BUDGET_S (270; not yet run
# there: the four took 107 s for one round on the 2-core VM, build aside). gpu_check then rebuilds
# its venv for CUDA; its later stages (the engine bench, the mixed routes) may find no time left.
#
#   1. Here, first:   bash bench/gpu_prepare.sh
#   2. One `run`:     command bash bench/device_check.sh, carry [".cache/gpu-carry"],
#                     timeout_s 595
#   3. give_back, then record $OUT's files (at most 8: cores_check's 2 and gpu_check's 6) in
#      bench/RESULTS.md.
#
# Environment: DEVICE_CHECK_BUDGET_S (585: both together), CORES_CHECK_BUDGET_S (270),
# CORES_CHECK_LEVELS (1,4 here), CORES_CHECK_ROUNDS (2), CORES_CHECK_CONFIGS (cores_check's).
#
# `bash bench/device_check.sh --big-model` (issue 53; prepared, not yet run on a device): no
# cores_check; bench/gpu_check.sh builds llama.cpp for CUDA and then runs only the Llama 3
# 8B-shape stages (GPU_CHECK_BIG_MODEL=1): bench/engine.py's split parity and prefill/decode
# against the whole model on the GPU, and bench/big_model.py (join, fetch, memory, time to first
# token for 1024 and 4096 tokens, decode, against monolithic llama.cpp on the same GPU). Its
# files: gpu_check.log, system.txt, build.log.gz, bulk_lane.txt, bench.txt, big_model.txt. The build (~310 s)
# leaves ~270 s: the 8B prompts are the stage most likely to run out (a stopped stage
# still returns what it printed).
set -uo pipefail
cd "$(dirname "$0")/.."
STARTED=$(date +%s)
BUDGET=${DEVICE_CHECK_BUDGET_S:-585}
if [ "${1:-}" = --big-model ]; then
  GPU_CHECK_BIG_MODEL=1 GPU_CHECK_BUDGET_S=$BUDGET exec bash bench/gpu_check.sh
fi
CORES_CHECK_BUDGET_S=${CORES_CHECK_BUDGET_S:-270} CORES_CHECK_LEVELS=${CORES_CHECK_LEVELS:-1,4} \
  bash bench/cores_check.sh
cores_status=$?
left=$((BUDGET - ($(date +%s) - STARTED)))
if [ "$left" -lt 120 ]; then
  echo "device_check: ${left}s left, too little for bench/gpu_check.sh"
  exit 1
fi
GPU_CHECK_BUDGET_S=$left bash bench/gpu_check.sh
gpu_status=$?
echo "device_check: cores_check exit $cores_status, gpu_check exit $gpu_status"
[ "$cores_status" -eq 0 ] && [ "$gpu_status" -eq 0 ]
