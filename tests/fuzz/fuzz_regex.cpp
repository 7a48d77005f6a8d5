// Fuzzes the regular-expression compiler of structured outputs (engine/grammar/regex_dfa.cpp):
// the input is a pattern, as a request's `structured_outputs.regex` brings it. A pattern is
// compiled or refused with std::invalid_argument; a compiled automaton must keep its promises:
// every state can still reach a match, and walking any bytes from any state stays in range.
#include "engine/grammar/regex_dfa.h"
#include "tests/fuzz/fuzz_automaton.h"
#include "tests/fuzz/fuzz_support.h"

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string pattern(reinterpret_cast<const char*>(data), size);
  try {
    const kvpipe::RegexDfa dfa(pattern, 2000);
    kvpipe::fuzz::check_automaton(dfa, pattern);
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
