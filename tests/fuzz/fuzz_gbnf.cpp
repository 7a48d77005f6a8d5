// Fuzzes the GBNF translator of structured outputs (engine/grammar/gbnf.cpp): the input is a
// grammar, as a request's `grammar` brings it. A grammar is translated or refused with
// std::invalid_argument; a translated one is a pattern RegexDfa compiles or refuses (too many
// states) with std::invalid_argument, and a compiled automaton keeps RegexDfa's promises:
// every state can still reach a match, and walking any bytes from any state stays in range.
#include "engine/grammar/gbnf.h"
#include "engine/grammar/regex_dfa.h"
#include "tests/fuzz/fuzz_automaton.h"
#include "tests/fuzz/fuzz_support.h"

#include <cstdint>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string grammar(reinterpret_cast<const char*>(data), size);
  std::string pattern;
  try {
    pattern = kvpipe::gbnf_regex(grammar);
  } catch (const std::invalid_argument&) {
    return 0;
  }
  try {
    const kvpipe::RegexDfa dfa(pattern, 2000);
    kvpipe::fuzz::check_automaton(dfa, grammar);
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
