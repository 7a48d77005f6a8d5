#!/usr/bin/env python3
"""Runs kvpipe on corrupted model files, bad configs and bad flags, and counts the outcomes.

Every probe must end in one of three ways: exit 0 (the input was still valid, as a byte
flipped inside the weights is), exit 2 with one line on stderr (bad input, named), or exit 1
with a request named as failed (non-finite numbers that only show at run time). Anything
else -- another exit code, a signal, a hang, a Python-style traceback, a message of several
lines, `internal error` -- is counted as `other` and listed.

    python3 tests/tools/hostile_probe.py --kvpipe build/release/launch/kvpipe [--models 300]
        [--configs 200] [--seed 1] [--timeout 20] [--jobs 2]

Exit status: 0 when no probe ended as `other`, 1 otherwise. Deterministic for a seed.
"""
import argparse
import concurrent.futures
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

TINY_REQUEST = "requests:\n  - {prompt_ids: [1, 2, 3], max_new_tokens: 2}\n"


def job_yaml(model_path, extra=""):
    return (f"model: {{path: {model_path}}}\nruntime: {{threads: 1}}\n"
            f"cache: {{memory: 4MiB}}\n{extra}{TINY_REQUEST}")


class Probe:
    def __init__(self, kind, name, argv, accept_zero=True):
        self.kind, self.name, self.argv, self.accept_zero = kind, name, argv, accept_zero


def classify(probe, timeout):
    t0 = time.monotonic()
    try:
        p = subprocess.run(probe.argv, stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    except subprocess.TimeoutExpired:
        return "other", f"hang (> {timeout} s)", timeout
    seconds = time.monotonic() - t0
    err = p.stderr.decode("utf-8", "replace")
    errors = [l for l in err.splitlines() if "error" in l]
    if p.returncode == 0:
        if probe.accept_zero:
            return "exit 0", "", seconds
        return "other", "exit 0 where the input is invalid", seconds
    if p.returncode == 2:
        if "internal error" in err or "Traceback" in err or len(errors) != 1:
            return "other", "exit 2 but not one error line: " + err.strip()[:300], seconds
        return "exit 2", errors[0][:200], seconds
    if p.returncode == 1 and re.search(r"error: request \d+", err):
        return "exit 1 (request failed)", errors[0][:200] if errors else "", seconds
    return "other", f"exit {p.returncode}: " + err.strip()[-300:], seconds


def gguf_header_end(data):
    """Byte offset where a GGUF's tensor-info section ends (best effort: the probes corrupt
    the header, so this reads the intact original)."""
    off = 4 + 4
    n_tensors, n_kv = struct.unpack_from("<QQ", data, off)
    off += 16

    def read_str(o):
        (n,) = struct.unpack_from("<Q", data, o)
        return o + 8 + n

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def read_value(o, t):
        if t == 8:
            return read_str(o)
        if t == 9:
            (et, n) = struct.unpack_from("<IQ", data, o)
            o += 12
            for _ in range(n):
                o = read_value(o, et)
            return o
        return o + sizes[t]

    for _ in range(n_kv):
        off = read_str(off)
        (t,) = struct.unpack_from("<I", data, off)
        off = read_value(off + 4, t)
    for _ in range(n_tensors):
        off = read_str(off)
        (nd,) = struct.unpack_from("<I", data, off)
        off += 4 + 8 * nd + 4 + 8
    return off


def model_probes(kvpipe, work, rng, count):
    """Corrupted GGUF files, safetensors files and config.json files of a tiny model."""
    gguf = os.path.join(work, "tiny.gguf")
    hf = os.path.join(work, "tiny-hf")
    for argv in ([kvpipe, "init-model", "--out", gguf, "--format", "gguf", "--preset", "tiny"],
                 [kvpipe, "init-model", "--out", hf, "--format", "hf", "--preset", "tiny"]):
        subprocess.run(argv, check=True, capture_output=True)
    gguf_bytes = open(gguf, "rb").read()
    header_end = gguf_header_end(gguf_bytes)
    st_bytes = open(os.path.join(hf, "model.safetensors"), "rb").read()
    (st_header_len,) = struct.unpack_from("<Q", st_bytes, 0)
    config = json.load(open(os.path.join(hf, "config.json")))

    probes = []

    def add_job(name, model_path, data_writer, accept_zero):
        d = os.path.join(work, f"m{len(probes)}")
        os.makedirs(d)
        path = data_writer(d)
        cfg = os.path.join(d, "job.yaml")
        with open(cfg, "w") as f:
            f.write(job_yaml(path))
        sub = "generate" if rng.random() < 0.5 else "validate"
        probes.append(Probe("model", name, [kvpipe, sub, "--config", cfg], accept_zero))

    def gguf_variant(mutate):
        def write(d):
            b = bytearray(gguf_bytes)
            b = mutate(b)
            path = os.path.join(d, "m.gguf")
            open(path, "wb").write(bytes(b))
            return path
        return write

    def hf_variant(mutate_st=None, mutate_config=None):
        def write(d):
            path = os.path.join(d, "hf")
            shutil.copytree(hf, path)
            if mutate_st:
                b = mutate_st(bytearray(st_bytes))
                open(os.path.join(path, "model.safetensors"), "wb").write(bytes(b))
            if mutate_config:
                text = mutate_config(dict(config))
                open(os.path.join(path, "config.json"), "w").write(text)
            return path
        return write

    hostile_json = ["-1", "0", "1e999", "-1e999", "\"x\"", "[]", "{}", "null", "true", "1e18",
                    "9223372036854775808", "0.5", "1000000000"]
    for i in range(count):
        r = rng.random()
        if r < 0.2:  # truncation anywhere
            n = rng.randrange(0, len(gguf_bytes))
            add_job(f"gguf truncated to {n} bytes", None, gguf_variant(lambda b, n=n: b[:n]), False)
        elif r < 0.45:  # a byte in the header
            pos, val = rng.randrange(0, header_end), rng.randrange(256)
            add_job(f"gguf header byte {pos} = {val}", None,
                    gguf_variant(lambda b, p=pos, v=val: b[:p] + bytes([v]) + b[p + 1:]), True)
        elif r < 0.55:  # an 8-byte field in the header
            pos = rng.randrange(8, header_end - 8)
            val = rng.choice([0, 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1, 64])
            add_job(f"gguf header u64 at {pos} = {val}", None,
                    gguf_variant(lambda b, p=pos, v=val: b[:p] + struct.pack("<Q", v) + b[p + 8:]), True)
        elif r < 0.6:  # bytes in the weights: valid unless they make non-finite numbers
            pos = rng.randrange(header_end, len(gguf_bytes) - 4)
            add_job(f"gguf data bytes at {pos} = NaN", None,
                    gguf_variant(lambda b, p=pos: b[:p] + struct.pack("<f", float("nan")) + b[p + 4:]), True)
        elif r < 0.7:  # safetensors truncation
            n = rng.randrange(0, len(st_bytes))
            add_job(f"safetensors truncated to {n} bytes", None,
                    hf_variant(mutate_st=lambda b, n=n: b[:n]), False)
        elif r < 0.8:  # a character of the safetensors header
            pos = rng.randrange(8, 8 + st_header_len)
            ch = rng.choice(b"0123456789e-+.,:{}[]\"x ")
            add_job(f"safetensors header char {pos} = {chr(ch)!r}", None,
                    hf_variant(mutate_st=lambda b, p=pos, c=ch: b[:p] + bytes([c]) + b[p + 1:]), True)
        elif r < 0.85:  # the safetensors header length
            val = rng.choice([0, 1, 7, st_header_len - 1, st_header_len + 1, 2**40, 2**64 - 1])
            add_job(f"safetensors header length = {val}", None,
                    hf_variant(mutate_st=lambda b, v=val: struct.pack("<Q", v) + b[8:]), val == st_header_len)
        else:  # a config.json key
            key = rng.choice(sorted(config.keys()))
            val = rng.choice(hostile_json)

            def mutate(c, k=key, v=val):
                c[k] = "@@"
                return json.dumps(c).replace('"@@"', v)
            add_job(f"config.json {key} = {val}", None, hf_variant(mutate_config=mutate), True)
    # Non-regular files as the model.
    fifo = os.path.join(work, "fifo.gguf")
    os.mkfifo(fifo)
    for name, path in [("model is a FIFO", fifo), ("model is /dev/zero", "/dev/zero"),
                       ("model is a directory without config.json", work)]:
        cfg = os.path.join(work, f"nonreg{len(probes)}.yaml")
        open(cfg, "w").write(job_yaml(path))
        probes.append(Probe("model", name, [kvpipe, "validate", "--config", cfg], False))
    return probes, gguf


# Every key of the job config with hostile values for it.
CONFIG_KEYS = [
    "model.dtype", "runtime.device", "runtime.threads", "runtime.memory", "runtime.share_gpu",
    "parallel.layers", "parallel.micro_batches", "parallel.backend", "parallel.timeout",
    "cache.block_size", "cache.memory", "cache.prefix_reuse", "cache.dtype", "cache.cached_layers",
    "cache.window.sinks", "cache.window.recent", "scheduler.max_batch",
    "scheduler.max_tokens_per_step", "scheduler.max_prefill_tokens_per_step",
    "sampling.temperature", "sampling.top_k", "sampling.top_p", "sampling.seed", "sampling.stop",
]
HOSTILE_YAML = ["-1", "0", "1e999", ".nan", ".inf", "-.inf", "abc", "[]", "{}", "''",
                "99999999999999999999", "100000", "1000000000", "0.5", "[1, 2, 3]", "true",
                "'" + "x" * 5000 + "'", "~"]


def config_probes(kvpipe, work, gguf, rng, count):
    probes = []
    pairs = [(k, v) for k in CONFIG_KEYS for v in HOSTILE_YAML]
    rng.shuffle(pairs)
    for i, (key, value) in enumerate(pairs[:count]):
        cfg = os.path.join(work, f"c{i}.yaml")
        open(cfg, "w").write(job_yaml(gguf))
        sub = "validate" if i % 2 == 0 else "generate"
        probes.append(Probe("config", f"--set {key}={value[:20]}",
                            [kvpipe, sub, "--config", cfg, "--set", f"{key}={value}"], True))
    # Whole files and flags.
    base = os.path.join(work, "base.yaml")
    open(base, "w").write(job_yaml(gguf))
    fifo = os.path.join(work, "config.fifo")
    os.mkfifo(fifo)
    bad_files = {"empty": "", "not yaml": "{{{{", "list": "- 1\n- 2\n",
                 "binary": "\x00\x01\x02", "unknown section": job_yaml(gguf, "bogus: {a: 1}\n"),
                 "request token -1": job_yaml(gguf).replace("[1, 2, 3]", "[1, -1, 3]"),
                 "request token 10^9": job_yaml(gguf).replace("[1, 2, 3]", "[1, 1000000000]"),
                 "max_new_tokens 10^9": job_yaml(gguf).replace("max_new_tokens: 2", "max_new_tokens: 1000000000")}
    for name, text in bad_files.items():
        path = os.path.join(work, f"bad-{len(probes)}.yaml")
        open(path, "w").write(text)
        probes.append(Probe("config", f"config file: {name}", [kvpipe, "validate", "--config", path],
                            False))
    flags = [
        ["validate", "--config", fifo], ["validate", "--config", "/dev/zero"],
        ["validate", "--config", work], ["validate", "--config", os.path.join(work, "missing.yaml")],
        ["generate", "--config", base, "--max-new-tokens", "-1"],
        ["generate", "--config", base, "--max-new-tokens", "abc"],
        ["generate", "--config", base, "--prompt-ids", "a,b"],
        ["generate", "--config", base, "--prompt-ids", "-5"],
        ["generate", "--config", base, "--prompt-ids", "99999999999"],
        ["generate", "--config", base, "--set", "nokey=1"],
        ["generate", "--config", base, "--set", "runtime.threads"],
        ["generate", "--config", base, "--logprobs-out", "/nonexistent/dir/lp.jsonl"],
        ["generate", "--config", base, "--output", "/nonexistent/dir/out.jsonl"],
        ["generate", "--config", base, "--bogus-flag"],
        ["validate", "--config", base, "--ranks", "0"],
        ["validate", "--config", base, "--ranks", "-3"],
        ["tokenize", "--config", base],
        ["bench", "--config", base, "--out", "/dev/null/x"],
        ["init-model", "--out", os.path.join(work, "im"), "--layers", "-1"],
        ["init-model", "--out", os.path.join(work, "im2"), "--vocab", "0"],
    ]
    for argv in flags:
        probes.append(Probe("flag", " ".join(argv[:1] + argv[3:] if "--config" in argv[:3] else argv),
                            [kvpipe] + argv, False))
    return probes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvpipe", required=True)
    ap.add_argument("--models", type=int, default=300)
    ap.add_argument("--configs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    kvpipe = os.path.abspath(args.kvpipe)
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="kvpipe_probe_")
    try:
        probes, gguf = model_probes(kvpipe, work, rng, args.models)
        probes += config_probes(kvpipe, work, gguf, rng, args.configs)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            outcomes = list(pool.map(lambda p: classify(p, args.timeout), probes))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = {}
    slowest = {}
    others = []
    for probe, (outcome, detail, seconds) in zip(probes, outcomes):
        row = table.setdefault(probe.kind, {})
        row[outcome] = row.get(outcome, 0) + 1
        if outcome == "exit 2":
            slowest[probe.kind] = max(slowest.get(probe.kind, 0.0), seconds)
        if outcome == "other":
            others.append(f"  {probe.kind}: {probe.name}: {detail}")
    columns = ["exit 0", "exit 2", "exit 1 (request failed)", "other"]
    print("| probes | tried | " + " | ".join(columns) + " | slowest exit 2 (s) |")
    print("|---|---|" + "---|" * len(columns) + "---|")
    for kind, row in table.items():
        print(f"| {kind} | {sum(row.values())} | " + " | ".join(str(row.get(c, 0)) for c in columns) +
              f" | {slowest.get(kind, 0.0):.2f} |")
    if others:
        print(f"{len(others)} probes ended otherwise:")
        print("\n".join(others))
    return 1 if others else 0


if __name__ == "__main__":
    sys.exit(main())
