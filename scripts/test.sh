#!/usr/bin/env bash
# The README's test command: installs dependencies (the tests' references included), builds,
# runs the whole test suite, then fuzzes the parsers (scripts/fuzz.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --references
bash scripts/build.sh
# Tests run one compute thread per rank; Open MPI refuses root without these.
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ctest --preset release "$@"
# The parsers of untrusted input under libFuzzer (ASan + UBSan): seed corpora replayed, then
# KVPIPE_FUZZ_SECONDS (default 30) of fuzzing per target; 0 skips this stage.
fuzz_seconds="${KVPIPE_FUZZ_SECONDS:-30}"
if [ "$fuzz_seconds" != 0 ]; then
  bash scripts/fuzz.sh --seconds "$fuzz_seconds"
fi
