#!/usr/bin/env bash
# Configures and builds kvpipe (Release) into build/release.
set -euo pipefail
cd "$(dirname "$0")/.."
# ccache keys paths relative to the checkout, so another clone of the same sources (CI's)
# reuses this one's objects.
export CCACHE_BASEDIR="$PWD"
cmake --preset release >/dev/null
cmake --build --preset release
