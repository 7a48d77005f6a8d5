#define PCRE2_CODE_UNIT_WIDTH 8
#include "engine/text/pre_tokenizer.h"

#include <pcre2.h>

#include "engine/text/unicode_text.h"

#include <algorithm>
#include <cctype>
#include <stdexcept>

namespace kvpipe::text {

namespace {

// Unicode White_Space as a class body.
constexpr const char* kWhiteSpace =
    "\\x{09}-\\x{0D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

// Rewrites \s and \S into explicit White_Space classes: PCRE2's UCP \s also takes U+180E and
// differs between releases, while the references agree on White_Space.
std::string rewrite_white_space(const std::string& p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      if (e == 's') {
        out += in_class ? std::string(kWhiteSpace) : "[" + std::string(kWhiteSpace) + "]";
      } else if (e == 'S' && !in_class) {
        out += "[^" + std::string(kWhiteSpace) + "]";
      } else {
        out += c;
        out += e;
      }
      ++i;
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

}  // namespace

struct Regex::Code {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Code() {
    if (code != nullptr) pcre2_code_free(code);
  }
};

Regex::Regex(const std::string& pattern, const std::string& where) : pattern_(pattern) {
  const std::string rewritten = rewrite_white_space(pattern);
  int error = 0;
  PCRE2_SIZE offset = 0;
  auto code = std::make_shared<Code>();
  code->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten.data()), rewritten.size(),
                             PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &error, &offset, nullptr);
  if (code->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    throw std::invalid_argument(where + ": regular expression '" + pattern + "' does not compile: " +
                                reinterpret_cast<const char*>(message) + " (at offset " + std::to_string(offset) + ")");
  }
  code->jit = pcre2_jit_compile(code->code, PCRE2_JIT_COMPLETE) == 0;
  code_ = std::move(code);
}

Regex Regex::literal(const std::string& literal, const std::string& where) {
  return Regex(regex_escape(literal), where);
}

std::string regex_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) out += '\\';
    out += c;
  }
  return out;
}

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> out;
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_->code, nullptr);
  if (md == nullptr) throw std::bad_alloc();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start <= text.size()) {
    const int rc = code_->jit ? pcre2_jit_match(code_->code, subject, text.size(), start, 0, md, nullptr)
                              : pcre2_match(code_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc < 0) break;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t b = ov[0], e = ov[1];
    if (e == b) {
      // An empty match splits nothing; step over one character.
      if (b >= text.size()) break;
      start = b + utf8_length(text[b]);
      continue;
    }
    out.emplace_back(b, e);
    start = e;
  }
  pcre2_match_data_free(md);
  return out;
}

std::vector<std::pair<size_t, size_t>> split_ranges(std::string_view text, const Regex& regex,
                                                    SplitBehavior behavior, bool invert) {
  // Spans covering the text, each marked as a match or not.
  std::vector<std::pair<std::pair<size_t, size_t>, bool>> spans;
  size_t prev = 0;
  for (const auto& [b, e] : regex.find_all(text)) {
    if (b > prev) spans.push_back({{prev, b}, invert});
    spans.push_back({{b, e}, !invert});
    prev = e;
  }
  if (prev < text.size()) spans.push_back({{prev, text.size()}, invert});

  std::vector<std::pair<size_t, size_t>> out;
  switch (behavior) {
    case SplitBehavior::Removed:
      for (const auto& [r, m] : spans)
        if (!m) out.push_back(r);
      break;
    case SplitBehavior::Isolated:
      for (const auto& [r, m] : spans) out.push_back(r);
      break;
    case SplitBehavior::Contiguous: {
      bool previous = false;
      for (const auto& [r, m] : spans) {
        if (m == previous && !out.empty()) out.back().second = r.second;
        else out.push_back(r);
        previous = m;
      }
      break;
    }
    case SplitBehavior::MergedWithPrevious: {
      bool previous = false;
      for (const auto& [r, m] : spans) {
        if (m && !previous && !out.empty()) out.back().second = r.second;
        else out.push_back(r);
        previous = m;
      }
      break;
    }
    case SplitBehavior::MergedWithNext: {
      // As the reference does it: walking backwards, a match joins the piece after it.
      bool previous = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        const auto& [r, m] = *it;
        if (m && !previous && !out.empty()) out.back().first = r.first;
        else out.push_back(r);
        previous = m;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
  }
  return out;
}

}  // namespace kvpipe::text
