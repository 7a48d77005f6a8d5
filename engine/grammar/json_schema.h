// JSON Schema to regular expression: the pattern (RegexDfa's syntax) whose matches are JSON
// texts valid against a schema, for structured outputs (`response_format: json_schema`,
// vLLM's `structured_outputs.json`).
//
// kvpipe's own (no packaged library): the design is outlines' (a schema without recursion
// describes a regular language once its whitespace is fixed). Texts are written as Python's
// json.dumps writes them: ", " between items, ": " after keys, no other whitespace, the
// properties of an object in the schema's order. Supported, as applications write schemas
// (Pydantic, OpenAI's strict mode): `type` (one or a list), `properties` with `required`,
// `additionalProperties` (false or absent: only the listed properties are written; an
// object without `properties` takes any JSON object), `enum`, `const`, `items` with
// `minItems`/`maxItems`, `anyOf`, `oneOf` (alternatives that must exclude each other: where
// two of them take some text, the schema is refused naming it), `allOf` of one schema, `$ref`
// to `#/$defs/...` or `#/definitions/...`, strings' `minLength`,
// `maxLength`, `pattern` (RegexDfa's subset, matching the whole string) and `format`
// (date, time, date-time, uuid); integers' and numbers' `minimum`, `maximum`,
// `exclusiveMinimum`, `exclusiveMaximum` (a number, or draft 4's boolean; on numbers, whole
// bounds only, and bounded numbers are written without an exponent); annotations (title, description, default, examples,
// $schema, $id, $comment, deprecated, readOnly, writeOnly, discriminator) change nothing.
// Values a schema leaves free are JSON of bounded depth (3 levels of nesting) with strings
// (and keys) of at most 32 printable ASCII characters; numbers have at most 16 digits. A
// recursive `$ref` (a tree, a linked list) nests inside itself at most 3 times: at the
// deepest level, optional properties, array items and alternatives that need it once more
// are left out, so every answer is valid and the deepest ones are cut short; a schema that
// cannot end that way ("next" required all the way down) is refused as recursing without an
// end. Anything else is std::invalid_argument naming the keyword and its place
// ("properties.age.multipleOf: is not supported").
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <string>

namespace kvpipe {

// `schema` keeps its keys in the order written (the properties' order is the text's).
std::string json_schema_regex(const nlohmann::ordered_json& schema);

// Any JSON object (`response_format: {type: json_object}`).
std::string json_object_regex();

}  // namespace kvpipe
