"""Tool calls through `kvpipe serve --chat-template` (Qwen2.5's template, whose tools section
SmolLM2's own lacks; its ChatML turns are SmolLM2's) with SmolLM2-135M-Instruct and OpenAI's
Python client: `tool_choice: "required"` and a named function always give calls whose
arguments validate against the function's schema (with the `jsonschema` package), also
streamed, and through `chat.completions.parse` with Pydantic tools; the prompt the server
renders with tools, an assistant's tool calls and a tool's answer is transformers'
rendering of the same messages; what a tool request gets wrong is a 400 naming the field.
"""
import concurrent.futures
import enum
import json
import os
import subprocess
import unittest

import jsonschema
import openai
import pydantic

from serve_fixture import BINARY, SMOLLM2, SOURCE, ServedTestCase

QWEN_TEMPLATE = os.path.join(SOURCE, "tests", "data", "chat_templates", "qwen2.5-7b-instruct.jinja")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now."}},
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {},
                                                                   "additionalProperties": False})
           for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Unit(str, enum.Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    unit: Unit


class ToolCalls(ServedTestCase):
    server_args = ("--chat-template", QWEN_TEMPLATE)

    def chat(self, **kw):
        kw.setdefault("messages", ASK)
        return self.client.chat.completions.create(model=self.model, max_tokens=120, **kw)

    def check_call(self, call, names=SCHEMAS):
        self.assertEqual(call.type, "function")
        self.assertTrue(call.id.startswith("call_"), call.id)
        self.assertIn(call.function.name, names)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

    def test_required_always_calls_with_valid_arguments(self):
        def answers(seed):
            return self.chat(tools=TOOLS, tool_choice="required", temperature=1.0, n=8, seed=seed).choices

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for choices in pool.map(answers, range(2)):
                for c in choices:
                    self.assertEqual(c.finish_reason, "tool_calls", c.message)
                    self.assertIsNone(c.message.content)
                    self.assertGreaterEqual(len(c.message.tool_calls), 1)
                    for call in c.message.tool_calls:
                        self.check_call(call)
                    self.assertEqual(len({call.id for call in c.message.tool_calls}), len(c.message.tool_calls))

    def test_parallel_tool_calls_false_gives_one_call(self):
        r = self.chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, n=4, seed=9)
        for c in r.choices:
            self.assertEqual(len(c.message.tool_calls), 1, c.message)

    def test_named_function_calls_it(self):
        for name in ("get_weather", "add", "get_time"):
            r = self.chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}},
                          temperature=1.0, n=8, seed=5)
            for c in r.choices:
                self.assertEqual(c.finish_reason, "stop", c.message)  # as OpenAI ends a forced call
                self.assertEqual(len(c.message.tool_calls), 1)
                self.assertEqual(c.message.tool_calls[0].function.name, name)
                self.check_call(c.message.tool_calls[0], [name])

    def test_streamed_calls_are_the_non_streamed_ones(self):
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            whole = self.chat(tools=TOOLS, tool_choice=choice, temperature=0.0, seed=1).choices[0]
            calls, reason, content = {}, None, ""
            for chunk in self.chat(tools=TOOLS, tool_choice=choice, temperature=0.0, seed=1, stream=True):
                for c in chunk.choices:
                    content += c.delta.content or ""
                    for d in c.delta.tool_calls or []:
                        call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                        if d.id:
                            self.assertIsNone(call["id"], "a call's id comes once")
                            call["id"] = d.id
                        call["name"] += d.function.name or ""
                        call["arguments"] += d.function.arguments or ""
                    reason = c.finish_reason or reason
            self.assertEqual(reason, whole.finish_reason)
            self.assertEqual(content, "")
            self.assertEqual([(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
                             [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls])

    def test_pydantic_tools_parse(self):
        r = self.client.chat.completions.parse(
            model=self.model, messages=ASK, max_tokens=120, temperature=1.0, n=4, seed=2,
            tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required")
        for c in r.choices:
            for call in c.message.tool_calls:
                self.assertIsInstance(call.function.parsed_arguments, GetWeather)

    def test_auto_answers_with_text_or_valid_calls(self):
        r = self.chat(tools=TOOLS, temperature=1.0, n=6, seed=4)
        for c in r.choices:
            if c.message.tool_calls:
                self.assertEqual(c.finish_reason, "tool_calls")
                for call in c.message.tool_calls:
                    self.check_call(call)
            else:
                self.assertIn(c.finish_reason, ("stop", "length"))
                self.assertIsInstance(c.message.content, str)

    def test_the_prompt_is_transformers_rendering(self):
        from transformers.utils.chat_template_utils import render_jinja_template
        messages = [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"unit\": \"celsius\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": -3}"},
        ]
        status, body = self.server.post("/tokenize", {"model": self.model, "messages": messages, "tools": TOOLS})
        self.assertEqual(status, 200, body)
        status, text = self.server.post("/detokenize", {"model": self.model, "tokens": json.loads(body)["tokens"]})
        self.assertEqual(status, 200, text)
        with open(QWEN_TEMPLATE, encoding="utf-8") as f:
            template = f.read()
        # transformers (as vLLM hands them over): arguments as objects, content "" for none.
        reference = json.loads(json.dumps(messages))
        reference[2]["content"] = ""
        reference[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Oslo", "unit": "celsius"}
        rendered, _ = render_jinja_template(conversations=[reference], tools=TOOLS, chat_template=template,
                                            add_generation_prompt=True, bos_token="", eos_token="<|im_end|>")
        self.assertEqual(json.loads(text)["prompt"], rendered[0])
        self.assertIn("<tools>", rendered[0])
        self.assertIn("<tool_response>", rendered[0])

    def test_bad_tool_requests_are_named(self):
        cases = [
            ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools[0].function.name"),
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
             "tool_choice.function.name"),
            ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
            ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}}}], "tool_choice": "required"},
             "tools[0].function.parameters"),
            ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
            ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
                "name": "f", "arguments": "{not json"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
        ]
        for extra, param in cases:
            body = {"model": self.model, "messages": ASK, **extra}
            status, text = self.server.post("/v1/chat/completions", body)
            self.assertEqual(status, 400, (extra, text))
            self.assertEqual(json.loads(text)["error"]["param"], param, text)


class ToolFlags(unittest.TestCase):
    def serve_fails(self, *args):
        r = subprocess.run([BINARY, "serve", "--config", SMOLLM2, "--port", "0", *args], capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL, cwd=SOURCE)
        self.assertEqual(r.returncode, 2, r.stderr)
        return r.stderr

    def test_bad_flags_exit_2_naming_them(self):
        self.assertIn("--tool-call-parser", self.serve_fails("--tool-call-parser", "pythonic"))
        self.assertIn("--chat-template", self.serve_fails("--chat-template", "/nonexistent/template.jinja"))

    def test_a_template_that_does_not_parse_names_the_file(self):
        import tempfile
        with tempfile.NamedTemporaryFile("w", suffix=".jinja") as f:
            f.write("{% for m in messages %}{{ m.content }}\n{% if %}")
            f.flush()
            err = self.serve_fails("--chat-template", f.name)
            self.assertIn(f.name, err)


if __name__ == "__main__":
    unittest.main()
