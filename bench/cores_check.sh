#!/usr/bin/env bash
# Issue 15's concurrency bench where every node has cores of its own: the device machine's 16.
#
# On the 2-core machines here the three nodes of (d) share two cores with each other and with
# the bench, so a pipeline cannot overlap its stages and (d) at concurrency 4 is bounded by the
# CPU a token costs (bench/RESULTS.md, "Where the cores go at concurrency 4"). The device
# machine lent to some tasks has 16 cores: there each node's two threads, its event loop and
# the bench's own (a) and (a') contexts can all run at once, as on the pooled machines the
# product is for. Its GPU is hidden (CUDA_VISIBLE_DEVICES=""): this measures CPU nodes with
# every session in one batch (--pipeline off) and in two cohorts, on an even split of the
# layers and on one with a light tail.
#
# HOW TO RUN IT (a session whose task is lent the device machine):
#   1. Here, first:   bash bench/gpu_prepare.sh      (also fetches the runtime wheels)
#   2. bash bench/device_check.sh runs it first, then bench/gpu_check.sh. Alone:
#        command:   bash bench/cores_check.sh
#        carry:     [".cache/gpu-carry"]
#        timeout_s: 300
#      On a fresh machine it makes a venv (/tmp/meshnode-gpu-venv) and builds llama-cpp-python
#      for the CPU from the carried sdist first (16 jobs); where a venv with llama-cpp-python is
#      there already (bench/gpu_check.sh's, or --cpu-dry-run's here) it uses it. Results:
#      $OUT/cores_check.log (all of stdout) and $OUT/cores.txt (the bench's table). Call
#      give_back after.
#
# The model is a generated stand-in of Gemma 3 270M's shape and weight types
# (bench/random_model.py --size gemma270m): the device has no package registry to bring
# Gemma from and the carry is limited to 64 MiB. On the 2-core machine here it decodes as
# Gemma does ((a) 71-77 against 74-76 tokens/s, (a') at k=4 111 against 114).
#
#   bash bench/cores_check.sh --here     the same bench on this machine, with .venv
# Environment: CORES_CHECK_BUDGET_S (280: the whole script), CORES_CHECK_LEVELS (1,4,8),
# CORES_CHECK_ROUNDS (2), CORES_CHECK_CONFIGS (bench/concurrency.py's --configs; below), GPU_CHECK_PYTHON (python3),
# GPU_CHECK_VENV (/tmp/meshnode-gpu-venv), OUT (the device tool sets it; else
# .cache/cores-check-out), MESHNODE_CACHE_DIR (/tmp/meshnode-gpu-cache on the device).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
STARTED=$(date +%s)
BUDGET=${CORES_CHECK_BUDGET_S:-280}
DEADLINE=$((STARTED + BUDGET))
HERE=0
case "${1:-}" in
  "") ;;
  --here) HERE=1 ;;
  *) echo "usage: bash bench/cores_check.sh [--here]" >&2; exit 2 ;;
esac
CARRY=.cache/gpu-carry
OUT=${OUT:-$ROOT/.cache/cores-check-out}
mkdir -p "$OUT"
rm -f "$OUT/cores_check.log" "$OUT/cores.txt"
exec > >(tee -a "$OUT/cores_check.log") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1

stamp() { printf '[%s +%4ds] %s\n' "$(date +%T)" "$(($(date +%s) - STARTED))" "$*"; }
left() { echo $((DEADLINE - $(date +%s))); }
finish() {
  stamp "done: $1"
  exec 1>&- 2>&-
  wait "$TEE_PID" 2>/dev/null || sleep 1
  [ "$1" = ok ]
  exit $?
}

stamp "== the machine"
{
  grep -m1 "model name" /proc/cpuinfo
  echo "cores: $(nproc)"
  free -g | sed -n 2p
  grep -m1 -o -w -E "amx_int8|avx512f" /proc/cpuinfo | sort -u | tr '\n' ' '
  echo
}

if [ "$HERE" = 1 ]; then
  VPY=$ROOT/.venv/bin/python
else
  export MESHNODE_CACHE_DIR=${MESHNODE_CACHE_DIR:-/tmp/meshnode-gpu-cache}
  export CUDA_VISIBLE_DEVICES=""
  VENV=${GPU_CHECK_VENV:-/tmp/meshnode-gpu-venv}
  VPY=$VENV/bin/python
  PY=${GPU_CHECK_PYTHON:-python3}
  if ! ls "$CARRY"/runtime-wheels/aioquic-*.whl >/dev/null 2>&1; then
    echo "$CARRY/runtime-wheels is missing: run bash bench/gpu_prepare.sh here first (and carry it)"
    finish "no runtime wheels"
  fi
  if [ ! -x "$VPY" ]; then
    stamp "== a venv over $PY with the carried wheels"
    $PY -m venv --without-pip --system-site-packages "$VENV" || finish "venv"
    purelib=$($VPY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # As in bench/gpu_check.sh: the image's python3 may itself be a venv.
    $PY -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])' \
      | sort -u >"$purelib/_outer_site.pth"
    pip_wheel=$(ls "$CARRY"/wheels/pip-*.whl)
    "$VPY" "$pip_wheel/pip" install -q --no-index --no-deps --no-cache-dir --ignore-installed \
      --disable-pip-version-check "$CARRY"/wheels/*.whl || finish "wheels"
  fi
  PIP=("$VPY" -m pip --disable-pip-version-check -q)
  # Whether it is installed (importing it also needs the image's jinja2).
  if ! "$VPY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp') is None)"; then
    stamp "== llama-cpp-python for the CPU from the carried sdist, $(nproc) jobs"
    # The system compiler, as in bench/gpu_check.sh: the image's /opt/gcc g++ links the C++
    # runtime into each library, and model loads die of it (engines/cxx_runtime.py).
    [ -x /usr/bin/g++ ] && export CC=/usr/bin/gcc CXX=/usr/bin/g++
    CMAKE_ARGS="" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout "$(left)" "${PIP[@]}" install --no-index \
      --no-deps --no-build-isolation --no-cache-dir "$CARRY"/llama_cpp_python-0.3.36.tar.gz \
      >/tmp/meshnode-cores-build.log 2>&1 || { tail -n 30 /tmp/meshnode-cores-build.log; finish "build"; }
    stamp "built"
  fi
  # Where the venv sees them already (bench/gpu_check.sh --cpu-dry-run's, over .venv's Python),
  # the carried wheels (built for the device's Python 3.12) are not needed.
  if "$VPY" -c "import aioquic, aiohttp, cryptography, google.protobuf, google_crc32c, prometheus_client, uvloop, zstandard" 2>/dev/null; then
    stamp "== meshnode's runtime dependencies: in $VENV already"
  else
    stamp "== meshnode's runtime wheels into $VENV"
    "${PIP[@]}" install --no-index --no-deps --no-cache-dir --ignore-installed "$CARRY"/runtime-wheels/*.whl || finish "runtime wheels"
  fi
  stamp "== meshnode (editable) into $VENV"
  "${PIP[@]}" install --no-index --no-deps --no-build-isolation --no-cache-dir -e . || finish "meshnode install"
fi
"$VPY" -c 'import llama_cpp, aioquic, aiohttp; print("llama_cpp", llama_cpp.__version__, "|",
llama_cpp.llama_print_system_info().decode().strip())' || finish "imports"

# A build that carries its own C++ runtime (bench/gpu_check.sh's, if an older copy of it
# built one) runs as the refusal advises: with the system's runtime preloaded.
if [ -n "$("$VPY" -c 'from engines.cxx_runtime import bundled_cxx_runtime as b; print(b() or "")')" ]; then
  export LD_PRELOAD=libstdc++.so.6${LD_PRELOAD:+:$LD_PRELOAD}
  stamp "libllama.so carries its own C++ runtime: LD_PRELOAD=$LD_PRELOAD"
fi

stamp "== the stand-in model"
model=$("$VPY" bench/random_model.py --size gemma270m) || finish "model"
ls -l "$model"

# One run, its meshes side by side in the same alternating rounds (so that the machine's drift
# between minutes, which moved (d) at k=1 from 32.3 to 23.9 tokens/s between two runs on
# 2026-12-05, hits them alike): (d)'s even split as a convoy (--pipeline off), and (d) and the
# light tail (dt: [0,8) [8,16) [16,18), as `meshnode split --nodes 3` gives it) with the nodes'
# defaults: --pipeline auto, which on these 16 CPUs finds a CPU for each node's 2 threads and
# event loop (9 of 16) and so runs two cohorts (--pipeline-cohorts 2; the head logs it at debug).
# bench/pipeline_overlap.py --stage-ms, timed as the three nodes measured on the device and as
# the two splits measure here, predicts the light tail in two cohorts near 2.5x its k=1
# (bench/RESULTS.md, "A light tail"). Every node now waits in OpenMP as on a machine of its own
# (libgomp's spin; engines.openmp_wait: 3 x 3 + 1 <= 16 CPUs), where the 2026-12-05 run gave
# them the short spin of nodes sharing cores: the fourth mesh, the convoy under that short spin,
# says what the change is worth on cores of their own.
configs=${CORES_CHECK_CONFIGS:-d+pipeline=off,d,dt,d+pipeline=off+env.GOMP_SPINCOUNT=1000}
stamp "== bench/concurrency.py, three CPU nodes of 2 threads, speculation off, configs $configs ($(left) s left)"
timeout --signal=INT --kill-after=15 "$(($(left) - 10))" "$VPY" bench/concurrency.py \
  --model "$model" --configs "$configs" --levels "${CORES_CHECK_LEVELS:-1,4,8}" \
  --rounds "${CORES_CHECK_ROUNDS:-2}" --tokens 32 --node-arg=--max-sessions --node-arg=8 \
  --node-arg=--speculation --node-arg=off --node-arg=--n-gpu-layers --node-arg=0 2>&1 | tee -a "$OUT/cores.txt"
status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] && finish ok
finish "bench (exit $status: 124 is the budget)"
