"""`kvpipe serve` on one rank with SmolLM2-135M-Instruct, driven by OpenAI's Python client:
the server's tokens equal `kvpipe generate`'s for the same requests (greedy and seeded),
streaming, usage, stop strings, log-probabilities, n, seeds, prefix-cache usage,
/tokenize, /metrics (read by Prometheus' own parser), malformed requests and fields kvpipe
does not implement (400 naming them), logit bias, penalties, bad words and min_tokens (equal
to `kvpipe generate`'s, and generate's against a float64 recompute from its raw logits),
clients that go away (streaming or not), authentication, a full queue and SIGTERM."""
import json
import math
import os
import re
import socket
import tempfile
import threading
import time
import unittest
import urllib.request

import openai

from serve_fixture import SMOLLM2, SOURCE, Server, ServedTestCase, generate, http

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"


def extra(obj, key):
    return obj.model_dump()[key]


class OneRankServer(ServedTestCase):
    def complete(self, **kw):
        kw.setdefault("model", self.model)
        return self.client.completions.create(**kw)

    # --- the same tokens as `kvpipe generate` --------------------------------------------
    def test_greedy_completion_equals_generate(self):
        ref = generate("--config", SMOLLM2, "--prompt", PROMPT, "--max-new-tokens", "12")[0]
        r = self.complete(prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
        c = r.choices[0]
        self.assertEqual(extra(c, "prompt_token_ids"), ref["prompt_ids"])
        self.assertEqual(extra(c, "token_ids"), ref["output_ids"])
        self.assertEqual(c.text, ref["text"])
        self.assertEqual(c.finish_reason, ref["finish_reason"])
        self.assertEqual(r.usage.prompt_tokens, len(ref["prompt_ids"]))
        self.assertEqual(r.usage.completion_tokens, len(ref["output_ids"]))
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)

    def test_token_id_prompt_equals_text_prompt(self):
        ids = json.loads(http("POST", self.server.url + "/tokenize", {"prompt": PROMPT})[1])["tokens"]
        a = self.complete(prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
        b = self.complete(prompt=ids, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
        self.assertEqual(extra(a.choices[0], "token_ids"), extra(b.choices[0], "token_ids"))
        self.assertEqual(a.choices[0].text, b.choices[0].text)

    def test_seeded_sampling_equals_generate_and_repeats(self):
        ref = generate("--config", SMOLLM2, "--prompt", PROMPT, "--max-new-tokens", "10",
                       "--set", "sampling.temperature=0.9", "--set", "sampling.seed=7")[0]
        kw = dict(prompt=PROMPT, max_tokens=10, temperature=0.9, seed=7, extra_body={"return_token_ids": True})
        first = self.complete(**kw)
        again = self.complete(**kw)
        self.assertEqual(extra(first.choices[0], "token_ids"), ref["output_ids"])
        self.assertEqual(extra(again.choices[0], "token_ids"), ref["output_ids"])

    def test_n_choices_with_a_seed(self):
        kw = dict(prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11, n=3,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
        r = self.complete(**kw)
        self.assertEqual([c.index for c in r.choices], [0, 1, 2])
        ids = [extra(c, "token_ids") for c in r.choices]
        self.assertTrue(all(len(x) == 8 for x in ids))
        self.assertGreater(len({tuple(x) for x in ids}), 1, "three samples at temperature 1 were all equal")
        self.assertEqual(r.usage.completion_tokens, 24)
        self.assertEqual([extra(c, "token_ids") for c in self.complete(**kw).choices], ids)
        ref = generate("--config", SMOLLM2, "--prompt", PROMPT, "--max-new-tokens", "8",
                       "--set", "sampling.temperature=1.0", "--set", "sampling.seed=11",
                       "--set", "sampling.ignore_eos=true")[0]
        self.assertEqual(ids[0], ref["output_ids"])

    def test_chat_equals_generate(self):
        ref = generate("--config", SMOLLM2, "--chat", QUESTION, "--max-new-tokens", "16")[0]
        r = self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=16, temperature=0)
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertEqual(r.choices[0].message.content, ref["text"])
        self.assertEqual(r.usage.prompt_tokens, len(ref["prompt_ids"]))

    # --- streaming ------------------------------------------------------------------------
    def test_streaming_completion(self):
        whole = self.complete(prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        chunks = list(self.complete(prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        self.assertEqual(text, whole.choices[0].text)
        with_text = [c for c in chunks if c.choices and c.choices[0].text]
        self.assertGreaterEqual(len(with_text), 6, "tokens did not arrive one chunk each")
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, 12)
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        self.assertEqual(finals, ["length"])

    def test_streaming_chat(self):
        whole = self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": QUESTION}],
                                                    max_tokens=16, temperature=0)
        stream = self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": QUESTION}],
                                                     max_tokens=16, temperature=0, stream=True,
                                                     stream_options={"include_usage": True})
        chunks = list(stream)
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(text, whole.choices[0].message.content)
        self.assertEqual(chunks[-1].usage.completion_tokens, whole.usage.completion_tokens)

    def test_raw_sse_ends_with_done(self):
        req = urllib.request.Request(self.server.url + "/v1/completions", method="POST",
                                     data=json.dumps({"prompt": PROMPT, "max_tokens": 3, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            self.assertTrue(r.headers["Content-Type"].startswith("text/event-stream"))
            events = [e for e in r.read().decode().split("\n\n") if e.strip() and not e.startswith(":")]
        self.assertTrue(all(e.startswith("data: ") for e in events), events)
        self.assertEqual(events[-1], "data: [DONE]")
        for e in events[:-1]:
            json.loads(e[len("data: "):])

    # --- stop strings, log-probabilities, usage -------------------------------------------
    def test_stop_string_cuts_the_text(self):
        full = self.complete(prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        text = full.choices[0].text
        self.assertIn(".", text, "the reference text has no '.' to stop at")
        for stream in (False, True):
            kw = dict(prompt=PROMPT, max_tokens=12, temperature=0, stop=["."])
            if stream:
                chunks = list(self.complete(stream=True, **kw))
                got = "".join(c.choices[0].text for c in chunks if c.choices)
                reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
            else:
                r = self.complete(**kw)
                got, reason = r.choices[0].text, r.choices[0].finish_reason
            self.assertEqual(got, text[:text.index(".")])
            self.assertEqual(reason, "stop")

    def test_logprobs_equal_generate(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "logprobs.jsonl")
            generate("--config", SMOLLM2, "--prompt", PROMPT, "--max-new-tokens", "5", "--logprobs-out", path)
            with open(path) as f:
                rows = [json.loads(line) for line in f]
        r = self.complete(prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                          extra_body={"return_token_ids": True, "ignore_eos": True})
        lp = r.choices[0].logprobs
        ids = extra(r.choices[0], "token_ids")
        self.assertEqual(len(lp.token_logprobs), 5)
        for step, row in enumerate(rows):
            self.assertEqual(row["token"], ids[step])
            self.assertAlmostEqual(lp.token_logprobs[step], row["logprobs"][ids[step]], delta=1e-4)
            best = sorted(row["logprobs"], reverse=True)[:3]
            self.assertEqual(len(lp.top_logprobs[step]), 3)
            for got, want in zip(sorted(lp.top_logprobs[step].values(), reverse=True), best):
                self.assertAlmostEqual(got, want, delta=1e-4)
        self.assertEqual(lp.text_offset[0], 0)

    def test_chat_logprobs(self):
        r = self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), r.usage.completion_tokens)
        for entry in content:
            self.assertEqual(len(entry.top_logprobs), 2)
            self.assertLessEqual(entry.logprob, 0.0)
            # Greedy: the chosen token is the most likely one.
            self.assertAlmostEqual(entry.top_logprobs[0].logprob, entry.logprob, delta=1e-6)
            self.assertEqual(bytes(entry.bytes), entry.token.encode())

    def test_prefix_cache_shows_in_usage(self):
        prompt = "Paris is the capital and largest city of France. " * 4 + "It is known for"
        first = self.complete(prompt=prompt, max_tokens=2, temperature=0)
        second = self.complete(prompt=prompt, max_tokens=2, temperature=0)
        self.assertGreater(first.usage.prompt_tokens, 32)
        self.assertGreaterEqual(second.usage.prompt_tokens_details.cached_tokens, 32)

    # --- other endpoints ------------------------------------------------------------------
    def test_models_tokenize_detokenize(self):
        models = self.client.models.list().data
        self.assertEqual(len(models), 1)
        self.assertEqual(models[0].id, "SmolLM2-135M-Instruct.Q4_1.gguf")
        import subprocess
        from serve_fixture import BINARY
        ref = json.loads(subprocess.run([BINARY, "tokenize", "--config", SMOLLM2, "--text", PROMPT],
                                        capture_output=True, text=True, check=True, cwd=SOURCE).stdout)
        status, body = self.server.post("/tokenize", {"prompt": PROMPT})
        self.assertEqual(status, 200)
        tok = json.loads(body)
        self.assertEqual(tok["tokens"], ref["ids"])
        self.assertEqual(tok["count"], len(ref["ids"]))
        status, body = self.server.post("/detokenize", {"tokens": tok["tokens"]})
        self.assertEqual(status, 200)
        self.assertTrue(json.loads(body)["prompt"].endswith(PROMPT))
        ref_chat = json.loads(subprocess.run([BINARY, "tokenize", "--config", SMOLLM2, "--chat", QUESTION],
                                             capture_output=True, text=True, check=True, cwd=SOURCE).stdout)
        status, body = self.server.post("/tokenize", {"messages": [{"role": "user", "content": QUESTION}]})
        self.assertEqual(json.loads(body)["tokens"], ref_chat["ids"])

    def test_advertised_context_is_the_one_served(self):
        # The listening line's figure: here the KV pool (cache.memory), not SmolLM2's 8192-token
        # context, sets it, and /v1/models, /tokenize and the refusal all say the same.
        import re
        limit = int(re.search(r"(\d+) tokens per request at most", self.server.log()).group(1))
        self.assertLess(limit, 8192)
        status, body = self.server.get("/v1/models")
        self.assertEqual(json.loads(body)["data"][0]["max_model_len"], limit)
        status, body = self.server.post("/tokenize", {"prompt": PROMPT})
        self.assertEqual(json.loads(body)["max_model_len"], limit)
        status, body = self.server.post("/v1/completions", {"prompt": [1] * limit, "max_tokens": 1})
        self.assertEqual(status, 400, body)
        self.assertIn(f"maximum context length is {limit} tokens (set by cache.memory)",
                      json.loads(body)["error"]["message"])
        status, body = self.server.post("/v1/completions", {"prompt": [1] * (limit - 2), "max_tokens": 1})
        self.assertEqual(status, 200, body)

    def test_health_and_page(self):
        self.assertEqual(self.server.get("/health")[0], 200)
        status, page = self.server.get("/")
        self.assertEqual(status, 200)
        self.assertIn(b"/v1/chat/completions", page)

    def test_metrics_count_requests_and_tokens(self):
        before = self.server.metrics()
        self.complete(prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
        after = self.server.metrics()
        self.assertEqual(after["kvpipe:generation_tokens_total"] - before["kvpipe:generation_tokens_total"], 7)
        self.assertEqual(after["kvpipe:request_success_total:length"] - before["kvpipe:request_success_total:length"], 1)
        self.assertEqual(after["kvpipe:time_to_first_token_seconds_count"] -
                         before["kvpipe:time_to_first_token_seconds_count"], 1)
        self.assertEqual(after["kvpipe:inter_token_latency_seconds_count"] -
                         before["kvpipe:inter_token_latency_seconds_count"], 6)
        self.assertGreater(after["kvpipe:prompt_tokens_total"], before["kvpipe:prompt_tokens_total"])
        for name in ("kvpipe:num_requests_running", "kvpipe:num_requests_waiting", "kvpipe:kv_cache_usage_perc",
                     "kvpipe:prefix_cache_queries_total", "kvpipe:prefix_cache_hits_total",
                     "kvpipe:num_preemptions_total", "kvpipe:e2e_request_latency_seconds_sum",
                     "kvpipe:request_queue_time_seconds_count"):
            self.assertIn(name, after)
        self.assertEqual(after["kvpipe:num_requests_running"], 0)

    # --- bad requests and clients that leave ----------------------------------------------
    def test_malformed_requests_get_4xx_and_the_server_keeps_serving(self):
        C, H = "/v1/completions", "/v1/chat/completions"
        user = [{"role": "user", "content": "hi"}]
        cases = [
            (C, b"{", 400, None), (C, b"[]", 400, None), (C, b"null", 400, None), (C, b'{"prompt":"\xff"}', 400, None),
            (C, b'{"prompt": "hi", "temperature": 1e999}', 400, None), (C, {}, 400, "prompt"), (C, {"prompt": 5}, 400, "prompt"), (C, {"prompt": []}, 400, "prompt"),
            (C, {"prompt": [1, "a"]}, 400, "prompt"), (C, {"prompt": [-1]}, 400, "prompt"),
            (C, {"prompt": [49152]}, 400, "prompt"), (C, {"prompt": [[1], 2]}, 400, "prompt[1]"),
            (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
            (C, {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
            (C, {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
            (C, {"prompt": "hi " * 3000}, 400, "prompt"),
            (C, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
            (C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
            (C, {"prompt": "hi", "top_p": 0}, 400, "top_p"), (C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
            (C, {"prompt": "hi", "top_k": -2}, 400, "top_k"), (C, {"prompt": "hi", "n": 0}, 400, "n"),
            (C, {"prompt": "hi", "n": True}, 400, "n"), (C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
            (C, {"prompt": "hi", "stop": [1]}, 400, "stop"), (C, {"prompt": "hi", "stop": [""]}, 400, "stop"),
            (C, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
            (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
            (C, {"prompt": "hi", "seed": "x"}, 400, "seed"), (C, {"prompt": "hi", "echo": True}, 400, "echo"),
            (C, {"prompt": "hi", "model": "other"}, 404, "model"),
            (H, {}, 400, "messages"), (H, {"messages": []}, 400, "messages"),
            (H, {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
            (H, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
            (H, {"messages": user, "top_logprobs": 2}, 400, "top_logprobs"),
            (H, {"messages": user, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
            # What kvpipe does not implement is refused by name, never silently ignored.
            (C, {"prompt": "hi", "structured_outputs": {"grammar": "root ::= value"}}, 400, "structured_outputs.grammar"),
            (C, {"prompt": "hi", "structured_outputs": {"json": {"type": "string", "format": "email"}}}, 400,
             "structured_outputs.json"),
            (C, {"prompt": "hi", "structured_outputs": {}}, 400, "structured_outputs"),
            (C, {"prompt": "hi", "structured_outputs": {"regex": "(a"}}, 400, "structured_outputs.regex"),
            (C, {"prompt": "hi", "structured_outputs": {"regex": "a(?=b)"}}, 400, "structured_outputs.regex"),
            (C, {"prompt": "hi", "structured_outputs": {"choice": []}}, 400, "structured_outputs.choice"),
            (C, {"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, 400, "guided_choice"),
            (C, {"prompt": "hi", "guided_regex": "a", "ignore_eos": True}, 400, "ignore_eos"),
            (C, {"prompt": "hi", "guided_grammar": "root ::= \"a"}, 400, "guided_grammar"),
            (C, {"prompt": "hi", "grammar": "root ::= <[13]>"}, 400, "grammar"),
            (C, {"prompt": "hi", "stop_token_ids": [2]}, 400, "stop_token_ids"),
            (C, {"prompt": "hi", "guided_json": {"type": "integer", "multipleOf": 2}}, 400, "guided_json"),
            (C, {"prompt": "hi", "response_format": {"type": "xml"}}, 400, "response_format"),
            (H, {"messages": user, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {},
                                                                                           "extra": 1}}},
             400, "response_format.json_schema.extra"),
            (H, {"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
            (H, {"messages": user, "tool_choice": "required"}, 400, "tool_choice"),
            (H, {"messages": user, "functions": []}, 400, "functions"),
            (H, {"messages": user, "prompt": "hi"}, 400, "prompt"),
            (C, {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
            (C, {"prompt": "hi", "logit_bias": {"49152": 1}}, 400, "logit_bias"),
            (C, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
            (C, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
            (C, {"prompt": "hi", "frequency_penalty": "x"}, 400, "frequency_penalty"),
            (C, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
            (C, {"prompt": "hi", "min_p": 2}, 400, "min_p"),
            (C, {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
            (C, {"prompt": "hi", "bad_words": "Paris"}, 400, "bad_words"),
            (C, {"prompt": "hi", "bad_words": [" "]}, 400, "bad_words"),
            ("/tokenize", {"prompt": 3}, 400, "prompt"), ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
            ("/v1/embeddings", {"input": "x"}, 404, None),
        ]
        self.assertGreaterEqual(len(cases), 20)
        for path, body, want, param in cases:
            status, raw = self.server.post(path, body)
            self.assertEqual(status, want, f"{path} {body!r}: {raw!r}")
            err = json.loads(raw)["error"]
            self.assertEqual(set(err), {"message", "type", "param", "code"}, raw)
            self.assertTrue(err["message"])
            if param is not None:
                self.assertEqual(err["param"], param, f"{body!r}: {err}")
        self.assertEqual(self.server.get("/v1/nothing")[0], 404)
        self.assertEqual(self.server.get(C)[0], 404)
        status, raw = self.server.post(C, b'{"prompt": "' + b"a" * (9 << 20) + b'"}')
        self.assertEqual(status, 413)
        self.assertIn("error", json.loads(raw))
        # Still serving.
        self.assertEqual(self.server.get("/health")[0], 200)
        r = self.complete(prompt=PROMPT, max_tokens=2, temperature=0)
        self.assertEqual(r.usage.completion_tokens, 2)

    # --- penalties, bias, banned words, min_tokens, min_p; fields ignored harmlessly ------
    def test_penalties_and_bias_equal_generate(self):
        """The server's processed greedy tokens are `kvpipe generate`'s with the same
        sampling: keys, and differ from the unprocessed ones."""
        params = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.4, "min_p": 0.1}
        sets = []
        for k, v in params.items():
            sets += ["--set", f"sampling.{k}={v}"]
        ref = generate("--config", SMOLLM2, "--prompt", PROMPT, "--max-new-tokens", "24",
                       "--set", "sampling.ignore_eos=true", *sets)[0]
        r = self.complete(prompt=PROMPT, max_tokens=24, temperature=0,
                          extra_body={"return_token_ids": True, "ignore_eos": True, **params})
        self.assertEqual(extra(r.choices[0], "token_ids"), ref["output_ids"])
        plain = self.complete(prompt=PROMPT, max_tokens=24, temperature=0,
                              extra_body={"return_token_ids": True, "ignore_eos": True})
        self.assertNotEqual(extra(plain.choices[0], "token_ids"), ref["output_ids"])

    def test_generate_penalties_and_bias_against_a_float64_recompute(self):
        """Each greedy token of a penalised, biased `kvpipe generate` run is the argmax of its
        step's raw logits (from --logprobs-out: logprob + log_z) with vLLM's formulas applied
        here in float64: bias, then repetition over prompt and output, frequency and presence
        over the output."""
        plain = generate("--config", SMOLLM2, "--prompt", PROMPT, "--max-new-tokens", "24",
                         "--set", "sampling.ignore_eos=true")[0]["output_ids"]
        rp, fp, pp = 1.25, 0.6, 0.3
        bias = {plain[1]: -4.0, plain[3]: 2.0, 1000: 1.5}
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "logprobs.jsonl")
            got = generate("--config", SMOLLM2, "--prompt", PROMPT, "--max-new-tokens", "24", "--logprobs-out", path,
                           "--set", "sampling.ignore_eos=true", "--set", f"sampling.repetition_penalty={rp}",
                           "--set", f"sampling.frequency_penalty={fp}", "--set", f"sampling.presence_penalty={pp}",
                           "--set", "sampling.logit_bias={" + ", ".join(f"{k}: {v}" for k, v in bias.items()) + "}")[0]
            with open(path) as f:
                rows = [json.loads(line) for line in f]
        self.assertNotEqual(got["output_ids"], plain)
        self.assertEqual([r["token"] for r in rows], got["output_ids"])
        prompt = got["prompt_ids"]
        checked = 0
        for step, row in enumerate(rows):
            history = prompt + got["output_ids"][:step]
            counts = {}
            for t in got["output_ids"][:step]:
                counts[t] = counts.get(t, 0) + 1
            x = [lp + row["log_z"] for lp in row["logprobs"]]
            for t, b in bias.items():
                x[t] += b
            for t in set(history):
                x[t] = x[t] / rp if x[t] > 0 else x[t] * rp
                c = counts.get(t, 0)
                x[t] -= fp * c + pp * (1 if c else 0)
            order = sorted(range(len(x)), key=lambda i: -x[i])
            if x[order[0]] - x[order[1]] < 1e-3:
                continue  # a near tie: float32 logits may rank it either way
            self.assertEqual(row["token"], order[0], f"step {step}")
            checked += 1
        self.assertGreaterEqual(checked, 20)

    def test_logit_bias_and_bad_words_keep_a_token_out(self):
        ids = json.loads(http("POST", self.server.url + "/tokenize", {"prompt": " Paris", "add_special_tokens": False})[1])["tokens"]
        self.assertEqual(len(ids), 1, ids)
        paris = ids[0]
        plain = self.complete(prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"return_token_ids": True})
        self.assertIn(paris, extra(plain.choices[0], "token_ids"), "the model does not answer Paris here")
        for body in ({"logit_bias": {str(paris): -100}}, {"bad_words": ["Paris"]}):
            r = self.complete(prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"return_token_ids": True, **body})
            self.assertNotIn(paris, extra(r.choices[0], "token_ids"), body)
            self.assertNotIn("Paris", r.choices[0].text, body)
        # +100 forces a token; llama.cpp's [[id, false]] form bans it.
        forced = self.complete(prompt=PROMPT, max_tokens=3, temperature=0.8, seed=3, logit_bias={"42": 100},
                               extra_body={"return_token_ids": True, "ignore_eos": True})
        self.assertEqual(extra(forced.choices[0], "token_ids"), [42, 42, 42])
        banned = self.complete(prompt=PROMPT, max_tokens=4, temperature=0,
                               extra_body={"return_token_ids": True, "logit_bias": [[paris, False]]})
        self.assertNotIn(paris, extra(banned.choices[0], "token_ids"))

    def test_choice_and_regex_answers_always_match(self):
        """Sampled at temperature 1, every answer to a `choice` is one of the choices, and
        every answer to a `regex` is a re.fullmatch of it, streamed or not."""
        choices = ["Paris", "London", "Berlin", "New York City", "Rome (Italy)"]
        msgs = [{"role": "user", "content": QUESTION}]
        for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
            r = self.client.chat.completions.create(model=self.model, messages=msgs, max_tokens=16, temperature=1.0,
                                                    n=4, seed=5, extra_body=body)
            for c in r.choices:
                self.assertIn(c.message.content, choices, body)
                self.assertEqual(c.finish_reason, "stop")
        patterns = [r"\d{3}-\d{4}", r"\d{4}-\d{2}-\d{2}", r"(yes|no)", r"[A-Z][a-z]{1,8} [A-Z][a-z]{1,8}",
                    r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)", r'\{"name": "[A-Za-z ]{1,20}", "age": \d{1,2}\}',
                    r"0x[0-9a-f]{4}", r"(red|green|blue)(, (red|green|blue)){0,2}", r"-?\d{1,3}(\.\d{1,2})?",
                    r"[^\n\"]{1,12}!"]
        for i, pattern in enumerate(patterns):
            r = self.complete(prompt=PROMPT, max_tokens=64, temperature=1.0, n=4, seed=i,
                              extra_body={"structured_outputs": {"regex": pattern}})
            for c in r.choices:
                self.assertIsNotNone(re.fullmatch(pattern, c.text), (pattern, c.text))
                self.assertEqual(c.finish_reason, "stop", (pattern, c.text))
        chunks = list(self.complete(prompt=PROMPT, max_tokens=64, temperature=1.0, seed=9, stream=True,
                                    extra_body={"guided_regex": patterns[1]}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        self.assertIsNotNone(re.fullmatch(patterns[1], text), text)
        # Unconstrained requests beside constrained ones are untouched.
        plain = self.complete(prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        ref = generate("--config", SMOLLM2, "--prompt", PROMPT, "--max-new-tokens", "6", "--set", "sampling.ignore_eos=true")[0]
        self.assertEqual(plain.choices[0].text, ref["text"])

    def test_min_tokens_holds_back_the_end(self):
        msgs = [{"role": "user", "content": QUESTION + " Answer in one sentence."}]
        short = self.client.chat.completions.create(model=self.model, messages=msgs, max_tokens=64, temperature=0)
        self.assertEqual(short.choices[0].finish_reason, "stop")
        n = short.usage.completion_tokens + 6
        longer = self.client.chat.completions.create(model=self.model, messages=msgs, max_tokens=64, temperature=0,
                                                     extra_body={"min_tokens": n})
        self.assertGreaterEqual(longer.usage.completion_tokens, n)

    def test_harmless_fields_are_accepted_and_created_is_the_request_time(self):
        before = int(time.time())
        r = self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2, temperature=0, user="someone", store=False,
                                                metadata={"k": "v"}, response_format={"type": "text"},
                                                tool_choice="none")
        after = int(time.time())
        self.assertEqual(r.usage.completion_tokens, 2)
        self.assertTrue(before <= r.created <= after, (before, r.created, after))
        time.sleep(1.1)
        again = self.complete(prompt=PROMPT, max_tokens=1)
        self.assertGreater(again.created, r.created)

    def test_client_that_disconnects_frees_its_blocks(self):
        before = self.server.metrics()
        req = urllib.request.Request(self.server.url + "/v1/completions", method="POST",
                                     data=json.dumps({"prompt": PROMPT, "max_tokens": 1000, "stream": True,
                                                      "ignore_eos": True, "temperature": 0}).encode(),
                                     headers={"Content-Type": "application/json"})
        r = urllib.request.urlopen(req, timeout=60)
        for _ in range(3):
            self.assertTrue(r.readline().startswith(b"data: "))
            r.readline()
        held = self.server.metrics()
        self.assertEqual(held["kvpipe:num_requests_running"], 1)
        self.assertGreater(held["kvpipe:kv_cache_used_blocks"], 0)
        r.close()
        deadline = time.time() + 20
        while True:
            m = self.server.metrics()
            if m["kvpipe:num_requests_running"] == 0 and m["kvpipe:kv_cache_used_blocks"] == 0:
                break
            self.assertLess(time.time(), deadline, f"blocks still held 20 s after the client left: {m}")
            time.sleep(0.2)
        self.assertEqual(m["kvpipe:request_success_total:abort"] - before["kvpipe:request_success_total:abort"], 1)
        self.assertLess(m["kvpipe:generation_tokens_total"] - before["kvpipe:generation_tokens_total"], 500)


    def test_non_streaming_client_that_leaves_frees_its_blocks(self):
        """A client that times out on a long non-streaming request: its request ends (abort)
        within a second or so, its blocks freed."""
        before = self.server.metrics()
        body = json.dumps({"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "temperature": 0}).encode()
        with socket.create_connection(("127.0.0.1", self.server.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            deadline = time.time() + 30
            while self.server.metrics()["kvpipe:num_requests_running"] == 0:
                self.assertLess(time.time(), deadline, "the request never started")
                time.sleep(0.05)
            time.sleep(0.5)
        left = time.time()
        while True:
            m = self.server.metrics()
            if m["kvpipe:num_requests_running"] == 0 and m["kvpipe:kv_cache_used_blocks"] == 0:
                break
            self.assertLess(time.time() - left, 2, f"blocks still held 2 s after the client left: {m}")
            time.sleep(0.05)
        self.assertEqual(m["kvpipe:request_success_total:abort"] - before["kvpipe:request_success_total:abort"], 1)
        self.assertLess(m["kvpipe:generation_tokens_total"] - before["kvpipe:generation_tokens_total"], 500)


class GuardedServer(unittest.TestCase):
    """An API key, a small queue, a short shutdown deadline."""

    def test_api_key_queue_limit_and_shutdown(self):
        server = Server(args=("--api-key", "sesame", "--max-requests", "2", "--shutdown-timeout", "2"))
        try:
            self.assertEqual(server.get("/health")[0], 200)
            status, raw = server.get("/v1/models")
            self.assertEqual(status, 401)
            self.assertEqual(json.loads(raw)["error"]["code"], "invalid_api_key")
            self.assertEqual(server.get("/v1/models", headers={"Authorization": "Bearer wrong"})[0], 401)
            key = {"Authorization": "Bearer sesame"}
            self.assertEqual(server.get("/v1/models", headers=key)[0], 200)
            self.assertEqual(server.post("/v1/completions", {"prompt": "hi", "max_tokens": 1})[0], 401)
            with self.assertRaises(openai.AuthenticationError):
                openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).completions.create(
                    model="x", prompt="hi", max_tokens=1)
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0)
            model = client.models.list().data[0].id

            # Two long choices fill the queue: a third request is refused with 503.
            long = client.completions.create(model=model, prompt=PROMPT, max_tokens=1000, n=2, stream=True,
                                             temperature=0, extra_body={"ignore_eos": True})
            first = next(iter(long))
            self.assertTrue(first.choices)
            status, raw = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers=key)
            self.assertEqual(status, 503, raw)
            self.assertEqual(json.loads(raw)["error"]["type"], "service_unavailable_error")

            # SIGTERM: the open stream is cancelled after --shutdown-timeout, ends properly, and
            # the server exits 0.
            rest = []
            reader = threading.Thread(target=lambda: rest.extend(long))
            reader.start()
            t0 = time.time()
            os.kill(server.rank0_pid(), 15)
            reader.join(timeout=30)
            self.assertFalse(reader.is_alive(), "the stream did not end after SIGTERM")
            reasons = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
            self.assertEqual(sorted(reasons), ["abort", "abort"])
            self.assertEqual(server.proc.wait(timeout=30), 0, server.log())
            self.assertLess(time.time() - t0, 20)
        finally:
            server.kill()

    def test_sigterm_lets_streams_finish(self):
        server = Server()
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            stream = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=40,
                                               temperature=0, stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
            it = iter(stream)
            next(it)
            os.kill(server.rank0_pid(), 15)
            time.sleep(0.5)
            refused = None
            try:
                refused = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}, timeout=5)[0]
            except OSError:
                refused = "closed"
            self.assertIn(refused, (503, "closed"))
            chunks = list(it)
            self.assertEqual(chunks[-1].usage.completion_tokens, 40)
            self.assertEqual(server.proc.wait(timeout=60), 0, server.log())
        finally:
            server.kill()


if __name__ == "__main__":
    unittest.main()
