"""What structured outputs cost a serving load: output tokens/s of `kvpipe serve` (SmolLM2,
benchmarks/serve-smollm2.yaml) under closed-loop clients when every request is plain, against
the same load with every other request constrained to a JSON Schema of tests/data/json_schemas.json
(response_format json_schema, the schemas in turn, so compiles are part of the load). The two
loads alternate, one server for all, so that drift of the machine falls on both.

    .venv/bin/python benchmarks/structured_serve_bench.py [--clients 8] [--requests 48] [--runs 3]

Prints per run the tokens/s of each load, then the medians and their ratio (the target: the
half-constrained load at least 0.9x the plain one), and the mask time per constrained token
that the server's /metrics reports (mean, and the bucket that holds the p99).
"""
import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time

import openai

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "server"))
from serve_fixture import SOURCE, Server  # noqa: E402

CONFIG = os.path.join(SOURCE, "benchmarks", "serve-smollm2.yaml")
CORPUS = os.path.join(SOURCE, "tests", "data", "json_schemas.json")
TOPICS = ["a city", "a book", "a pet", "a meal", "a trip", "a song", "a planet", "a game"]


def load(client, model, schemas, clients, requests, max_tokens, constrained, seed):
    """Sends `requests` chat requests from `clients` closed-loop clients; (tokens, seconds)."""
    def one(i):
        kw = {}
        if constrained and i % 2 == 1:
            entry = schemas[(seed * requests + i) % len(schemas)]
            kw["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": entry["name"], "schema": entry["schema"]}}
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}],
            max_tokens=max_tokens, temperature=1.0, seed=seed * 1000 + i, **kw)
        return r.usage.completion_tokens

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one, range(requests)))
    return tokens, time.monotonic() - start


def mask_figures(server):
    """(mean mask seconds per token, upper bound of the bucket holding the p99, count)."""
    from prometheus_client.parser import text_string_to_metric_families
    status, text = server.get("/metrics")
    assert status == 200, text
    buckets, total, count = [], 0.0, 0.0
    for family in text_string_to_metric_families(text.decode()):
        if family.name != "kvpipe:structured_output_mask_seconds":
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_sum"):
                total = s.value
            elif s.name.endswith("_count"):
                count = s.value
    p99 = next((le for le, c in sorted(buckets) if count and c >= 0.99 * count), float("inf"))
    return (total / count if count else 0.0), p99, count


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with open(CORPUS) as f:
        schemas = json.load(f)
    server = Server(config=CONFIG, sets=[f"runtime.threads={args.threads}"])
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        load(client, model, schemas, args.clients, args.clients, 8, True, 99)  # warm-up
        plain, mixed = [], []
        print("| run | plain tok/s | half constrained tok/s | ratio |\n|---|---|---|---|")
        for run in range(args.runs):
            t, s = load(client, model, schemas, args.clients, args.requests, args.max_tokens, False, run)
            plain.append(t / s)
            t, s = load(client, model, schemas, args.clients, args.requests, args.max_tokens, True, run)
            mixed.append(t / s)
            print(f"| {run + 1} | {plain[-1]:.1f} | {mixed[-1]:.1f} | {mixed[-1] / plain[-1]:.3f} |", flush=True)
        p, m = statistics.median(plain), statistics.median(mixed)
        mean, p99, count = mask_figures(server)
        print(f"\nmedian: plain {p:.1f} tok/s, half constrained {m:.1f} tok/s, ratio {m / p:.3f} (target >= 0.9)")
        print(f"mask per constrained token (/metrics, {count:.0f} tokens): mean {mean * 1e6:.1f} us, "
              f"p99 at most {p99 * 1e6:.0f} us")
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
