"""Structured outputs of `kvpipe serve` with SmolLM2-135M-Instruct: every answer sampled at
temperature 1 under a JSON Schema of tests/data/json_schemas.json validates with the
`jsonschema` package, `json_object` answers are JSON objects, the OpenAI client's
`chat.completions.parse` with Pydantic models parses every answer, answers under a GBNF
grammar are texts of it (by Python's `re` for a grammar without recursion, by Python's own
parser for recursive arithmetic), /metrics counts masks and compiles, and what kvpipe cannot
constrain is a 400 naming the keyword or the grammar's line."""
import ast
import concurrent.futures
import enum
import json
import os
import re
import unittest
from typing import List, Optional

import jsonschema
import pydantic

from serve_fixture import SOURCE, ServedTestCase

CORPUS = os.path.join(SOURCE, "tests", "data", "json_schemas.json")
ASK = "Describe something as JSON."


class Color(str, enum.Enum):
    red = "red"
    green = "green"


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    color: Color


class Owner(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=130)
    rating: float = pydantic.Field(gt=0, lt=5)
    pets: List[Pet] = pydantic.Field(max_length=2)
    nickname: Optional[str] = pydantic.Field(max_length=10)
    verified: bool


class StructuredOutputs(ServedTestCase):
    def chat(self, **kw):
        return self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": ASK}], **kw)

    def test_every_sampled_answer_validates_against_its_schema(self):
        with open(CORPUS) as f:
            corpus = json.load(f)
        self.assertGreaterEqual(len(corpus), 40)
        checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
        self.assertIn("date-time", checker.checkers, "rfc3339-validator is missing: date-time would go unchecked")

        def answers(i):
            entry = corpus[i]
            r = self.chat(max_tokens=200, temperature=1.0, n=8, seed=i,
                          response_format={"type": "json_schema",
                                           "json_schema": {"name": entry["name"], "schema": entry["schema"], "strict": True}})
            return entry, [(c.message.content, c.finish_reason) for c in r.choices]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for entry, outs in pool.map(answers, range(len(corpus))):
                validator = jsonschema.Draft202012Validator(entry["schema"], format_checker=checker)
                for text, reason in outs:
                    self.assertEqual(reason, "stop", f"{entry['name']}: {text!r}")
                    errors = list(validator.iter_errors(json.loads(text)))
                    self.assertEqual(errors, [], f"{entry['name']}: {text!r}")

    def test_json_object_and_the_older_field_names(self):
        for kw in ({"response_format": {"type": "json_object"}},
                   {"extra_body": {"structured_outputs": {"json_object": True}}},
                   {"extra_body": {"guided_json": {"type": "object", "properties": {"k": {"type": "integer"}},
                                                   "required": ["k"]}}},
                   {"extra_body": {"structured_outputs": {"json": json.dumps({"type": "array", "items": {"type": "integer"},
                                                                             "maxItems": 3})}}}):
            r = self.chat(max_tokens=200, temperature=1.0, n=4, seed=3, **kw)
            for c in r.choices:
                self.assertEqual(c.finish_reason, "stop", (kw, c.message.content))
                value = json.loads(c.message.content)
                self.assertIsInstance(value, list if "json" in kw.get("extra_body", {}).get("structured_outputs", {}) else dict)

    def test_pydantic_models_parse(self):
        for seed in range(3):
            r = self.client.chat.completions.parse(model=self.model, messages=[{"role": "user", "content": "Describe a pet owner."}],
                                                   response_format=Owner, max_tokens=200, temperature=1.0, n=3, seed=seed)
            for c in r.choices:
                self.assertIsInstance(c.message.parsed, Owner, c.message.content)
                self.assertLessEqual(len(c.message.parsed.pets), 2)

    def test_grammar_answers_are_texts_of_the_grammar(self):
        flat = ('root ::= answer " because " reason   # a comment\n'
                'answer ::= "yes" | "no"\n'
                'reason ::= [a-z]{1,10} (" " [a-z]{1,10}){0,3}\n')
        arithmetic = ('root ::= expr\n'
                      'expr ::= term (("+" | "-" | "*") term){0,3}\n'
                      'term ::= [1-9] [0-9]{0,2} | "(" expr ")"\n')
        for field, grammar in (("structured_outputs", {"grammar": flat}), ("guided_grammar", flat),
                               ("grammar", arithmetic)):
            r = self.client.completions.create(model=self.model, prompt="Is the sky blue? Answer:", max_tokens=64,
                                               temperature=1.0, n=6, seed=7, extra_body={field: grammar})
            for c in r.choices:
                self.assertEqual(c.finish_reason, "stop", (field, c.text))
                if grammar is arithmetic:
                    self.assertRegex(c.text, r"^[0-9+*()-]+$")
                    ast.parse(c.text, mode="eval")  # a SyntaxError fails the test
                else:
                    self.assertTrue(re.fullmatch(r"(yes|no) because [a-z]{1,10}( [a-z]{1,10}){0,3}", c.text), c.text)
        for grammar, where in (("root ::= value\n", "undefined rule 'value'"), ("start ::= \"a\"\n", "root"),
                               ('root ::= "a\n', "line 1")):
            status, raw = self.server.post("/v1/completions", {"prompt": "x", "guided_grammar": grammar})
            self.assertEqual(status, 400, raw)
            err = json.loads(raw)["error"]
            self.assertEqual(err["param"], "guided_grammar")
            self.assertIn(where, err["message"])

    def test_metrics_report_what_masks_and_compiles_cost(self):
        before = self.server.metrics()
        r = self.client.completions.create(model=self.model, prompt="A code:", max_tokens=8, temperature=1.0, seed=1,
                                           extra_body={"structured_outputs": {"regex": "metrics-[0-9]{3}"}})
        self.assertRegex(r.choices[0].text, r"^metrics-[0-9]{3}$")
        after = self.server.metrics()
        name = "kvpipe:structured_output_"
        # One mask per token sampled under the constraint (the end of sequence too, whether
        # usage counts it or not), one compile.
        masks = after[name + "mask_seconds_count"] - before.get(name + "mask_seconds_count", 0)
        self.assertIn(masks, (r.usage.completion_tokens, r.usage.completion_tokens + 1))
        self.assertGreater(after[name + "mask_seconds_sum"], before.get(name + "mask_seconds_sum", 0))
        self.assertEqual(after[name + "compile_seconds_count"] - before.get(name + "compile_seconds_count", 0), 1)
        self.assertGreater(after[name + "cache_bytes"], 0)
        self.assertGreater(after[name + "cache_states"], 0)

    def test_what_cannot_be_constrained_is_refused_by_keyword(self):
        cases = [
            ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "multipleOf": 3}}}, "multipleOf"),
            ({"type": "json_schema", "json_schema": {"name": "n", "schema": {
                "$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}}, "required": ["next"]}},
                "$ref": "#/$defs/N"}}},
             "recurses without an end"),
            ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string", "format": "email"}}}, "email"),
            ({"type": "json_schema", "json_schema": {"name": "n"}}, "schema"),
            ({"type": "xml"}, "xml"),
        ]
        for response_format, word in cases:
            status, raw = self.server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                    "response_format": response_format})
            self.assertEqual(status, 400, raw)
            err = json.loads(raw)["error"]
            self.assertTrue(err["param"].startswith("response_format"), err)
            self.assertIn(word, err["message"])


if __name__ == "__main__":
    unittest.main()
