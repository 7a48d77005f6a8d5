"""Tests of benchmarks/sweep against a stub kvpipe (and a stub mpirun), so they need neither
the engine nor MPI: the stub writes a report.json whose figures follow its --set values.

    cd tests/sweep && python3 -m unittest -v test_sweep
"""

import csv
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SWEEP = REPO / "benchmarks" / "sweep"
CORES = os.cpu_count() or 1

# A stand-in for `kvpipe bench`. Figures: p99 TPOT 10 + 2*batch ms and output tokens/s
# 1000*batch / (10 + 2*batch) (still growing at 16, so only the limit stops doubling), or
# with STUB_MODE=plateau a flat 10 ms TPOT and tokens/s that stop growing at batch 8.
STUB_KVPIPE = r'''
import json, os, sys
args = sys.argv[1:]
assert args[0] == "bench", args
sets, out, i = {}, None, 1
while i < len(args):
    if args[i] == "--set":
        key, _, value = args[i + 1].partition("=")
        sets[key] = value
        i += 2
    elif args[i] in ("--out", "--config", "--log-level"):
        if args[i] == "--out":
            out = args[i + 1]
        i += 2
    else:
        i += 1
world = int(os.environ.get("STUB_WORLD_SIZE", "1"))
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps({"argv": sys.argv, "world": world}) + "\n")
batch = int(sets.get("scheduler.max_batch", "8"))
if os.environ.get("STUB_FAIL_BATCH") == str(batch):
    print("stub: out of memory at batch %d" % batch, file=sys.stderr)
    sys.exit(1)
prompt = json.loads(sets.get("workload.prompt_len", "128"))
prompt_mean = sum(prompt) / 2 if isinstance(prompt, list) else prompt
requests = int(sets.get("workload.requests", os.environ.get("STUB_REQUESTS", "64")))
if os.environ.get("STUB_MODE") == "plateau":
    tpot, tok = 10.0, 100.0 * min(batch, 8)
else:
    tpot, tok = 10.0 + 2 * batch, 1000.0 * batch / (10.0 + 2 * batch)
tok *= world
threads = int(sets.get("runtime.threads", "1"))

def dist(x):
    return {"count": 10, "mean": x, "median": x, "p90": x * 1.1, "p99": tpot if x == tpot else x * 1.2,
            "min": x / 2, "max": x * 2}

os.makedirs(out, exist_ok=True)
layers = [8 // world] * world
report = {
    "kvpipe": {"version": "0.1.0", "git": "abc1234", "build_type": "Release", "compiler": "GNU 12.2.0",
               "torch": "1.13.1", "nccl": False},
    "machine": {"hostname": "h", "cpu": "Stub CPU", "cores": 2, "memory_bytes": 25000000000, "gpus": 0},
    "world_size": world, "backend": "mpi", "threads_per_rank": threads, "oversubscribed": False,
    "config": {"file": "x.yaml", "overrides": [k + "=" + v for k, v in sets.items()]},
    "workload": {"mode": "closed", "requests": requests, "prompt_len": [prompt_mean, prompt_mean],
                 "output_len": [32, 32], "shared_prefix": 0.0, "concurrency": batch, "rate": 0.0,
                 "warmup": 2, "seed": 0},
    "requests": {"completed": requests, "prompt_tokens": 1000, "output_tokens": 1000},
    "duration_s": 1.0,
    "throughput": {"output_tokens_per_s": tok, "total_tokens_per_s": 2 * tok, "requests_per_s": tok / 32},
    "latency_ms": {"ttft": dist(prompt_mean / 2), "tpot": dist(tpot), "itl": dist(tpot),
                   "e2e": dist(100.0), "step": dist(5.0 + batch), "decode_step": dist(4.0 + batch)},
    "decode_weight_bytes": 411111424,
    "ranks": [{"rank": r, "first_layer": r * layers[0], "num_layers": layers[r], "compute": 0.8 - 0.1 * r,
               "comm": 0.05, "wait": 0.1 + 0.1 * r, "idle": 0.05, "total_s": 1.0} for r in range(world)],
    "kv_cache": {"num_blocks": 1024, "block_size": 16, "peak_blocks_used": 10 * batch,
                 "mean_blocks_used": 5.0,
                 "blocks_used": [[0.0, 1]], "prefix_hit_rate": 0.0, "prefix_hit_tokens": 0,
                 "prefix_lookup_tokens": 100, "evictions": 0, "preemptions": 0, "recomputed_tokens": 0},
    "files": {"requests_csv": "requests.csv", "trace": "trace.json", "profile": None},
}
with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f)
print("summary table")
'''

# A stand-in for mpirun: one process that tells the stub kvpipe the world size.
STUB_MPIRUN = r'''
import json, os, sys
args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps({"mpirun": sys.argv}) + "\n")
while args[0].startswith("-"):
    if args[0] == "-np":
        os.environ["STUB_WORLD_SIZE"] = args[1]
        args = args[2:]
    else:
        args = args[1:]
os.execv(args[0], args)
'''

FIGURES = (["output_tokens_per_s", "total_tokens_per_s", "requests_per_s"]
           + [f"{d}_{s}_ms" for d in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "median", "p90", "p99")]
           + [f"{d}_{s}_ms" for d in ("step", "decode_step") for s in ("median", "p99")])
TAIL = ["peak_blocks_used", "prefix_hit_rate", "preemptions", "decode_weight_bytes", "report"]


class SweepTest(unittest.TestCase):
    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="sweep-test-"))
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.kvpipe = self.write_exe("kvpipe", STUB_KVPIPE)
        self.mpirun = self.write_exe("mpirun", STUB_MPIRUN)
        self.log = self.tmp / "calls.jsonl"
        self.env = {**os.environ, "STUB_LOG": str(self.log)}
        (self.tmp / "job.yaml").write_text('model: {path: "dummy:tiny"}\n')

    def write_exe(self, name, body):
        path = self.tmp / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)
        return path

    def sweep_file(self, text, name="s.toml"):
        path = self.tmp / name
        path.write_text(textwrap.dedent(text))
        return path

    def sweep(self, *args, env=None):
        return subprocess.run([sys.executable, str(SWEEP), *map(str, args)], capture_output=True, text=True,
                              env={**self.env, **(env or {})}, timeout=120)

    def run_sweep(self, sweep_path, *extra, env=None):
        out = self.tmp / "out"
        done = self.sweep("run", sweep_path, "--out", out, "--kvpipe", self.kvpipe, "--mpirun", self.mpirun,
                          *extra, env=env)
        return done, out

    def calls(self):
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if "argv" in line]

    def read_csv(self, out):
        with open(out / "sweep.csv", newline="") as f:
            reader = csv.DictReader(f)
            return reader.fieldnames, list(reader)

    @staticmethod
    def sets_of(call):
        argv = call["argv"]
        return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]

    # -- running points ---------------------------------------------------------------

    def test_cartesian_product_with_per_key_values(self):
        path = self.sweep_file("""
            name = "grid"
            config = "job.yaml"
            set = ["workload.output_len=8"]
            [[axis]]
            name = "ranks"
            values = [1, 2]
            [[axis]]
            name = "batch"
            keys = ["scheduler.max_batch", "workload.concurrency"]
            values = [[1, 2], 4]
            [[axis]]
            name = "prompt_len"
            key = "workload.prompt_len"
            values = [16, [8, 32]]
            """)
        done, out = self.run_sweep(path, "--gnuplot", "/nonexistent/gnuplot")
        self.assertEqual(done.returncode, 0, done.stderr)
        calls = self.calls()
        self.assertEqual(len(calls), 8)
        self.assertEqual([c["world"] for c in calls], [1] * 4 + [2] * 4)
        self.assertEqual(self.sets_of(calls[0]), ["workload.output_len=8", "scheduler.max_batch=1",
                                                  "workload.concurrency=2", "workload.prompt_len=16"])
        self.assertEqual(self.sets_of(calls[3]), ["workload.output_len=8", "scheduler.max_batch=4",
                                                  "workload.concurrency=4", "workload.prompt_len=[8, 32]"])
        _, rows = self.read_csv(out)
        self.assertEqual([(r["ranks"], r["batch"], r["prompt_len"]) for r in rows],
                         [(r, b, p) for r in ("1", "2") for b in ("[1, 2]", "4") for p in ("16", "[8, 32]")])
        self.assertEqual(len(set(r["report"] for r in rows)), 8)
        for r in rows:
            self.assertTrue((out / r["report"]).is_file(), r["report"])
        self.assertEqual(done.stdout.count("output tok/s"), 8, done.stdout)

    def test_csv_columns_and_figures(self):
        path = self.sweep_file("""
            name = "cols"
            config = "job.yaml"
            [[axis]]
            name = "ranks"
            values = [1, 2]
            [[axis]]
            name = "batch"
            key = "scheduler.max_batch"
            values = [2, 8]
            """)
        done, out = self.run_sweep(path, "--gnuplot", "/nonexistent/gnuplot")
        self.assertEqual(done.returncode, 0, done.stderr)
        columns, rows = self.read_csv(out)
        ranks = [f"rank{r}_{f}" for r in range(2) for f in ("compute", "comm", "wait", "idle")]
        self.assertEqual(columns,
                         ["sweep", "point", "ranks", "oversubscribed", "batch"] + FIGURES + ranks + TAIL)
        self.assertEqual([r["point"] for r in rows], ["0", "1", "2", "3"])
        self.assertEqual({r["sweep"] for r in rows}, {"cols"})
        one, two = rows[1], rows[3]  # batch 8 on one and two ranks
        self.assertAlmostEqual(float(one["tpot_p99_ms"]), 26.0)
        self.assertAlmostEqual(float(two["output_tokens_per_s"]), 2 * float(one["output_tokens_per_s"]))
        self.assertAlmostEqual(float(one["step_median_ms"]), 13.0)
        self.assertEqual(one["peak_blocks_used"], "80")
        self.assertEqual(one["rank1_compute"], "")
        self.assertAlmostEqual(float(two["rank1_compute"]), 0.7)
        self.assertEqual(one["decode_weight_bytes"], "411111424")
        self.assertTrue(json.loads((out / "sweep.json").read_text())["sweeps"][0]["axes"])

    def test_oversubscribed_points_are_marked(self):
        many = CORES + 1
        path = self.sweep_file(f"""
            name = "over"
            config = "job.yaml"
            [[axis]]
            name = "ranks"
            values = [1, {many}]
            [[axis]]
            name = "threads"
            key = "runtime.threads"
            values = [1, {CORES + 1}]
            """)
        done, out = self.run_sweep(path, "--gnuplot", "/nonexistent/gnuplot")
        self.assertEqual(done.returncode, 0, done.stderr)
        _, rows = self.read_csv(out)
        marks = {(r["ranks"], r["threads"]): r["oversubscribed"] for r in rows}
        self.assertEqual(marks, {("1", "1"): "false", ("1", str(CORES + 1)): "true",
                                 (str(many), "1"): "true", (str(many), str(CORES + 1)): "true"})
        self.assertIn("(oversubscribed)", done.stdout)

    def test_dry_run_prints_command_lines(self):
        path = self.sweep_file("""
            config = "missing-is-fine-for-a-dry-run.yaml"
            set = ["cache.window={sinks: 4, recent: 64}"]
            [[axis]]
            name = "ranks"
            values = [1, 3]
            """, name="dry.toml")
        done, out = self.run_sweep(path, "--dry-run")
        self.assertEqual(done.returncode, 0, done.stderr)
        lines = [shlex.split(line) for line in done.stdout.splitlines()]
        self.assertEqual(len(lines), 2)
        one, three = lines
        self.assertEqual(one[:2], [str(self.kvpipe), "bench"])
        self.assertIn("--set", one)
        self.assertEqual(one[one.index("--set") + 1], "cache.window={sinks: 4, recent: 64}")
        self.assertTrue(one[one.index("--out") + 1].endswith("points/000-dry-ranks1"), one)
        self.assertEqual(three[:2], [str(self.mpirun), "--oversubscribe"])
        np = three.index("-np")
        self.assertEqual(three[np + 1], "3")
        self.assertEqual(three[np + 2:np + 4], [str(self.kvpipe), "bench"])
        self.assertEqual("--allow-run-as-root" in three, os.geteuid() == 0)
        self.assertEqual(self.calls(), [])
        self.assertFalse(out.exists())

    def test_failed_point_stops_the_sweep(self):
        path = self.sweep_file("""
            name = "fail"
            config = "job.yaml"
            [[axis]]
            name = "batch"
            key = "scheduler.max_batch"
            values = [1, 4, 8]
            """)
        done, out = self.run_sweep(path, "--gnuplot", "/nonexistent/gnuplot", env={"STUB_FAIL_BATCH": "4"})
        self.assertEqual(done.returncode, 1)
        self.assertIn("out of memory at batch 4", done.stderr)
        self.assertEqual(len(self.calls()), 2)
        _, rows = self.read_csv(out)
        self.assertEqual([(r["batch"], bool(r["report"])) for r in rows], [("1", True), ("4", False)])

    def test_keep_going_runs_the_rest(self):
        path = self.sweep_file("""
            name = "fail"
            config = "job.yaml"
            [[axis]]
            name = "batch"
            key = "scheduler.max_batch"
            values = [1, 4, 8]
            """)
        done, out = self.run_sweep(path, "--keep-going", "--gnuplot", "/nonexistent/gnuplot",
                                   env={"STUB_FAIL_BATCH": "4"})
        self.assertEqual(done.returncode, 1)
        _, rows = self.read_csv(out)
        self.assertEqual([(r["batch"], bool(r["report"])) for r in rows],
                         [("1", True), ("4", False), ("8", True)])
        self.assertEqual(rows[1]["output_tokens_per_s"], "")

    def test_two_sweep_files_share_one_table(self):
        a = self.sweep_file('name = "a"\nconfig = "job.yaml"\n[[axis]]\nname = "ranks"\nvalues = [1, 2]\n',
                            name="a.toml")
        b = self.sweep_file('name = "b"\nconfig = "job.yaml"\n[[axis]]\nname = "prompt_len"\n'
                            'key = "workload.prompt_len"\nvalues = [16, 32]\n', name="b.toml")
        out = self.tmp / "out"
        done = self.sweep("run", a, b, "--out", out, "--kvpipe", self.kvpipe, "--mpirun", self.mpirun,
                          "--gnuplot", "/nonexistent/gnuplot")
        self.assertEqual(done.returncode, 0, done.stderr)
        _, rows = self.read_csv(out)
        self.assertEqual([(r["sweep"], r["point"], r["ranks"], r["prompt_len"]) for r in rows],
                         [("a", "0", "1", ""), ("a", "1", "2", ""),
                          ("b", "2", "1", "16"), ("b", "3", "1", "32")])

    def test_missing_gnuplot_still_writes_the_table(self):
        path = self.sweep_file('config = "job.yaml"\n[[axis]]\nname = "ranks"\nvalues = [1, 2]\n')
        done, out = self.run_sweep(path, "--gnuplot", "/nonexistent/gnuplot")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("gnuplot not found", done.stderr)
        self.assertTrue((out / "sweep.csv").is_file())

    # -- bad input --------------------------------------------------------------------

    def test_bad_sweep_files_name_the_key(self):
        cases = {
            "colour": 'config = "job.yaml"\ncolour = "red"\n',
            "config": 'name = "x"\n',
            "set": 'config = "job.yaml"\nset = "workload.requests=4"\n',
            "set[1]": 'config = "job.yaml"\nset = ["workload.requests=4", "requests"]\n',
            "values": 'config = "job.yaml"\n[[axis]]\nname = "batch"\nkey = "scheduler.max_batch"\n',
            "axis[0] (batch).values": 'config = "job.yaml"\n[[axis]]\nname = "batch"\n'
                                      'key = "scheduler.max_batch"\nvalues = 4\n',
            "axis[0] (batch).keys": 'config = "job.yaml"\n[[axis]]\nname = "batch"\nvalues = [1]\n',
            "axis[0].step": 'config = "job.yaml"\n[[axis]]\nname = "batch"\nstep = 2\n',
            "values[1]": 'config = "job.yaml"\n[[axis]]\nname = "b"\nkeys = ["scheduler.max_batch",'
                         ' "workload.concurrency"]\nvalues = [[1, 1], [2, 2, 2]]\n',
            "axis[0] (ranks).values[0]": 'config = "job.yaml"\n[[axis]]\nname = "ranks"\nvalues = [0]\n',
            "axis[1].name": 'config = "job.yaml"\n[[axis]]\nname = "ranks"\nvalues = [1]\n'
                            '[[axis]]\nname = "ranks"\nvalues = [2]\n',
            "axis[0].name": 'config = "job.yaml"\n[[axis]]\nname = "report"\nkey = "a.b"\nvalues = [1]\n',
            "invalid TOML": 'config = \n',
            "config: no such file": 'config = "nope.yaml"\n[[axis]]\nname = "ranks"\nvalues = [1]\n',
        }
        for key, text in cases.items():
            with self.subTest(key=key):
                path = self.sweep_file(text, name="bad.toml")
                done, _ = self.run_sweep(path)
                self.assertEqual(done.returncode, 2, done.stderr)
                lines = done.stderr.strip().splitlines()
                self.assertEqual(len(lines), 1, done.stderr)
                self.assertIn(str(path), lines[0])
                self.assertIn(key, lines[0])
        self.assertEqual(self.calls(), [])

    # -- tune-batch -------------------------------------------------------------------

    def tune(self, *extra, env=None):
        out = self.tmp / "tune"
        done = self.sweep("tune-batch", "--config", self.tmp / "job.yaml", "--out", out, "--kvpipe",
                          self.kvpipe, "--mpirun", self.mpirun, *extra, env=env)
        return done, out

    def test_tune_batch_bisects_to_the_limit(self):
        done, out = self.tune("--tpot-limit", "50", env={"STUB_REQUESTS": "4"})
        self.assertEqual(done.returncode, 0, done.stderr)
        sets = [dict(s.split("=") for s in self.sets_of(c)) for c in self.calls()]
        self.assertEqual([int(s["scheduler.max_batch"]) for s in sets], [1, 2, 4, 8, 16, 32, 24, 20, 22, 21])
        self.assertIn("tune-batch: largest batch with p99 TPOT <= 50 ms: 20 (output 400.0 tok/s)",
                      done.stdout)
        self.assertEqual([s.get("workload.requests") for s in sets],
                         [None, "4", "8", "16", "32", "64", "48", "40", "44", "42"])
        tune = json.loads((out / "tune.json").read_text())
        self.assertEqual(tune["answer"]["batch"], 20)
        self.assertEqual(tune["stopped_by"], "limit")
        with open(out / "tune.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(len(rows), 10)
        self.assertEqual({r["batch"]: r["verdict"] for r in rows}["21"], "over limit")
        for line in ("    20 |       50.00 |        400.0 | ok, the answer", "    21 |       52.00 |"):
            self.assertIn(line, done.stdout)

    def test_tune_batch_stops_at_the_throughput_plateau(self):
        done, out = self.tune("--tpot-limit", "50", "--ranks", "2", env={"STUB_MODE": "plateau"})
        self.assertEqual(done.returncode, 0, done.stderr)
        calls = self.calls()
        batches = [int(dict(s.split("=") for s in self.sets_of(c))["scheduler.max_batch"]) for c in calls]
        self.assertEqual(batches, [1, 2, 4, 8, 16])
        self.assertEqual({c["world"] for c in calls}, {2})
        # Batch 16 meets the limit but adds nothing over 8, so 8 is the answer.
        self.assertIn("    16 |       10.00 |       1600.0 | within limit, plateau (+0.0% tok/s)",
                      done.stdout)
        self.assertIn("largest batch with p99 TPOT <= 50 ms: 8 (output 1600.0 tok/s) (throughput plateau: "
                      "batch 16 adds < 5% output tok/s)", done.stdout)
        tune = json.loads((out / "tune.json").read_text())
        self.assertEqual((tune["stopped_by"], tune["answer"]["batch"]), ("plateau", 8))

    def test_tune_batch_respects_max_batch(self):
        # A job of one request: batch 1 reruns with two, so every batch runs 2 x batch requests.
        done, _ = self.tune("--tpot-limit", "1000", "--max-batch", "12", env={"STUB_REQUESTS": "1"})
        self.assertEqual(done.returncode, 0, done.stderr)
        sets = [dict(s.split("=") for s in self.sets_of(c)) for c in self.calls()]
        self.assertEqual([int(s["scheduler.max_batch"]) for s in sets], [1, 1, 2, 4, 8, 12])
        self.assertEqual([s.get("workload.requests") for s in sets], [None, "2", "4", "8", "16", "24"])
        self.assertIn("largest batch with p99 TPOT <= 1000 ms: 12 ", done.stdout)

    def test_tune_batch_fails_when_batch_one_is_over(self):
        done, out = self.tune("--tpot-limit", "5")
        self.assertEqual(done.returncode, 1)
        self.assertIn("even batch 1", done.stdout)
        self.assertEqual(len(self.calls()), 1)
        self.assertIsNone(json.loads((out / "tune.json").read_text())["answer"])

    # -- plots and tables -------------------------------------------------------------

    def plotted_sweep(self):
        path = self.sweep_file("""
            name = "plots"
            config = "job.yaml"
            [[axis]]
            name = "ranks"
            values = [1, 2]
            [[axis]]
            name = "batch"
            keys = ["scheduler.max_batch", "workload.concurrency", "workload.requests"]
            values = [[1, 1, 8], [8, 8, 16]]
            [[axis]]
            name = "prompt_len"
            key = "workload.prompt_len"
            values = [16, [32, 64]]
            """)
        return self.run_sweep(path)

    def test_plots_are_drawn(self):
        if not shutil.which("gnuplot"):
            self.skipTest("gnuplot is not installed")
        done, out = self.plotted_sweep()
        self.assertEqual(done.returncode, 0, done.stderr)
        names = {p.name for p in (out / "plots").glob("*.png")}
        self.assertEqual(names, {"plots-throughput-vs-ranks.png", "plots-step-vs-batch.png",
                                 "plots-latency-vs-prompt_len.png", "plots-breakdown-ranks1.png",
                                 "plots-breakdown-ranks2.png"})
        for name in names:
            self.assertEqual((out / "plots" / name).read_bytes()[:8], b"\x89PNG\r\n\x1a\n", name)
        shutil.rmtree(out / "plots")
        again = self.sweep("plot", out)
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertEqual({p.name for p in (out / "plots").glob("*.png")}, names)

    def test_plots_follow_the_axes(self):
        if not shutil.which("gnuplot"):
            self.skipTest("gnuplot is not installed")
        path = self.sweep_file(f"""
            name = "only-ranks"
            config = "job.yaml"
            [[axis]]
            name = "ranks"
            values = [1, {CORES + 1}]
            """)
        done, out = self.run_sweep(path)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual({p.name for p in (out / "plots").glob("*.png")},
                         {"only-ranks-throughput-vs-ranks.png", "only-ranks-breakdown-ranks1.png",
                          f"only-ranks-breakdown-ranks{CORES + 1}.png"})
        script = (out / "plots" / "only-ranks-throughput-vs-ranks.gp").read_text()
        self.assertIn(f'"{CORES + 1} (oversubscribed)" {CORES + 1}', script)
        self.assertIn("ideal, linear from 1 rank", script)

    def test_markdown_tables(self):
        done, out = self.plotted_sweep()
        self.assertEqual(done.returncode, 0, done.stderr)
        md = self.sweep("markdown", out, "--relative-to", self.tmp)
        self.assertEqual(md.returncode, 0, md.stderr)
        lines = md.stdout.splitlines()
        self.assertIn("### plots", lines)
        head = next(line for line in lines if line.startswith("| ranks"))
        for column in ("batch", "prompt_len", "output tok/s", "total tok/s", "speedup", "efficiency", "vs smallest batch",
                       "TPOT p99 ms", "compute per rank"):
            self.assertIn(column, head)
        rows = [line for line in lines if line.startswith("| 2 | 8 | 16 |")]
        self.assertEqual(len(rows), 1, md.stdout)
        cells = [c.strip() for c in rows[0].strip("|").split("|")]
        self.assertEqual(cells[5], "2.00x")  # two ranks against one
        self.assertEqual(cells[6], "1.00")   # the stub scales perfectly
        self.assertEqual(cells[-2], "0.80 / 0.70")
        if shutil.which("gnuplot"):
            self.assertIn("](out/plots/plots-throughput-vs-ranks.png)", md.stdout)

    # -- the sweep files kept in the repository ---------------------------------------

    def test_repository_sweeps_expand(self):
        expected = {"ci.toml": 2, "standard-scaling.toml": 3, "standard-batch.toml": 14,
                    "standard-prompt.toml": 5}
        sweeps = REPO / "benchmarks" / "sweeps"
        for name, points in expected.items():
            with self.subTest(sweep=name):
                done = self.sweep("run", sweeps / name, "--out", self.tmp / "dry", "--dry-run")
                self.assertEqual(done.returncode, 0, done.stderr)
                self.assertEqual(len(done.stdout.splitlines()), points)
        ci = self.sweep("run", sweeps / "ci.toml", "--out", self.tmp / "dry", "--dry-run").stdout
        for item in ("workload.requests=4", "workload.prompt_len=16", "workload.output_len=8",
                     "workload.warmup=1",
                     "scheduler.max_batch=4", "configs/bench-tiny.yaml"):
            self.assertIn(item, ci)
        batch = self.sweep("run", sweeps / "standard-batch.toml", "--out", self.tmp / "dry",
                           "--dry-run").stdout
        last = shlex.split(batch.splitlines()[-1])
        self.assertEqual(last[last.index("-np") + 1], "2")
        self.assertIn("workload.requests=128", last)
        self.assertIn("scheduler.max_batch=64", last)


if __name__ == "__main__":
    unittest.main()
