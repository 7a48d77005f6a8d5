#!/usr/bin/env bash
# kvpipe against llama.cpp on the same weights, machine and run: batch-1 decode (128 tokens)
# and prompt processing (512 tokens) of the `small` preset in F32, with 1 and 2 threads.
#
#   benchmarks/peers/compare.sh [--runs N]
#
# The model is written once by `kvpipe init-model --format gguf --preset small` (the weights of
# `dummy:small`), and both engines read that file. kvpipe: decode = 1000 / tpot_ms over 128 new
# tokens after a 16-token prompt, prefill = 512000 / ttft_ms of a 512-token prompt.
# llama.cpp: llama-bench (built by build_llama_cpp.sh from the source the pinned
# llama-cpp-python sdist ships) tg128 and pp512. Each run measures the two engines back to back; medians over runs
# are printed as a Markdown table.
set -euo pipefail
cd "$(dirname "$0")/../.."
runs=3
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    *) echo "compare: unknown argument $1" >&2; exit 2 ;;
  esac
done
kvpipe=build/release/launch/kvpipe
bench=benchmarks/peers/llama.cpp/bin/llama-bench
[ -x "$bench" ] || { echo "compare: build llama-bench first (benchmarks/peers/build_llama_cpp.sh)" >&2; exit 2; }
peer="llama-bench ($(cat benchmarks/peers/llama.cpp/version 2>/dev/null | sed 's/^/llama-cpp-python /'))"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$kvpipe" init-model --format gguf --preset small --out "$tmp/small.gguf" >/dev/null 2>&1
ids() { seq 0 $(($1 - 1)) | awk '{printf "%s%d", (NR>1?",":""), ($1*7919)%8000+3}'; }
field() { grep -oE "\"$1\":[0-9.]+" | head -1 | cut -d: -f2; }

echo "threads run kv_decode kv_prefill ll_decode ll_prefill" >"$tmp/rows"
for threads in 1 2; do
  cat >"$tmp/job.yaml" <<YAML
model: {path: "$tmp/small.gguf"}
runtime: {threads: $threads}
cache: {memory: 256MiB}
sampling: {ignore_eos: true}
YAML
  for r in $(seq 1 "$runs"); do
    export OMP_NUM_THREADS=$threads
    "$kvpipe" generate --config "$tmp/job.yaml" --prompt-ids "$(ids 16)" --max-new-tokens 128 \
      >"$tmp/out" 2>"$tmp/err" || { echo "compare: kvpipe generate failed:" >&2; tail -n 3 "$tmp/err" >&2; exit 1; }
    tpot=$(field tpot_ms <"$tmp/out")
    "$kvpipe" generate --config "$tmp/job.yaml" --prompt-ids "$(ids 512)" --max-new-tokens 1 \
      >"$tmp/out" 2>"$tmp/err" || { echo "compare: kvpipe generate failed:" >&2; tail -n 3 "$tmp/err" >&2; exit 1; }
    ttft=$(field ttft_ms <"$tmp/out")
    "$bench" -m "$tmp/small.gguf" -t "$threads" -p 512 -n 128 -r 1 -o json >"$tmp/ll.json" 2>/dev/null
    read -r ll_pp ll_tg < <(python3 -c '
import json, sys
rows = json.load(open(sys.argv[1]))
ts = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in rows}
print(ts[(512, 0)], ts[(0, 128)])' "$tmp/ll.json")
    awk -v t="$threads" -v r="$r" -v tpot="$tpot" -v ttft="$ttft" -v pp="$ll_pp" -v tg="$ll_tg" \
      'BEGIN { printf "%d %d %.1f %.1f %.1f %.1f\n", t, r, 1000 / tpot, 512000 / ttft, tg, pp }' >>"$tmp/rows"
  done
done

echo "| threads | kvpipe decode tok/s | llama.cpp decode tok/s | decode ratio | kvpipe pp512 tok/s | llama.cpp pp512 tok/s | pp512 ratio |"
echo "|---|---|---|---|---|---|---|"
for threads in 1 2; do
  awk -v t="$threads" '$1 == t' "$tmp/rows" | sort -k1 | awk '
    function median(a, n,   i, j, x) { for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { x = a[i]; a[i] = a[j]; a[j] = x }
                                      return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
    { n++; kd[n] = $3; kp[n] = $4; ld[n] = $5; lp[n] = $6; rd[n] = $3 / $5; rp[n] = $4 / $6; t = $1 }
    END { printf "| %d | %.1f | %.1f | %.2f | %.1f | %.1f | %.2f |\n", t, median(kd, n), median(ld, n), median(rd, n),
                 median(kp, n), median(lp, n), median(rp, n) }'
done
echo
echo "llama.cpp measured with: $peer"
echo "small preset, F32 weights from one GGUF file, $runs run(s) per thread count; ratio = kvpipe / llama.cpp (median of per-run ratios)"
echo "raw rows (threads run kvpipe_decode kvpipe_pp512 llama_decode llama_pp512):"
tail -n +2 "$tmp/rows"
