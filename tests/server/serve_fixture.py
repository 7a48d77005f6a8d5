"""A live `kvpipe serve` for the server tests: started on a free port of 127.0.0.1, ready
once GET /health answers 200, stopped with SIGTERM (and its exit status checked by callers).

Environment (set by ctest): KVPIPE_BINARY (the kvpipe executable), KVPIPE_SOURCE_DIR (the
repository), KVPIPE_MPIRUN (mpirun, for the two-rank tests).
"""
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.error
import urllib.request

SOURCE = os.path.abspath(os.environ.get("KVPIPE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")))
BINARY = os.environ.get("KVPIPE_BINARY", os.path.join(SOURCE, "build", "release", "launch", "kvpipe"))
MPIRUN = os.environ.get("KVPIPE_MPIRUN", "mpirun")
SMOLLM2 = os.path.join(SOURCE, "configs", "smollm2.yaml")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, headers=None, timeout=60):
    """(status, body bytes) of one request; HTTP errors are returned, not raised."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None and "Content-Type" not in (headers or {}):
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Server:
    """`kvpipe serve --config CONFIG ARGS...` on its own port (on `ranks` ranks)."""

    def __init__(self, config=SMOLLM2, args=(), ranks=1, sets=()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [BINARY, "serve", "--config", config, "--port", str(self.port), *args]
        for s in ("runtime.threads=1", *sets):
            cmd += ["--set", s]
        if ranks > 1:
            cmd = [MPIRUN, "-np", str(ranks), "--oversubscribe", "--allow-run-as-root", *cmd]
        self.cmd = cmd
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.stderr,
                                     cwd=SOURCE, start_new_session=True)
        deadline = time.time() + 180
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpipe serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status, _ = http("GET", self.url + "/health", timeout=5)
                if status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                self.kill()
                raise RuntimeError(f"kvpipe serve was not ready in 180 s:\n{self.log()}")
            time.sleep(0.2)

    def log(self):
        if self.stderr.closed:
            return "(log closed)"
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def get(self, path, **kw):
        return http("GET", self.url + path, **kw)

    def post(self, path, body, **kw):
        return http("POST", self.url + path, body, **kw)

    def metrics(self):
        """{name: value} of the unlabelled-by-reason samples, plus request_success by reason."""
        from prometheus_client.parser import text_string_to_metric_families
        status, text = self.get("/metrics")
        assert status == 200, text
        out = {}
        for family in text_string_to_metric_families(text.decode()):
            for s in family.samples:
                key = s.name
                if "finished_reason" in s.labels:
                    key += ":" + s.labels["finished_reason"]
                if "le" in s.labels:
                    continue
                out[key] = s.value
        return out

    def rank0_pid(self):
        """The pid of the process that listens (rank 0), from its log line."""
        m = re.search(r"listening on \S+ \(pid (\d+)", self.log())
        assert m, self.log()
        return int(m.group(1))

    def terminate(self, timeout=60):
        """SIGTERM to the listening process (rank 0: mpirun itself would abort the job rather
        than let it stop); the exit code of the whole server (mpirun's with several ranks)."""
        os.kill(self.rank0_pid(), signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if not self.stderr.closed:
            self.stderr.close()


class ServedTestCase(unittest.TestCase):
    """Tests that share one one-rank server (SmolLM2, started with `server_args`) and an
    OpenAI client of it; the server must exit 0 on SIGTERM once they are done."""

    server_args = ()

    @classmethod
    def setUpClass(cls):
        import openai
        cls.server = Server(args=cls.server_args)
        cls.client = openai.OpenAI(base_url=cls.server.url + "/v1", api_key="unused", max_retries=0)
        cls.model = cls.client.models.list().data[0].id

    @classmethod
    def tearDownClass(cls):
        code = cls.server.terminate()
        if code != 0:
            raise AssertionError(f"kvpipe serve exited {code} after SIGTERM:\n{cls.server.log()}")


def generate(*args, ranks=1):
    """The JSON lines `kvpipe generate` prints for ARGS (one rank unless `ranks`)."""
    cmd = [BINARY, "generate", *args, "--set", "runtime.threads=1"]
    if ranks > 1:
        cmd = [MPIRUN, "-np", str(ranks), "--oversubscribe", "--allow-run-as-root", *cmd]
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, cwd=SOURCE)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr}")
    # Lines come in finish order: return them in request order.
    return sorted((json.loads(line) for line in r.stdout.splitlines() if line.strip()), key=lambda j: j["id"])
