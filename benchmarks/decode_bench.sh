#!/usr/bin/env bash
# Batch-1 decode and prompt processing of the `small` preset against the memory-bandwidth
# floor, on one machine in one run.
#
#   benchmarks/decode_bench.sh [--runs N] [--threads T] [--preset small]
#
# Each run measures, back to back: the read bandwidth (kvpipe_membw), decode of 128 tokens
# after a 16-token prompt (1000 / tpot_ms), and a 512-token prompt (512 / ttft_ms). The
# floor is (weight bytes read per decode step) / bandwidth; the ratio is taken per run and
# the medians are printed as a Markdown table.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=5 threads=1 preset=small
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --preset) preset=$2; shift 2 ;;
    *) echo "decode_bench: unknown argument $1" >&2; exit 2 ;;
  esac
done
kvpipe=build/release/launch/kvpipe membw=build/release/benchmarks/kvpipe_membw
[ -x "$kvpipe" ] && [ -x "$membw" ] || { echo "decode_bench: build first (scripts/build.sh)" >&2; exit 2; }
export OMP_NUM_THREADS=$threads
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/job.yaml" <<YAML
model: {path: "dummy:$preset"}
runtime: {threads: $threads}
cache: {memory: 256MiB}
sampling: {ignore_eos: true}
YAML
ids() { seq 0 $(($1 - 1)) | awk '{printf "%s%d", (NR>1?",":""), ($1*7919)%8000+3}'; }
decode_prompt=$(ids 16) prefill_prompt=$(ids 512)
field() { grep -oE "\"$1\":[0-9.]+" | head -1 | cut -d: -f2; }

echo "run bandwidth_GBps decode_tok_s floor_tok_s ratio prefill512_tok_s" >"$tmp/rows"
for r in $(seq 1 "$runs"); do
  bw=$("$membw" 1024 5 | grep -oE '"read_gbps_median": [0-9.]+' | awk '{print $2}')
  "$kvpipe" generate --config "$tmp/job.yaml" --prompt-ids "$decode_prompt" --max-new-tokens 128 \
      >"$tmp/out" 2>"$tmp/err"
  tpot=$(field tpot_ms <"$tmp/out")
  bytes=$(grep -oE '[0-9]+ weight bytes read per decode step' "$tmp/err" | awk '{print $1}')
  "$kvpipe" generate --config "$tmp/job.yaml" --prompt-ids "$prefill_prompt" --max-new-tokens 1 \
      >"$tmp/out" 2>"$tmp/err"
  ttft=$(field ttft_ms <"$tmp/out")
  awk -v r="$r" -v bw="$bw" -v tpot="$tpot" -v bytes="$bytes" -v ttft="$ttft" 'BEGIN {
    tok = 1000 / tpot; floor = bw * 1e9 / bytes
    printf "%d %.2f %.1f %.1f %.3f %.1f\n", r, bw, tok, floor, tok / floor, 512000 / ttft }' >>"$tmp/rows"
done

median() { tail -n +2 "$tmp/rows" | awk -v c="$1" '{print $c}' | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
echo "| run | read GB/s | decode tok/s | floor tok/s | decode / floor | prefill 512 tok/s |"
echo "|---|---|---|---|---|---|"
tail -n +2 "$tmp/rows" | awk '{printf "| %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6}'
echo "| **median** | $(median 2) | $(median 3) | $(median 4) | **$(median 5)** | $(median 6) |"
echo
echo "preset $preset, $threads thread(s), weight bytes read per decode step: $bytes"
