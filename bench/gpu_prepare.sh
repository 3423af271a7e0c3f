#!/usr/bin/env bash
# Builds .cache/gpu-carry/, everything bench/gpu_check.sh needs on a CUDA machine that has
# no internet and is not in git, from the package registries reachable here:
#
#   llama_cpp_python-0.3.36.tar.gz  the pinned sdist, trimmed from 76.6 MB to what its CMake
#                                   build of the CPU and CUDA backends reads (see TRIM below)
#   wheels/                         pure-Python wheels for Python 3.12 that a PyTorch image may
#                                   lack or hold at another version: the checks' imports (gguf,
#                                   llama-cpp-python's diskcache) and the offline build's tools
#                                   (pip, setuptools, wheel, scikit-build-core and its needs)
#   runtime-wheels/                 meshnode's own runtime dependencies (pyproject.toml's, less
#                                   llama-cpp-python, gguf and numpy) and theirs, for CPython
#                                   3.12 on x86_64 Linux: bench/cores_check.sh runs real nodes
#   MANIFEST.txt                    what is in it, with sizes and sha256
#
# The device tool carries ignored paths only when named (64 MiB in all, the working tree
# included), so the folder must stay under that; this script checks it.
#
#   bash bench/gpu_prepare.sh          (idempotent; about a minute, most of it pip)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
CARRY=.cache/gpu-carry
SCRATCH=.cache/gpu-prepare
LLAMA_VERSION=0.3.36
SDIST=llama_cpp_python-$LLAMA_VERSION
# One version of each (two stop an offline install). All are py3-none-any.
WHEELS=(
  gguf==0.19.0
  diskcache==5.6.3
  pip==26.3
  setuptools==84.2.1
  wheel==0.48.0
  scikit-build-core==1.1.2
  pathspec==1.1.1
  packaging==26.4
)
# Everything the build of llama.cpp's CPU and CUDA backends (plus the mtmd library the
# Python package ships) never reads. llama.cpp is a subdirectory of the package's CMake
# project, so its tests, examples, tools and server are off; only tools/mtmd is added.
TRIM=(
  .git  # 39 MB of history; without it llama.cpp's build info says commit "unknown"
  vendor/llama.cpp/.git
  docs examples docker tests scripts mkdocs.yml .github .readthedocs.yaml
  vendor/llama.cpp/models
  vendor/llama.cpp/docs
  vendor/llama.cpp/media
  vendor/llama.cpp/examples
  vendor/llama.cpp/benches
  vendor/llama.cpp/tests
  vendor/llama.cpp/pocs
  vendor/llama.cpp/app
  vendor/llama.cpp/gguf-py
  vendor/llama.cpp/conversion
  vendor/llama.cpp/requirements
  vendor/llama.cpp/grammars
  vendor/llama.cpp/skills
  vendor/llama.cpp/ci
  vendor/llama.cpp/.github
  vendor/llama.cpp/.devops
  vendor/llama.cpp/.gemini
  vendor/llama.cpp/.pi
  vendor/llama.cpp/convert_hf_to_gguf.py
  vendor/llama.cpp/convert_hf_to_gguf_update.py
  vendor/llama.cpp/convert_llama_ggml_to_gguf.py
  vendor/llama.cpp/convert_lora_to_gguf.py
  vendor/llama.cpp/tools/mtmd/tests
  vendor/llama.cpp/tools/mtmd/test-1.jpeg
  vendor/llama.cpp/tools/mtmd/test-2.mp3
  vendor/llama.cpp/tools/mtmd/test-3.mp4
)
# Every tool but mtmd (the server's web UI alone is 8.5 MB).
KEEP_TOOLS=mtmd
# ggml backends other than CPU and CUDA (each is added only when its GGML_<NAME> option is on).
KEEP_BACKENDS="ggml-cpu ggml-cuda"

stamp() { printf '[%s] %s\n' "$(date +%T)" "$*"; }

mkdir -p "$SCRATCH"
original=$SCRATCH/$SDIST.tar.gz
if [ ! -f "$original" ]; then
  stamp "downloading the $SDIST sdist"
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_VERSION" -d "$SCRATCH"
fi

stamp "trimming it"
rm -rf "$SCRATCH/tree" && mkdir -p "$SCRATCH/tree"
tar -xzf "$original" -C "$SCRATCH/tree"
root=$SCRATCH/tree/$SDIST
llama_commit=$(cat "$root/.git/modules/vendor/llama.cpp/HEAD" 2>/dev/null || echo unknown)
for path in "${TRIM[@]}"; do
  rm -rf "${root:?}/$path"
done
for tool in "$root"/vendor/llama.cpp/tools/*/; do
  [ "$(basename "$tool")" = "$KEEP_TOOLS" ] || rm -rf "$tool"
done
for backend in "$root"/vendor/llama.cpp/ggml/src/ggml-*/; do
  case " $KEEP_BACKENDS " in
    *" $(basename "$backend") "*) ;;
    *) rm -rf "$backend" ;;
  esac
done
# What the build must still find.
for needed in CMakeLists.txt pyproject.toml README.md llama_cpp/llama_cpp.py \
  vendor/llama.cpp/CMakeLists.txt vendor/llama.cpp/ggml/src/ggml-cuda/CMakeLists.txt \
  vendor/llama.cpp/ggml/src/ggml-cuda/template-instances vendor/llama.cpp/ggml/src/ggml-cpu/CMakeLists.txt \
  vendor/llama.cpp/tools/mtmd/CMakeLists.txt vendor/llama.cpp/common/CMakeLists.txt \
  vendor/llama.cpp/vendor/cpp-httplib vendor/llama.cpp/src/llama.cpp; do
  [ -e "$root/$needed" ] || { echo "trimmed too much: $needed is gone" >&2; exit 1; }
done

mkdir -p "$CARRY"
rm -rf "$CARRY/wheels" && mkdir -p "$CARRY/wheels"
# Deterministic bytes: sorted names, fixed owner and mtime.
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime='2026-01-01 00:00:00' \
  -C "$SCRATCH/tree" -cf - "$SDIST" | gzip -9n >"$CARRY/$SDIST.tar.gz"
rm -rf "$SCRATCH/tree"

stamp "downloading wheels for Python 3.12"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$CARRY/wheels" "${WHEELS[@]}"

stamp "downloading meshnode's runtime dependencies for Python 3.12"
rm -rf "$CARRY/runtime-wheels" && mkdir -p "$CARRY/runtime-wheels"
# Built on the device (llama-cpp-python), or among the carried wheels and the image's.
mapfile -t runtime < <("$PY" -c '
import re, tomllib
for requirement in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    if re.split(r"[<>=!~; \[]", requirement, maxsplit=1)[0].lower() not in {"llama-cpp-python", "gguf", "numpy"}:
        print(requirement)
')
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$CARRY/runtime-wheels" "${runtime[@]}"

{
  echo "bench/gpu_prepare.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "$SDIST.tar.gz: the PyPI sdist ($(stat -c %s "$original") bytes, sha256 $(sha256sum "$original" | cut -d' ' -f1)) less:"
  echo "(vendored llama.cpp commit $llama_commit)"
  printf '  %s\n' "${TRIM[@]}" "vendor/llama.cpp/tools/* but $KEEP_TOOLS" "vendor/llama.cpp/ggml/src/ggml-* but $KEEP_BACKENDS"
  echo
  (cd "$CARRY" && find . -type f ! -name MANIFEST.txt -printf '%P\n' | sort | while read -r file; do
    printf '%10d  %s  %s\n' "$(stat -c %s "$file")" "$(sha256sum "$file" | cut -d' ' -f1)" "$file"
  done)
} >"$CARRY/MANIFEST.txt"

carry_bytes=$(du -sb "$CARRY" | cut -f1)
tree_bytes=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
limit=$((64 * 1024 * 1024))
stamp "$CARRY: $((carry_bytes / 1024)) KiB; with the working tree ($((tree_bytes / 1024)) KiB) $(((carry_bytes + tree_bytes) * 100 / limit))% of the device tool's 64 MiB"
cat "$CARRY/MANIFEST.txt"
if [ $((carry_bytes + tree_bytes)) -ge "$limit" ]; then
  echo "too big to travel: trim more" >&2
  exit 1
fi
