// Fuzzes the JSON Schema compiler of structured outputs (engine/grammar/json_schema.cpp): the
// input is a schema's JSON text, as `response_format.json_schema.schema` brings it. A schema
// is compiled to a pattern and then to an automaton, or refused with std::invalid_argument;
// deep, recursive or huge schemas must be refused, never loop or exhaust memory.
#include "engine/grammar/json_schema.h"
#include "engine/grammar/regex_dfa.h"
#include "tests/fuzz/fuzz_support.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const nlohmann::ordered_json schema = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (schema.is_discarded()) return 0;
  try {
    const std::string pattern = kvpipe::json_schema_regex(schema);
    const kvpipe::RegexDfa dfa(pattern, 5000);
    (void)dfa.full_match(text);
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
