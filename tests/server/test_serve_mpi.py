"""`kvpipe serve` under `mpirun -np 2`: rank 0 serves, rank 1 runs its stage. Its tokens equal
the one-rank `kvpipe generate`'s, concurrent streams all finish, a bad request is a 400, and
SIGTERM to mpirun stops both ranks with exit 0; idle, the two ranks use under 5% of a core. Under `mpirun -np 3` with three tensor ranks
(parallel.tensor: 3, SmolLM2's 9 heads in thirds), its tokens equal `kvpipe generate`'s on the
same grid, and SIGTERM stops every rank with exit 0."""
import concurrent.futures
import os
import time
import unittest

import openai

from serve_fixture import SMOLLM2, Server, generate

PROMPT = "The capital of France is"


def rank_pids(session):
    """The kvpipe processes of the session `session` leads (mpirun's ranks)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if name == "kvpipe" and int(fields[3]) == session:
            pids.append(int(entry))
    return pids


def cpu_seconds(pids):
    """User + system CPU time of `pids` so far, in seconds."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        fields = stat[stat.rindex(")") + 2:].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


class TwoRankServer(unittest.TestCase):
    def completes_as_generate(self, server, ref):
        """The server's client and model, once a greedy completion of PROMPT gave `ref`'s ids and text."""
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True})
        self.assertEqual(r.choices[0].model_dump()["token_ids"], ref["output_ids"])
        self.assertEqual(r.choices[0].text, ref["text"])
        return client, model

    def test_two_ranks(self):
        ref = generate("--config", SMOLLM2, "--prompt", PROMPT, "--max-new-tokens", "12")[0]
        server = Server(ranks=2)
        try:
            client, model = self.completes_as_generate(server, ref)

            def stream(i):
                chunks = list(client.completions.create(model=model, prompt=f"{i} plus {i} is", max_tokens=6,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True},
                                                        extra_body={"ignore_eos": True}))
                return chunks[-1].usage.completion_tokens

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                self.assertEqual(list(pool.map(stream, range(16))), [6] * 16)
            status, _ = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 0})
            self.assertEqual(status, 400)
            self.assertEqual(server.get("/health")[0], 200)
            # Idle, the ranks wait without spinning; the next request is served as before.
            time.sleep(1.0)
            ranks = rank_pids(server.proc.pid)
            self.assertEqual(len(ranks), 2, ranks)
            start, t0 = cpu_seconds(ranks), time.monotonic()
            time.sleep(5.0)
            used = (cpu_seconds(ranks) - start) / (time.monotonic() - t0)
            self.assertLess(used, 0.05, f"two idle ranks used {used:.1%} of a core")
            self.completes_as_generate(server, ref)
            self.assertEqual(server.terminate(), 0, server.log())
        finally:
            server.kill()

    def test_three_tensor_ranks(self):
        grid = ("--set", "parallel.tensor=3")
        ref = generate("--config", SMOLLM2, "--prompt", PROMPT, "--max-new-tokens", "12", *grid, ranks=3)[0]
        server = Server(ranks=3, sets=("parallel.tensor=3",))
        try:
            client, model = self.completes_as_generate(server, ref)

            def chat(i):
                c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Count to {i}."}],
                                                   max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
                return c.usage.completion_tokens

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                self.assertEqual(list(pool.map(chat, range(8))), [5] * 8)
            self.assertEqual(server.terminate(), 0, server.log())
        finally:
            server.kill()


if __name__ == "__main__":
    unittest.main()
