#!/usr/bin/env bash
# Build llama.cpp's llama-bench and RPC server (the target is ggml-rpc-server in the
# llama.cpp that llama-cpp-python 0.3.36 vendors; older trees call it rpc-server) from
# the vendored source in the pinned llama-cpp-python sdist, for the llama.cpp RPC
# anchor in bench/e2e.py --rpc (issue 20) and bench/big_model.py (issue 53).
#
# Why the sdist and not a llama.cpp checkout: the anchor must run the same ggml/llama
# code meshnode's engine runs, and the sdist is fetchable from the package registry
# that CI and every bench machine already reach.
#
# The build lives outside the repo, in $MESHNODE_LLAMA_RPC_CACHE (default
# ~/.cache/meshnode/llama-rpc) under <version>/, and is reused when its stamp (version
# and CMake flags) matches. On success the last line of stdout is the bin directory,
# which holds llama-bench and ggml-rpc-server.
#
# Usage: bench/build_llama_rpc.sh [--force | --check]     (-j from $JOBS, default 2)
#   --check: build nothing; print the bin directory if the cached build is current, else
#            exit 3 (what bench/big_model.py asks before it skips the anchor).
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
force=0
check=0
[ "${1:-}" = "--force" ] && force=1
[ "${1:-}" = "--check" ] && check=1

# The pinned version, read from pyproject.toml so it cannot drift from the engine's.
version="$(sed -n 's/.*"llama-cpp-python==\([0-9][0-9.]*\)".*/\1/p' "$repo/pyproject.toml" | head -1)"
if [ -z "$version" ]; then
  echo "build_llama_rpc: no llama-cpp-python==X pin in $repo/pyproject.toml" >&2
  exit 1
fi
# $PIP, else the repository's .venv, else $PYTHON's (a worktree has no .venv of its own).
if [ -n "${PIP:-}" ]; then
  pip=("$PIP")
elif [ -x "$repo/.venv/bin/pip" ]; then
  pip=("$repo/.venv/bin/pip")
else
  pip=("${PYTHON:-python3}" -m pip)
fi
jobs="${JOBS:-2}"
root="${MESHNODE_LLAMA_RPC_CACHE:-$HOME/.cache/meshnode/llama-rpc}/$version"
src="$root/src/llama_cpp_python-$version/vendor/llama.cpp"
build="$root/build"
bin="$root/bin"

# GGML_NATIVE=OFF with explicit ISA flags so the build does not depend on what the
# build machine's compiler detects. Each flag is on only where this CPU lists the
# instructions in /proc/cpuinfo: a fixed set taken from one bench machine (AVX-VNNI
# among them) died with SIGILL on an AMD EPYC that has AVX512-VNNI but not AVX-VNNI.
# AMX stays off everywhere: the issue's reference figures were taken without it.
# LLAMA_CURL is deprecated in this tree (a warning, no effect) but kept so the flag
# line matches the issue's; OpenSSL/server/examples/tests are off because neither
# tool downloads anything and they only cost configure and link time.
cpu_flags=" $(sed -n 's/^flags[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -1) "
isa() { # isa GGML_OPTION cpuinfo-flag...: ON when the CPU has every flag named
  local option="$1" flag
  shift
  for flag in "$@"; do
    case "$cpu_flags" in *" $flag "*) ;; *) echo "-D$option=OFF"; return ;; esac
  done
  echo "-D$option=ON"
}
flags=(
  -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=OFF
  -DGGML_RPC=ON
  -DLLAMA_CURL=OFF
  -DLLAMA_OPENSSL=OFF
  -DGGML_NATIVE=OFF
  "$(isa GGML_SSE42 sse4_2)"
  "$(isa GGML_AVX avx)"
  "$(isa GGML_AVX2 avx2)"
  "$(isa GGML_BMI2 bmi2)"
  "$(isa GGML_FMA fma)"
  "$(isa GGML_F16C f16c)"
  "$(isa GGML_AVX_VNNI avx_vnni)"
  # ggml's GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw.
  "$(isa GGML_AVX512 avx512f avx512cd avx512vl avx512dq avx512bw)"
  "$(isa GGML_AVX512_VBMI avx512vbmi)"
  "$(isa GGML_AVX512_VNNI avx512_vnni)"
  "$(isa GGML_AVX512_BF16 avx512_bf16)"
  -DGGML_AMX_TILE=OFF
  -DGGML_AMX_INT8=OFF
  -DGGML_AMX_BF16=OFF
  -DGGML_OPENMP=ON
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_SERVER=OFF
  -DLLAMA_BUILD_TOOLS=ON
)
stamp="llama-cpp-python==$version ${flags[*]}"

if [ "$force" = 0 ] && [ -x "$bin/llama-bench" ] && [ -x "$bin/ggml-rpc-server" ] &&
  [ "$(cat "$root/stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "$bin"
  exit 0
fi
if [ "$check" = 1 ]; then
  echo "build_llama_rpc: no current build under $root (bench/build_llama_rpc.sh builds it, minutes)" >&2
  exit 3
fi

for tool in cmake g++; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "build_llama_rpc: $tool not found (apt-get install -y cmake g++, or pip install cmake)" >&2
    exit 1
  fi
done

mkdir -p "$root/sdist" "$root/src"
sdist="$root/sdist/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
  "${pip[@]}" download --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$root/sdist" >&2
fi
if [ ! -f "$src/CMakeLists.txt" ]; then
  tar -xzf "$sdist" -C "$root/src"
fi
# The tools are part of the sdist in 0.3.36; say so plainly if a future pin drops them
# rather than silently building something else.
for d in tools/llama-bench tools/rpc; do
  if [ ! -f "$src/$d/CMakeLists.txt" ]; then
    echo "build_llama_rpc: the sdist has no $d (vendor/llama.cpp/$d); no fallback here" >&2
    exit 1
  fi
done

# The RPC server target's name changed across llama.cpp versions; take it from the tree.
rpc_target="$(sed -n 's/^set(TARGET \([a-z-]*\)).*/\1/p' "$src/tools/rpc/CMakeLists.txt" | head -1)"
rpc_target="${rpc_target:-rpc-server}"

start=$(date +%s)
cmake -S "$src" -B "$build" "${flags[@]}" >&2
cmake --build "$build" --target llama-bench "$rpc_target" -j "$jobs" >&2
mkdir -p "$bin"
cp "$build/bin/llama-bench" "$bin/llama-bench"
# One name for the bench to call whatever this version names its server.
cp "$build/bin/$rpc_target" "$bin/ggml-rpc-server"
echo "$stamp" >"$root/stamp"
echo "build_llama_rpc: built in $(($(date +%s) - start)) s into $bin" >&2
echo "$bin"
