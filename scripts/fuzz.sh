#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (clang 14, ASan + UBSan) into build/fuzz, replays
# every seed corpus (tests/fuzz/corpus/TARGET), then fuzzes each target for a bounded time and
# prints one table: executions per target and the result. Exit 1 on any finding (a crash, an
# exception other than the parser's bad-input one, a leak, a timeout, a sanitizer report); the
# message names the file that reproduces it (build/fuzz/findings/TARGET/), which
# `build/fuzz/tests/fuzz/fuzz_TARGET FILE` replays.
#
#   scripts/fuzz.sh [--seconds N] [--replay-only] [TARGET...]
#     --seconds N     fuzzing time per target (default 30)
#     --replay-only   replay the seed corpora, no fuzzing
#     TARGET          gguf, safetensors, model_config, job_config, tokenizer_json,
#                     tokenizer_encode, chat_template, serve_request (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=30
replay_only=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="${2:?--seconds needs a number}"; shift 2 ;;
    --seconds=*) seconds="${1#*=}"; shift ;;
    --replay-only) replay_only=1; shift ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fuzz: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
  echo "fuzz: --seconds must be a positive whole number, got '$seconds'" >&2
  exit 2
fi
if [ ${#targets[@]} -eq 0 ]; then
  for dir in tests/fuzz/corpus/*/; do targets+=("$(basename "$dir")"); done
fi
for t in "${targets[@]}"; do
  if [ ! -f "tests/fuzz/fuzz_$t.cpp" ]; then
    echo "fuzz: no target '$t' (tests/fuzz/fuzz_$t.cpp)" >&2
    exit 2
  fi
done
if ! command -v clang++-14 >/dev/null; then
  echo "fuzz: clang++-14 not found: run scripts/setup.sh (Debian's clang-14, libclang-rt-14-dev)" >&2
  exit 1
fi

# Longest input per target: room for a small model file, a few KB for text.
max_len() {
  case "$1" in
    gguf) echo 65536 ;;
    safetensors|tokenizer_json|chat_template) echo 16384 ;;
    *) echo 4096 ;;
  esac
}

export CCACHE_BASEDIR="$PWD"
start=$SECONDS
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz
echo "fuzz: built in $((SECONDS - start)) s"

# Findings stop the process (no recovery); leaks are findings. The symbolizer names the
# functions and lines of a stack.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1:symbolize=1}"
if [ -x /usr/lib/llvm-14/bin/llvm-symbolizer ]; then
  export ASAN_SYMBOLIZER_PATH=/usr/lib/llvm-14/bin/llvm-symbolizer
fi
# One compute thread: the machine is shared with the rest of CI.
export OMP_NUM_THREADS=1

bin=build/fuzz/tests/fuzz
logs=build/fuzz/logs
mkdir -p "$logs"
failed=0
rows=()
for t in "${targets[@]}"; do
  corpus="tests/fuzz/corpus/$t"
  seeds=("$corpus"/*)
  findings="build/fuzz/findings/$t"
  mkdir -p "$findings"
  result="ok"
  execs="-"
  rate="-"
  # Replay: every seed once, each its own run, so a failure names its file.
  if ! "$bin/fuzz_$t" -rss_limit_mb=4096 -timeout=10 "${seeds[@]}" >"$logs/$t.replay.log" 2>&1; then
    bad="$(grep -o 'Running: [^ ]*' "$logs/$t.replay.log" | tail -1 | cut -d' ' -f2)"
    echo "fuzz: $t: seed ${bad:-?} fails (log: $logs/$t.replay.log):" >&2
    grep -E 'ERROR|SUMMARY|terminate|what\(\)|runtime error' "$logs/$t.replay.log" | head -5 >&2 || true
    result="FAIL replay: ${bad:-see $logs/$t.replay.log}"
    failed=1
  elif [ "$replay_only" -eq 0 ]; then
    # New inputs go to build/fuzz/corpus/TARGET (kept between runs); the seeds stay as they are.
    work="build/fuzz/corpus/$t"
    mkdir -p "$work"
    status=0
    "$bin/fuzz_$t" "$work" "$corpus" -max_total_time="$seconds" -max_len="$(max_len "$t")" \
      -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$findings/" \
      >"$logs/$t.log" 2>&1 || status=$?
    execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$logs/$t.log" | tail -1)"
    execs="${execs:--}"
    if [[ "$execs" =~ ^[0-9]+$ ]]; then rate="$((execs / seconds))"; fi
    if [ "$status" -ne 0 ]; then
      artifact="$(sed -n 's/.*Test unit written to \([^ ]*\).*/\1/p' "$logs/$t.log" | tail -1)"
      echo "fuzz: $t: finding ${artifact:-(no reproducer written)} (log: $logs/$t.log):" >&2
      grep -E 'ERROR|SUMMARY|terminate|what\(\)|runtime error' "$logs/$t.log" | head -5 >&2 || true
      result="FAIL: ${artifact:-see $logs/$t.log}"
      failed=1
    fi
  fi
  rows+=("$(printf '%-18s %6s %12s %8s  %s' "$t" "${#seeds[@]}" "$execs" "$rate" "$result")")
done

printf '\n%-18s %6s %12s %8s  %s\n' target seeds executions "exec/s" result
printf '%s\n' "${rows[@]}"
if [ "$failed" -ne 0 ]; then
  echo "fuzz: findings above; reproduce one with $bin/fuzz_TARGET FILE" >&2
  exit 1
fi
