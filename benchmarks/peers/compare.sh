#!/usr/bin/env bash
# kvpipe against llama.cpp on the same GGUF files, machine and run, for every weight type kvpipe
# computes with: batch-1 decode (128 tokens) and prompt processing (512 tokens) at 1 and 2
# threads, batched decode at batch 8 and 32, and each decode against the bandwidth floor of
# the type's bytes.
#
#   benchmarks/peers/compare.sh [--runs N] [--types "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K_M
#                               Q4_K_M Q5_K_M Q6_K IQ4_NL IQ4_XS"]
#                               [--threads "1 2"] [--batches "8 32"] [--preset small] [--ik]
#
# The F32, F16 and BF16 files are written by `kvpipe init-model --format gguf` (the weights of
# `dummy:<preset>`); the quantised ones by llama.cpp's llama-quantize from the F16 file, so both
# engines read the very same bytes. A quantised type's name is any llama-quantize mix (Q3_K_S,
# Q5_K_S, ...); the default list has one mix per stored type (Q2_K, Q3_K_M: mostly Q2_K and
# Q3_K; IQ4_NL, IQ4_XS, Q5_0, Q5_1: those types throughout). kvpipe: decode = 1000 / tpot_ms over 128 new tokens after a
# 16-token prompt, prefill = 512000 / ms of a 512-token prompt's step after a first one (as
# llama-bench's warm-up run before its timed one), batched decode = batch x
# 1000 / median step ms of `batch` requests of 128 distinct prompt tokens and 32 new tokens.
# llama.cpp: llama-bench tg128 and pp512, llama-batched-bench -npp 128 -ntg 32 (speed_tg).
# Floor = read bandwidth (kvpipe_membw, measured at the start of each run and thread count) /
# weight bytes read per decode step. Every ratio is the median of per-run ratios.
# --ik adds ik_llama.cpp's llama-bench (benchmarks/peers/build_ik_llama_cpp.sh) as a second
# peer on the same files, in the same runs: tg128 and pp512 with its run-time repack of the
# weights into row-interleaved blocks (-rtr 1, its fastest CPU setting), a table of its own.
set -euo pipefail
cd "$(dirname "$0")/../.."
runs=3 types="F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K_M Q4_K_M Q5_K_M Q6_K IQ4_NL IQ4_XS" thread_list="1 2" batches="8 32" preset=small ik=0
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --types) types=$2; shift 2 ;;
    --threads) thread_list=$2; shift 2 ;;
    --batches) batches=$2; shift 2 ;;
    --preset) preset=$2; shift 2 ;;
    --ik) ik=1; shift ;;
    *) echo "compare: unknown argument $1" >&2; exit 2 ;;
  esac
done
kvpipe=build/release/launch/kvpipe membw=build/release/benchmarks/kvpipe_membw
bin=benchmarks/peers/llama.cpp/bin
[ -x "$kvpipe" ] && [ -x "$membw" ] || { echo "compare: build first (scripts/build.sh)" >&2; exit 2; }
for tool in llama-bench llama-batched-bench llama-quantize; do
  [ -x "$bin/$tool" ] || { echo "compare: build $tool first (benchmarks/peers/build_llama_cpp.sh)" >&2; exit 2; }
done
ik_bench=benchmarks/peers/ik_llama.cpp/bin/llama-bench
[ $ik = 0 ] || [ -x "$ik_bench" ] ||
  { echo "compare: --ik needs $ik_bench (benchmarks/peers/build_ik_llama_cpp.sh)" >&2; exit 2; }
peer="llama.cpp ($(cat benchmarks/peers/llama.cpp/version 2>/dev/null | sed 's/^/llama-cpp-python /'))"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ids() { seq "$2" $(($2 + $1 - 1)) | awk '{printf "%s%d", (NR>1?",":""), ($1*7919)%8000+3}'; }
field() { grep -oE "\"$1\":[0-9.]+" | head -1 | cut -d: -f2; }

model_file() {  # writes $tmp/<type>.gguf once
  local type=$1 f="$tmp/$1.gguf"
  [ -f "$f" ] && { echo "$f"; return; }
  case "$type" in
    F32) "$kvpipe" init-model --format gguf --preset "$preset" --dtype float32 --out "$f" >/dev/null 2>&1 ;;
    F16) "$kvpipe" init-model --format gguf --preset "$preset" --dtype float16 --out "$f" >/dev/null 2>&1 ;;
    BF16) "$kvpipe" init-model --format gguf --preset "$preset" --dtype bfloat16 --out "$f" >/dev/null 2>&1 ;;
    *) model_file F16 >/dev/null
       "$bin/llama-quantize" "$tmp/F16.gguf" "$f" "$type" 1 >"$tmp/quantize.log" 2>&1 ||
         { echo "compare: llama-quantize $type failed:" >&2; tail -n 3 "$tmp/quantize.log" >&2; exit 1; } ;;
  esac
  echo "$f"
}

bench_ts() {  # llama-bench JSON -> "pp512 tg128" tokens/s
  python3 -c '
import json, sys
rows = json.load(open(sys.argv[1]))
ts = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in rows}
print(ts[(512, 0)], ts[(0, 128)])' "$1"
}

kv_generate() {  # config, prompt ids, new tokens -> stdout line and stderr in $tmp/err
  "$kvpipe" generate --config "$1" --prompt-ids "$2" --max-new-tokens "$3" 2>"$tmp/err" ||
    { echo "compare: kvpipe generate failed:" >&2; tail -n 3 "$tmp/err" >&2; exit 1; }
}

kv_prompt_step() {  # threads -> ms of the second of two 512-token prompt steps (the first warms up)
  {
    echo "model: {path: \"$model\"}"
    echo "runtime: {threads: $1}"
    echo "cache: {memory: 512MiB, prefix_reuse: false}"
    echo "scheduler: {max_batch: 1, max_tokens_per_step: 512}"
    echo "requests:"
    echo "  - {prompt_ids: [$(ids 512 0)], max_new_tokens: 1}"
    echo "  - {prompt_ids: [$(ids 512 512)], max_new_tokens: 1}"
  } >"$tmp/prompts.yaml"
  "$kvpipe" generate --config "$tmp/prompts.yaml" 2>"$tmp/err" |
    python3 -c 'import json, sys; t = sorted(json.loads(l)["ttft_ms"] for l in sys.stdin if l.startswith("{")); print(t[1] - t[0])' ||
    { echo "compare: kvpipe prompt steps failed:" >&2; tail -n 3 "$tmp/err" >&2; exit 1; }
}

echo "type threads run bw_GBps bytes kv_decode kv_pp512 ll_decode ll_pp512 ik_decode ik_pp512" >"$tmp/rows"
echo "type threads batch run kv_tg ll_tg" >"$tmp/batched"
for type in $types; do
  model=$(model_file "$type")
  for threads in $thread_list; do
    export OMP_NUM_THREADS=$threads
    cat >"$tmp/job.yaml" <<YAML
model: {path: "$model"}
runtime: {threads: $threads}
cache: {memory: 512MiB, prefix_reuse: false}
sampling: {ignore_eos: true}
YAML
    for r in $(seq 1 "$runs"); do
      bw=$("$membw" 1024 5 | grep -oE '"read_gbps_median": [0-9.]+' | awk '{print $2}')
      tpot=$(kv_generate "$tmp/job.yaml" "$(ids 16 0)" 128 | field tpot_ms)
      bytes=$(grep -oE '[0-9]+ weight bytes read per decode step' "$tmp/err" | awk '{print $1}')
      # llama-bench runs a warm-up prompt before the one it times, and so does kvpipe here: two
      # distinct 512-token prompts in one process, one step each, the second one timed.
      ttft=$(kv_prompt_step "$threads")
      "$bin/llama-bench" -m "$model" -t "$threads" -p 512 -n 128 -r 1 -o json >"$tmp/ll.json" 2>/dev/null
      read -r ll_pp ll_tg < <(bench_ts "$tmp/ll.json")
      ik_pp=nan ik_tg=nan
      if [ $ik = 1 ]; then
        "$ik_bench" -m "$model" -t "$threads" -p 512 -n 128 -r 1 -rtr 1 -o json >"$tmp/ik.json" 2>/dev/null
        read -r ik_pp ik_tg < <(bench_ts "$tmp/ik.json")
      fi
      awk -v ty="$type" -v t="$threads" -v r="$r" -v bw="$bw" -v b="$bytes" -v tpot="$tpot" -v ttft="$ttft" \
        -v pp="$ll_pp" -v tg="$ll_tg" -v ipp="$ik_pp" -v itg="$ik_tg" \
        'BEGIN { printf "%s %d %d %.2f %d %.2f %.2f %.2f %.2f %s %s\n", ty, t, r, bw, b, 1000 / tpot, 512000 / ttft, tg, pp, itg, ipp }' \
        >>"$tmp/rows"
      for batch in $batches; do
        {
          echo "model: {path: \"$model\"}"
          echo "runtime: {threads: $threads}"
          echo "cache: {memory: 512MiB, prefix_reuse: false}"
          echo "scheduler: {max_batch: $batch, max_tokens_per_step: 4096}"
          echo "sampling: {ignore_eos: true}"
          echo "requests:"
          for i in $(seq 1 "$batch"); do echo "  - {prompt_ids: [$(ids 128 $((i * 128)))], max_new_tokens: 32}"; done
        } >"$tmp/batch.yaml"
        "$kvpipe" generate --config "$tmp/batch.yaml" >/dev/null 2>"$tmp/err" ||
          { echo "compare: kvpipe batched generate failed:" >&2; tail -n 3 "$tmp/err" >&2; exit 1; }
        step=$(grep -oE 'median [0-9.]+ ms' "$tmp/err" | head -1 | awk '{print $2}')
        ll=$("$bin/llama-batched-bench" -m "$model" -c $((batch * 160 + 64)) -b 4096 -ub 512 -npp 128 -ntg 32 \
               -npl "$batch" -t "$threads" --output-format jsonl 2>/dev/null | grep -oE '"speed_tg": [0-9.]+' | awk '{print $2}')
        awk -v ty="$type" -v t="$threads" -v b="$batch" -v r="$r" -v step="$step" -v ll="$ll" \
          'BEGIN { printf "%s %d %d %d %.2f %.2f\n", ty, t, b, r, b * 1000 / step, ll }' >>"$tmp/batched"
      done
    done
  done
done

python3 - "$tmp/rows" "$tmp/batched" "$peer" "$runs" "$preset" <<'PY'
import statistics as st
import sys
from collections import defaultdict

rows = [l.split() for l in open(sys.argv[1]).read().splitlines()[1:]]
batched = [l.split() for l in open(sys.argv[2]).read().splitlines()[1:]]
peer, runs, preset = sys.argv[3], sys.argv[4], sys.argv[5]
groups = defaultdict(list)
for ty, t, r, bw, b, kd, kp, ld, lp, idd, ip in rows:
    groups[(ty, int(t))].append((float(bw), int(b), float(kd), float(kp), float(ld), float(lp), float(idd), float(ip)))
print("| type | threads | MB/token | kvpipe decode tok/s | llama.cpp | ratio | floor tok/s | kvpipe/floor | llama.cpp/floor "
      "| kvpipe pp512 tok/s | llama.cpp | ratio |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for (ty, t), v in groups.items():
    med = lambda f: st.median(f(x) for x in v)
    floor = lambda x: x[0] * 1e9 / x[1]
    print(f"| {ty} | {t} | {v[0][1] / 1e6:.0f} | {med(lambda x: x[2]):.1f} | {med(lambda x: x[4]):.1f} | "
          f"{med(lambda x: x[2] / x[4]):.2f} | {med(floor):.1f} | {med(lambda x: x[2] / floor(x)):.2f} | "
          f"{med(lambda x: x[4] / floor(x)):.2f} | {med(lambda x: x[3]):.1f} | {med(lambda x: x[5]):.1f} | "
          f"{med(lambda x: x[3] / x[5]):.2f} |")
if any(x[6] == x[6] for v in groups.values() for x in v):  # ik_llama.cpp ran (not nan)
    print()
    print("| type | threads | kvpipe decode tok/s | ik_llama.cpp | ratio | kvpipe pp512 tok/s | ik_llama.cpp | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for (ty, t), v in groups.items():
        med = lambda f: st.median(f(x) for x in v)
        print(f"| {ty} | {t} | {med(lambda x: x[2]):.1f} | {med(lambda x: x[6]):.1f} | {med(lambda x: x[2] / x[6]):.2f} | "
              f"{med(lambda x: x[3]):.1f} | {med(lambda x: x[7]):.1f} | {med(lambda x: x[3] / x[7]):.2f} |")
if batched:
    print()
    print("| type | threads | batch | kvpipe decode tok/s | llama-batched-bench tok/s | ratio |")
    print("|---|---|---|---|---|---|")
    bg = defaultdict(list)
    for ty, t, b, r, kv, ll in batched:
        bg[(ty, int(t), int(b))].append((float(kv), float(ll)))
    for (ty, t, b), v in bg.items():
        print(f"| {ty} | {t} | {b} | {st.median(x[0] for x in v):.1f} | {st.median(x[1] for x in v):.1f} | "
              f"{st.median(x[0] / x[1] for x in v):.2f} |")
print()
print(f"{peer}; `{preset}` preset, {runs} run(s); ratio = kvpipe / llama.cpp, medians of per-run ratios.")
print("raw rows (type threads run bandwidth_GBps bytes_per_token kv_decode kv_pp512 ll_decode ll_pp512 ik_decode ik_pp512):")
for r in rows:
    print(" ".join(r))
print("raw batched rows (type threads batch run kv_tok_s ll_tok_s):")
for r in batched:
    print(" ".join(r))
PY
