// Fuzzes the regular-expression compiler of structured outputs (engine/grammar/regex_dfa.cpp):
// the input is a pattern, as a request's `structured_outputs.regex` brings it. A pattern is
// compiled or refused with std::invalid_argument; a compiled automaton must keep its promises:
// every state can still reach a match, and walking any bytes from any state stays in range.
#include "engine/grammar/regex_dfa.h"
#include "tests/fuzz/fuzz_support.h"

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string pattern(reinterpret_cast<const char*>(data), size);
  try {
    const kvpipe::RegexDfa dfa(pattern, 2000);
    const int32_t n = dfa.num_states();
    if (n <= 0) std::abort();
    for (int32_t s = 0; s < n; ++s) {
      if (!dfa.accepting(s) && !dfa.continues(s)) std::abort();  // a live state that cannot go on
      for (int b = 0; b < 256; ++b) {
        const int32_t t = dfa.next(s, static_cast<uint8_t>(b));
        if (t != kvpipe::RegexDfa::kDead && (t < 0 || t >= n)) std::abort();
      }
    }
    // The pattern's own bytes, walked from the start, never leave the table.
    (void)dfa.full_match(pattern);
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
