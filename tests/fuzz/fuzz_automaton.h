// Shared by the fuzz targets whose input compiles to a RegexDfa (fuzz_regex, fuzz_gbnf): the
// promises a compiled automaton keeps, checked state by state. A broken promise aborts, which
// libFuzzer reports as a crash.
#pragma once

#include "engine/grammar/regex_dfa.h"

#include <cstdint>
#include <cstdlib>
#include <string>

namespace kvpipe::fuzz {

// Every state can still reach a match, every transition stays in the table, and walking
// `text` from the start never leaves it.
inline void check_automaton(const RegexDfa& dfa, const std::string& text) {
  const int32_t n = dfa.num_states();
  if (n <= 0) std::abort();
  for (int32_t s = 0; s < n; ++s) {
    if (!dfa.accepting(s) && !dfa.continues(s)) std::abort();  // a live state that cannot go on
    for (int b = 0; b < 256; ++b) {
      const int32_t t = dfa.next(s, static_cast<uint8_t>(b));
      if (t != RegexDfa::kDead && (t < 0 || t >= n)) std::abort();
    }
  }
  (void)dfa.full_match(text);
}

}  // namespace kvpipe::fuzz
