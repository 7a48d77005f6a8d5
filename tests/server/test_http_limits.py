"""What `kvpipe serve` does with connections that hold on without sending a request: a
header that does not arrive whole within --header-timeout gets 408, one over 16 KiB gets
431, and under 600 idle and 520 slow-header connections at once (each of which once held one
of the server's HTTP threads) /health answers within a second and a real completion
answers; a kept-alive connection serves its next request. Only 127.0.0.1; every loop is
bounded in count and time.
"""
import json
import resource
import socket
import time
import unittest

from serve_fixture import Server, http

IDLE, SLOW = 600, 520


def read_response(sock, timeout=10, reader=None):
    """The status and body of one HTTP response read off `sock` (Content-Length framed);
    `reader` (sock.makefile("rb")) keeps what follows for the next response. Status 0: the
    connection closed first."""
    sock.settimeout(timeout)
    f = reader or sock.makefile("rb")
    try:
        status_line = f.readline()
        if not status_line:
            return 0, b""
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = f.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode().partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        return status, f.read(length)
    except ConnectionResetError:
        return 0, b""


class HttpLimits(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = IDLE + SLOW + 256
        if soft < need:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
        if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < need:
            raise unittest.SkipTest(f"this process may open only {soft} files; the test needs {need}")
        cls.server = Server(args=["--header-timeout", "2"])

    @classmethod
    def tearDownClass(cls):
        code = cls.server.terminate()
        if code != 0:
            raise AssertionError(f"kvpipe serve exited {code} after SIGTERM:\n{cls.server.log()}")

    def connect(self):
        return socket.create_connection(("127.0.0.1", self.server.port), timeout=10)

    def test_a_header_that_does_not_finish_gets_408(self):
        with self.connect() as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            start = time.monotonic()
            status, body = read_response(s, timeout=10)
            waited = time.monotonic() - start
        self.assertEqual(status, 408, body)
        self.assertIn("header", json.loads(body)["error"]["message"])
        self.assertGreater(waited, 1.5)
        self.assertLess(waited, 5.0)

    def test_a_connection_that_sends_nothing_is_closed(self):
        with self.connect() as s:
            start = time.monotonic()
            status, _ = read_response(s, timeout=10)
            self.assertLess(time.monotonic() - start, 5.0)
        self.assertIn(status, (0, 408))

    def test_a_header_over_16_kib_gets_431(self):
        with self.connect() as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20000)
            status, body = read_response(s)
        self.assertEqual(status, 431, body)

    def test_a_kept_alive_connection_serves_its_next_requests(self):
        with self.connect() as s:
            for _ in range(3):
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                status, _ = read_response(s)
                self.assertEqual(status, 200)
            # Two requests sent at once are both answered, in order.
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 2)
            reader = s.makefile("rb")
            self.assertEqual(read_response(s, reader=reader)[0], 200)
            self.assertEqual(read_response(s, reader=reader)[0], 200)

    def test_health_and_requests_answer_under_idle_and_slow_header_connections(self):
        idle, slow = [], []
        try:
            for _ in range(IDLE):
                idle.append(self.connect())
            for _ in range(SLOW):
                s = self.connect()
                s.sendall(b"GET /health HTTP/1.1\r\n")
                slow.append(s)
            # The slow ones go on a byte at a time for 1.5 s (under the 2 s header timeout).
            header = b"Host: 127.0.0.1\r\nX-Slow: "
            health = []
            deadline = time.monotonic() + 1.5
            sent = 0
            while time.monotonic() < deadline and sent < len(header):
                for s in slow:
                    s.sendall(header[sent:sent + 1])
                sent += 1
                start = time.monotonic()
                status, _ = http("GET", self.server.url + "/health", timeout=5)
                health.append((status, time.monotonic() - start))
                time.sleep(0.1)
            self.assertTrue(health)
            self.assertTrue(all(status == 200 for status, _ in health), health)
            self.assertLess(max(t for _, t in health), 1.0, health)
            start = time.monotonic()
            status, body = http("POST", self.server.url + "/v1/completions",
                                {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}, timeout=30)
            self.assertEqual(status, 200, body)
            self.assertLess(time.monotonic() - start, 10.0)
            # Past the header timeout every slow connection got 408.
            answered = 0
            for s in slow:
                status, _ = read_response(s, timeout=10)
                answered += status == 408
            self.assertEqual(answered, SLOW)
        finally:
            for s in idle + slow:
                s.close()


if __name__ == "__main__":
    unittest.main()
