#!/usr/bin/env bash
# Builds ik_llama.cpp's llama-bench (CPU only), the second benchmark peer, from the source that
# PyPI's ik-llama-cpp-python sdist ships (vendor/ik_llama.cpp), with the code generation of the
# llama.cpp peer (scripts/llama_cpp_flags.sh: native, without AMX).
#   bash benchmarks/peers/build_ik_llama_cpp.sh     -> benchmarks/peers/ik_llama.cpp/bin/llama-bench
# The sdist lacks the cmake script that writes common/build-info.cpp from git; it is written
# here from build-info.cpp.in. About 20 minutes on 2 cores. For benchmarks only; CI does not
# need it. IK_LLAMA_CPP_PYTHON (default 0.1.5) picks the sdist, JOBS (default 2) the compile jobs.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="$here/ik_llama.cpp"
version="${IK_LLAMA_CPP_PYTHON:-0.1.5}"
python="$root/.venv/bin/python"
[ -x "$python" ] || { echo "build_ik_llama_cpp: run scripts/setup.sh first (.venv is missing)" >&2; exit 1; }
# shellcheck source=scripts/llama_cpp_flags.sh
. "$root/scripts/llama_cpp_flags.sh"
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DGGML_CUDA=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF)
stamp="$version $(llama_cpp_build_key "${cmake_args[*]}")"
if [ -x "$out/bin/llama-bench" ] && [ "$(cat "$out/version" 2>/dev/null)" = "$stamp" ]; then
  echo "build_ik_llama_cpp: ik_llama.cpp of ik-llama-cpp-python $version is built in $out/bin"
  exit 0
fi
rm -rf "$out"
mkdir -p "$out/sdist"
"$python" -m pip download --disable-pip-version-check --quiet --no-deps --no-binary :all: \
  "ik-llama-cpp-python==$version" -d "$out/sdist"
tar -xzf "$out/sdist/ik_llama_cpp_python-$version.tar.gz" -C "$out/sdist"
src="$out/sdist/ik_llama_cpp_python-$version/vendor/ik_llama.cpp"
sed -e 's/@BUILD_NUMBER@/0/' -e "s/@BUILD_COMMIT@/ik-llama-cpp-python-$version/" \
  -e "s/@BUILD_COMPILER@/$(${CC:-cc} --version | head -n 1 | tr -d '"\\/')/" -e 's/@BUILD_TARGET@/x86_64/' \
  "$src/common/build-info.cpp.in" >"$src/common/build-info.cpp"
echo "build_ik_llama_cpp: building llama-bench from ik-llama-cpp-python $version's ik_llama.cpp"
cmake -S "$src" -B "$out/cmake" "${cmake_args[@]}" -DCMAKE_C_FLAGS="$llama_cpp_isa_flags" \
  -DCMAKE_CXX_FLAGS="$llama_cpp_isa_flags" >"$out/cmake.log" 2>&1 ||
  { echo "build_ik_llama_cpp: cmake failed (see $out/cmake.log)" >&2; exit 1; }
cmake --build "$out/cmake" --target llama-bench -j "${JOBS:-2}" >"$out/build.log" 2>&1 ||
  { echo "build_ik_llama_cpp: build failed (see $out/build.log)" >&2; tail -n 5 "$out/build.log" >&2; exit 1; }
mkdir -p "$out/bin"
llama_cpp_check_no_amx "$out/cmake/bin/llama-bench" || exit 1
cp "$out/cmake/bin/llama-bench" "$out/bin/llama-bench"
echo "$stamp" >"$out/version"
echo "build_ik_llama_cpp: $out/bin/llama-bench"
