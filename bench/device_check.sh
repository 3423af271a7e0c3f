#!/usr/bin/env bash
# Both device checks in one call of the device tool: bench/gpu_check.sh, then
# bench/cores_check.sh on the same machine with the venv and llama.cpp build the first leaves.
#
# A session's device time is 900 s, each start of a machine costs a minute or more and a call
# may run 600 s, so one call that does both is what fits (2026-12-05: a start, this pair in
# 457 s and four short follow-ups used 693 s):
#
#   1. Here, first:   bash bench/gpu_prepare.sh
#   2. One `run`:     command bash bench/device_check.sh, carry [".cache/gpu-carry"],
#                     timeout_s 595
#   3. give_back, then record $OUT's files (at most 8: gpu_check's 6 and cores_check's 2) in
#      bench/RESULTS.md.
#
# Environment: DEVICE_CHECK_BUDGET_S (585: both together), GPU_CHECK_BUDGET_S (430: the first;
# its CUDA build alone took 309-311 s on the H100 and H200 machines), CORES_CHECK_LEVELS (1,4
# here: three runs of bench/concurrency.py must fit in what is left), CORES_CHECK_ROUNDS (2).
set -uo pipefail
cd "$(dirname "$0")/.."
STARTED=$(date +%s)
BUDGET=${DEVICE_CHECK_BUDGET_S:-585}
GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-430} bash bench/gpu_check.sh
gpu_status=$?
left=$((BUDGET - ($(date +%s) - STARTED)))
if [ "$left" -lt 60 ]; then
  echo "device_check: ${left}s left, too little for bench/cores_check.sh"
  exit 1
fi
CORES_CHECK_BUDGET_S=$left CORES_CHECK_LEVELS=${CORES_CHECK_LEVELS:-1,4} bash bench/cores_check.sh
cores_status=$?
echo "device_check: gpu_check exit $gpu_status, cores_check exit $cores_status"
[ "$gpu_status" -eq 0 ] && [ "$cores_status" -eq 0 ]
