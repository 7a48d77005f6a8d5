#!/usr/bin/env bash
# Builds llama.cpp's `llama-bench` (CPU only) from the source bundled in the installed
# node-llama-cpp package (llama/gitRelease.bundle, a git bundle), so that the benchmark peer is
# exactly the llama.cpp the parity tests run. For benchmarks only; CI does not need it.
#   bash benchmarks/peers/build_llama_bench.sh     -> benchmarks/peers/llama-cpp/build/bin/llama-bench
# JOBS (default 2) sets the parallel compile jobs.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
peer="$here/llama-cpp"
bundle="$peer/node_modules/node-llama-cpp/llama/gitRelease.bundle"
src="$peer/build/src"
out="$peer/build/cmake"
bin="$peer/build/bin/llama-bench"

if [ -x "$bin" ]; then echo "llama-bench: $bin is built"; exit 0; fi
[ -f "$bundle" ] || { echo "llama-bench: $bundle not found: run scripts/setup.sh first" >&2; exit 1; }
command -v cmake >/dev/null || { echo "llama-bench: cmake is needed" >&2; exit 1; }
if [ ! -d "$src/.git" ]; then
  rm -rf "$src"
  git -c advice.detachedHead=false clone --quiet "$bundle" "$src"
fi
echo "llama-bench: building llama.cpp $(git -C "$src" rev-parse --short HEAD) in $out"
cmake -S "$src" -B "$out" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
  -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON >/dev/null
cmake --build "$out" --target llama-bench -j "${JOBS:-2}" >/dev/null
mkdir -p "$(dirname "$bin")"
cp "$(find "$out" -name llama-bench -type f -perm -u+x | head -n 1)" "$bin"
echo "llama-bench: $bin"
