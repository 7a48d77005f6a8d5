#!/usr/bin/env bash
# Tensor parallelism against the other layouts of two cores, on the `small` preset in float32
# (made in memory) and on a Q8_0 GGUF of at least 200 MB (the small shape with 16 layers,
# quantised by llama.cpp's quantiser):
#   - one rank with one thread, two pipeline stages (PP = 2), two tensor ranks (TP = 2),
#     each rank one thread, and one rank with two threads;
#   - batch-1 decode (a 16-token prompt, 128 new tokens: 1000 / tpot_ms), and batched decode
#     (16 requests of 512-token prompts prefilled in one step, then 32 new tokens each:
#     16 x 1000 / median tpot_ms);
#   - the KV blocks each layout holds at the same cache.memory, and for TP = 2 the
#     all-reduce's calls, microseconds per call and share of rank 0's time (batch 1).
#
#   benchmarks/tensor_bench.sh [--runs N] [--only f32|q8_0]
#
# Prints Markdown tables of medians over the runs. Needs the build (scripts/build.sh) and,
# for the Q8_0 file, llama-cpp-python in .venv (scripts/setup.sh --references).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=3
only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    *) echo "tensor_bench: unknown argument $1" >&2; exit 2 ;;
  esac
done
kvpipe=build/release/launch/kvpipe
[ -x "$kvpipe" ] || { echo "tensor_bench: build first (scripts/build.sh)" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

prompt() {  # length, seed
  seq 0 $(($1 - 1)) | awk -v i="$2" '{printf "%s%d", (NR>1?", ":""), ($1*7919+i*13)%8000+3}'
}
{
  echo 'cache: {memory: 256MiB}'
  echo 'sampling: {ignore_eos: true}'
  echo 'requests:'
  echo "  - {prompt_ids: [$(prompt 16 0)], max_new_tokens: 128}"
} >"$tmp/batch1.yaml"
{
  echo 'cache: {memory: 256MiB}'
  # Every prompt in one step: the decode steps that follow are decode alone.
  echo 'scheduler: {max_batch: 16, max_tokens_per_step: 8192}'
  echo 'sampling: {ignore_eos: true}'
  echo 'requests:'
  for i in $(seq 0 15); do echo "  - {prompt_ids: [$(prompt 512 "$i")], max_new_tokens: 32}"; done
} >"$tmp/batch16.yaml"

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

run_layout() {  # job, model, layout -> stderr in $tmp/err, stdout in $tmp/out
  local job=$1 model=$2 layout=$3
  local args=(generate --config "$job" --set model.path="$model")
  case "$layout" in
    one1) "$kvpipe" "${args[@]}" --set runtime.threads=1 >"$tmp/out" 2>"$tmp/err" ;;
    one2) "$kvpipe" "${args[@]}" --set runtime.threads=2 >"$tmp/out" 2>"$tmp/err" ;;
    pp2) mpirun --oversubscribe -np 2 "$kvpipe" "${args[@]}" --set runtime.threads=1 >"$tmp/out" 2>"$tmp/err" ;;
    tp2) mpirun --oversubscribe -np 2 "$kvpipe" "${args[@]}" --set runtime.threads=1 --set parallel.tensor=2 \
           >"$tmp/out" 2>"$tmp/err" ;;
  esac
}

tpot_median() { grep -oE '"tpot_ms":[0-9.]+' "$tmp/out" | cut -d: -f2 | median; }

measure() {  # model label, model path
  local label=$1 model=$2
  declare -A b1 b16 blocks
  : >"$tmp/ar_calls"; : >"$tmp/ar_us"; : >"$tmp/ar_share"
  for layout in one1 pp2 tp2 one2; do
    : >"$tmp/b1"; : >"$tmp/b16"
    for _ in $(seq 1 "$runs"); do
      run_layout "$tmp/batch1.yaml" "$model" "$layout"
      tpot_median | awk '{printf "%.2f\n", 1000 / $1}' >>"$tmp/b1"
      if [ "$layout" = tp2 ]; then
        # rank 0's line: "all-reduce N calls, U us per call, S% of the run"
        sed -nE 's/.*rank 0: all-reduce ([0-9.]+) calls, ([0-9.]+) us per call, ([0-9.]+)% of the run.*/\1 \2 \3/p' \
          "$tmp/err" | head -1 >"$tmp/ar"
        awk '{print $1}' "$tmp/ar" >>"$tmp/ar_calls"; awk '{print $2}' "$tmp/ar" >>"$tmp/ar_us"
        awk '{print $3}' "$tmp/ar" >>"$tmp/ar_share"
      fi
      run_layout "$tmp/batch16.yaml" "$model" "$layout"
      tpot_median | awk '{printf "%.1f\n", 16 * 1000 / $1}' >>"$tmp/b16"
      blocks[$layout]=$(grep -oE ', [0-9]+ blocks of 16 tokens' "$tmp/err" | head -1 | grep -oE '[0-9]+' | head -1)
    done
    b1[$layout]=$(median <"$tmp/b1")
    b16[$layout]=$(median <"$tmp/b16")
  done
  echo "#### $label"
  echo
  echo "| layout | batch-1 decode tok/s | / one rank 1 thread | / one rank 2 threads | batch-16 decode tok/s (512-token prompts) | / one rank 1 thread | KV blocks at 256 MiB |"
  echo "|---|---|---|---|---|---|---|"
  for layout in one1 pp2 tp2 one2; do
    local name
    case "$layout" in
      one1) name="one rank, 1 thread" ;;
      pp2) name="PP = 2 (2 stages, 1 thread each)" ;;
      tp2) name="TP = 2 (2 tensor ranks, 1 thread each)" ;;
      one2) name="one rank, 2 threads" ;;
    esac
    echo "| $name | ${b1[$layout]} | $(awk -v a="${b1[$layout]}" -v b="${b1[one1]}" 'BEGIN{printf "%.2f", a/b}') |" \
         "$(awk -v a="${b1[$layout]}" -v b="${b1[one2]}" 'BEGIN{printf "%.2f", a/b}') | ${b16[$layout]} |" \
         "$(awk -v a="${b16[$layout]}" -v b="${b16[one1]}" 'BEGIN{printf "%.2f", a/b}') | ${blocks[$layout]} |"
  done
  echo
  echo "TP = 2, batch 1, rank 0: $(median <"$tmp/ar_calls") all-reduces, $(median <"$tmp/ar_us") us per call," \
       "$(median <"$tmp/ar_share")% of the run (medians of $runs runs)"
  echo
}

if [ "$only" != q8_0 ]; then measure "small preset, float32 (dummy:small, 445 MB)" "dummy:small"; fi
if [ "$only" != f32 ]; then
  "$kvpipe" init-model --preset small --layers 16 --format gguf --out "$tmp/f32.gguf" >/dev/null
  .venv/bin/python tests/peer/llama_quantize.py "$tmp/f32.gguf" "$tmp/q8_0.gguf" Q8_0 >/dev/null
  rm -f "$tmp/f32.gguf"
  size=$(stat -c %s "$tmp/q8_0.gguf")
  measure "small shape with 16 layers, Q8_0 GGUF by llama-quantize ($((size / 1000000)) MB)" "$tmp/q8_0.gguf"
fi
echo "medians of $runs runs; machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc --all) cores"
