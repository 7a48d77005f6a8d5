#!/usr/bin/env bash
# Steady-state decode through the pipeline: the `small` preset, a batch of 16 requests
# (16-token prompts, 64 new tokens each), on one rank (one and two threads) and on two
# ranks of one thread with one and with two micro-batches in flight.
#
#   benchmarks/pipeline_bench.sh [--runs N]
#
# Prints a Markdown table of medians over the runs: generated tokens/s, median micro-batch
# step latency, and each rank's busy and wait (pipeline bubble) fractions.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=3
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    *) echo "pipeline_bench: unknown argument $1" >&2; exit 2 ;;
  esac
done
kvpipe=build/release/launch/kvpipe
[ -x "$kvpipe" ] || { echo "pipeline_bench: build first (scripts/build.sh)" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
{
  echo 'model: {path: "dummy:small"}'
  echo 'cache: {memory: 256MiB}'
  echo 'scheduler: {max_batch: 16}'
  echo 'sampling: {ignore_eos: true}'
  echo 'requests:'
  for i in $(seq 0 15); do
    echo "  - {prompt_ids: [$(seq 0 15 | awk -v i="$i" '{printf "%s%d", (NR>1?", ":""), ($1*7919+i*13)%8000+3}')], max_new_tokens: 64}"
  done
} >"$tmp/job.yaml"

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
measure() {  # name, ranks, threads, extra args
  local name=$1 ranks=$2 threads=$3; shift 3
  : >"$tmp/tok" ; : >"$tmp/step"; : >"$tmp/r0"; : >"$tmp/r1"
  for _ in $(seq 1 "$runs"); do
    if [ "$ranks" -eq 1 ]; then
      OMP_NUM_THREADS=$threads "$kvpipe" generate --config "$tmp/job.yaml" --set runtime.threads="$threads" "$@" \
          >/dev/null 2>"$tmp/err"
    else
      OMP_NUM_THREADS=$threads mpirun --oversubscribe -np "$ranks" "$kvpipe" generate --config "$tmp/job.yaml" \
          --set runtime.threads="$threads" "$@" >/dev/null 2>"$tmp/err"
    fi
    grep -oE '[0-9.]+ tokens/s generated' "$tmp/err" | awk '{print $1}' >>"$tmp/tok"
    grep -oE 'median [0-9.]+ ms' "$tmp/err" | awk '{print $2}' >>"$tmp/step"
    for r in 0 1; do
      grep -E "^rank $r: busy" "$tmp/err" | sed -E 's/.*busy ([0-9.]+)%, wait ([0-9.]+)%.*/\1 \2/' >>"$tmp/r$r" || true
    done
  done
  local cells=""
  for r in 0 1; do
    if [ -s "$tmp/r$r" ]; then
      cells="$cells | $(awk '{print $1}' "$tmp/r$r" | median)% / $(awk '{print $2}' "$tmp/r$r" | median)%"
    else
      cells="$cells | -"
    fi
  done
  echo "| $name | $(median <"$tmp/tok") | $(median <"$tmp/step")$cells |"
}

echo "| configuration | tokens/s | median step ms | rank 0 busy / wait | rank 1 busy / wait |"
echo "|---|---|---|---|---|"
measure "1 rank, 1 thread" 1 1
measure "1 rank, 2 threads" 1 2
measure "2 ranks x 1 thread, 1 micro-batch" 2 1 --set parallel.micro_batches=1
measure "2 ranks x 1 thread, 2 micro-batches" 2 1 --set parallel.micro_batches=2
echo
echo "small preset, batch 16, 16-token prompts, 64 new tokens each, medians of $runs runs"
