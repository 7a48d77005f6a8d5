#!/usr/bin/env python3
"""Speculative decoding at batch 1: prompt lookup (speculative.method ngram) against no
speculation, on prompts whose answers copy from the input and on ordinary chat prompts.

Every configuration runs the same job (one request at a time, greedy) through
`kvpipe generate`; the configurations alternate within each run, so drift of the machine
touches them alike. Per configuration it reports the decode rate (tokens after each
request's first, over the time they took: what speculation changes), the end-to-end rate
(every generated token over the wall time, prompt processing included), the acceptance
rate and mean accepted length, and whether every output equals the one without
speculation. Ratios are medians of per-run ratios against `off` of the same run.

    benchmarks/speculative_bench.py [--kvpipe build/release/launch/kvpipe]
        [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--runs 3] [--threads 1]
        [--tokens 2,4,8] [--sets copy,chat] [--draft DRAFT.gguf] [--methods ngram,draft]
        [--baseline-kvpipe OTHER/kvpipe] [--repeat 1]

With --draft, speculative.method draft with that draft model is measured too (the same K).
--repeat N sends each prompt set N times in one job (one request at a time, so the same
answers): longer timed spans. With --baseline-kvpipe, every method is measured with that
build too, in the same runs (rows marked "baseline"), to compare two builds' speculation
against the same `off`.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SETS = {"copy": os.path.join(HERE, "speculative", "copy_prompts.yaml"),
        "chat": os.path.join(HERE, "speculative", "chat_prompts.yaml")}


def job_text(model, threads, prompts_file, repeat=1):
    with open(prompts_file) as f:
        requests = "".join(line for line in f if not line.startswith("#"))
    # The set again, `repeat` times in one job: longer timed spans, less noise.
    head, _, body = requests.partition("requests:\n")
    requests = head + "requests:\n" + body * repeat
    return (f"model: {{path: {model}}}\n"
            f"runtime: {{threads: {threads}}}\n"
            "cache: {block_size: 16, memory: 64MiB, prefix_reuse: false}\n"
            "scheduler: {max_batch: 1, max_tokens_per_step: 512}\n"
            "sampling: {temperature: 0.0}\n" + requests)


def run(kvpipe, job, method, k, draft=None):
    cmd = [kvpipe, "generate", "--config", job, "--set", f"speculative.method={method}"]
    if method != "off":
        cmd += ["--set", f"speculative.num_tokens={k}"]
    if method == "draft":
        cmd += ["--set", f"speculative.model={draft}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.exit(f"speculative_bench: {' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    lines = [json.loads(l) for l in p.stdout.splitlines() if l.strip()]
    outputs = {l["id"]: l["output_ids"] for l in lines}
    decode_tokens = sum(max(len(l["output_ids"]) - 1, 0) for l in lines)
    decode_s = sum(l["tpot_ms"] * max(len(l["output_ids"]) - 1, 0) for l in lines) / 1000.0
    timing = re.search(r"generated tokens in ([0-9.]+) s \(([0-9.]+) tokens/s generated\)", p.stderr)
    spec = re.search(r"speculative: (\d+) drafts, (\d+) of (\d+) draft tokens accepted", p.stderr)
    drafts, accepted, drafted = (int(x) for x in spec.groups()) if spec else (0, 0, 0)
    return {"outputs": outputs, "decode_tps": decode_tokens / max(decode_s, 1e-9),
            "e2e_tps": float(timing.group(2)) if timing else 0.0,
            "tokens": sum(len(l["output_ids"]) for l in lines),
            "drafts": drafts, "accepted": accepted, "drafted": drafted}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvpipe", default="build/release/launch/kvpipe")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", default="2,4,8", help="draft lengths K to measure")
    ap.add_argument("--sets", default="copy,chat")
    ap.add_argument("--draft", help="a draft model for speculative.method draft")
    ap.add_argument("--methods", default="ngram,draft", help="methods to measure besides off")
    ap.add_argument("--baseline-kvpipe", help="another build whose speculation is measured in the same runs")
    ap.add_argument("--repeat", type=int, default=1, help="each prompt set this many times per job")
    a = ap.parse_args()
    ks = [int(k) for k in a.tokens.split(",")]
    methods = [m for m in a.methods.split(",") if m != "draft" or a.draft]
    # (method, K, the build that runs it)
    configs = [("off", 0, a.kvpipe)] + [(m, k, a.kvpipe) for m in methods for k in ks]
    if a.baseline_kvpipe:
        configs += [(m, k, a.baseline_kvpipe) for m in methods for k in ks]
    print(f"# speculative_bench: {a.model}, {a.threads} thread(s), {a.runs} runs, each set {a.repeat} time(s) per run, "
          "batch 1, greedy"
          + (f", draft model {a.draft}" if a.draft else "") + "\n")
    print("| prompts | method | K | decode tok/s | ratio | e2e tok/s | ratio | acceptance | mean accepted length |"
          " outputs equal off |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.sets.split(","):
            job = os.path.join(tmp, f"{name}.yaml")
            with open(job, "w") as f:
                f.write(job_text(a.model, a.threads, SETS[name], a.repeat))
            results = {c: [] for c in configs}
            for _ in range(a.runs):
                for c in configs:
                    results[c].append(run(c[2], job, c[0], c[1], draft=a.draft))
            base = results[("off", 0, a.kvpipe)]
            for c in configs:
                rs = results[c]
                same = all(r["outputs"] == b["outputs"] for r, b in zip(rs, base))
                ratio = lambda key: statistics.median(r[key] / b[key] for r, b in zip(rs, base))
                drafted = sum(r["drafted"] for r in rs)
                drafts = sum(r["drafts"] for r in rs)
                accepted = sum(r["accepted"] for r in rs)
                acc = f"{accepted / drafted:.2f}" if drafted else "-"
                length = f"{1 + accepted / drafts:.2f}" if drafts else "-"
                label = c[0] + (" (baseline)" if c[2] != a.kvpipe else "")
                print(f"| {name} ({rs[0]['tokens']} tokens) | {label} | {c[1] or '-'} | "
                      f"{statistics.median(r['decode_tps'] for r in rs):.1f} | {ratio('decode_tps'):.2f} | "
                      f"{statistics.median(r['e2e_tps'] for r in rs):.1f} | {ratio('e2e_tps'):.2f} | {acc} | {length} | "
                      f"{'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
