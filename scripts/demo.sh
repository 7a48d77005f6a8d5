#!/usr/bin/env bash
# The README's demo command: installs dependencies, builds, makes a small random-weight
# model and generates from it, printing one JSON line per request and the timing.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
kvpipe=build/release/launch/kvpipe
[ -f models/tiny/model.safetensors ] || "$kvpipe" init-model --preset tiny --out models/tiny
mpirun -np 1 "$kvpipe" generate --config configs/demo-1rank.yaml
