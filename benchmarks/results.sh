#!/usr/bin/env bash
# Regenerates benchmarks/RESULTS.md on this machine.
#
#   benchmarks/results.sh [--all | --with decode,pipeline,tensor,cache,peers,serve] [--runs N]
#
# Always runs batch-1 decode against the memory-bandwidth floor (--runs times) and the
# standard sweep (benchmarks/sweeps/standard-*.toml: 1, 2 and 4 ranks, batch 1 to 64,
# prompts of 128 to 2,048 tokens, the `small` preset), and rewrites that section of RESULTS.md: the
# tables, the plots (copied to benchmarks/results/) and each figure against its reference
# (the memory-bandwidth floor for batch-1 decode, the one-rank run for scaling). `--with`
# (or `--all`) also reruns the other benchmark scripts and replaces their sections with
# their output; sections not rerun are kept from the previous RESULTS.md as they were.
# Takes about 15 minutes on 2 cores for the sweep alone; run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
with="" runs=3
while [ $# -gt 0 ]; do
  case "$1" in
    --all) with="decode,pipeline,tensor,cache,peers,serve"; shift ;;
    --with) with=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    *) echo "results: unknown argument $1" >&2; exit 2 ;;
  esac
done
# Configures and builds first, so that the reports name the commit being measured.
bash scripts/build.sh >/dev/null
kvpipe=build/release/launch/kvpipe membw=build/release/benchmarks/kvpipe_membw
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

out=out/results-sweep
rm -rf "$out"
bandwidth() { "$membw" 1024 5 | grep -oE '"read_gbps_median": [0-9.]+' | awk '{print $2}'; }
# Batch-1 decode against the memory-bandwidth floor: each run measures the read bandwidth,
# then decode of 128 tokens after a 16-token prompt, back to back; the ratio is per run.
floor_runs=$(mktemp)
for r in $(seq 1 "$runs"); do
  bw=$(bandwidth)
  "$kvpipe" bench --config configs/bench-small.yaml --out "$out/floor-$r" --log-level error \
    --set workload.requests=2 --set workload.warmup=1 --set workload.concurrency=1 \
    --set workload.prompt_len=16 --set workload.output_len=128 >/dev/null
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
print(sys.argv[2], r["latency_ms"]["decode_step"]["median"], r["decode_weight_bytes"])' \
    "$out/floor-$r/report.json" "$bw" >>"$floor_runs"
  echo "results: floor run $r: $(tail -1 "$floor_runs") (GB/s, decode step ms, bytes)"
done
benchmarks/sweep run benchmarks/sweeps/standard-scaling.toml benchmarks/sweeps/standard-batch.toml \
  benchmarks/sweeps/standard-prompt.toml --out "$out"

# What RESULTS.md shows of the sweep lives in the repository: the CSV and the plots.
rm -rf benchmarks/results/sweep
mkdir -p benchmarks/results/sweep
cp "$out/sweep.csv" "$out/sweep.json" benchmarks/results/sweep/
cp -r "$out/plots" benchmarks/results/sweep/plots
rm -f benchmarks/results/sweep/plots/*.gp

section_file=$(mktemp)
trap 'rm -f "$section_file" "$floor_runs"' EXIT
python3 - "$floor_runs" >"$section_file" <<'PY'
import csv, json, statistics, subprocess, sys
floor_runs = [line.split() for line in open(sys.argv[1]) if line.strip()]
rows = list(csv.DictReader(open("benchmarks/results/sweep/sweep.csv")))
meta = json.load(open("benchmarks/results/sweep/sweep.json"))
machine = meta.get("machine", {})
kv = meta.get("kvpipe", {})
print("## Standard sweep")
print()
print("Command: `benchmarks/results.sh` (the sweep files are benchmarks/sweeps/standard-*.toml;")
print("raw figures in [results/sweep/sweep.csv](results/sweep/sweep.csv)).")
print()
print(f"Machine: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, "
      f"{machine.get('memory_bytes', 0) / 2**30:.0f} GiB, no GPU; kvpipe {kv.get('version', '?')} "
      f"({kv.get('git', '?')}, {kv.get('build_type', '?')}, {kv.get('compiler', '?')}, LibTorch {kv.get('torch', '?')}). "
      "One compute thread per rank; 4 ranks on 2 cores are oversubscribed (marked `*`). "
      "Every point is one `kvpipe bench` run; latencies are medians and p99s over its requests and steps.")
print()
# Batch-1 decode against the memory-bandwidth floor, run by run.
if floor_runs:
    print("### Batch-1 decode against the memory-bandwidth floor")
    print()
    print("| run | read GB/s | decode step median ms | floor ms | floor / step |")
    print("|---|---|---|---|---|")
    ratios, steps, bws = [], [], []
    for i, (bw, step, nbytes) in enumerate(floor_runs, 1):
        bw, step, nbytes = float(bw), float(step), int(nbytes)
        floor = nbytes / (bw * 1e9) * 1e3
        ratios.append(floor / step); steps.append(step); bws.append(bw)
        print(f"| {i} | {bw:.2f} | {step:.2f} | {floor:.2f} | {floor / step:.2f} |")
    print(f"| **median** | {statistics.median(bws):.2f} | {statistics.median(steps):.2f} | | "
          f"**{statistics.median(ratios):.2f}** |")
    print()
    print(f"`kvpipe bench` on `configs/bench-small.yaml`, one rank, one thread: 128 tokens decoded after a "
          f"16-token prompt, batch 1. The floor is the time to read the {int(floor_runs[0][2]):,} bytes of "
          "weights a decode step touches once, at the read bandwidth `kvpipe_membw` measured with one thread "
          "just before (median of 5 passes over 1 GiB); 1.00 would be a step bound by memory alone. The table "
          "quotes the median of the per-run ratios.")
    print()
md = subprocess.run(["benchmarks/sweep", "markdown", "benchmarks/results/sweep", "--relative-to", "benchmarks"],
                    check=True, capture_output=True, text=True).stdout
print(md)
PY

# Reruns the other sections asked for; each script prints Markdown.
declare -A titles=([decode]="Batch-1 decode and prompt processing against the memory-bandwidth floor"
                   [pipeline]="Pipeline: steady-state decode on two ranks"
                   [tensor]="Tensor parallelism"
                   [cache]="KV-cache policies: what they cost and save"
                   [peers]="Against llama.cpp on the same weights"
                   [serve]="Serving: kvpipe serve against llama-server")
declare -A commands=([decode]="benchmarks/decode_bench.sh --runs $runs"
                     [pipeline]="benchmarks/pipeline_bench.sh --runs $runs"
                     [tensor]="benchmarks/tensor_bench.sh --runs $runs"
                     [cache]="benchmarks/cache_bench.sh --runs $runs"
                     [peers]="benchmarks/peers/compare.sh --runs $runs"
                     [serve]="benchmarks/serve_bench.sh")
rerun_dir=$(mktemp -d)
for s in ${with//,/ }; do
  [ -n "${commands[$s]:-}" ] || { echo "results: unknown section $s (decode, pipeline, tensor, cache, peers, serve)" >&2; exit 2; }
  echo "results: running ${commands[$s]}"
  {
    echo "## ${titles[$s]}"
    echo
    echo "Command: \`${commands[$s]}\` (run by benchmarks/results.sh on $(date -u +%Y-%m-%d))."
    echo
    ${commands[$s]}
  } >"$rerun_dir/$s.md"
done

python3 - "$section_file" "$rerun_dir" <<'PY'
import os, re, sys
section_file, rerun_dir = sys.argv[1], sys.argv[2]
path = "benchmarks/RESULTS.md"
old = open(path).read() if os.path.exists(path) else ""
def block(name, body):
    return f"<!-- section: {name} -->\n{body.rstrip()}\n<!-- end: {name} -->"
def previous(name):
    m = re.search(rf"<!-- section: {name} -->\n(.*?)\n<!-- end: {name} -->", old, re.S)
    return m.group(1) if m else None
head = """# kvpipe benchmark results

Regenerated by `benchmarks/results.sh`, which runs the standard sweep and, with `--all`,
every other benchmark script below; a section it did not rerun is kept as its last run left
it (each section names its command). The machines are shared and noisy (the same command
varies by up to 30% between runs): read the medians, and the ratios to references measured
in the same run, rather than single figures.
"""
parts = [head, block("standard-sweep", open(section_file).read())]
for name in ["platform", "decode", "pipeline", "tensor", "cache", "peers", "peers-intel", "cpu-kernels-intel", "cpu-kernels-amd", "cpu-kernels-zen4",
             "serve", "real-workloads", "tuning",
             "structured-outputs", "speculative"]:
    fresh = os.path.join(rerun_dir, name + ".md")
    body = open(fresh).read() if os.path.exists(fresh) else previous(name)
    if body:
        parts.append(block(name, body))
open(path, "w").write("\n\n".join(parts) + "\n")
print(f"results: wrote {path}")
PY
rm -rf "$rerun_dir"
