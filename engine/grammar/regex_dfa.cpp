#include "engine/grammar/regex_dfa.h"

#include "engine/text/unicode_text.h"

#include <algorithm>
#include <bitset>
#include <cctype>
#include <set>
#include <stdexcept>
#include <unordered_map>
#include <utility>

namespace kvpipe {
namespace {

using ByteSet = std::bitset<256>;

// A parsed pattern: one byte out of a set, a sequence, alternatives, or a repetition.
struct Node {
  enum Kind { kSet, kSeq, kAlt, kRepeat } kind = kSeq;
  ByteSet set;
  std::vector<Node> kids;
  int min = 0, max = -1;  // kRepeat; max -1: unbounded
};

constexpr int kMaxRepeat = 1000;
constexpr size_t kMaxNfaNodes = 200000;

Node set_node(const ByteSet& s) {
  Node n;
  n.kind = Node::kSet;
  n.set = s;
  return n;
}

Node seq_node(std::vector<Node> kids) {
  Node n;
  n.kind = Node::kSeq;
  n.kids = std::move(kids);
  return n;
}

Node alt_node(std::vector<Node> kids) {
  if (kids.size() == 1) return std::move(kids[0]);
  Node n;
  n.kind = Node::kAlt;
  n.kids = std::move(kids);
  return n;
}

ByteSet byte_range(int lo, int hi) {
  ByteSet s;
  for (int b = lo; b <= hi; ++b) s.set(static_cast<size_t>(b));
  return s;
}

Node bytes_node(std::initializer_list<std::pair<int, int>> ranges) {
  std::vector<Node> kids;
  for (const auto& [lo, hi] : ranges) kids.push_back(set_node(byte_range(lo, hi)));
  return seq_node(std::move(kids));
}

// Every well-formed UTF-8 sequence of two to four bytes (a character outside ASCII).
Node multibyte_char() {
  return alt_node({bytes_node({{0xC2, 0xDF}, {0x80, 0xBF}}),
                   bytes_node({{0xE0, 0xE0}, {0xA0, 0xBF}, {0x80, 0xBF}}),
                   bytes_node({{0xE1, 0xEC}, {0x80, 0xBF}, {0x80, 0xBF}}),
                   bytes_node({{0xED, 0xED}, {0x80, 0x9F}, {0x80, 0xBF}}),
                   bytes_node({{0xEE, 0xEF}, {0x80, 0xBF}, {0x80, 0xBF}}),
                   bytes_node({{0xF0, 0xF0}, {0x90, 0xBF}, {0x80, 0xBF}, {0x80, 0xBF}}),
                   bytes_node({{0xF1, 0xF3}, {0x80, 0xBF}, {0x80, 0xBF}, {0x80, 0xBF}}),
                   bytes_node({{0xF4, 0xF4}, {0x80, 0x8F}, {0x80, 0xBF}, {0x80, 0xBF}})});
}

// The UTF-8 encodings of the characters in [lo, hi] (0x80 <= lo <= hi <= 0x10FFFF) as
// sequences of byte ranges, appended to `out`: split where the encoded length changes, and
// where the range does not take whole blocks of continuation bytes, until each piece is a
// product of byte ranges (how RE2 and Rust's regex-syntax compile a class). The surrogates
// (which no UTF-8 text holds) are left out.
void utf8_sequences(uint32_t lo, uint32_t hi, std::vector<Node>* out) {
  if (lo > hi) return;
  if (lo <= 0xDFFF && hi >= 0xD800) {
    if (lo < 0xD800) utf8_sequences(lo, 0xD7FF, out);
    if (hi > 0xDFFF) utf8_sequences(0xE000, hi, out);
    return;
  }
  for (uint32_t top : {0x7FFu, 0xFFFFu})
    if (lo <= top && hi > top) {
      utf8_sequences(lo, top, out);
      utf8_sequences(top + 1, hi, out);
      return;
    }
  for (int i = 1; i < 4; ++i) {
    const uint32_t low_bits = (1u << (6 * i)) - 1;
    if ((lo & ~low_bits) == (hi & ~low_bits)) continue;
    if ((lo & low_bits) != 0) {
      utf8_sequences(lo, lo | low_bits, out);
      utf8_sequences((lo | low_bits) + 1, hi, out);
      return;
    }
    if ((hi & low_bits) != low_bits) {
      utf8_sequences(lo, (hi & ~low_bits) - 1, out);
      utf8_sequences(hi & ~low_bits, hi, out);
      return;
    }
  }
  const std::string a = text::codepoint_to_utf8(lo), b = text::codepoint_to_utf8(hi);
  std::vector<Node> kids;
  for (size_t k = 0; k < a.size(); ++k)
    kids.push_back(set_node(byte_range(static_cast<uint8_t>(a[k]), static_cast<uint8_t>(b[k]))));
  out->push_back(seq_node(std::move(kids)));
}

Node literal(const std::string& bytes) {
  std::vector<Node> kids;
  for (unsigned char c : bytes) {
    ByteSet s;
    s.set(c);
    kids.push_back(set_node(s));
  }
  return seq_node(std::move(kids));
}

const ByteSet kAscii = byte_range(0, 0x7F);

ByteSet digit_set() { return byte_range('0', '9'); }
ByteSet word_set() { return byte_range('a', 'z') | byte_range('A', 'Z') | byte_range('0', '9') | byte_range('_', '_'); }
ByteSet space_set() {
  ByteSet s;
  for (char c : std::string(" \t\n\r\f\v")) s.set(static_cast<unsigned char>(c));
  return s;
}

class Parser {
 public:
  explicit Parser(const std::string& pattern) : p_(pattern) {}

  Node parse() {
    if (i_ < p_.size() && p_[i_] == '^') ++i_;
    Node n = parse_alt();
    if (i_ < p_.size()) fail(p_[i_] == ')' ? "an unmatched ')'" : "an unexpected character");
    return n;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument(what + " at position " + std::to_string(i_) + " of the regular expression");
  }

  bool at_end() const { return i_ >= p_.size(); }
  // '$' as the pattern's last character (the only place an anchor is taken).
  bool is_end_anchor() const { return p_[i_] == '$' && i_ + 1 == p_.size(); }

  Node parse_alt() {
    std::vector<Node> alts = {parse_seq()};
    while (!at_end() && p_[i_] == '|') {
      ++i_;
      alts.push_back(parse_seq());
    }
    return alt_node(std::move(alts));
  }

  Node parse_seq() {
    std::vector<Node> items;
    while (!at_end() && p_[i_] != '|' && p_[i_] != ')') {
      if (is_end_anchor()) {
        ++i_;
        break;
      }
      Node atom = parse_atom();
      items.push_back(parse_quantifiers(std::move(atom)));
    }
    return seq_node(std::move(items));
  }

  // {n}, {n,}, {n,m} at i_, or false (then '{' is a literal, as in Python).
  bool read_braces(int* lo, int* hi) {
    size_t j = i_ + 1;
    auto number = [&](int* out) {
      const size_t begin = j;
      long v = 0;
      while (j < p_.size() && std::isdigit(static_cast<unsigned char>(p_[j]))) {
        v = std::min<long>(v * 10 + (p_[j] - '0'), 1L << 30);
        ++j;
      }
      *out = static_cast<int>(v);
      return j > begin;
    };
    int a = 0, b = -1;
    const bool has_a = number(&a);
    if (j < p_.size() && p_[j] == '}') {
      if (!has_a) return false;
      b = a;
    } else if (j < p_.size() && p_[j] == ',') {
      ++j;
      if (!number(&b)) b = -1;
      if (j >= p_.size() || p_[j] != '}') return false;
      if (!has_a) a = 0;
    } else {
      return false;
    }
    i_ = j + 1;
    *lo = a;
    *hi = b;
    return true;
  }

  Node parse_quantifiers(Node atom) {
    for (bool repeated = false;; repeated = true) {
      if (at_end()) return atom;
      int lo = 0, hi = -1;
      const char c = p_[i_];
      if (c == '*') {
        ++i_;
      } else if (c == '+') {
        lo = 1;
        ++i_;
      } else if (c == '?') {
        hi = 1;
        ++i_;
      } else if (c == '{' && read_braces(&lo, &hi)) {
        if (hi >= 0 && hi < lo) fail("a repetition {n,m} with m < n");
      } else {
        return atom;
      }
      if (repeated) fail("a quantifier after a quantifier (multiple repeat)");
      if (lo > kMaxRepeat || hi > kMaxRepeat) fail("a repetition above " + std::to_string(kMaxRepeat));
      if (!at_end() && p_[i_] == '?') ++i_;  // lazy: the same language
      if (!at_end() && p_[i_] == '+') fail("a possessive quantifier");
      Node r;
      r.kind = Node::kRepeat;
      r.min = lo;
      r.max = hi;
      r.kids.push_back(std::move(atom));
      atom = std::move(r);
    }
  }

  uint32_t hex(size_t digits) {
    if (i_ + digits > p_.size()) fail("a short \\x or \\u escape");
    uint32_t v = 0;
    for (size_t k = 0; k < digits; ++k) {
      const char c = p_[i_ + k];
      if (!std::isxdigit(static_cast<unsigned char>(c))) fail("a bad hexadecimal escape");
      v = v * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(c)) ? c - '0' : (std::tolower(c) - 'a' + 10));
    }
    i_ += digits;
    if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) fail("an escape that is not a Unicode scalar value");
    return v;
  }

  // The character (code point) of a UTF-8 sequence at i_.
  uint32_t read_char() {
    const unsigned char c = static_cast<unsigned char>(p_[i_]);
    size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i_ + len > p_.size()) fail("invalid UTF-8");
    uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
    for (size_t k = 1; k < len; ++k) {
      const unsigned char d = static_cast<unsigned char>(p_[i_ + k]);
      if ((d >> 6) != 2) fail("invalid UTF-8");
      cp = (cp << 6) | (d & 0x3F);
    }
    i_ += len;
    return cp;
  }

  // An escape at i_ (just past the backslash): a set of ASCII bytes (`*set`) or a character.
  // Returns true for a set.
  bool read_escape(ByteSet* set, uint32_t* cp) {
    if (at_end()) fail("a trailing backslash");
    const char c = p_[i_];
    switch (c) {
      case 'd': ++i_; *set = digit_set(); return true;
      case 'w': ++i_; *set = word_set(); return true;
      case 's': ++i_; *set = space_set(); return true;
      case 'D': ++i_; *set = kAscii & ~digit_set(); return true;
      case 'W': ++i_; *set = kAscii & ~word_set(); return true;
      case 'S': ++i_; *set = kAscii & ~space_set(); return true;
      case 'n': ++i_; *cp = '\n'; return false;
      case 't': ++i_; *cp = '\t'; return false;
      case 'r': ++i_; *cp = '\r'; return false;
      case 'f': ++i_; *cp = '\f'; return false;
      case 'v': ++i_; *cp = '\v'; return false;
      case '0': ++i_; *cp = 0; return false;
      case 'x': ++i_; *cp = hex(2); return false;
      case 'u': ++i_; *cp = hex(4); return false;
      case 'U': ++i_; *cp = hex(8); return false;
      default: break;
    }
    if (std::isalnum(static_cast<unsigned char>(c))) fail(std::string("the escape \\") + c + " (not supported)");
    *cp = read_char();
    return false;
  }

  Node parse_class() {
    ++i_;  // '['
    bool negated = false;
    if (!at_end() && p_[i_] == '^') {
      negated = true;
      ++i_;
    }
    ByteSet ascii;
    std::vector<std::pair<uint32_t, uint32_t>> others;  // ranges of characters outside ASCII
    bool class_escape = false;  // \d \w \s or their negations among the members
    bool first = true;
    for (;;) {
      if (at_end()) fail("an unterminated [");
      if (p_[i_] == ']' && !first) {
        ++i_;
        break;
      }
      first = false;
      uint32_t lo = 0;
      ByteSet s;
      if (p_[i_] == '\\') {
        ++i_;
        if (read_escape(&s, &lo)) {
          ascii |= s;
          class_escape = true;
          continue;
        }
      } else {
        lo = read_char();
      }
      uint32_t hi = lo;
      if (i_ + 1 < p_.size() && p_[i_] == '-' && p_[i_ + 1] != ']') {
        ++i_;
        if (p_[i_] == '\\') {
          ++i_;
          if (read_escape(&s, &hi)) fail("a class escape as the end of a range");
        } else {
          hi = read_char();
        }
        if (hi < lo) fail("a range whose end is below its start");
      }
      if (hi > 0x10FFFF) fail("a character beyond U+10FFFF");
      if (lo < 0x80)
        ascii |= byte_range(static_cast<int>(lo), static_cast<int>(std::min<uint32_t>(hi, 0x7F)));
      if (hi >= 0x80) others.emplace_back(std::max<uint32_t>(lo, 0x80), hi);
    }
    // A negated class takes every other character, as in Python. With a class escape among
    // its members it stands for the ASCII characters outside it alone: Python's \d \w \s
    // also take characters outside ASCII, which this automaton cannot tell apart, so the
    // ASCII part is the subset on which both agree.
    if (negated) {
      if (class_escape) return set_node(kAscii & ~ascii);
      if (others.empty()) return alt_node({set_node(kAscii & ~ascii), multibyte_char()});
      std::sort(others.begin(), others.end());
      std::vector<std::pair<uint32_t, uint32_t>> left;
      uint32_t next = 0x80;
      for (const auto& [lo, hi] : others) {
        if (lo > next) left.emplace_back(next, lo - 1);
        next = std::max(next, hi + 1);
      }
      if (next <= 0x10FFFF) left.emplace_back(next, 0x10FFFF);
      others = std::move(left);
      ascii = kAscii & ~ascii;
    }
    std::vector<Node> alts;
    if (ascii.any()) alts.push_back(set_node(ascii));
    for (const auto& [lo, hi] : others) utf8_sequences(lo, hi, &alts);
    if (alts.empty()) fail(negated ? "a negated class that takes no character" : "an empty class");
    return alt_node(std::move(alts));
  }

  Node parse_atom() {
    const char c = p_[i_];
    if (c == '(') {
      ++i_;
      if (!at_end() && p_[i_] == '?') {
        if (i_ + 1 < p_.size() && p_[i_ + 1] == ':') {
          i_ += 2;
        } else if (i_ + 2 < p_.size() && p_[i_ + 1] == 'P' && p_[i_ + 2] == '<') {
          const size_t close = p_.find('>', i_);
          if (close == std::string::npos) fail("an unterminated group name");
          i_ = close + 1;
        } else {
          fail("lookaround, inline flags and other (?...) groups (not supported)");
        }
      }
      Node inner = parse_alt();
      if (at_end() || p_[i_] != ')') fail("an unterminated (");
      ++i_;
      return inner;
    }
    if (c == '[') return parse_class();
    if (c == '.') {
      ++i_;
      return alt_node({set_node(kAscii & ~byte_range('\n', '\n')), multibyte_char()});
    }
    if (c == '\\') {
      ++i_;
      ByteSet s;
      uint32_t cp = 0;
      if (read_escape(&s, &cp)) return set_node(s);
      return literal(text::codepoint_to_utf8(cp));
    }
    if (c == '*' || c == '+' || c == '?') fail("a quantifier with nothing to repeat");
    if (c == '^' || c == '$') fail("an anchor inside the pattern (only ^ at the start and $ at the end)");
    return literal(text::codepoint_to_utf8(read_char()));
  }

  const std::string& p_;
  size_t i_ = 0;
};

// Thompson's construction: each node has at most one byte edge and any number of empty ones.
struct Nfa {
  std::vector<ByteSet> on;
  std::vector<int> to;
  std::vector<std::vector<int>> eps;

  int add() {
    if (on.size() >= kMaxNfaNodes) throw std::invalid_argument("the regular expression is too complex (its automaton)");
    on.emplace_back();
    to.push_back(-1);
    eps.emplace_back();
    return static_cast<int>(on.size()) - 1;
  }

  std::pair<int, int> emit(const Node& n) {
    switch (n.kind) {
      case Node::kSet: {
        const int a = add(), b = add();
        on[a] = n.set;
        to[a] = b;
        return {a, b};
      }
      case Node::kSeq: {
        const int in = add();
        int out = in;
        for (const Node& k : n.kids) {
          const auto [ki, ko] = emit(k);
          eps[out].push_back(ki);
          out = ko;
        }
        return {in, out};
      }
      case Node::kAlt: {
        const int in = add(), out = add();
        for (const Node& k : n.kids) {
          const auto [ki, ko] = emit(k);
          eps[in].push_back(ki);
          eps[ko].push_back(out);
        }
        return {in, out};
      }
      case Node::kRepeat: {
        const int in = add();
        int out = in;
        const Node& kid = n.kids[0];
        for (int i = 0; i < n.min; ++i) {
          const auto [ki, ko] = emit(kid);
          eps[out].push_back(ki);
          out = ko;
        }
        if (n.max < 0) {
          const auto [ki, ko] = emit(kid);
          const int end = add();
          eps[out].push_back(ki);
          eps[out].push_back(end);
          eps[ko].push_back(ki);
          eps[ko].push_back(end);
          return {in, end};
        }
        // Optional copies, each reachable only after the one before it.
        const int end = add();
        for (int i = n.min; i < n.max; ++i) {
          eps[out].push_back(end);
          const auto [ki, ko] = emit(kid);
          eps[out].push_back(ki);
          out = ko;
        }
        eps[out].push_back(end);
        return {in, end};
      }
    }
    return {-1, -1};
  }

  // The nodes reachable from `nodes` by empty edges that tell a DFA state apart: those with
  // a byte edge, and `final_node`; sorted. Leaving out the nodes with empty edges alone makes
  // closures that differ only in them one state, not several.
  std::vector<int> closure(const std::vector<int>& nodes, int final_node) {
    std::vector<int> out;
    closure(nodes, final_node, &out);
    return out;
  }
  void closure(const std::vector<int>& nodes, int final_node, std::vector<int>* found) {
    if (seen_.size() != on.size()) seen_.assign(on.size(), 0);
    if (++generation_ == 0) {  // the stamps wrapped around: start them again
      std::fill(seen_.begin(), seen_.end(), 0);
      generation_ = 1;
    }
    stack_.assign(nodes.begin(), nodes.end());
    std::vector<int>& out = *found;
    out.clear();
    while (!stack_.empty()) {
      const int x = stack_.back();
      stack_.pop_back();
      if (seen_[x] == generation_) continue;
      seen_[x] = generation_;
      if (to[x] >= 0 || x == final_node) out.push_back(x);
      for (int y : eps[x]) stack_.push_back(y);
    }
    std::sort(out.begin(), out.end());
  }

 private:
  std::vector<uint32_t> seen_;  // per node: the closure that last reached it
  uint32_t generation_ = 0;
  std::vector<int> stack_;
};

struct NodeSetHash {
  size_t operator()(const std::vector<int>& v) const {
    size_t h = v.size();
    for (int x : v) h = (h * 1000003u) ^ static_cast<size_t>(x);
    return h;
  }
};

// The DFA's states as sets of NFA nodes, in one pool, found again through an open-addressing
// table of their hashes: tens of thousands of sets, which a map of vectors would allocate and
// copy one by one.
class NodeSets {
 public:
  size_t size() const { return begin_.size() - 1; }
  const int* begin(size_t i) const { return pool_.data() + begin_[i]; }
  const int* end(size_t i) const { return pool_.data() + begin_[i + 1]; }

  // The id of `set`, added where it is new; -1 (nothing added) where `limit` sets exist.
  int32_t find_or_add(const std::vector<int>& set, int32_t limit) {
    const size_t h = NodeSetHash()(set);
    size_t slot = slot_of(h);
    for (; slots_[slot] >= 0; slot = (slot + 1) & (slots_.size() - 1)) {
      const int32_t id = slots_[slot];
      if (hash_[id] == h && static_cast<size_t>(end(id) - begin(id)) == set.size() &&
          std::equal(set.begin(), set.end(), begin(id)))
        return id;
    }
    if (static_cast<int32_t>(size()) >= limit) return -1;
    const int32_t id = static_cast<int32_t>(size());
    pool_.insert(pool_.end(), set.begin(), set.end());
    begin_.push_back(static_cast<uint32_t>(pool_.size()));
    hash_.push_back(h);
    slots_[slot] = id;
    if (2 * size() > slots_.size()) grow();
    return id;
  }

 private:
  // The hash's bits mixed (a multiply and shifts) before its low bits pick a slot.
  size_t slot_of(size_t h) const {
    uint64_t x = static_cast<uint64_t>(h);
    x = (x ^ (x >> 31)) * 0x7fb5d329728ea185ull;
    return static_cast<size_t>(x ^ (x >> 27)) & (slots_.size() - 1);
  }
  void grow() {
    slots_.assign(slots_.size() * 2, -1);
    for (size_t id = 0; id < size(); ++id) {
      size_t slot = slot_of(hash_[id]);
      while (slots_[slot] >= 0) slot = (slot + 1) & (slots_.size() - 1);
      slots_[slot] = static_cast<int32_t>(id);
    }
  }

  std::vector<int> pool_;
  std::vector<uint32_t> begin_ = {0};
  std::vector<size_t> hash_;
  std::vector<int32_t> slots_ = std::vector<int32_t>(1024, -1);
};

}  // namespace

RegexDfa::RegexDfa(const std::string& pattern, int32_t max_states) {
  const Node root = Parser(pattern).parse();
  Nfa nfa;
  const auto [in, final_node] = nfa.emit(root);

  // Bytes that every byte edge treats alike share one class: the DFA is built per class.
  // The distinct sets of the byte edges first: a pattern's thousands of edges take a few
  // dozen sets (the classes are numbered by their smallest byte, whatever the sets' order).
  std::vector<int> byte_class(256, 0);
  int classes = 1;
  std::unordered_map<ByteSet, int> set_index;
  std::vector<const ByteSet*> distinct;
  std::vector<int> set_of(nfa.on.size(), -1);
  for (size_t n = 0; n < nfa.on.size(); ++n)
    if (nfa.to[n] >= 0) {
      const auto [it, added] = set_index.emplace(nfa.on[n], static_cast<int>(distinct.size()));
      if (added) distinct.push_back(&it->first);
      set_of[n] = it->second;
    }
  for (const ByteSet* bits : distinct) {
    std::vector<int> renumber(static_cast<size_t>(classes) * 2, -1);
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      int& slot = renumber[static_cast<size_t>(byte_class[b]) * 2 + ((*bits)[b] ? 1 : 0)];
      if (slot < 0) slot = next++;
      byte_class[b] = slot;
    }
    classes = next;
  }
  std::vector<int> representative(classes, -1);
  for (int b = 0; b < 256; ++b)
    if (representative[byte_class[b]] < 0) representative[byte_class[b]] = b;

  NodeSets sets;
  std::vector<std::vector<int32_t>> moves;  // [state][class]
  auto id_of = [&](const std::vector<int>& set) {
    const int32_t id = sets.find_or_add(set, max_states);
    if (id < 0)
      throw std::invalid_argument("the regular expression is too complex (more than " + std::to_string(max_states) +
                                  " automaton states)");
    return id;
  };
  // The byte classes each distinct set of a byte edge takes.
  std::vector<std::vector<int>> set_classes(distinct.size());
  for (size_t i = 0; i < distinct.size(); ++i)
    for (int c = 0; c < classes; ++c)
      if ((*distinct[i])[representative[c]]) set_classes[i].push_back(c);
  id_of(nfa.closure({in}, final_node));
  std::vector<std::vector<int>> targets(classes);
  std::vector<int> found;
  for (size_t s = 0; s < sets.size(); ++s) {
    for (std::vector<int>& t : targets) t.clear();
    for (const int* node = sets.begin(s); node != sets.end(s); ++node)
      if (const int n = *node; nfa.to[n] >= 0)
        for (int c : set_classes[set_of[n]]) targets[c].push_back(nfa.to[n]);
    // Classes whose byte edges lead to the same nodes (the characters of a string, mostly)
    // share one closure: a state has a few distinct sets of targets among its classes.
    std::vector<int32_t> row(classes, kDead);
    std::vector<size_t> hashes(classes, 0);
    for (int c = 0; c < classes; ++c) {
      if (targets[c].empty()) continue;
      hashes[c] = NodeSetHash()(targets[c]);
      int same = -1;
      for (int d = 0; d < c && same < 0; ++d)
        if (hashes[d] == hashes[c] && !targets[d].empty() && targets[d] == targets[c]) same = d;
      if (same >= 0) {
        row[c] = row[same];
      } else {
        nfa.closure(targets[c], final_node, &found);
        row[c] = id_of(found);
      }
    }
    moves.push_back(std::move(row));
  }

  // Breadth first from the matches over the transitions backwards: a state it reaches can
  // still reach a match, and at the fewest bytes it took; the others become kDead.
  const size_t total = sets.size();
  std::vector<uint32_t> back_start(total + 1, 0);
  for (size_t s = 0; s < total; ++s)
    for (int32_t t : moves[s])
      if (t >= 0) ++back_start[static_cast<size_t>(t) + 1];
  for (size_t s = 0; s < total; ++s) back_start[s + 1] += back_start[s];
  std::vector<int32_t> back(back_start[total]);
  {
    std::vector<uint32_t> fill(back_start.begin(), back_start.end() - 1);
    for (size_t s = 0; s < total; ++s)
      for (int32_t t : moves[s])
        if (t >= 0) back[fill[t]++] = static_cast<int32_t>(s);
  }
  std::vector<char> accepting(total, 0);
  std::vector<int32_t> dist(total, -1);
  std::vector<int32_t> frontier;
  frontier.reserve(total);
  for (size_t s = 0; s < total; ++s)
    if (std::binary_search(sets.begin(s), sets.end(s), final_node)) {
      accepting[s] = 1;
      dist[s] = 0;
      frontier.push_back(static_cast<int32_t>(s));
    }
  for (size_t i = 0; i < frontier.size(); ++i) {
    const int32_t t = frontier[i];
    for (uint32_t e = back_start[t]; e < back_start[t + 1]; ++e)
      if (dist[back[e]] < 0) {
        dist[back[e]] = dist[t] + 1;
        frontier.push_back(back[e]);
      }
  }
  if (dist[0] < 0) throw std::invalid_argument("the regular expression matches nothing");
  std::vector<int32_t> renumbered(total, kDead);
  int32_t kept = 0;
  for (size_t s = 0; s < total; ++s)
    if (dist[s] >= 0) renumbered[s] = kept++;
  classes_ = classes;
  for (int b = 0; b < 256; ++b) byte_class_[b] = static_cast<uint8_t>(byte_class[b]);
  table_.assign(static_cast<size_t>(kept) * classes, kDead);
  accepting_.assign(kept, 0);
  continues_.assign(kept, 0);
  distance_.assign(kept, -1);
  for (size_t s = 0; s < total; ++s) {
    const int32_t r = renumbered[s];
    if (r < 0) continue;
    accepting_[r] = accepting[s];
    distance_[r] = dist[s];
    max_distance_ = std::max(max_distance_, dist[s]);
    for (int c = 0; c < classes; ++c) {
      const int32_t t = moves[s][c];
      const int32_t to = t < 0 ? kDead : renumbered[t];
      table_[static_cast<size_t>(r) * classes + c] = to;
      if (to >= 0) continues_[r] = 1;
    }
  }
}

int32_t RegexDfa::walk(int32_t state, const std::string& bytes) const {
  for (unsigned char c : bytes) {
    if (state < 0) return kDead;
    state = next(state, c);
  }
  return state;
}

bool RegexDfa::full_match(const std::string& text) const {
  const int32_t s = walk(start(), text);
  return s >= 0 && accepting(s);
}

Overlap common_match(const RegexDfa& a, const RegexDfa& b, size_t max_pairs, std::string* witness) {
  // One byte for each pair of classes that some byte has: bytes of the same pair go alike.
  std::vector<uint8_t> bytes;
  {
    std::set<std::pair<int, int>> seen;
    for (int c = 0; c < 256; ++c) {
      const auto byte = static_cast<uint8_t>(c);
      if (seen.insert({a.byte_class(byte), b.byte_class(byte)}).second) bytes.push_back(byte);
    }
  }
  struct Visit {
    int32_t sa, sb;
    int64_t parent;  // index of the pair before, -1 at the start
    uint8_t byte;    // the byte from it
  };
  std::vector<Visit> order = {{a.start(), b.start(), -1, 0}};
  std::unordered_map<int64_t, int64_t> index;
  auto key = [](int32_t x, int32_t y) { return (static_cast<int64_t>(x) << 32) | static_cast<uint32_t>(y); };
  index.emplace(key(a.start(), b.start()), 0);
  for (size_t i = 0; i < order.size(); ++i) {
    const Visit v = order[i];
    if (a.accepting(v.sa) && b.accepting(v.sb)) {
      std::string text;
      for (int64_t at = static_cast<int64_t>(i); order[at].parent >= 0; at = order[at].parent)
        text += static_cast<char>(order[at].byte);
      std::reverse(text.begin(), text.end());
      if (witness) *witness = text;
      return Overlap::kSome;
    }
    for (uint8_t byte : bytes) {
      const int32_t na = a.next(v.sa, byte), nb = b.next(v.sb, byte);
      if (na < 0 || nb < 0) continue;
      if (index.emplace(key(na, nb), static_cast<int64_t>(order.size())).second) {
        if (order.size() >= max_pairs) return Overlap::kUnknown;
        order.push_back({na, nb, static_cast<int64_t>(i), byte});
      }
    }
  }
  return Overlap::kNone;
}

std::string regex_escape(const std::string& text) {
  static const std::string special = "\\.^$|?*+()[]{}-&~# \t\n\r\v\f";
  std::string out;
  for (char c : text) {
    if (special.find(c) != std::string::npos) {
      switch (c) {
        case '\t': out += "\\t"; continue;
        case '\n': out += "\\n"; continue;
        case '\r': out += "\\r"; continue;
        case '\v': out += "\\v"; continue;
        case '\f': out += "\\f"; continue;
        default: out += '\\';
      }
    }
    out += c;
  }
  return out;
}

}  // namespace kvpipe
