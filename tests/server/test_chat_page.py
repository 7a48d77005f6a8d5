"""The chat page `kvpipe serve` serves at GET / (launch/serve/serve_page.html), driven by headless
Chromium with the keyboard alone against the real server and SmolLM2-135M-Instruct.

    KVPIPE_BINARY=$PWD/build/release/launch/kvpipe KVPIPE_SOURCE_DIR=$PWD \
        .venv/bin/python -m unittest -v tests/server/test_chat_page.py

It starts `$KVPIPE_BINARY serve --config $KVPIPE_SOURCE_DIR/configs/smollm2.yaml` on a free
port through serve_fixture.Server, or with KVPIPE_SERVER_URL=http://HOST:PORT uses a server
already running there (and skips the SIGTERM check). Needs Selenium (scripts/requirements-references.txt)
and Debian's chromium and chromium-driver; Selenium Manager is never used, so nothing is
downloaded.
"""

import os
import re
import signal
import subprocess
import sys
import time
import unittest
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_fixture  # noqa: E402  (tests/server/serve_fixture.py)

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ANSWER_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30

# Records every state of the newest assistant message, so the test sees the answer grow even
# when tokens arrive faster than WebDriver can poll; and the body of each request sent.
RECORDER = """
window.__states = [];
window.__requests = [];
const record = () => {
  const all = document.querySelectorAll('#transcript .msg.assistant');
  const last = all[all.length - 1];
  if (last) window.__states.push([last.dataset.state || '', last.querySelector('.text').textContent]);
};
new MutationObserver(record).observe(document.getElementById('transcript'),
    {childList: true, subtree: true, characterData: true, attributes: true});
const fetch0 = window.fetch;
window.fetch = (url, init) => {
  if (init && init.body) window.__requests.push([String(url), JSON.parse(init.body)]);
  return fetch0(url, init);
};
"""

LAST_ANSWER = """
const all = document.querySelectorAll('#transcript .msg.assistant');
const last = all[all.length - 1];
if (!last) return null;
const stats = last.querySelector('.stats');
return {count: all.length, state: last.dataset.state || '',
        text: last.querySelector('.text').textContent, stats: stats ? stats.textContent : '',
        error: document.getElementById('error').textContent};
"""


class ChatPageTest(unittest.TestCase):
    server = None

    @classmethod
    def setUpClass(cls):
        url = os.environ.get("KVPIPE_SERVER_URL")
        if url:
            cls.base = url.rstrip("/")
        else:
            cls.start_server()
        cls.driver = cls.start_browser()
        cls.addClassCleanup(cls.driver.quit)

    @classmethod
    def start_server(cls):
        if not os.access(serve_fixture.BINARY, os.X_OK):
            raise unittest.SkipTest(f"no kvpipe executable at {serve_fixture.BINARY}"
                                    " (set KVPIPE_BINARY)")
        # SmolLM2 on a free port with --set runtime.threads=1, run from the repository root;
        # it raises with the server's stderr if the server exits or /health is not 200 in time.
        cls.server = serve_fixture.Server()
        cls.addClassCleanup(cls.server.kill)   # runs even when setUpClass fails
        cls.base = cls.server.url

    @classmethod
    def server_output(cls):
        return cls.server.log()[-20000:] if cls.server else "(server started outside the test)"

    @staticmethod
    def start_browser():
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                    "--window-size=1200,900", "--no-first-run", "--disable-extensions"):
            options.add_argument(arg)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        driver.set_page_load_timeout(30)
        driver.set_script_timeout(30)
        return driver

    def run(self, result=None):
        # On failure, show what the browser and the server said.
        failures = len(result.failures) + len(result.errors) if result else 0
        outcome = super().run(result)
        if result and len(result.failures) + len(result.errors) > failures:
            try:
                console = "\n".join(f"  {e['level']} {e['message']}"
                                    for e in self.driver.get_log("browser"))
            except Exception as e:  # the browser may be gone
                console = f"  (unavailable: {e})"
            sys.stderr.write(f"\n--- browser console ---\n{console}\n"
                             f"--- server output ---\n{self.server_output()}\n")
        return outcome

    def wait_for(self, what, predicate, timeout, interval=0.05):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                self.fail(f"timed out after {timeout} s waiting for {what}")
            time.sleep(interval)

    def focused(self):
        return self.driver.switch_to.active_element

    def type_keys(self, *keys):
        self.focused().send_keys(*keys)

    def ask(self, question, previous_answers):
        """Types the question into the focused message box, presses Enter and returns the answer,
        the states it went through and the stats line, once it has finished."""
        self.assertEqual(self.focused().get_attribute("id"), "input")
        self.driver.execute_script("window.__states = [];")
        self.type_keys(question)
        self.type_keys(Keys.ENTER)
        seen = []   # WebDriver's own observations, beside the page's recorder

        def finished():
            answer = self.driver.execute_script(LAST_ANSWER)
            if not answer or answer["count"] <= previous_answers:
                return None
            seen.append((answer["state"], answer["text"]))
            return answer if answer["state"] not in ("", "streaming") else None

        answer = self.wait_for(f"an answer to {question!r}", finished, ANSWER_TIMEOUT_S)
        self.assertEqual(answer["state"], "done", answer)
        self.assertEqual(answer["error"], "", answer)
        states = [tuple(s) for s in self.driver.execute_script("return window.__states;")] + seen
        partial = {text for state, text in states if state == "streaming" and text}
        return answer, partial

    def test_a_keyboard_chat(self):
        driver = self.driver
        driver.get(self.base + "/")
        driver.execute_script(RECORDER)
        # The model comes from /v1/models.
        self.wait_for("the model name", lambda: driver.find_element(By.ID, "model").text
                      not in ("", "loading model\u2026"), 30)
        self.assertNotEqual(driver.find_element(By.ID, "model").text, "no model",
                            driver.find_element(By.ID, "error").text)

        # Focus starts in the message box; Shift+Enter is a newline, not a send.
        self.assertEqual(self.focused().get_attribute("id"), "input")
        self.type_keys("x")
        self.type_keys(Keys.SHIFT, Keys.ENTER, Keys.NULL)
        self.type_keys("y")
        self.assertEqual(self.focused().get_attribute("value"), "x\ny")
        self.assertEqual(driver.find_elements(By.CSS_SELECTOR, "#transcript .msg"), [])
        self.type_keys(Keys.CONTROL, "a", Keys.NULL)
        self.type_keys(Keys.BACKSPACE)
        self.assertEqual(self.focused().get_attribute("value"), "")

        # Every control is reachable with Tab, named, and shows its focus; temperature 0 and
        # a token limit make the answers short and deterministic.
        values = {"temperature": "0", "maxtokens": "48"}
        for expected in ("send", "stop", "temperature", "maxtokens", "apikey"):
            self.type_keys(Keys.TAB)
            element = self.focused()
            self.assertEqual(element.get_attribute("id"), expected)
            self.assertTrue(element.accessible_name, f"#{expected} has no accessible name")
            outline = driver.execute_script(
                "const s = getComputedStyle(arguments[0]);"
                "return [s.outlineStyle, parseFloat(s.outlineWidth)];", element)
            self.assertTrue(outline[0] != "none" and outline[1] > 0,
                            f"#{expected} shows no focus outline: {outline}")
            if expected in values:
                self.type_keys(values[expected])
        for _ in range(5):
            self.type_keys(Keys.SHIFT, Keys.TAB, Keys.NULL)
        self.assertEqual(self.focused().get_attribute("id"), "input")
        self.assertEqual(driver.find_element(By.ID, "transcript").get_attribute("aria-live"),
                         "polite")

        # The question of the README and configs/smollm2.yaml: SmolLM2-135M answers the bare
        # "What is the capital of France?" greedily with a list of French words, not "Paris".
        answer, partial = self.ask("What is the capital of France? Answer in one sentence.", 0)
        self.assertIn("Paris", answer["text"])
        self.assertGreaterEqual(len(partial), 2,
                                f"the answer did not stream: partial states {partial}")
        self.assertTrue(all(answer["text"].startswith(p) for p in partial), partial)
        rate = re.search(r"([0-9]+(?:\.[0-9]+)?) tokens/s", answer["stats"])
        self.assertTrue(rate and float(rate.group(1)) > 0, f"no tokens/s in {answer['stats']!r}")

        # A second question in the same conversation; the request carries the first turn.
        answer2, _ = self.ask("And what is the capital of Germany? Answer in one sentence.", 1)
        self.assertTrue(answer2["text"].strip(), answer2)
        requests = [body for url, body in driver.execute_script("return window.__requests;")
                    if url.endswith("/v1/chat/completions")]
        self.assertEqual(len(requests), 2)
        self.assertEqual([m["role"] for m in requests[1]["messages"]],
                         ["user", "assistant", "user"])
        self.assertEqual(requests[1]["messages"][1]["content"], answer["text"])
        self.assertEqual(requests[1]["temperature"], 0)
        self.assertEqual(requests[1]["max_tokens"], 48)
        self.assertTrue(requests[1]["stream"])

    def test_z_sigterm_stops_the_server(self):
        if self.server is None:
            self.skipTest("KVPIPE_SERVER_URL: the server is not this test's to stop")
        # The page stays open, as a user's would: the browser's idle keep-alive connection
        # must not hold the server up. One rank: the process started is the one that listens.
        os.kill(self.server.proc.pid, signal.SIGTERM)
        try:
            code = self.server.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.fail(f"the server did not exit within {STOP_TIMEOUT_S} s of SIGTERM"
                      " (with the page open in the browser)")
        self.assertEqual(code, 0, self.server_output())


if __name__ == "__main__":
    unittest.main()
