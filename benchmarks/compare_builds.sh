#!/usr/bin/env bash
# This build of kvpipe against another (an earlier commit, another LibTorch) on one machine in
# one run: batch-1 decode of the `small` preset or --model's file (128 tokens after a 16-token
# prompt, 1000 / tpot_ms) and a 512-token prompt (512000 / ttft_ms), the builds alternating within
# each run, with the read bandwidth measured at the start of each run.
#
#   benchmarks/compare_builds.sh --base OTHER/kvpipe [--runs N] [--threads T] [--env NAME=V,...]
#                                [--set KEY=V,...] [--model PATH]
#
# --env adds a third variant: this build with those environment variables (for example
# KVPIPE_CPU_BLAS=torch); --set gives that variant config overrides instead or as well (for
# example model.repack=false). Prints a Markdown table of medians and of the per-run ratios to the
# base build.
set -euo pipefail
cd "$(dirname "$0")/.."
base="" runs=5 threads=1 extra="" sets="" model=dummy:small
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --env) extra=$2; shift 2 ;;
    --set) sets=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    *) echo "compare_builds: unknown argument $1" >&2; exit 2 ;;
  esac
done
this=build/release/launch/kvpipe membw=build/release/benchmarks/kvpipe_membw
[ -x "$this" ] && [ -x "$membw" ] || { echo "compare_builds: build first (scripts/build.sh)" >&2; exit 2; }
[ -n "$base" ] && [ -x "$base" ] || { echo "compare_builds: --base names no executable" >&2; exit 2; }
export OMP_NUM_THREADS=$threads
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf 'model: {path: "%s"}\nruntime: {threads: %s}\ncache: {memory: 256MiB}\nsampling: {ignore_eos: true}\n' \
  "$model" "$threads" >"$tmp/job.yaml"
ids() { seq 0 $(($1 - 1)) | awk '{printf "%s%d", (NR>1?",":""), ($1*7919)%8000+3}'; }
decode_prompt=$(ids 16) prefill_prompt=$(ids 512)
field() { grep -oE "\"$1\":[0-9.]+" | head -1 | cut -d: -f2; }
variants=(base this)
[ -n "$extra$sets" ] && variants+=(env)
for r in $(seq 1 "$runs"); do
  bw=$("$membw" 1024 5 | grep -oE '"read_gbps_median": [0-9.]+' | awk '{print $2}')
  for v in "${variants[@]}"; do
    bin=$this env_args=() set_args=()
    [ "$v" = base ] && bin=$base
    [ "$v" = env ] && [ -n "$extra" ] && IFS=, read -r -a env_args <<<"$extra"
    if [ "$v" = env ] && [ -n "$sets" ]; then
      IFS=, read -r -a kvs <<<"$sets"
      for kv in "${kvs[@]}"; do set_args+=(--set "$kv"); done
    fi
    tpot=$(env "${env_args[@]}" "$bin" generate --config "$tmp/job.yaml" "${set_args[@]}" --prompt-ids "$decode_prompt" \
      --max-new-tokens 128 --log-level error | field tpot_ms)
    ttft=$(env "${env_args[@]}" "$bin" generate --config "$tmp/job.yaml" "${set_args[@]}" --prompt-ids "$prefill_prompt" \
      --max-new-tokens 1 --log-level error | field ttft_ms)
    echo "$r $v $bw $tpot $ttft" >>"$tmp/rows"
  done
done
python3 - "$tmp/rows" "$base" "$extra${extra:+${sets:+, }}${sets:+--set $sets}" "$threads" "$runs" "$model" <<'PY'
import statistics as st, sys
rows, base, extra, threads, runs, model = sys.argv[1:7]
by = {}
for line in open(rows):
    r, v, bw, tpot, ttft = line.split()
    by.setdefault(r, {})[v] = (1000 / float(tpot), 512000 / float(ttft), float(bw))
names = {"base": f"base ({base})", "this": "this build", "env": f"this build, {extra}"}
print("| build | decode tok/s | decode / base | prefill 512 tok/s | prefill / base |")
print("|---|---|---|---|---|")
for v in [k for k in ("base", "this", "env") if k in next(iter(by.values()))]:
    d = st.median(x[v][0] for x in by.values()); p = st.median(x[v][1] for x in by.values())
    rd = st.median(x[v][0] / x["base"][0] for x in by.values())
    rp = st.median(x[v][1] / x["base"][1] for x in by.values())
    print(f"| {names[v]} | {d:.1f} | {rd:.2f} | {p:.1f} | {rp:.2f} |")
print()
print(f"{'`small` preset' if model == 'dummy:small' else model}, {threads} thread(s), {runs} run(s), builds alternating within each run; "
      f"ratios are medians of the per-run ratios; read bandwidth median "
      f"{st.median(x['base'][2] for x in by.values()):.2f} GB/s (one thread).")
print("raw rows (run build bandwidth_GBps decode_tok_s prefill512_tok_s):")
print()
print("```")
for r, vs in by.items():
    for v, (d, p, bw) in vs.items():
        print(f"{r} {v} {bw} {d:.1f} {p:.1f}")
print("```")
PY
