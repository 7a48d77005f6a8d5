#!/usr/bin/env bash
# Builds llama.cpp's tools (CPU only) from the source that the pinned llama-cpp-python sdist
# ships (vendor/llama.cpp), so that the benchmark peer is exactly the llama.cpp the parity
# tests run: llama-bench, llama-batched-bench, llama-quantize and llama-server, with the same
# code generation (scripts/llama_cpp_flags.sh: native, without AMX).
#   bash benchmarks/peers/build_llama_cpp.sh     -> benchmarks/peers/llama.cpp/bin/
# For benchmarks only; CI does not need it. JOBS (default 2) sets the parallel compile jobs.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="$here/llama.cpp"
tools=(llama-bench llama-batched-bench llama-quantize llama-server)
python="$root/.venv/bin/python"
[ -x "$python" ] || { echo "build_llama_cpp: run scripts/setup.sh first (.venv is missing)" >&2; exit 1; }
# shellcheck source=scripts/llama_cpp_flags.sh
. "$root/scripts/llama_cpp_flags.sh"
version="$(sed -n 's/^llama-cpp-python==\([0-9.]*\).*/\1/p' "$root/scripts/requirements-references.txt")"
[ -n "$version" ] || { echo "build_llama_cpp: no llama-cpp-python pin in scripts/requirements-references.txt" >&2; exit 1; }
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DGGML_CUDA=OFF
  -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
  -DLLAMA_BUILD_TOOLS=ON)
# The version file names the build key too: tools built with other flags (AMX) or on another
# processor are built again.
stamp="$version $(llama_cpp_build_key "${cmake_args[*]}")"

built=1
for t in "${tools[@]}"; do [ -x "$out/bin/$t" ] || built=0; done
if [ $built = 1 ] && [ "$(cat "$out/version" 2>/dev/null)" = "$stamp" ]; then
  echo "build_llama_cpp: llama.cpp of llama-cpp-python $version is built in $out/bin"
  exit 0
fi
rm -rf "$out"
mkdir -p "$out/sdist"
"$python" -m pip download --disable-pip-version-check --quiet --no-deps --no-binary :all: \
  "llama-cpp-python==$version" -d "$out/sdist"
tar -xzf "$out/sdist/llama_cpp_python-$version.tar.gz" -C "$out/sdist"
src="$out/sdist/llama_cpp_python-$version/vendor/llama.cpp"
echo "build_llama_cpp: building ${tools[*]} from llama-cpp-python $version's llama.cpp"
cmake -S "$src" -B "$out/cmake" "${cmake_args[@]}" -DCMAKE_C_FLAGS="$llama_cpp_isa_flags" \
  -DCMAKE_CXX_FLAGS="$llama_cpp_isa_flags" >"$out/cmake.log" 2>&1 ||
  { echo "build_llama_cpp: cmake failed (see $out/cmake.log)" >&2; exit 1; }
cmake --build "$out/cmake" --target "${tools[@]}" -j "${JOBS:-2}" >"$out/build.log" 2>&1 ||
  { echo "build_llama_cpp: build failed (see $out/build.log)" >&2; tail -n 5 "$out/build.log" >&2; exit 1; }
mkdir -p "$out/bin"
for t in "${tools[@]}"; do
  llama_cpp_check_no_amx "$out/cmake/bin/$t" || exit 1
  cp "$out/cmake/bin/$t" "$out/bin/$t"
done
echo "$stamp" >"$out/version"
echo "build_llama_cpp: $out/bin: ${tools[*]}"
