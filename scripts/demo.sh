#!/usr/bin/env bash
# The README's demo command: installs dependencies, builds, asks a real model
# (SmolLM2-135M-Instruct) a question on two pipeline ranks, then makes a small random-weight
# model and generates from it, printing one JSON line per request, the layer split and the
# timing.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
kvpipe=build/release/launch/kvpipe
mpirun --oversubscribe -np 2 "$kvpipe" generate --config configs/smollm2.yaml \
  --chat "What is the capital of France? Answer in one sentence." --max-new-tokens 48 --log-level warn
[ -f models/tiny/model.safetensors ] || "$kvpipe" init-model --preset tiny --out models/tiny
# Two ranks split the model's layers (see the plan lines on stderr); --oversubscribe lets
# them share a machine with fewer cores.
mpirun --oversubscribe -np 2 "$kvpipe" generate --config configs/tiny-2rank.yaml
