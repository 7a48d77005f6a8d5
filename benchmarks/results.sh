#!/usr/bin/env bash
# Regenerates benchmarks/RESULTS.md on this machine.
#
#   benchmarks/results.sh [--all | --with decode,pipeline,cache,peers] [--runs N]
#
# Always runs the standard sweep (benchmarks/sweeps/standard-*.toml: 1, 2 and 4 ranks,
# batch 1 to 64, prompts of 128 to 2,048 tokens, the `small` preset) with the read
# bandwidth measured before and after it, and rewrites the sweep section of RESULTS.md: the
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
    --all) with="decode,pipeline,cache,peers"; shift ;;
    --with) with=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    *) echo "results: unknown argument $1" >&2; exit 2 ;;
  esac
done
kvpipe=build/release/launch/kvpipe membw=build/release/benchmarks/kvpipe_membw
[ -x "$kvpipe" ] && [ -x "$membw" ] || { echo "results: build first (scripts/build.sh)" >&2; exit 2; }
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

out=out/results-sweep
rm -rf "$out"
bandwidth() { "$membw" 1024 5 | grep -oE '"read_gbps_median": [0-9.]+' | awk '{print $2}'; }
bw_before=$(bandwidth)
echo "results: read bandwidth before the sweep: $bw_before GB/s (1 thread)"
benchmarks/sweep run benchmarks/sweeps/standard-scaling.toml benchmarks/sweeps/standard-batch.toml \
  benchmarks/sweeps/standard-prompt.toml --out "$out"
bw_after=$(bandwidth)
echo "results: read bandwidth after the sweep: $bw_after GB/s (1 thread)"

# What RESULTS.md shows of the sweep lives in the repository: the CSV and the plots.
rm -rf benchmarks/results/sweep
mkdir -p benchmarks/results/sweep
cp "$out/sweep.csv" "$out/sweep.json" benchmarks/results/sweep/
cp -r "$out/plots" benchmarks/results/sweep/plots
rm -f benchmarks/results/sweep/plots/*.gp

section_file=$(mktemp)
trap 'rm -f "$section_file"' EXIT
python3 - "$bw_before" "$bw_after" >"$section_file" <<'PY'
import csv, json, statistics, subprocess, sys
bw = [float(sys.argv[1]), float(sys.argv[2])]
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
# Batch-1 decode against the memory-bandwidth floor: the one-rank, batch-1 point.
b1 = [r for r in rows if r["sweep"] == "batch" and r["ranks"] == "1" and json.loads(r["batch"])[0] == 1]
if b1:
    r = b1[0]
    step = float(r["decode_step_median_ms"])
    nbytes = int(float(r["decode_weight_bytes"]))
    bw_mean = statistics.mean(bw)
    floor = nbytes / (bw_mean * 1e9) * 1e3
    print("### Batch-1 decode against the memory-bandwidth floor")
    print()
    print("| decode step median ms | weight bytes per step | read GB/s (before / after the sweep) | floor ms | floor / step |")
    print("|---|---|---|---|---|")
    print(f"| {step:.2f} | {nbytes:,} | {bw[0]:.2f} / {bw[1]:.2f} | {floor:.2f} | **{floor / step:.2f}** |")
    print()
    print("The floor is the time to read every weight a decode step touches once at the read bandwidth "
          "`kvpipe_membw` measured with one thread in the same run (mean of before and after); "
          "1.00 would be a step bound by memory alone.")
    print()
md = subprocess.run(["benchmarks/sweep", "markdown", "benchmarks/results/sweep", "--relative-to", "benchmarks"],
                    check=True, capture_output=True, text=True).stdout
print(md)
PY

# Reruns the other sections asked for; each script prints Markdown.
declare -A titles=([decode]="Batch-1 decode and prompt processing against the memory-bandwidth floor"
                   [pipeline]="Pipeline: steady-state decode on two ranks"
                   [cache]="KV-cache policies: what they cost and save"
                   [peers]="Against llama.cpp on the same weights")
declare -A commands=([decode]="benchmarks/decode_bench.sh --runs $runs"
                     [pipeline]="benchmarks/pipeline_bench.sh --runs $runs"
                     [cache]="benchmarks/cache_bench.sh --runs $runs"
                     [peers]="benchmarks/peers/compare.sh --runs $runs")
rerun_dir=$(mktemp -d)
for s in ${with//,/ }; do
  [ -n "${commands[$s]:-}" ] || { echo "results: unknown section $s (decode, pipeline, cache, peers)" >&2; exit 2; }
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
for name in ["decode", "pipeline", "cache", "peers"]:
    fresh = os.path.join(rerun_dir, name + ".md")
    body = open(fresh).read() if os.path.exists(fresh) else previous(name)
    if body:
        parts.append(block(name, body))
open(path, "w").write("\n\n".join(parts) + "\n")
print(f"results: wrote {path}")
PY
rm -rf "$rerun_dir"
