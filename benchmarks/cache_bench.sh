#!/usr/bin/env bash
# What the KV-cache policies cost and save, on one rank with one thread.
#
#   benchmarks/cache_bench.sh [--runs N]
#
# 1. Prefix reuse: requests sharing a 1,024-token prefix, each with 64 tokens of its own,
#    arriving one after another (`small` preset): median time to first token of the
#    requests after the first, with prefix reuse and without.
# 2. Layer-level reuse: decode step latency (tpot) and KV bytes per token for
#    cached_layers = all, L/2, L/4 and 0, after prompts of 512 and 2,048 tokens (`small`).
# 3. Window: a 4,096-token generation with a window of 4 sinks + 256 recent tokens against
#    no window (a `tiny`-shaped model with an 8,192-token context): mean step latency over
#    the generation and peak KV blocks held.
# Prints Markdown tables of medians over the runs.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=3
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    *) echo "cache_bench: unknown argument $1" >&2; exit 2 ;;
  esac
done
kvpipe=build/release/launch/kvpipe
[ -x "$kvpipe" ] || { echo "cache_bench: build first (scripts/build.sh)" >&2; exit 2; }
export OMP_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ids() { seq 0 $(($1 - 1)) | awk -v s="$2" '{printf "%s%d", (NR>1?", ":""), ($1*7919+s*104729)%8000+3}'; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

# --- 1. prefix reuse -------------------------------------------------------------------
{
  echo 'model: {path: "dummy:small"}'
  echo 'cache: {memory: 512MiB}'
  echo 'sampling: {ignore_eos: true}'
  echo 'requests:'
  prefix=$(ids 1024 1)
  for i in 0 1 2 3; do
    echo "  - {prompt_ids: [$prefix, $(ids 64 $((i + 2)))], max_new_tokens: 2, arrival_step: $((i * 4))}"
  done
} >"$tmp/prefix.yaml"
ttft_after_first() {  # median ttft of requests 1.. over the runs
  for _ in $(seq 1 "$runs"); do
    "$kvpipe" generate --config "$tmp/prefix.yaml" "$@" 2>/dev/null |
      grep -v '^{"id":0,' | grep -oE '"ttft_ms":[0-9.]+' | cut -d: -f2 | median
  done | median
}
on=$(ttft_after_first --set cache.prefix_reuse=true)
off=$(ttft_after_first --set cache.prefix_reuse=false)
echo "### Prefix reuse (1,024 shared + 64 own tokens, small preset)"
echo
echo "| prefix reuse | median TTFT ms (requests 2-4) |"
echo "|---|---|"
echo "| off | $off |"
echo "| on | $on |"
echo "| **on / off** | **$(awk -v a="$on" -v b="$off" 'BEGIN {printf "%.3f", a / b}')** |"
echo

# --- 2. layer-level reuse ----------------------------------------------------------------
echo "### Layer-level reuse (small preset, 8 layers; decode after the prompt)"
echo
echo "| context | cached layers | KV bytes / token | decode step ms | vs all |"
echo "|---|---|---|---|---|"
# K and V, 8 KV heads of 64, float32: 4 KiB per token per layer.
for ctx in 512 2048; do
  prompt=$(ids "$ctx" 7 | tr -d ' ')
  base=""
  for n in all 4 2 0; do
    for _ in $(seq 1 "$runs"); do
      "$kvpipe" generate --config "$tmp/prefix.yaml" --prompt-ids "$prompt" \
          --max-new-tokens 4 --set cache.cached_layers=$n 2>/dev/null | grep -oE '"tpot_ms":[0-9.]+' | cut -d: -f2
    done | median >"$tmp/tpot"
    tpot=$(cat "$tmp/tpot")
    layers=$([ "$n" = all ] && echo 8 || echo "$n")
    [ -n "$base" ] || base=$tpot
    echo "| $ctx | $n | $((layers * 4096)) | $tpot | $(awk -v a="$tpot" -v b="$base" 'BEGIN {printf "%.2fx", a / b}') |"
  done
done
echo

# --- 3. window ----------------------------------------------------------------------------
"$kvpipe" init-model --preset tiny --max-position 8192 --out "$tmp/tiny8k" 2>/dev/null
cat >"$tmp/window.yaml" <<YAML
model: {path: $tmp/tiny8k}
cache: {memory: 256MiB}
sampling: {ignore_eos: true}
requests: [{prompt_ids: [1, 2, 3, 4, 5, 6, 7, 8], max_new_tokens: 4088}]
YAML
echo "### Window (tiny shape, 8,192-token context, 4,096 tokens generated)"
echo
echo "| window | mean step ms | peak KV blocks (16 tokens) | peak KV MiB |"
echo "|---|---|---|---|"
for w in "{sinks: 0, recent: 0}" "{sinks: 4, recent: 256}"; do
  : >"$tmp/steps"; : >"$tmp/blocks"
  for _ in $(seq 1 "$runs"); do
    "$kvpipe" generate --config "$tmp/window.yaml" --set "cache.window=$w" >/dev/null 2>"$tmp/err"
    grep -oE 'step latency mean [0-9.]+' "$tmp/err" | awk '{print $4}' >>"$tmp/steps"
    grep -oE 'peak [0-9]+ of' "$tmp/err" | awk '{print $2}' >>"$tmp/blocks"
  done
  blocks=$(median <"$tmp/blocks")
  # tiny: 4 layers x 4 KV heads x 32 x 2 (K, V) x 4 bytes = 4 KiB per token.
  echo "| $w | $(median <"$tmp/steps") | $blocks | $(awk -v b="$blocks" 'BEGIN {printf "%.1f", b * 16 * 4096 / 1048576}') |"
done
echo
echo "medians of $runs runs, one thread"
