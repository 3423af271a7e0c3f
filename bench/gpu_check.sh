#!/usr/bin/env bash
# GPU checks of the llama.cpp shard engine, in one run on a CUDA machine without internet.
#
# HOW TO RUN IT (a session whose task is lent the device machine: one H100 or H200, 16 cores):
#
#   1. Here, first:   bash bench/gpu_prepare.sh      (builds .cache/gpu-carry/, ~26 MiB)
#   2. Then one call of the device tool's `run`: `bash bench/device_check.sh` (carry
#      [".cache/gpu-carry"], timeout_s 595), which runs bench/cores_check.sh (issue 15's
#      concurrency bench with every node on cores of its own) first and then this script with
#      what is left; a session's 900 device seconds fit one start and that call, not two
#      starts. This script alone: `bash bench/gpu_check.sh`, timeout_s 600.
#      Everything comes back in $OUT (at most 8 files): gpu_check.log (all of stdout),
#      system.txt, build.log.gz, parity.txt, bench.txt, mixed.txt. Call give_back after.
#      The script keeps itself inside its budget (GPU_CHECK_BUDGET_S, 570 alone) and prints a
#      timestamp per stage; the CUDA build (one architecture, 16 jobs, ~310 s) is the long pole.
#
# Stages: the environment (nvidia-smi, nvcc, cmake); a venv over the image's python3 (its
# packages stay visible) with the carried wheels; llama-cpp-python 0.3.36 from the carried,
# trimmed sdist with CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90" (sm_90 only,
# parallel, pip --no-index) by the system's gcc/g++ (not the image's /opt/gcc, which links
# the C++ runtime statically: every model load died of it); meshnode installed into it (editable, its C extensions built);
# llama_print_system_info() and which CUDA libraries libggml-cuda resolves; the engine parity
# tests with every layer offloaded, each test in a process of its own so that one that kills
# its process is named and the rest still run (MESHNODE_TEST_N_GPU_LAYERS=99: split vs whole
# at the float32 boundary, the largest difference printed, greedy text identical; the
# passthrough layer in a GPU split of its own; a middle slice fully offloaded); whether
# libllama.so links the shared C++ runtime, and if it does not, an A/B of the first contract
# test without and with LD_PRELOAD=libstdc++.so.6, which the later stages then keep
# (engines/cxx_runtime.py; bench/RESULTS.md, the H100 run); bench/engine.py on the GPU (whole vs 2 and 3 shards, each weight-repack setting in a
# child) on a generated 1.35 GB random-weight llama (bench/random_model.py); and mixed routes
# (bench/mixed_route.py: head on the GPU, tail on the CPU, and the other ways) against the
# CPU-only route.
#
# Every stage after the build runs with the environment an installed node has (the build's
# LD_LIBRARY_PATH and CUDACXX dropped), PYTHONFAULTHANDLER=1, and bench/gpu/crash_backtrace.c
# preloaded, which prints the native stack on a fatal signal (the machine has no gdb).
#
# Modes for a machine without a GPU (both run in a throwaway copy of what the device tool
# would send: tracked and untracked-not-ignored files plus .cache/gpu-carry):
#   --cpu-dry-run   no build: everything else against the llama-cpp-python installed in
#                   .venv (a CPU build), with n_gpu_layers 0 and the small random model.
#   --cpu-build     as --cpu-dry-run, but builds the carried sdist for the CPU first (the
#                   check that the trimmed sdist still builds; ~7 minutes on 2 cores).
# GPU_CHECK_BIG_MODEL=1 runs issue 53's 8B-shape stages instead of the parity tests, the engine
# bench and the mixed routes (in the CPU modes on the q4-tiny shape: the script's own check).
# Environment: GPU_CHECK_PYTHON (python3; .venv/bin/python in the CPU modes),
# GPU_CHECK_VENV (/tmp/meshnode-gpu-venv), GPU_CHECK_BUDGET_S (570), GPU_CHECK_BUILD_S (the
# build's own limit, 520), GPU_CHECK_COPY (the CPU modes' copy), OUT (the device
# tool sets it; else .cache/gpu-check-out), MESHNODE_CACHE_DIR (/tmp/meshnode-gpu-cache).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
STARTED=$(date +%s)

MODE=gpu
case "${1:-}" in
  "") ;;
  --cpu-dry-run) MODE=dry ;;
  --cpu-build) MODE=cpu-build ;;
  *) echo "usage: bash bench/gpu_check.sh [--cpu-dry-run | --cpu-build]" >&2; exit 2 ;;
esac
CARRY=.cache/gpu-carry
SDIST=$CARRY/llama_cpp_python-0.3.36.tar.gz
if [ ! -f "$SDIST" ] || ! ls "$CARRY"/wheels/pip-*.whl >/dev/null 2>&1; then
  echo "$CARRY is missing or incomplete: run bash bench/gpu_prepare.sh here first (and carry it)" >&2
  exit 2
fi

# The CPU modes rerun this script in a copy of what the device tool would send, so that
# nothing here (an in-tree C extension, the cache) is touched and nothing ignored leaks in.
if [ "$MODE" != gpu ] && [ -z "${GPU_CHECK_IN_COPY:-}" ]; then
  copy=${GPU_CHECK_COPY:-/tmp/meshnode-gpu-check-tree}
  rm -rf "$copy" && mkdir -p "$copy"
  git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$copy"
  mkdir -p "$copy/.cache" && cp -a "$CARRY" "$copy/.cache/"
  echo "running in a copy of the tree that would travel: $copy"
  export GPU_CHECK_IN_COPY=1
  export GPU_CHECK_PYTHON=${GPU_CHECK_PYTHON:-$ROOT/.venv/bin/python}
  export OUT=${OUT:-$ROOT/.cache/gpu-check-out}
  exec bash "$copy/bench/gpu_check.sh" "$@"
fi

OUT=${OUT:-$ROOT/.cache/gpu-check-out}
mkdir -p "$OUT"
rm -f "$OUT"/gpu_check.log "$OUT"/system.txt "$OUT"/build.log.gz "$OUT"/parity.txt "$OUT"/bench.txt "$OUT"/mixed.txt \
  "$OUT"/big_model.txt "$OUT"/bulk_lane.txt
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE_PID=$!

PY=${GPU_CHECK_PYTHON:-python3}
VENV=${GPU_CHECK_VENV:-/tmp/meshnode-gpu-venv}
BUDGET=${GPU_CHECK_BUDGET_S:-570}
DEADLINE=$((STARTED + BUDGET))
JOBS=$(nproc)
export MESHNODE_CACHE_DIR=${MESHNODE_CACHE_DIR:-/tmp/meshnode-gpu-cache}
export PYTHONUNBUFFERED=1
ORIGINAL_LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
if [ "$MODE" = gpu ]; then
  NGL=99 MODEL_SIZE=large BENCH_ARGS=(--rounds 5 --decode-tokens 64 --threads 4)
else
  NGL=0 MODEL_SIZE=small BENCH_ARGS=(--rounds 2 --decode-tokens 16 --threads 2)
fi
FAILED=()

stamp() { printf '[%s +%4ds] %s\n' "$(date +%T)" "$(($(date +%s) - STARTED))" "$*"; }
stage() { echo; stamp "== $*"; }
# Seconds left before the budget, at most $1.
left() {
  local remaining=$((DEADLINE - $(date +%s)))
  [ "$remaining" -lt "$1" ] && echo "$((remaining > 5 ? remaining : 5))" || echo "$1"
}
# run_step NAME MAX_SECONDS command...: runs under a timeout, records a failure.
run_step() {
  local name=$1 limit
  limit=$(left "$2")
  shift 2
  timeout --signal=TERM --kill-after=10 "$limit" "$@"
  local status=$?
  if [ "$status" -ne 0 ]; then
    [ "$status" -eq 124 ] && stamp "$name: stopped after ${limit}s" || stamp "$name: failed ($status)"
    FAILED+=("$name")
  fi
  return "$status"
}
# run_logged NAME MAX_SECONDS FILE command...: run_step with the output appended to FILE
# (in $OUT, so it comes back even if the device tool stops the script), then shown.
run_logged() {
  local name=$1 limit=$2 file=$3 before
  shift 3
  before=$(stat -c %s "$file" 2>/dev/null || echo 0)
  run_step "$name" "$limit" "$@" >>"$file" 2>&1
  local status=$?
  tail -c +"$((before + 1))" "$file"
  return "$status"
}
finish() {
  echo
  if [ ${#FAILED[@]} -eq 0 ]; then
    stamp "done, mode $MODE: every stage passed"
  else
    stamp "done, mode $MODE: FAILED: ${FAILED[*]}"
  fi
  local status=$((${#FAILED[@]} > 0))
  # Let tee write the last lines to $OUT/gpu_check.log before the device tool collects it.
  exec 1>&- 2>&-
  wait "$TEE_PID" 2>/dev/null || sleep 1
  exit "$status"
}

stage "environment (mode $MODE, $JOBS cores, budget ${BUDGET}s, results in $OUT)"
if [ "$MODE" = gpu ] && ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
{
  echo "uname: $(uname -srm)"
  grep -m1 "model name" /proc/cpuinfo
  echo "cores: $JOBS"
  free -g | sed -n 2p
  echo "python: $($PY -c 'import sys; print(sys.version.split()[0], sys.executable)')"
  for tool in cmake ninja gcc nvcc; do
    if command -v "$tool" >/dev/null 2>&1; then
      echo "$tool: $(command -v "$tool"): $("$tool" --version 2>&1 | grep -m1 -iE 'version|release|ninja|[0-9]+\.[0-9]+')"
    else
      echo "$tool: not found"
    fi
  done
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
  else
    echo "nvidia-smi: not found"
  fi
} | tee "$OUT/system.txt"

stage "venv over $PY, carried wheels"
rm -rf "$VENV"
$PY -m venv --without-pip --system-site-packages "$VENV" || { FAILED+=(venv); finish; }
VPY=$VENV/bin/python
# The image's python3 may itself be a venv (PyTorch's): --system-site-packages would reach
# the base interpreter's packages, not its. A .pth adds its site-packages behind ours.
purelib=$($VPY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
$PY -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])' \
  | sort -u >"$purelib/_outer_site.pth"
pip_wheel=$(ls "$CARRY"/wheels/pip-*.whl)
PIP=("$VPY" -m pip --disable-pip-version-check)
# --ignore-installed: the venv gets its own copy even where python3 has the same version.
run_step "wheels" 120 "$VPY" "$pip_wheel/pip" install -q --no-index --no-deps --no-cache-dir --ignore-installed \
  --disable-pip-version-check "$CARRY"/wheels/*.whl || finish
"${PIP[@]}" list 2>/dev/null | grep -iE "^(gguf|diskcache|numpy|pytest|pytest-timeout|jinja2|typing.extensions|scikit.build.core|setuptools|cmake|ninja) "

if [ "$MODE" = dry ]; then
  stage "llama-cpp-python: not built (--cpu-dry-run), the installed CPU build is used"
else
  # PyTorch's CUDA image puts a g++ first (/opt/gcc/bin) that links the C++ runtime into every
  # library it links: libllama.so and libggml-cuda.so each carried a copy, and every model load
  # died of SIGSEGV in llama_model::print_info once numpy had loaded the system's libstdc++
  # (engines/cxx_runtime.py; bench/RESULTS.md, the H100 run). The system compiler links it shared.
  if [ -x /usr/bin/gcc ] && [ -x /usr/bin/g++ ]; then
    export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
    echo "compilers: CC=$CC CXX=$CXX CUDAHOSTCXX=$CUDAHOSTCXX (g++ on PATH: $(command -v g++))"
  fi
  if [ "$MODE" = gpu ]; then
    export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_NCCL=OFF"
    # nvcc on PATH may be a wrapper script, which hides the toolkit's root from CMake's
    # search: ask nvcc itself (its TOP), and name the root and the compiler.
    toolkit=$(nvcc -v --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
    if [ -n "$toolkit" ] && [ -x "$toolkit/bin/nvcc" ]; then
      toolkit=$(readlink -f "$toolkit")
      export CUDACXX=$toolkit/bin/nvcc
      CMAKE_ARGS="$CMAKE_ARGS -DCUDAToolkit_ROOT=$toolkit"
      [ -d "$toolkit/lib64" ] && export LD_LIBRARY_PATH=$toolkit/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
      echo "CUDA toolkit: $toolkit"
    fi
  else
    export CMAKE_ARGS=""
  fi
  export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
  stage "llama-cpp-python 0.3.36 from the trimmed sdist, CMAKE_ARGS=\"$CMAKE_ARGS\", $JOBS jobs"
  # The verbose log runs to megabytes of compiler warnings: it goes to $OUT compressed as
  # it is written (a stopped build's log still comes back), and to /tmp for the greps.
  build_log=/tmp/meshnode-gpu-check-build.log
  # A line a minute on progress (ninja's [done/total]), so a stopped build says how far it got.
  (
    while sleep 60; do
      progress=$(grep -oE '^ *\[[0-9]+/[0-9]+\]' "$build_log" 2>/dev/null | tail -1 | tr -d ' ')
      stamp "  building ${progress:-(configuring)}"
    done
  ) &
  ticker=$!
  limit=$(left "${GPU_CHECK_BUILD_S:-520}")
  timeout --signal=TERM --kill-after=10 "$limit" "${PIP[@]}" install -v --no-index --no-deps \
    --no-build-isolation --no-cache-dir "$SDIST" 2>&1 | tee "$build_log" | gzip -1 >"$OUT/build.log.gz"
  built=${PIPESTATUS[0]}
  kill "$ticker" 2>/dev/null
  wait "$ticker" 2>/dev/null
  grep -E "CMAKE_CUDA_ARCHITECTURES|CUDA Toolkit|Using CUDA|Found CUDAToolkit|Build files have been" \
    "$build_log" | sort -u | head -12
  if [ "$built" -ne 0 ]; then
    [ "$built" -eq 124 ] && stamp "build: stopped after ${limit}s" || stamp "build: failed ($built)"
    grep -E "CMake Error|FAILED:|error:" "$build_log" | head -40
    tail -n 40 "$build_log"
    FAILED+=(build)
    finish
  fi
  grep -oE '^ *\[[0-9]+/[0-9]+\]' "$build_log" | tail -1 | tr -d ' ' | sed 's/^/  compiled and linked: /'
  stamp "built"
fi

# What the build needed is not what a user's node runs with: the toolkit's LD_LIBRARY_PATH
# and CUDACXX go, so the runs load the CUDA libraries the way an installed meshnode would. A
# native backtrace is printed on a fatal signal (bench/gpu/crash_backtrace.c; no gdb there).
export LD_LIBRARY_PATH=$ORIGINAL_LD_LIBRARY_PATH
unset CUDACXX
export PYTHONFAULTHANDLER=1
if gcc -shared -fPIC -O1 -o /tmp/meshnode-crash-backtrace.so bench/gpu/crash_backtrace.c; then
  export LD_PRELOAD=/tmp/meshnode-crash-backtrace.so${LD_PRELOAD:+:$LD_PRELOAD}
else
  stamp "crash_backtrace.c did not build: crashes show Python frames only"
fi

stage "meshnode into the venv (editable, its C extensions built)"
run_step "meshnode install" 180 "${PIP[@]}" install -q --no-index --no-deps --no-build-isolation \
  --no-cache-dir -e . || finish

stage "the C++ runtime llama.cpp's libraries link (engines/cxx_runtime.py)"
bundled=$("$VPY" -c 'from engines.cxx_runtime import bundled_cxx_runtime as b; print(b() or "")')
"$VPY" -c 'from engines.cxx_runtime import elf_needed, llama_library_dir as d
for name in ("libllama.so", "libggml-cuda.so", "libggml-cpu.so"):
    print(name, "needs", elf_needed(d() / name))'
if [ -n "$bundled" ]; then
  stamp "$bundled carries its own C++ runtime: the first contract test without and with $(
    "$VPY" -c 'from engines.cxx_runtime import PRELOAD_FIX; print(PRELOAD_FIX)')"
  for preload in "" libstdc++.so.6; do
    LD_PRELOAD=$preload${LD_PRELOAD:+:$LD_PRELOAD} MESHNODE_TEST_N_GPU_LAYERS=$NGL timeout 60 "$VPY" -m pytest \
      -p no:cacheprovider -q tests/engines/test_engine_llama_tiny.py -k test_load_reports >/tmp/meshnode-gpu-ab.log 2>&1
    echo "LD_PRELOAD=$preload: exit $?"
  done
  # The rest runs as a user following the refusal's advice would.
  export LD_PRELOAD=libstdc++.so.6${LD_PRELOAD:+:$LD_PRELOAD}
else
  echo "libllama.so links the shared C++ runtime"
fi

stage "llama.cpp as the venv sees it"
{
  "$VPY" - <<'EOF'
import llama_cpp

import engines.hidden_capture as capture

print("llama_cpp", llama_cpp.__version__, "from", llama_cpp.__file__)
print("llama_print_system_info():", llama_cpp.llama_print_system_info().decode().strip())
print("llama_supports_gpu_offload():", bool(llama_cpp.llama_supports_gpu_offload()))
print("hidden capture in C:", capture.native_in_use())
from engines.device_memory import offload_devices

# What a node placing itself with --n-gpu-layers sizes its range to (meshnode.autoplace).
print("offload devices (free/total MiB):", [(d.name, d.kind, d.free_bytes >> 20, d.total_bytes >> 20) for d in offload_devices()])
EOF
} | tee -a "$OUT/system.txt"
offload=$("$VPY" -c 'import llama_cpp; print(int(bool(llama_cpp.llama_supports_gpu_offload())))')
for library in "$("$VPY" -c 'import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))')"/lib/libggml-cuda.so*; do
  [ -f "$library" ] || continue
  { echo "ldd $(basename "$library") (the runs' environment):"; ldd "$library" | grep -E "cuda|cublas|nvidia"; } | tee -a "$OUT/system.txt"
  break
done
if [ "$MODE" = gpu ] && [ "$offload" != 1 ]; then
  stamp "this build cannot offload: the GPU checks would run on the CPU, stopping"
  FAILED+=("no GPU offload")
  finish
fi

# Issue 53's model that needs the mesh (GPU_CHECK_BIG_MODEL=1, bench/device_check.sh --big-model):
# these stages instead of the ones below. Llama 3 8B's shape in Q4_0 (4.5 GB, generated here),
# every layer offloaded: bench/engine.py's whole vs 2 and 3 shards on the device (greedy
# tokens the same, prefill 128 and decode against the whole model on the same GPU), then
# bench/big_model.py (created on A, joined by B and C with only an invite, prefill 1024 and
# 4096 tokens and decode through the API, against monolithic llama.cpp on the same GPU, and
# the activations' share of the time to first token on the QUIC path). First bench/bulk_lane.py:
# the bulk lane against raw TLS over TCP where the fetcher does not share two cores with the
# nodes (on the 2-core VM it reached 0.35-0.47). The llama.cpp RPC anchor is skipped (--no-rpc):
# its tools are a CPU build of their own, minutes of this budget.
if [ "${GPU_CHECK_BIG_MODEL:-0}" = 1 ]; then
  run_logged "bulk lane" 90 "$OUT/bulk_lane.txt" "$VPY" bench/bulk_lane.py
  BIG_SIZE=llama3-8b
  [ "$MODE" = gpu ] || BIG_SIZE=q4-tiny
  stage "issue 53: the $BIG_SIZE shape, n_gpu_layers $NGL"
  big=$(timeout "$(left 120)" "$VPY" bench/random_model.py --size "$BIG_SIZE")
  if [ -n "$big" ] && [ -f "$big" ]; then
    stamp "$(ls -l "$big")"
    run_logged "engine bench ($BIG_SIZE)" 150 "$OUT/bench.txt" \
      "$VPY" bench/engine.py --model "$big" --n-gpu-layers "$NGL" --weight-repack off --rounds 2 \
      --decode-tokens 32 --threads 4
    if [ "$MODE" = gpu ]; then
      run_logged "big model ($BIG_SIZE)" 400 "$OUT/big_model.txt" \
        "$VPY" bench/big_model.py --n-gpu-layers "$NGL" --threads 4 --tokens 32 --no-rpc
    else
      run_logged "big model ($BIG_SIZE)" 400 "$OUT/big_model.txt" \
        "$VPY" bench/big_model.py --size "$BIG_SIZE" --first-layers 1 --prompt-tokens 64 --tokens 4 \
        --tls-mib 16 --no-rpc
    fi
  else
    stamp "the $BIG_SIZE model: not generated"
    FAILED+=("$BIG_SIZE model")
  fi
  [ "$MODE" = gpu ] && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee -a "$OUT/system.txt"
  finish
fi

stage "engine parity tests, MESHNODE_TEST_N_GPU_LAYERS=$NGL, each test in a process of its own"
# One process per test: a test that kills its process (llama.cpp aborts or faults) is named,
# with its native backtrace, and the others still run.
isolated_tests() {
  local id status crashed=0 failed=0 passed=0
  while IFS= read -r id; do
    MESHNODE_TEST_N_GPU_LAYERS=$NGL timeout --kill-after=5 60 "$VPY" -m pytest -s -p no:cacheprovider -q "$id" \
      >/tmp/meshnode-gpu-test.log 2>&1
    status=$?
    if [ "$status" -eq 0 ]; then
      passed=$((passed + 1))
      grep -E "max \|Δlogit\||bit for bit|SKIPPED" /tmp/meshnode-gpu-test.log | sed "s|^|  $id: |"
    elif [ "$status" -lt 124 ]; then
      failed=$((failed + 1))
      echo "FAILED $id (pytest exit $status)"
      grep -E "^E |Error" /tmp/meshnode-gpu-test.log | head -8
    else
      crashed=$((crashed + 1))
      echo "CRASHED $id (exit $status: 124 is the 60 s limit, 128+N signal N)"
      grep -vE "^  File \"/(opt|usr)|site-packages/(_pytest|pluggy)" /tmp/meshnode-gpu-test.log | tail -60
    fi
  done < <("$VPY" -m pytest -p no:cacheprovider -q --collect-only tests/engines/test_engine_llama_tiny.py \
    tests/engines/test_hidden_capture.py tests/engines/test_buffer_overrides.py 2>/dev/null | grep '::')
  echo "isolated tests: $passed passed, $failed failed, $crashed crashed"
  [ "$failed" -eq 0 ] && [ "$crashed" -eq 0 ]
}
export -f isolated_tests
export VPY NGL
run_logged "parity tests" 200 "$OUT/parity.txt" bash -c isolated_tests


stage "bench/engine.py on a generated random-weight llama ($MODEL_SIZE), n_gpu_layers $NGL"
model=$(timeout "$(left 60)" "$VPY" bench/random_model.py --size "$MODEL_SIZE")
if [ -n "$model" ] && [ -f "$model" ]; then
  stamp "$(ls -l "$model")"
  run_logged "engine bench" 200 "$OUT/bench.txt" \
    "$VPY" bench/engine.py --model "$model" --n-gpu-layers "$NGL" "${BENCH_ARGS[@]}"
else
  stamp "random model: not generated"
  FAILED+=("random model")
  model=""
fi

stage "mixed routes against the CPU-only route (GGML_OP_OFFLOAD_MIN_BATCH=1000000: CPU means CPU)"
for route_model in tiny ${model:+"$model"}; do
  model_args=()
  [ "$route_model" = tiny ] || model_args=(--model "$route_model")
  GGML_OP_OFFLOAD_MIN_BATCH=1000000 run_logged "mixed route ($route_model)" 90 "$OUT/mixed.txt" \
    "$VPY" bench/mixed_route.py "${model_args[@]}" --gpu-layers "$NGL" --decode-steps 32 --threads 4
done

if [ "$MODE" = gpu ]; then
  stage "GPU after the runs"
  nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv | tee -a "$OUT/system.txt"
fi
finish
