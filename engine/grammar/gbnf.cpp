#include "engine/grammar/gbnf.h"

#include "engine/grammar/regex_dfa.h"
#include "engine/text/unicode_text.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <utility>
#include <vector>

namespace kvpipe {
namespace {

constexpr size_t kMaxGrammar = size_t{1} << 20;    // bytes of grammar text
constexpr int kMaxRepeat = 1000;                   // {m,n}: RegexDfa's own cap
constexpr int kMaxParens = 100;                    // ( ) nested in the grammar
constexpr int kMaxQuantifiers = 16;                // quantifiers in a row on one item
constexpr size_t kMaxPattern = size_t{256} << 10;  // bytes of pattern
constexpr int kMaxGroups = 256;                    // groups nested in the pattern
constexpr int kMaxCallDepth = 2000;                // expansion recursion
constexpr uint64_t kMaxSteps = uint64_t{1} << 22;  // expansion steps, kept or dropped
constexpr uint32_t kMaxCodePoint = 0x10FFFF;
constexpr uint32_t kSurrogateLo = 0xD800, kSurrogateHi = 0xDFFF;

struct Range {
  uint32_t lo, hi;
};

// A parsed right-hand side. kText is a finished piece of pattern without a top-level '|' (a
// literal, a class, `.`).
struct Expr {
  enum Kind { kText, kRef, kSeq, kAlt, kRepeat } kind = kSeq;
  std::string text;
  int rule = -1;  // kRef
  std::vector<Expr> kids;
  int min = 0, max = -1;  // kRepeat; max -1: unbounded
};

struct Rule {
  std::string name;
  size_t defined_at = std::string::npos;
  size_t used_at = std::string::npos;  // the first reference
  Expr body;
};

std::string hex(uint32_t v, int digits) {
  static const char* kDigits = "0123456789ABCDEF";
  std::string out(static_cast<size_t>(digits), '0');
  for (int k = digits - 1; k >= 0; --k, v >>= 4) out[static_cast<size_t>(k)] = kDigits[v & 0xF];
  return out;
}

std::string code_point_name(uint32_t cp) {
  return "U+" + hex(cp, cp > 0xFFFF ? 6 : 4);
}

// The code point of the well-formed UTF-8 sequence at `i` (advancing it), or false.
bool decode_utf8(const std::string& s, size_t& i, uint32_t* cp) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) {
    *cp = c;
    ++i;
    return true;
  }
  size_t len = 0;
  uint32_t v = 0;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
    v = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    v = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    v = c & 0x07;
  } else {
    return false;
  }
  if (i + len > s.size()) return false;
  for (size_t k = 1; k < len; ++k) {
    const unsigned char d = static_cast<unsigned char>(s[i + k]);
    if ((d & 0xC0) != 0x80) return false;
    v = (v << 6) | (d & 0x3F);
  }
  if ((len == 3 && v < 0x800) || (len == 4 && (v < 0x10000 || v > kMaxCodePoint)) ||
      (v >= kSurrogateLo && v <= kSurrogateHi))
    return false;
  i += len;
  *cp = v;
  return true;
}

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_';
}

// One character as a pattern atom: control characters as \xHH, ASCII escaped, others as UTF-8.
std::string char_pattern(uint32_t cp) {
  if (cp < 0x20 || cp == 0x7F) return "\\x" + hex(cp, 2);
  if (cp < 0x80) return regex_escape(std::string(1, static_cast<char>(cp)));
  return text::codepoint_to_utf8(cp);
}

// Sorted, merged, without the surrogates (which no UTF-8 text holds).
std::vector<Range> normalized(std::vector<Range> ranges) {
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.lo < b.lo; });
  std::vector<Range> merged;
  for (const Range& r : ranges) {
    if (!merged.empty() && r.lo <= merged.back().hi + 1)
      merged.back().hi = std::max(merged.back().hi, r.hi);
    else
      merged.push_back(r);
  }
  std::vector<Range> out;
  for (const Range& r : merged) {
    if (r.hi < kSurrogateLo || r.lo > kSurrogateHi) {
      out.push_back(r);
      continue;
    }
    if (r.lo < kSurrogateLo) out.push_back({r.lo, kSurrogateLo - 1});
    if (r.hi > kSurrogateHi) out.push_back({kSurrogateHi + 1, r.hi});
  }
  return out;
}

// The characters in [lo, hi] outside `ranges` (normalized), without the surrogates.
std::vector<Range> complement(const std::vector<Range>& ranges, uint32_t lo, uint32_t hi) {
  std::vector<Range> out;
  uint32_t next = lo;
  for (const Range& r : ranges) {
    if (r.hi < lo || r.lo > hi) continue;
    if (r.lo > next) out.push_back({next, r.lo - 1});
    next = std::max(next, r.hi + 1);
  }
  if (next <= hi) out.push_back({next, hi});
  return normalized(std::move(out));
}

std::vector<Range> clipped(const std::vector<Range>& ranges, uint32_t lo, uint32_t hi) {
  std::vector<Range> out;
  for (const Range& r : ranges)
    if (r.hi >= lo && r.lo <= hi) out.push_back({std::max(r.lo, lo), std::min(r.hi, hi)});
  return out;
}

uint64_t count(const std::vector<Range>& ranges) {
  uint64_t n = 0;
  for (const Range& r : ranges) n += uint64_t{r.hi} - r.lo + 1;
  return n;
}

// Members of a pattern class for ASCII ranges, each end as \xHH.
std::string ascii_members(const std::vector<Range>& ranges) {
  std::string out;
  for (const Range& r : ranges) {
    out += "\\x" + hex(r.lo, 2);
    if (r.hi != r.lo) out += "-\\x" + hex(r.hi, 2);
  }
  return out;
}

class Parser {
 public:
  explicit Parser(const std::string& grammar) : g_(grammar) {}

  void parse() {
    skip_space(true);
    while (i_ < g_.size()) parse_rule();
  }

  [[noreturn]] void fail_at(size_t at, const std::string& what) const {
    size_t line = 1, column = 1;
    for (size_t k = 0; k < at && k < g_.size(); ++k) {
      if (g_[k] == '\n') {
        ++line;
        column = 1;
      } else if ((static_cast<unsigned char>(g_[k]) & 0xC0) != 0x80) {
        ++column;
      }
    }
    throw std::invalid_argument("line " + std::to_string(line) + ", column " +
                                std::to_string(column) + ": " + what);
  }

  std::vector<Rule> rules_;
  std::map<std::string, int> ids_;

 private:
  // What is at `at`, for a message.
  std::string describe(size_t at) const {
    if (at >= g_.size()) return "the end of the grammar";
    const char c = g_[at];
    if (c > 0x20 && c < 0x7F) return std::string("'") + c + "'";
    size_t j = at;
    uint32_t cp = 0;
    if (decode_utf8(g_, j, &cp)) return code_point_name(cp);
    return "byte 0x" + hex(static_cast<unsigned char>(c), 2) + " (not UTF-8)";
  }

  // Blanks and comments; newlines too where a rule goes on over lines.
  void skip_space(bool newline_ok) {
    while (i_ < g_.size()) {
      const char c = g_[i_];
      if (c == ' ' || c == '\t' || (newline_ok && (c == '\r' || c == '\n'))) {
        ++i_;
      } else if (c == '#') {
        while (i_ < g_.size() && g_[i_] != '\r' && g_[i_] != '\n') ++i_;
      } else {
        break;
      }
    }
  }

  std::string read_name() {
    const size_t start = i_;
    while (i_ < g_.size() && is_name_char(g_[i_])) ++i_;
    return g_.substr(start, i_ - start);
  }

  int rule_id(const std::string& name) {
    const auto it = ids_.find(name);
    if (it != ids_.end()) return it->second;
    const int id = static_cast<int>(rules_.size());
    ids_.emplace(name, id);
    rules_.emplace_back();
    rules_.back().name = name;
    return id;
  }

  void parse_rule() {
    const size_t start = i_;
    if (!is_name_char(g_[i_]))
      fail_at(i_, "expected a rule name, found " + describe(i_) +
                      " (a rule goes on to the next line only inside parentheses or after '|')");
    const std::string name = read_name();
    skip_space(false);
    if (g_.compare(i_, 3, "::=") != 0)
      fail_at(i_, "expected '::=' after the rule name '" + name + "'");
    i_ += 3;
    skip_space(true);
    Expr body = parse_alternates(false, 0);
    if (i_ < g_.size()) {
      if (g_[i_] == '\r') {
        ++i_;
        if (i_ < g_.size() && g_[i_] == '\n') ++i_;
      } else if (g_[i_] == '\n') {
        ++i_;
      } else if (g_[i_] == ')') {
        fail_at(i_, "an unmatched ')'");
      } else {
        fail_at(i_, "unexpected " + describe(i_) + " in rule '" + name + "'");
      }
    }
    skip_space(true);
    Rule& rule = rules_[static_cast<size_t>(rule_id(name))];
    if (rule.defined_at != std::string::npos)
      fail_at(start, "rule '" + name + "' is defined twice");
    rule.defined_at = start;
    rule.body = std::move(body);
  }

  Expr parse_alternates(bool nested, int depth) {
    Expr alt;
    alt.kind = Expr::kAlt;
    alt.kids.push_back(parse_sequence(nested, depth));
    while (i_ < g_.size() && g_[i_] == '|') {
      ++i_;
      skip_space(true);
      alt.kids.push_back(parse_sequence(nested, depth));
    }
    if (alt.kids.size() == 1) return std::move(alt.kids[0]);
    return alt;
  }

  static Expr text_expr(std::string text) {
    Expr e;
    e.kind = Expr::kText;
    e.text = std::move(text);
    return e;
  }

  Expr parse_sequence(bool nested, int depth) {
    Expr seq;
    seq.kind = Expr::kSeq;
    int quantifiers = 0;  // in a row on the last item
    while (i_ < g_.size()) {
      const size_t at = i_;
      const char c = g_[i_];
      if (c == '"') {
        seq.kids.push_back(text_expr(parse_literal()));
      } else if (c == '[') {
        seq.kids.push_back(text_expr(parse_class()));
      } else if (c == '<' || c == '!') {
        fail_at(at,
                "token syntax (<[id]>, <token>, !<...>) is not supported: kvpipe's grammars match "
                "characters");
      } else if (is_name_char(c)) {
        Expr ref;
        ref.kind = Expr::kRef;
        const std::string name = read_name();
        ref.rule = rule_id(name);
        Rule& rule = rules_[static_cast<size_t>(ref.rule)];
        if (rule.used_at == std::string::npos) rule.used_at = at;
        seq.kids.push_back(std::move(ref));
      } else if (c == '(') {
        if (depth >= kMaxParens)
          fail_at(at, "parentheses nested deeper than " + std::to_string(kMaxParens));
        ++i_;
        skip_space(true);
        Expr inner = parse_alternates(true, depth + 1);
        if (i_ >= g_.size()) fail_at(at, "unterminated group: this '(' has no ')'");
        if (g_[i_] != ')') fail_at(i_, "unexpected " + describe(i_) + " inside parentheses");
        ++i_;
        seq.kids.push_back(std::move(inner));
      } else if (c == '.') {
        ++i_;
        seq.kids.push_back(text_expr("(.|\\n)"));  // RegexDfa's '.' leaves out the newline
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        if (seq.kids.empty())
          fail_at(at, std::string("a quantifier '") + c + "' with nothing to repeat");
        if (++quantifiers > kMaxQuantifiers)
          fail_at(at, "more than " + std::to_string(kMaxQuantifiers) + " quantifiers in a row");
        Expr rep;
        rep.kind = Expr::kRepeat;
        read_quantifier(nested, &rep.min, &rep.max);
        rep.kids.push_back(std::move(seq.kids.back()));
        seq.kids.back() = std::move(rep);
        skip_space(nested);
        continue;
      } else {
        break;
      }
      quantifiers = 0;
      skip_space(nested);
    }
    if (seq.kids.size() == 1) return std::move(seq.kids[0]);
    return seq;
  }

  int read_count() {
    const size_t at = i_;
    long v = 0;
    while (i_ < g_.size() && g_[i_] >= '0' && g_[i_] <= '9') {
      v = std::min<long>(v * 10 + (g_[i_] - '0'), 1L << 30);
      ++i_;
    }
    if (v > kMaxRepeat) fail_at(at, "a repetition count above " + std::to_string(kMaxRepeat));
    return static_cast<int>(v);
  }

  static bool is_digit(char c) { return c >= '0' && c <= '9'; }

  void read_quantifier(bool nested, int* lo, int* hi) {
    const size_t at = i_;
    const char c = g_[i_++];
    if (c == '*' || c == '+' || c == '?') {
      *lo = c == '+' ? 1 : 0;
      *hi = c == '?' ? 1 : -1;
      return;
    }
    skip_space(nested);
    if (i_ >= g_.size() || !is_digit(g_[i_]))
      fail_at(i_, "expected a number after '{', found " + describe(i_));
    *lo = read_count();
    skip_space(nested);
    if (i_ < g_.size() && g_[i_] == '}') {
      *hi = *lo;
      ++i_;
    } else if (i_ < g_.size() && g_[i_] == ',') {
      ++i_;
      skip_space(nested);
      *hi = -1;
      if (i_ < g_.size() && is_digit(g_[i_])) {
        *hi = read_count();
        skip_space(nested);
      }
      if (i_ >= g_.size() || g_[i_] != '}')
        fail_at(i_, "expected '}' to end the repetition, found " + describe(i_));
      ++i_;
    } else {
      fail_at(i_, "expected ',' or '}' in the repetition, found " + describe(i_));
    }
    if (*hi >= 0 && *hi < *lo) fail_at(at, "a repetition {m,n} with n below m");
  }

  uint32_t read_hex(size_t at, int digits, char kind) {
    uint32_t v = 0;
    for (int k = 0; k < digits; ++k, ++i_) {
      const char c = i_ < g_.size() ? g_[i_] : '\0';
      uint32_t d = 0;
      if (c >= '0' && c <= '9')
        d = static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f')
        d = static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        d = static_cast<uint32_t>(c - 'A' + 10);
      else
        fail_at(at, "expected " + std::to_string(digits) + " hexadecimal digits after '\\" + kind +
                        "'");
      v = v * 16 + d;
    }
    if (v > kMaxCodePoint || (v >= kSurrogateLo && v <= kSurrogateHi))
      fail_at(at, "the escape '" + g_.substr(at, 2 + static_cast<size_t>(digits)) +
                      "' is not a Unicode character (a surrogate or above U+10FFFF)");
    return v;
  }

  // One character of a string or class at i_ (advancing): an escape or UTF-8 text.
  uint32_t read_char(size_t open, const char* what) {
    const size_t at = i_;
    if (g_[i_] != '\\') {
      uint32_t cp = 0;
      if (!decode_utf8(g_, i_, &cp)) fail_at(at, "invalid UTF-8 in a " + std::string(what));
      return cp;
    }
    if (i_ + 1 >= g_.size()) fail_at(open, "unterminated " + std::string(what));
    const char e = g_[i_ + 1];
    i_ += 2;
    switch (e) {
      case 'x':
        return read_hex(at, 2, e);
      case 'u':
        return read_hex(at, 4, e);
      case 'U':
        return read_hex(at, 8, e);
      case 'n':
        return '\n';
      case 'r':
        return '\r';
      case 't':
        return '\t';
      case '\\':
      case '"':
      case '[':
      case ']':
      case '-':
        return static_cast<unsigned char>(e);
      default:
        break;
    }
    if (e > 0x20 && e < 0x7F) fail_at(at, std::string("unknown escape '\\") + e + "'");
    fail_at(at, "unknown escape: a backslash before " + describe(at + 1));
  }

  std::string parse_literal() {
    const size_t open = i_++;
    std::string out;
    for (;;) {
      if (i_ >= g_.size()) fail_at(open, "unterminated string");
      if (g_[i_] == '"') {
        ++i_;
        return out;
      }
      out += char_pattern(read_char(open, "string"));
    }
  }

  std::string parse_class() {
    const size_t open = i_++;
    bool negated = false;
    if (i_ < g_.size() && g_[i_] == '^') {
      negated = true;
      ++i_;
    }
    std::vector<Range> members;
    for (;;) {
      if (i_ >= g_.size()) fail_at(open, "unterminated character class");
      if (g_[i_] == ']') {
        ++i_;
        break;
      }
      const size_t at = i_;
      const uint32_t lo = read_char(open, "character class");
      uint32_t hi = lo;
      if (i_ + 1 < g_.size() && g_[i_] == '-' && g_[i_ + 1] != ']') {
        ++i_;
        hi = read_char(open, "character class");
        if (hi < lo) fail_at(at, "a range whose end is below its start");
      }
      members.push_back({lo, hi});
    }
    if (members.empty()) fail_at(open, "an empty character class");
    return class_pattern(normalized(std::move(members)), negated, open);
  }

  // The pattern of a class, exact: the characters it takes as ranges of a pattern class.
  std::string class_pattern(const std::vector<Range>& members, bool negated, size_t open) const {
    const std::vector<Range> taken = negated ? complement(members, 0, kMaxCodePoint) : members;
    if (taken.empty()) fail_at(open, "a character class that takes no character");
    const std::vector<Range> ascii = clipped(taken, 0, 0x7F);
    const std::vector<Range> others = clipped(taken, 0x80, kMaxCodePoint);
    const uint64_t all_others =
        uint64_t{kMaxCodePoint} - 0x80 + 1 - (kSurrogateHi - kSurrogateLo + 1);
    if (count(others) == all_others) {
      // Every character outside ASCII: RegexDfa's negated class of ASCII members.
      const std::vector<Range> left_out = complement(ascii, 0, 0x7F);
      return left_out.empty() ? "(.|\\n)" : "[^" + ascii_members(left_out) + "]";
    }
    std::string out = "[" + ascii_members(ascii);
    for (const Range& r : others) {
      out += text::codepoint_to_utf8(r.lo);
      if (r.hi != r.lo) out += "-" + text::codepoint_to_utf8(r.hi);
    }
    return out + "]";
  }

  const std::string& g_;
  size_t i_ = 0;
};

// Whether `e` derives some finite text, given the rules that do.
bool ends(const Expr& e, const std::vector<char>& rule_ends) {
  switch (e.kind) {
    case Expr::kText:
      return true;
    case Expr::kRef:
      return rule_ends[static_cast<size_t>(e.rule)] != 0;
    case Expr::kSeq:
      for (const Expr& k : e.kids)
        if (!ends(k, rule_ends)) return false;
      return true;
    case Expr::kAlt:
      for (const Expr& k : e.kids)
        if (ends(k, rule_ends)) return true;
      return false;
    case Expr::kRepeat:
      return e.min == 0 || ends(e.kids[0], rule_ends);
  }
  return false;
}

void collect_refs(const Expr& e, std::vector<int>* out) {
  if (e.kind == Expr::kRef) out->push_back(e.rule);
  for (const Expr& k : e.kids) collect_refs(k, out);
}

bool mentions(const Expr& e, int rule) {
  if (e.kind == Expr::kRef) return e.rule == rule;
  for (const Expr& k : e.kids)
    if (mentions(k, rule)) return true;
  return false;
}

Expr empty_expr() { return Expr{}; }  // a sequence of nothing

Expr seq_of(std::vector<Expr> kids) {
  if (kids.size() == 1) return std::move(kids[0]);
  Expr e;
  e.kind = Expr::kSeq;
  e.kids = std::move(kids);
  return e;
}

bool is_empty(const Expr& e) { return e.kind == Expr::kSeq && e.kids.empty(); }

// The alternation of `alts`, an empty one among them as `?` around the others.
Expr alt_of(std::vector<Expr> alts) {
  bool empty = false;
  std::vector<Expr> kept;
  for (Expr& a : alts) {
    if (is_empty(a))
      empty = true;
    else
      kept.push_back(std::move(a));
  }
  if (kept.empty()) return empty_expr();
  Expr e;
  if (kept.size() == 1) {
    e = std::move(kept[0]);
  } else {
    e.kind = Expr::kAlt;
    e.kids = std::move(kept);
  }
  if (!empty) return e;
  Expr optional;
  optional.kind = Expr::kRepeat;
  optional.min = 0;
  optional.max = 1;
  optional.kids.push_back(std::move(e));
  return optional;
}

// Splits `e`, a part of rule `self`'s body, into the texts after which (`tail`) or before
// which (head) `self` follows once more, `again`, and those where it ends, `done`: false where
// `self` appears anywhere but at that end of `e`.
bool split_linear(const Expr& e, int self, bool tail, std::vector<Expr>* again, std::vector<Expr>* done) {
  if (!mentions(e, self)) {
    done->push_back(e);
    return true;
  }
  switch (e.kind) {
    case Expr::kRef:  // `self` itself
      again->push_back(empty_expr());
      return true;
    case Expr::kSeq: {
      const size_t n = e.kids.size();
      const size_t end = tail ? n - 1 : 0;  // e mentions self, so n > 0
      for (size_t i = 0; i < n; ++i)
        if (i != end && mentions(e.kids[i], self)) return false;
      std::vector<Expr> sub_again, sub_done;
      if (!split_linear(e.kids[end], self, tail, &sub_again, &sub_done)) return false;
      auto around = [&](Expr middle) {
        std::vector<Expr> kids;
        for (size_t i = 0; i < n; ++i) kids.push_back(i == end ? std::move(middle) : e.kids[i]);
        return seq_of(std::move(kids));
      };
      for (Expr& x : sub_again) again->push_back(around(std::move(x)));
      for (Expr& x : sub_done) done->push_back(around(std::move(x)));
      return true;
    }
    case Expr::kAlt:
      for (const Expr& k : e.kids)
        if (!split_linear(k, self, tail, again, done)) return false;
      return true;
    case Expr::kRepeat:
      if (e.min != 0 || e.max != 1) return false;
      done->push_back(empty_expr());
      return split_linear(e.kids[0], self, tail, again, done);
    case Expr::kText:
      break;
  }
  return false;
}

// Right and left recursion of a rule into itself alone (`ws ::= ([ \t\n] ws)?`, `items ::=
// item ("," items)?`, `list ::= list "," item | item`) is a regular language: rule R ::= A R |
// B is A* B, and R ::= R A | B is B A*. Such rules are rewritten so, and no longer unrolled,
// where none of R's other parts lead back to R through other rules.
void rewrite_linear_recursion(std::vector<Rule>* rules, const std::vector<std::vector<int>>& refs) {
  const size_t n = rules->size();
  for (size_t r = 0; r < n; ++r) {
    Rule& rule = (*rules)[r];
    const int self = static_cast<int>(r);
    if (!mentions(rule.body, self)) continue;
    // The rules R's body names besides itself must not lead back to it.
    std::vector<char> seen(n, 0);
    std::vector<int> todo;
    for (int t : refs[r])
      if (t != self) todo.push_back(t);
    bool back = false;
    while (!todo.empty() && !back) {
      const size_t t = static_cast<size_t>(todo.back());
      todo.pop_back();
      if (seen[t]) continue;
      seen[t] = 1;
      for (int u : refs[t]) {
        if (u == self) back = true;
        todo.push_back(u);
      }
    }
    if (back) continue;
    for (bool tail : {true, false}) {
      std::vector<Expr> again, done;
      if (!split_linear(rule.body, self, tail, &again, &done) || done.empty()) continue;
      Expr repeat;
      repeat.kind = Expr::kRepeat;
      repeat.min = 0;
      repeat.max = -1;
      repeat.kids.push_back(alt_of(std::move(again)));
      Expr end = alt_of(std::move(done));
      if (is_empty(repeat.kids[0])) {  // R ::= R | B is B
        rule.body = std::move(end);
        break;
      }
      rule.body = tail ? seq_of({std::move(repeat), std::move(end)}) : seq_of({std::move(end), std::move(repeat)});
      break;
    }
  }
}

// Expands rules into one pattern, each rule nesting in itself at most `max_depth` times.
class Expander {
 public:
  Expander(const std::vector<Rule>& rules, int max_depth)
      : rules_(rules), max_depth_(max_depth), active_(rules.size(), 0) {}

  // Appends `e`'s pattern; false (nothing appended) when it matches nothing within the depth.
  bool emit(const Expr& e, int depth) {
    if (++steps_ > kMaxSteps || depth > kMaxCallDepth) too_large("too many expansion steps");
    switch (e.kind) {
      case Expr::kText:
        out_ += e.text;
        check_size();
        return true;
      case Expr::kRef: {
        int& active = active_[static_cast<size_t>(e.rule)];
        if (active >= max_depth_) return false;
        ++active;
        const bool ok = emit(rules_[static_cast<size_t>(e.rule)].body, depth + 1);
        --active;
        return ok;
      }
      case Expr::kSeq: {
        const size_t start = out_.size();
        for (const Expr& k : e.kids)
          if (!emit(k, depth + 1)) {
            out_.resize(start);
            return false;
          }
        return true;
      }
      case Expr::kAlt: {
        const size_t start = out_.size();
        open_group();
        int kept = 0;
        for (const Expr& k : e.kids) {
          const size_t mark = out_.size();
          if (kept > 0) out_ += '|';
          if (emit(k, depth + 1))
            ++kept;
          else
            out_.resize(mark);
        }
        --groups_;
        if (kept == 0) {
          out_.resize(start);
          return false;
        }
        out_ += ')';
        return true;
      }
      case Expr::kRepeat: {
        if (e.max == 0) return true;
        const size_t start = out_.size();
        open_group();
        const bool ok = emit(e.kids[0], depth + 1);
        --groups_;
        if (!ok) {
          out_.resize(start);
          return e.min == 0;  // zero times
        }
        out_ += ')';
        if (e.min == 0 && e.max < 0)
          out_ += '*';
        else if (e.min == 1 && e.max < 0)
          out_ += '+';
        else if (e.min == 0 && e.max == 1)
          out_ += '?';
        else if (e.min == e.max)
          out_ += "{" + std::to_string(e.min) + "}";
        else
          out_ +=
              "{" + std::to_string(e.min) + "," + (e.max < 0 ? "" : std::to_string(e.max)) + "}";
        check_size();
        return true;
      }
    }
    return false;
  }

  std::string take() { return std::move(out_); }

 private:
  [[noreturn]] void too_large(const std::string& why) const {
    throw std::invalid_argument(
        "the grammar is too large once its recursion is unrolled to depth " +
        std::to_string(max_depth_) + " (" + why + ")");
  }
  void check_size() const {
    if (out_.size() > kMaxPattern) too_large("a pattern over 256 KB");
  }
  void open_group() {
    if (++groups_ > kMaxGroups)
      too_large("groups nested deeper than " + std::to_string(kMaxGroups));
    out_ += '(';
    check_size();
  }

  const std::vector<Rule>& rules_;
  const int max_depth_;
  std::vector<int> active_;  // [rule] expansions of it in progress
  std::string out_;
  uint64_t steps_ = 0;
  int groups_ = 0;
};

}  // namespace

std::string gbnf_regex(const std::string& grammar, int max_depth) {
  if (max_depth < 1) throw std::invalid_argument("gbnf: max_depth must be at least 1");
  if (grammar.size() > kMaxGrammar) throw std::invalid_argument("the grammar is longer than 1 MB");
  Parser parser(grammar);
  parser.parse();
  const std::vector<Rule>& rules = parser.rules_;

  // Undefined rules, the first reference first.
  const Rule* undefined = nullptr;
  for (const Rule& r : rules)
    if (r.defined_at == std::string::npos && (!undefined || r.used_at < undefined->used_at))
      undefined = &r;
  if (undefined) parser.fail_at(undefined->used_at, "undefined rule '" + undefined->name + "'");
  const auto root_it = parser.ids_.find("root");
  if (root_it == parser.ids_.end()) throw std::invalid_argument("no rule 'root'");
  const int root = root_it->second;

  // Rules reachable from root must derive some finite text.
  const size_t n = rules.size();
  std::vector<std::vector<int>> refs(n);
  for (size_t r = 0; r < n; ++r) collect_refs(rules[r].body, &refs[r]);
  std::vector<char> reachable(n, 0);
  std::vector<int> stack = {root};
  reachable[static_cast<size_t>(root)] = 1;
  while (!stack.empty()) {
    const int r = stack.back();
    stack.pop_back();
    for (int t : refs[static_cast<size_t>(r)])
      if (!reachable[static_cast<size_t>(t)]) {
        reachable[static_cast<size_t>(t)] = 1;
        stack.push_back(t);
      }
  }
  std::vector<char> rule_ends(n, 0);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < n; ++r)
      if (!rule_ends[r] && ends(rules[r].body, rule_ends)) rule_ends[r] = changed = true;
  }
  // Name a rule that cannot end: one that reaches itself (one always does), the first defined.
  const Rule* endless = nullptr;
  bool endless_cycles = false;
  for (size_t r = 0; r < n; ++r) {
    if (!reachable[r] || rule_ends[r]) continue;
    std::vector<char> seen(n, 0);
    std::vector<int> todo(refs[r].begin(), refs[r].end());
    bool cycles = false;
    while (!todo.empty() && !cycles) {
      const size_t t = static_cast<size_t>(todo.back());
      todo.pop_back();
      if (seen[t]) continue;
      seen[t] = 1;
      cycles = t == r;
      todo.insert(todo.end(), refs[t].begin(), refs[t].end());
    }
    if (!endless || (cycles && !endless_cycles) ||
        (cycles == endless_cycles && rules[r].defined_at < endless->defined_at)) {
      endless = &rules[r];
      endless_cycles = cycles;
    }
  }
  if (endless)
    parser.fail_at(endless->defined_at, "rule '" + endless->name + "' recurses without an end");

  std::vector<Rule> linear = rules;
  rewrite_linear_recursion(&linear, refs);
  Expander expander(linear, max_depth);
  Expr start;
  start.kind = Expr::kRef;
  start.rule = root;
  if (!expander.emit(start, 0))
    throw std::invalid_argument("rule 'root' matches nothing within depth " +
                                std::to_string(max_depth));
  return expander.take();
}

}  // namespace kvpipe
