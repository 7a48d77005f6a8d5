// Regular-expression splitting for pre-tokenizers: a compiled PCRE2 pattern (UTF + Unicode
// properties, JIT when the library has it) and the ways Hugging Face `tokenizers` (and
// llama.cpp, whose splitting is `Isolated`) turn its matches into pieces.
//
// Guarantees: `\s` and `\S` mean Unicode White_Space (as in llama.cpp, Rust's regex and
// Oniguruma) whatever the PCRE2 version thinks; a Regex is compiled once and immutable, and
// matching allocates its own match data, so one Regex serves many threads; a pattern that
// does not compile is an std::invalid_argument naming `where` and PCRE2's reason.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvpipe::text {

class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where);
  // A pattern matching `literal` exactly.
  static Regex literal(const std::string& literal, const std::string& where);

  // [begin, end) byte ranges of the successive non-overlapping matches in `text` (valid UTF-8).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;
  const std::string& pattern() const { return pattern_; }

 private:
  struct Code;
  std::string pattern_;
  std::shared_ptr<const Code> code_;
};

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// Splits `text` by the matches of `regex` (or by what lies between them, with `invert`), as
// `tokenizers`' Split pre-tokenizer does; empty pieces are dropped. Pieces are byte ranges.
std::vector<std::pair<size_t, size_t>> split_ranges(std::string_view text, const Regex& regex,
                                                    SplitBehavior behavior, bool invert = false);

// Escapes `s` so that PCRE2 matches it literally.
std::string regex_escape(const std::string& s);

}  // namespace kvpipe::text
