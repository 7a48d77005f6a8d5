#!/usr/bin/env bash
# kvpipe serve against llama.cpp's llama-server: the same GGUF file, the same number of
# parallel slots (32; llama-server with continuous batching), the same threads, the same
# workload, measured by one client (`kvpipe bench --endpoint`) at 1, 8 and 32 concurrent
# clients, one server at a time. Prints (Markdown, on stdout) a table of output tokens/s
# and p99 TPOT (the ratio is kvpipe over llama-server), then benchmarks/prefill_interference.py's
# table (decodes while 2,048-token prompts arrive, by scheduler.max_prefill_tokens_per_step);
# keeps every report.json under OUT. Progress goes to stderr.
#   bash benchmarks/serve_bench.sh [OUT]      (default out/serve-bench)
# Environment: KVPIPE (the binary), THREADS (compute threads of each server, default 2),
# CLIENTS (default "1 8 32").
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/out/serve-bench}"
kvpipe="${KVPIPE:-$root/build/release/launch/kvpipe}"
threads="${THREADS:-2}"
clients="${CLIENTS:-1 8 32}"
config="$root/benchmarks/serve-smollm2.yaml"
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
slots=32
port=18731

[ -x "$kvpipe" ] || { echo "serve_bench: build kvpipe first (bash scripts/build.sh)" >&2; exit 1; }
[ -f "$model" ] || { echo "serve_bench: $model is missing (run scripts/setup.sh)" >&2; exit 1; }
bash "$root/benchmarks/peers/build_llama_cpp.sh"
llama="$root/benchmarks/peers/llama.cpp/bin/llama-server"
mkdir -p "$out"

server_pid=""
stop_server() {
  [ -n "$server_pid" ] || return 0
  kill -TERM "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=""
}
trap stop_server EXIT

wait_ready() {
  for _ in $(seq 1 600); do
    if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then return 0; fi
    kill -0 "$server_pid" 2>/dev/null || { echo "serve_bench: the $1 server exited (see $out/$1.log)" >&2; exit 1; }
    sleep 0.2
  done
  echo "serve_bench: the $1 server was not ready in 120 s" >&2
  exit 1
}

for server in kvpipe llama-server; do
  if [ "$server" = kvpipe ]; then
    "$kvpipe" serve --config "$config" --port "$port" --set "runtime.threads=$threads" \
      --set "scheduler.max_batch=$slots" >"$out/$server.log" 2>&1 &
  else
    # Each slot holds prompt + output (192 tokens) with room to spare.
    "$llama" -m "$model" --host 127.0.0.1 --port "$port" -np "$slots" -c $((slots * 512)) \
      -t "$threads" -tb "$threads" >"$out/$server.log" 2>&1 &
  fi
  server_pid=$!
  (cd "$root" && wait_ready "$server")
  for c in $clients; do
    requests=$((c * 4 > 16 ? c * 4 : 16))
    echo "serve_bench: $server, $c client(s), $requests requests" >&2
    (cd "$root" && "$kvpipe" bench --config "$config" --endpoint "http://127.0.0.1:$port" \
      --out "$out/$server-c$c" --set "workload.concurrency=$c" --set "workload.requests=$requests" \
      >"$out/$server-c$c.txt")
  done
  stop_server
done

cpu="$(lscpu | sed -n 's/^Model name: *//p' | head -1)"
echo "Machine: $cpu, $(nproc) cores; each server computes on $threads thread(s), 32 slots; the client"
echo "(\`kvpipe bench --endpoint\`, benchmarks/serve-smollm2.yaml: prompts of 128 random token ids,"
echo "64 output tokens, EOS ignored, greedy, closed loop, 4 requests per client and at least 16) runs on"
echo "the same machine. Model: SmolLM2-135M-Instruct Q4_1 GGUF for both; llama-server of the pinned"
echo "llama-cpp-python's llama.cpp (\`-np 32 -c 16384 -t $threads -tb $threads\`, KV cache F16), kvpipe"
echo "with \`scheduler.max_batch: 32\` (KV cache F32)."
echo
python3 - "$out" "$clients" <<'EOF'
import json, sys
out, clients = sys.argv[1], sys.argv[2].split()
def load(server, c):
    r = json.load(open(f"{out}/{server}-c{c}/report.json"))
    return r["throughput"]["output_tokens_per_s"], r["latency_ms"]["tpot"]["p99"], r["latency_ms"]["tpot"]["median"], r["requests"]["failed"]
print("| clients | kvpipe tok/s | llama-server tok/s | ratio | kvpipe p99 TPOT ms | llama-server p99 TPOT ms | median TPOT ms (kvpipe / llama-server) |")
print("|---|---|---|---|---|---|---|")
for c in clients:
    k, l = load("kvpipe", c), load("llama-server", c)
    failed = f" ({k[3]} / {l[3]} failed)" if k[3] or l[3] else ""
    print(f"| {c} | {k[0]:.1f} | {l[0]:.1f} | {k[0] / l[0]:.2f} | {k[1]:.1f} | {l[1]:.1f} | {k[2]:.1f} / {l[2]:.1f}{failed} |")
EOF

echo
echo "Decode latency while 2,048-token prompts arrive (\`benchmarks/prefill_interference.py\`, 4"
echo "streams of 150 tokens; long prompts back to back, one output token each):"
echo
"$root/.venv/bin/python" "$root/benchmarks/prefill_interference.py" --budgets "${BUDGETS:-0,4,16}" --threads "$threads"
