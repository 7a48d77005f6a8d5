#!/usr/bin/env python3
"""Speculative decoding through a server: `kvpipe serve` with speculative.method off and ngram,
and llama.cpp's llama-server without and with its n-gram speculation (`--spec-type`), on the
prompts of benchmarks/speculative/ (chat completions, greedy), at 1 and 8 concurrent clients.

Each server runs alone; every prompt of a set is sent once per round by C client threads
(each takes the next prompt when its answer is done), streamed, and timed: a request's decode
rate is its output tokens after the first over the time from its first streamed token to its
last; a round's throughput is every output token over the round's wall time. Ratios are
medians of per-run ratios against the same server without speculation in the same run (the
configurations alternate within a run). Answers are compared with the same server's answers
without speculation.

    benchmarks/speculative_serve_bench.py [--kvpipe build/release/launch/kvpipe]
        [--llama-server benchmarks/peers/llama.cpp/bin/llama-server]
        [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--runs 3] [--threads 1]
        [--clients 1,8] [--tokens 2,4] [--sets copy,chat]
        [--llama-spec "NAME:--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8"]...
"""
import argparse
import http.client
import json
import os
import queue
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
SETS = {"copy": os.path.join(HERE, "speculative", "copy_prompts.yaml"),
        "chat": os.path.join(HERE, "speculative", "chat_prompts.yaml")}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, cmd, port, log):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"speculative_serve_bench: {' '.join(cmd)} exited {self.proc.returncode} (log {log.name})")
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                self.stop()
                sys.exit(f"speculative_serve_bench: {' '.join(cmd)} was not ready in 300 s")
            time.sleep(0.2)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def stream_chat(port, request):
    """(text, output tokens, seconds to the first token, seconds from the first token to the last)."""
    body = {"messages": request["messages"], "max_tokens": request.get("max_new_tokens", 160), "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    text, tokens, first, last = [], None, None, None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                now = time.perf_counter()
                first = first or now
                last = now
                text.append(piece)
    c.close()
    if tokens is None or first is None:
        raise RuntimeError("the stream had no usage or no content")
    return "".join(text), tokens, first - start, last - first


def run_round(port, prompts, clients):
    """Every prompt once from `clients` threads: per request (text, tokens, ttft, decode s), wall s."""
    work = queue.Queue()
    for i, p in enumerate(prompts):
        work.put((i, p))
    results = [None] * len(prompts)
    errors = []

    def client():
        while True:
            try:
                i, p = work.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = stream_chat(port, p)
            except Exception as e:  # reported below; the round fails
                errors.append(f"request {i}: {e}")

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        sys.exit("speculative_serve_bench: " + "; ".join(errors[:3]))
    return results, wall


def summary(results, wall):
    tokens = sum(r[1] for r in results)
    decode = [(r[1] - 1) / r[3] for r in results if r[1] > 1 and r[3] > 0]
    return {"texts": [r[0] for r in results], "throughput": tokens / wall, "decode": statistics.median(decode),
            "ttft_ms": 1000 * statistics.median(r[2] for r in results)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvpipe", default="build/release/launch/kvpipe")
    ap.add_argument("--llama-server", default="benchmarks/peers/llama.cpp/bin/llama-server")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--tokens", default="2,4", help="kvpipe's draft lengths K")
    ap.add_argument("--sets", default="copy,chat")
    ap.add_argument("--llama-spec", action="append", default=[],
                    help="NAME:ARGS, llama-server's speculative options to measure (repeatable)")
    a = ap.parse_args()
    clients = [int(c) for c in a.clients.split(",")]
    slots = max(clients)
    configs = [("kvpipe", "off", ())] + [("kvpipe", f"ngram K={k}", ("speculative.method=ngram", f"speculative.num_tokens={k}"))
                                         for k in (int(x) for x in a.tokens.split(","))]
    if os.path.exists(a.llama_server):
        configs.append(("llama-server", "off", ()))
        for spec in a.llama_spec:
            name, _, args = spec.partition(":")
            configs.append(("llama-server", name, tuple(shlex.split(args))))
    else:
        print(f"# {a.llama_server} is not built (benchmarks/peers/build_llama_cpp.sh): kvpipe only\n")

    print(f"# speculative_serve_bench: {a.model}, {a.threads} thread(s) per server, {slots} slots, {a.runs} runs, "
          f"clients {a.clients}, greedy\n")
    print("| prompts | server | speculation | clients | output tok/s | ratio | median decode tok/s per request | ratio |"
          " median TTFT ms | answers equal off |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        job = os.path.join(tmp, "job.yaml")
        with open(job, "w") as f:
            f.write(f"model: {{path: {os.path.abspath(a.model)}}}\nruntime: {{threads: {a.threads}}}\n"
                    f"cache: {{block_size: 16, memory: 256MiB, prefix_reuse: false}}\n"
                    f"scheduler: {{max_batch: {slots}, max_tokens_per_step: 512}}\nsampling: {{temperature: 0.0}}\n")
        for set_name in a.sets.split(","):
            with open(SETS[set_name]) as f:
                prompts = yaml.safe_load(f)["requests"]
            results = {(c, n): [] for c in configs for n in clients}
            for _ in range(a.runs):
                for c in configs:
                    port = free_port()
                    if c[0] == "kvpipe":
                        cmd = [a.kvpipe, "serve", "--config", job, "--port", str(port)]
                        for s in c[2]:
                            cmd += ["--set", s]
                    else:
                        # Prefix caching off, as kvpipe's; each slot holds a prompt and its answer.
                        cmd = [a.llama_server, "-m", a.model, "--host", "127.0.0.1", "--port", str(port), "-np",
                               str(slots), "-c", str(slots * 1024), "-t", str(a.threads), "-tb", str(a.threads),
                               "--no-cache-prompt", "--jinja", *c[2]]
                    with open(os.path.join(tmp, "server.log"), "w") as log:
                        server = Server(cmd, port, log)
                        try:
                            for n in clients:
                                results[(c, n)].append(summary(*run_round(port, prompts, n)))
                        finally:
                            server.stop()
            for c in configs:
                for n in clients:
                    rs = results[(c, n)]
                    base = results[((c[0], "off", ()), n)]
                    same = all(r["texts"] == b["texts"] for r, b in zip(rs, base))
                    equal = "yes" if same else "NO"
                    if not same and n != clients[0]:
                        # Which requests share a step changes the rounding of a quantised model
                        # and so its greedy choice at near-ties, with or without speculation:
                        # say whether the server without speculation keeps its answers either.
                        alone = results[((c[0], "off", ()), clients[0])]
                        kept = all(r["texts"] == b["texts"] for r, b in zip(base, alone))
                        equal += f" (off itself {'keeps' if kept else 'changes'} answers from {clients[0]} to {n} clients)"
                    ratio = lambda key: statistics.median(r[key] / b[key] for r, b in zip(rs, base))
                    print(f"| {set_name} | {c[0]} | {c[1]} | {n} | {statistics.median(r['throughput'] for r in rs):.1f} | "
                          f"{ratio('throughput'):.2f} | {statistics.median(r['decode'] for r in rs):.1f} | "
                          f"{ratio('decode'):.2f} | {statistics.median(r['ttft_ms'] for r in rs):.0f} | "
                          f"{equal} |", flush=True)


if __name__ == "__main__":
    main()
