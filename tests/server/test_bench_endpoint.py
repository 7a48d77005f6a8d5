"""`kvpipe bench --endpoint` against a live `kvpipe serve` on a tiny random model: the
workload's requests all complete with exactly their output lengths, report.json and
requests.csv agree with each other and with the workload, the latencies are finite and
ordered, goodput follows the SLOs given, and an endpoint nobody answers (or one refusing
the API key) fails fast with exit 2.

Environment: KVPIPE_BINARY (the kvpipe executable), KVPIPE_SOURCE_DIR (the repository).

    cd tests/server && KVPIPE_BINARY=$PWD/../../build/release/launch/kvpipe \\
        KVPIPE_SOURCE_DIR=$PWD/../.. ../../.venv/bin/python -m unittest -v test_bench_endpoint
"""
import csv
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
import unittest

from serve_fixture import BINARY, Server, free_port

REQUESTS, CONCURRENCY, PROMPT, OUTPUT = 8, 4, 16, 8
API_KEY = "bench-key"


def bench(config, out, *args, timeout=300):
    cmd = [BINARY, "bench", "--config", config, "--out", out, *args]
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def expect_ordered(test, d, what):
    test.assertGreater(d["count"], 0, what)
    for key in ("mean", "median", "p90", "p99", "min", "max"):
        test.assertTrue(math.isfinite(d[key]), f"{what}.{key} = {d[key]}")
    test.assertGreaterEqual(d["min"], 0, what)
    test.assertLessEqual(d["min"], d["median"], what)
    test.assertLessEqual(d["median"], d["p90"], what)
    test.assertLessEqual(d["p90"], d["p99"], what)
    test.assertLessEqual(d["p99"], d["max"], what)
    test.assertLessEqual(d["min"], d["mean"], what)
    test.assertLessEqual(d["mean"], d["max"], what)


class BenchAgainstServe(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="kvpipe_bench_endpoint_")
        model = os.path.join(cls.dir, "tiny")
        subprocess.run([BINARY, "init-model", "--out", model, "--preset", "tiny"], check=True,
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
        cls.config = os.path.join(cls.dir, "tiny.yaml")
        with open(cls.config, "w") as f:
            f.write(f"model:     {{path: {model}, dtype: float32}}\n"
                    "runtime:   {threads: 1}\n"
                    "cache:     {block_size: 16, memory: 16MiB}\n"
                    "scheduler: {max_batch: 8, max_tokens_per_step: 512}\n"
                    f"workload:  {{requests: {REQUESTS}, prompt_len: {PROMPT}, output_len: {OUTPUT},\n"
                    f"            concurrency: {CONCURRENCY}, rate: 0, warmup: 1, seed: 3}}\n")
        cls.server = Server(config=cls.config, args=("--api-key", API_KEY))

    @classmethod
    def tearDownClass(cls):
        code = cls.server.terminate()
        shutil.rmtree(cls.dir, ignore_errors=True)
        if code != 0:
            raise AssertionError(f"kvpipe serve exited {code} after SIGTERM:\n{cls.server.log()}")

    def run_bench(self, name, *args):
        out = os.path.join(self.dir, name)
        r = bench(self.config, out, "--endpoint", self.server.url, "--api-key", API_KEY, *args)
        self.assertEqual(r.returncode, 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}\nserver:\n{self.server.log()}")
        with open(os.path.join(out, "report.json")) as f:
            report = json.load(f)
        with open(os.path.join(out, "requests.csv")) as f:
            rows = list(csv.DictReader(f))
        return r, report, rows

    def test_closed_loop_completes_every_request_with_sane_figures(self):
        r, rep, rows = self.run_bench("closed", "--goodput", "ttft:600000", "--goodput", "e2el:600000")
        self.assertIn("Serving Benchmark Result", r.stdout)
        self.assertIn("Mean TTFT (ms):", r.stdout)
        self.assertEqual(rep["endpoint"]["url"], self.server.url)
        self.assertTrue(rep["endpoint"]["model"])
        self.assertEqual(rep["workload"]["mode"], "closed")
        self.assertEqual(rep["workload"]["concurrency"], CONCURRENCY)
        req = rep["requests"]
        self.assertEqual(req["completed"], REQUESTS, req)
        self.assertEqual(req["failed"], 0, req)
        self.assertIsNone(req["first_error"])
        self.assertEqual(req["output_tokens"], REQUESTS * OUTPUT)
        self.assertEqual(req["prompt_tokens"], REQUESTS * PROMPT)

        lat = rep["latency_ms"]
        for key in ("ttft", "tpot", "itl", "e2e"):
            expect_ordered(self, lat[key], key)
        self.assertEqual(lat["ttft"]["count"], REQUESTS)
        self.assertEqual(lat["tpot"]["count"], REQUESTS)
        self.assertEqual(lat["e2e"]["count"], REQUESTS)
        self.assertLessEqual(lat["ttft"]["max"], lat["e2e"]["max"])
        self.assertLessEqual(lat["itl"]["count"], REQUESTS * (OUTPUT - 1))

        t = rep["throughput"]
        self.assertGreater(rep["duration_s"], 0)
        self.assertAlmostEqual(t["output_tokens_per_s"], REQUESTS * OUTPUT / rep["duration_s"],
                               delta=0.01 * t["output_tokens_per_s"] + 0.01)
        self.assertGreater(t["total_tokens_per_s"], t["output_tokens_per_s"])
        self.assertLessEqual(t["peak_concurrent_requests"], 2 * CONCURRENCY)
        self.assertEqual(rep["goodput"]["good_requests"], REQUESTS, "every request meets a 10-minute SLO")

        # One row per measured request (ids after the warm-up one), consistent with report.json.
        self.assertEqual(len(rows), REQUESTS)
        self.assertEqual(sorted(int(row["id"]) for row in rows), list(range(1, REQUESTS + 1)))
        for row in rows:
            self.assertEqual(row["error"], "")
            self.assertEqual(int(row["output_tokens"]), OUTPUT)
            self.assertEqual(int(row["prompt_tokens"]), PROMPT)
            ttft, tpot, e2e = float(row["ttft_ms"]), float(row["tpot_ms"]), float(row["e2e_ms"])
            self.assertGreater(ttft, 0)
            self.assertLessEqual(ttft, e2e)
            self.assertAlmostEqual(e2e, ttft + (OUTPUT - 1) * tpot, delta=0.01 * OUTPUT)
        # Closed loop: never more than `concurrency` requests in flight at once. A client sends its
        # next request within microseconds of the last one's end, and the table rounds sent_ms and
        # e2e_ms to a microsecond each: a span is taken to end 2 us before its rounded sum.
        spans = [(float(row["sent_ms"]), float(row["sent_ms"]) + float(row["e2e_ms"]) - 0.002) for row in rows]
        for start, _ in spans:
            self.assertLessEqual(sum(1 for s, e in spans if s <= start < e), CONCURRENCY)

    def test_open_loop_and_an_slo_nobody_meets(self):
        _, rep, rows = self.run_bench("open", "--set", "workload.rate=50", "--set", "workload.requests=6",
                                      "--goodput", "ttft:0.001")
        self.assertEqual(rep["workload"]["mode"], "open")
        self.assertEqual(rep["requests"]["completed"], 6)
        self.assertEqual(rep["requests"]["output_tokens"], 6 * OUTPUT)
        self.assertEqual(rep["goodput"]["good_requests"], 0)
        arrivals = [float(row["arrival_ms"]) for row in sorted(rows, key=lambda row: int(row["id"]))]
        self.assertEqual(arrivals, sorted(arrivals), "Poisson arrivals are due in request order")
        for row in rows:
            self.assertGreaterEqual(float(row["sent_ms"]) + 1e-3, float(row["arrival_ms"]))

    def test_a_missing_api_key_fails_fast(self):
        r = bench(self.config, os.path.join(self.dir, "nokey"), "--endpoint", self.server.url)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(self.server.url, r.stderr)
        self.assertIn("--api-key", r.stderr)


class BenchWithoutServer(unittest.TestCase):
    def test_unreachable_endpoint_fails_fast_naming_the_url(self):
        with tempfile.TemporaryDirectory() as d:
            config = os.path.join(d, "job.yaml")
            with open(config, "w") as f:
                f.write("model: {path: 'dummy:tiny'}\nworkload: {requests: 2, prompt_len: 4, output_len: 2}\n")
            url = f"http://127.0.0.1:{free_port()}"
            start = time.time()
            r = bench(config, os.path.join(d, "out"), "--endpoint", url, timeout=60)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertLess(time.time() - start, 30)
            errors = [line for line in r.stderr.splitlines() if "error" in line]
            self.assertEqual(len(errors), 1, r.stderr)
            self.assertIn(url, errors[0])
            self.assertFalse(os.path.exists(os.path.join(d, "out", "report.json")))

    def test_bad_goodput_is_bad_input(self):
        with tempfile.TemporaryDirectory() as d:
            config = os.path.join(d, "job.yaml")
            with open(config, "w") as f:
                f.write("model: {path: 'dummy:tiny'}\n")
            r = bench(config, os.path.join(d, "out"), "--endpoint", "http://127.0.0.1:1", "--goodput", "latency:5")
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("--goodput", r.stderr)


if __name__ == "__main__":
    unittest.main()
