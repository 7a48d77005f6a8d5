#!/usr/bin/env bash
# Builds kvpipe and its unit tests with AddressSanitizer + UndefinedBehaviorSanitizer (the
# `sanitize` CMake preset, build/sanitize) and runs the unit tests under them; extra arguments
# go to ctest (e.g. -R Gguf). A sanitizer report fails the test that triggered it.
#
# LibTorch is not instrumented: its allocations at exit are not kvpipe's leaks
# (detect_leaks=0), and the CUDA libraries it loads map the shadow gap (protect_shadow_gap=0).
# kvpipe turns SIGBUS on a truncated model file into an error itself (handle_sigbus=0).
# The test preset sets the same options for the tests and the kvpipe processes they start;
# the build needs them too, since it lists each test binary's tests by running it.
set -euo pipefail
cd "$(dirname "$0")/.."
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:protect_shadow_gap=0:detect_odr_violation=0:handle_sigbus=0:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}"
export CCACHE_BASEDIR="$PWD"
start=$SECONDS
cmake --preset sanitize >/dev/null
cmake --build --preset sanitize
built=$SECONDS
echo "sanitize: built in $((built - start)) s"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
status=0
ctest --preset sanitize "$@" || status=$?
echo "sanitize: unit tests ran in $((SECONDS - built)) s"
exit "$status"
