"""Decodes behind long prompts: the inter-token latency of running streams while 2,048-token
prompts arrive, against the same streams alone, for several scheduler.max_prefill_tokens_per_step
budgets. One `kvpipe serve` per budget (SmolLM2, benchmarks/serve-smollm2.yaml), OpenAI's
Python client for the load.

    .venv/bin/python benchmarks/prefill_interference.py [--budgets 0,16,64] [--streams 4]

Prints, per budget, the p50/p99 inter-token latency (ms) of the streams decode-only and with
long prompts arriving, and their ratio (the target: p99 within 2x of decode-only).
"""
import argparse
import os
import statistics
import sys
import threading
import time

import openai

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "server"))
from serve_fixture import SOURCE, Server  # noqa: E402

CONFIG = os.path.join(SOURCE, "benchmarks", "serve-smollm2.yaml")


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def stream_gaps(client, model, i, tokens, gaps):
    stream = client.completions.create(model=model, prompt=f"Story {i}: once upon a time", max_tokens=tokens,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    last = None
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            if last is not None:
                gaps.append(now - last)
            last = now


def run(server, streams, tokens, long_prompts):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    gaps = []
    threads = [threading.Thread(target=stream_gaps, args=(client, model, i, tokens, gaps)) for i in range(streams)]
    for t in threads:
        t.start()
    if long_prompts:
        time.sleep(1.0)  # the streams are decoding
        ids = list(range(1000, 1000 + 2048))
        while any(t.is_alive() for t in threads):
            ids = ids[1:] + ids[:1]  # a new prompt each time: no prefix-cache hit
            client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0)
    for t in threads:
        t.join()
    return [g * 1000 for g in gaps]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="0,16,64")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    print("| max_prefill_tokens_per_step | decode-only ITL p50 / p99 ms | with 2,048-token prompts p50 / p99 ms | p99 ratio |")
    print("|---|---|---|---|")
    for budget in a.budgets.split(","):
        server = Server(config=CONFIG, sets=(f"runtime.threads={a.threads}",
                                             f"scheduler.max_prefill_tokens_per_step={budget}"))
        try:
            alone = run(server, a.streams, a.tokens, False)
            loaded = run(server, a.streams, a.tokens, True)
        finally:
            server.terminate()
            server.kill()
        print(f"| {budget} | {statistics.median(alone):.1f} / {percentile(alone, 99):.1f} | "
              f"{statistics.median(loaded):.1f} / {percentile(loaded, 99):.1f} | "
              f"{percentile(loaded, 99) / percentile(alone, 99):.2f} |", flush=True)


if __name__ == "__main__":
    main()
