// RegexDfa: a regular expression compiled to a deterministic automaton over bytes, for
// constrained decoding.
//
// kvpipe's own: PCRE2 (the packaged regex library) matches whole subjects, and its partial
// matching cannot say cheaply which next bytes keep a match alive, which is what a token mask
// over a 49,152-token vocabulary asks at every step; a DFA answers it with one table read per
// byte. The syntax is the subset structured outputs use, with Python's `re` meaning, matched
// as re.fullmatch: literal characters (UTF-8) and escapes (\n \t \r \f \v \xHH \uHHHH, \. and
// every other escaped punctuation), the classes \d \w \s \D \W \S, `.` (any character but a
// newline), [...] and [^...] (ranges of any characters; a negated class takes every
// character outside it, only its ASCII ones where it holds a class escape),
// groups (...), (?:...) and (?P<name>...), alternation |, quantifiers * + ? {n} {n,} {n,m}
// (also lazy: the language is the same), ^ at the start and $ at the end. Guarantees: every
// string the automaton accepts is one Python's re.fullmatch accepts (\d, \w and \s and their
// negations are their ASCII members, a subset of Python's Unicode ones), and is valid UTF-8;
// every state is live (it can still reach a match), so a path never runs into a dead end.
// Anything else (backreferences, lookaround, \b, inline flags) and a pattern that matches
// nothing are std::invalid_argument naming what and where.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace kvpipe {

class RegexDfa {
 public:
  static constexpr int32_t kDead = -1;

  // Throws std::invalid_argument; more than `max_states` states is "too complex".
  explicit RegexDfa(const std::string& pattern, int32_t max_states = 20000);

  int32_t start() const { return 0; }
  int32_t next(int32_t state, uint8_t byte) const {
    return table_[static_cast<size_t>(state) * classes_ + byte_class_[byte]];
  }
  // Bytes of one class lead every state to the same place: a text is known by its classes.
  uint8_t byte_class(uint8_t byte) const { return byte_class_[byte]; }
  int32_t num_classes() const { return classes_; }
  int32_t next_class(int32_t state, uint8_t cls) const { return table_[static_cast<size_t>(state) * classes_ + cls]; }
  // The table itself ([state * num_classes() + class]) and the distances by state, for walks
  // that hold them in registers over many steps.
  const int32_t* transitions() const { return table_.data(); }
  const int32_t* distances() const { return distance_.data(); }
  bool accepting(int32_t state) const { return accepting_[state] != 0; }
  // Some byte leads on from `state` (false: only the end of the text may follow).
  bool continues(int32_t state) const { return continues_[state] != 0; }
  int32_t num_states() const { return static_cast<int32_t>(accepting_.size()); }
  // The fewest bytes from `state` to a match (0 at a match).
  int32_t distance(int32_t state) const { return distance_[state]; }
  int32_t max_distance() const { return max_distance_; }

  // The state after `bytes` from `state`, or kDead.
  int32_t walk(int32_t state, const std::string& bytes) const;
  bool full_match(const std::string& text) const;

 private:
  // Bytes that every transition treats alike share a class, so a state's row has one entry
  // per class: a table several times smaller than one of 256 entries a state, which keeps a
  // walk over the vocabulary in cache.
  std::array<uint8_t, 256> byte_class_{};
  int32_t classes_ = 1;
  std::vector<int32_t> table_;  // [state][class] -> state or kDead
  std::vector<uint8_t> accepting_, continues_;
  std::vector<int32_t> distance_;
  int32_t max_distance_ = 0;
};

// Whether some text is a match of both `a` and `b`: by a breadth-first search of their pairs
// of states, so `*witness` is a shortest such text. kUnknown where the search would visit
// more than `max_pairs` pairs.
enum class Overlap { kNone, kSome, kUnknown };
Overlap common_match(const RegexDfa& a, const RegexDfa& b, size_t max_pairs, std::string* witness);

// `text` with every character that is special in a regular expression escaped, so that the
// pattern matches exactly `text` (as Python's re.escape).
std::string regex_escape(const std::string& text);

}  // namespace kvpipe
