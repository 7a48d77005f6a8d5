"""`kvpipe serve` under 200 concurrent streaming clients (OpenAI's async client): every stream
finishes with exactly the tokens it asked for, a sample of them gets the same greedy tokens as
on an idle server (a float32 model, where batching changes only rounding), /health keeps
answering while all of them are open, and every KV block is free afterwards."""
import asyncio
import os
import tempfile
import time
import unittest

import openai

from serve_fixture import Server, http

CLIENTS = 200
TOKENS = 8


class TwoHundredStreams(unittest.TestCase):
    def test_two_hundred_concurrent_streams(self):
        tmp = tempfile.TemporaryDirectory()
        config = os.path.join(tmp.name, "tiny.yaml")
        with open(config, "w") as f:
            f.write('model: {path: "dummy:tiny", dtype: float32}\n'
                    "cache: {block_size: 16, memory: 256MiB, prefix_reuse: true}\n"
                    "scheduler: {max_batch: 64}\n")
        server = Server(config=config)
        try:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
            prompts = [[1 + i, 17, 30 + i, 42, 7, 9 + i, 11, 13] for i in range(CLIENTS)]
            sync = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            model = sync.models.list().data[0].id
            # References, one at a time on an idle server, for a sample of the prompts.
            sample = list(range(0, CLIENTS, 40))
            alone = {i: sync.completions.create(model=model, prompt=prompts[i], max_tokens=TOKENS, temperature=0,
                                                extra_body={"ignore_eos": True, "return_token_ids": True})
                     .choices[0].model_dump()["token_ids"] for i in sample}

            health = []

            async def one(i):
                stream = await client.completions.create(model=model, prompt=prompts[i], max_tokens=TOKENS,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True},
                                                         extra_body={"ignore_eos": True, "return_token_ids": True})
                ids, usage, chunks = [], None, 0
                async for c in stream:
                    if c.choices:
                        ids += c.choices[0].model_dump().get("token_ids") or []
                        chunks += 1
                    if c.usage:
                        usage = c.usage
                return ids, usage, chunks

            async def probe_health(done):
                loop = asyncio.get_running_loop()
                while not done.is_set():
                    t0 = time.time()
                    status, _ = await loop.run_in_executor(None, lambda: http("GET", server.url + "/health", timeout=10))
                    health.append((status, time.time() - t0))
                    await asyncio.sleep(0.5)

            async def main():
                done = asyncio.Event()
                prober = asyncio.create_task(probe_health(done))
                results = await asyncio.gather(*(one(i) for i in range(CLIENTS)), return_exceptions=True)
                done.set()
                await prober
                return results

            t0 = time.time()
            results = asyncio.run(main())
            elapsed = time.time() - t0
            errors = [r for r in results if isinstance(r, BaseException)]
            self.assertEqual(errors, [], f"{len(errors)} of {CLIENTS} streams failed, first: {errors[:1]}")
            for i, (ids, usage, chunks) in enumerate(results):
                self.assertEqual(usage.completion_tokens, TOKENS, f"client {i}")
                self.assertEqual(len(ids), TOKENS, f"client {i}: one chunk per token")
                if i in alone:
                    self.assertEqual(ids, alone[i], f"client {i}: its tokens under load differ from alone")
            self.assertTrue(health, "no /health probe ran")
            self.assertTrue(all(status == 200 for status, _ in health), health)
            self.assertLess(max(t for _, t in health), 5.0, f"/health was slow under load: {health}")
            m = server.metrics()
            self.assertEqual(m["kvpipe:num_requests_running"], 0)
            self.assertEqual(m["kvpipe:kv_cache_used_blocks"], 0)
            print(f"{CLIENTS} streams x {TOKENS} tokens in {elapsed:.1f} s; /health max "
                  f"{max(t for _, t in health) * 1000:.0f} ms over {len(health)} probes")
            self.assertEqual(server.terminate(), 0)
        finally:
            server.kill()
            tmp.cleanup()


if __name__ == "__main__":
    unittest.main()
