#!/usr/bin/env bash
# Both device checks in one call of the device tool: bench/gpu_check.sh, with issue 15's
# bench/cores_check.sh run inside it right after the build (its interlude), on the venv and
# llama.cpp build it made, before the GPU stages.
#
# A session's device time is 900 s, each start of a machine costs a minute or more and a call
# may run 600 s, so one call that does both is what fits (2026-12-05: a start, the pair in
# 457 s and four short follow-ups used 693 s). Issue 15, the open one, goes first: the CUDA
# build (309-311 s on the H100 and H200 machines) serves both, then cores_check takes what is
# left less GPU_CHECK_RESERVE_S (120: the engine parity tests took 97 s), then the GPU stages
# run in the rest; the engine bench and the mixed routes may find none left.
#
#   1. Here, first:   bash bench/gpu_prepare.sh
#   2. One `run`:     command bash bench/device_check.sh, carry [".cache/gpu-carry"],
#                     timeout_s 595
#   3. give_back, then record $OUT's files (at most 8: gpu_check's 6 and cores_check's 2) in
#      bench/RESULTS.md.
#
# Environment: DEVICE_CHECK_BUDGET_S (585: both together), GPU_CHECK_RESERVE_S (120),
# CORES_CHECK_LEVELS (1,4 here), CORES_CHECK_ROUNDS (2), CORES_CHECK_CONFIGS (cores_check's).
set -uo pipefail
cd "$(dirname "$0")/.."
export GPU_CHECK_RESERVE_S=${GPU_CHECK_RESERVE_S:-120}
export CORES_CHECK_LEVELS=${CORES_CHECK_LEVELS:-1,4}
# shellcheck disable=SC2016  # expanded by gpu_check.sh's interlude, not here
export GPU_CHECK_INTERLUDE='CORES_CHECK_BUDGET_S=$INTERLUDE_BUDGET_S bash bench/cores_check.sh'
GPU_CHECK_BUDGET_S=${DEVICE_CHECK_BUDGET_S:-585} bash bench/gpu_check.sh
status=$?
echo "device_check: gpu_check (with cores_check inside) exit $status"
exit "$status"
