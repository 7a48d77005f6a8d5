#include "engine/text/text_stream.h"

#include "engine/text/tokenizer.h"

#include <algorithm>

namespace kvpipe {
namespace {

const char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

bool is_continuation(unsigned char c) { return (c & 0xC0) == 0x80; }

// Length of the UTF-8 sequence a lead byte starts, 0 when it cannot start one.
size_t sequence_length(unsigned char c) {
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return 2;
  if (c >= 0xE0 && c <= 0xEF) return 3;
  if (c >= 0xF0 && c <= 0xF4) return 4;
  return 0;
}

// How many bytes from i, at most n, form a valid start of the sequence the lead byte at i
// begins (overlong forms and surrogates excluded, as Python's decoder excludes them).
size_t valid_prefix(const std::string& s, size_t i, size_t n) {
  const size_t have = std::min(n, s.size() - i);
  const unsigned char lead = static_cast<unsigned char>(s[i]);
  for (size_t k = 1; k < have; ++k) {
    const unsigned char c = static_cast<unsigned char>(s[i + k]);
    if (!is_continuation(c)) return k;
    if (k == 1 && ((lead == 0xE0 && c < 0xA0) || (lead == 0xED && c > 0x9F) ||
                   (lead == 0xF0 && c < 0x90) || (lead == 0xF4 && c > 0x8F)))
      return k;
  }
  return have;
}

}  // namespace

std::string take_complete_utf8(std::string& bytes) {
  std::string out;
  size_t i = 0;
  while (i < bytes.size()) {
    const size_t n = sequence_length(static_cast<unsigned char>(bytes[i]));
    if (n == 0) {
      out += kReplacement;
      ++i;
      continue;
    }
    const size_t valid = valid_prefix(bytes, i, n);
    if (valid == n) {
      out.append(bytes, i, n);
      i += n;
    } else if (i + valid == bytes.size()) {
      break;  // may still become a character
    } else {
      out += kReplacement;  // one for the maximal invalid subpart, as Python replaces it
      i += valid;
    }
  }
  bytes.erase(0, i);
  return out;
}

TextStream::TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop)
    : tokenizer_(tokenizer), stop_(std::move(stop)) {
  stop_.erase(std::remove(stop_.begin(), stop_.end(), std::string()), stop_.end());
}

std::string TextStream::release(std::string s) {
  text_ += s;
  return s;
}

std::string TextStream::push(int64_t token) {
  if (stopped_) return {};
  if (tokenizer_.is_special(token)) return {};
  bytes_ += tokenizer_.token_bytes(token);
  held_ += take_complete_utf8(bytes_);
  // The earliest stop string wins; the text ends where it begins.
  size_t cut = std::string::npos;
  for (const std::string& s : stop_) cut = std::min(cut, held_.find(s));
  if (cut != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, cut);
    held_.clear();
    bytes_.clear();
    return release(std::move(out));
  }
  // Withhold the longest tail that is the start of some stop string.
  size_t keep = 0;
  for (const std::string& s : stop_) {
    for (size_t n = std::min(s.size() - 1, held_.size()); n > keep; --n) {
      if (held_.compare(held_.size() - n, n, s, 0, n) == 0) {
        keep = n;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return release(std::move(out));
}

std::string TextStream::finish() {
  if (stopped_) return {};
  std::string out = std::move(held_);
  held_.clear();
  out += take_complete_utf8(bytes_);
  if (!bytes_.empty()) out += kReplacement;  // a character cut short by the end
  bytes_.clear();
  return release(std::move(out));
}

}  // namespace kvpipe
