#!/usr/bin/env bash
# Installs the llama.cpp peer (node-llama-cpp 3.21.1 with its prebuilt linux-x64 CPU library)
# into benchmarks/peers/llama-cpp/node_modules from the committed package-lock.json.
# Idempotent: does nothing when that version is already installed. npm's install scripts are
# not run (the prebuilt library needs none, and they would try to build llama.cpp).
set -euo pipefail
dir="$(cd "$(dirname "$0")" && pwd)/llama-cpp"
version="3.21.1"

installed() {
  [ -f "$dir/node_modules/@node-llama-cpp/linux-x64/package.json" ] &&
    node -e "process.exit(require('$dir/node_modules/node-llama-cpp/package.json').version === '$version' ? 0 : 1)" 2>/dev/null
}

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "peers: node and npm are needed for the llama.cpp peer (Node.js 20 or newer, e.g. the" \
       "nodejs package from NodeSource)" >&2
  exit 1
fi
major="$(node -p 'process.versions.node.split(".")[0]')"
if [ "$major" -lt 20 ]; then
  echo "peers: node-llama-cpp $version needs Node.js 20 or newer; found $(node --version)" >&2
  exit 1
fi
if installed; then
  echo "peers: node-llama-cpp $version is installed"
  exit 0
fi
echo "peers: installing node-llama-cpp $version (npm ci) into $dir"
# --omit=optional skips the GPU and other-platform binaries; linux-x64 is a direct dependency.
if ! (cd "$dir" && npm ci --ignore-scripts --no-audit --no-fund --omit=optional \
        >/tmp/kvpipe-peers-npm.log 2>&1); then
  echo "peers: 'npm ci' failed in $dir (see /tmp/kvpipe-peers-npm.log; is the npm registry" \
       "reachable?)" >&2
  tail -n 5 /tmp/kvpipe-peers-npm.log >&2
  exit 1
fi
installed || { echo "peers: node-llama-cpp $version missing after npm ci" >&2; exit 1; }
echo "peers: done"
