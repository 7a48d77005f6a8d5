#include "engine/text/unicode_text.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>
#include <stdexcept>

namespace kvpipe::text {

size_t utf8_length(char lead) {
  static constexpr size_t lookup[] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return lookup[static_cast<uint8_t>(lead) >> 4];
}

std::string codepoint_to_utf8(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

namespace {

// Length of the well-formed sequence at `pos`, 0 when malformed.
size_t valid_sequence(std::string_view s, size_t pos) {
  const auto b = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t c = b(pos);
  if (c < 0x80) return 1;
  size_t n;
  uint32_t cp;
  if ((c & 0xE0) == 0xC0) n = 2, cp = c & 0x1F;
  else if ((c & 0xF0) == 0xE0) n = 3, cp = c & 0x0F;
  else if ((c & 0xF8) == 0xF0) n = 4, cp = c & 0x07;
  else return 0;
  if (pos + n > s.size()) return 0;
  for (size_t i = 1; i < n; ++i) {
    if ((b(pos + i) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b(pos + i) & 0x3F);
  }
  if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
      (cp >= 0xD800 && cp <= 0xDFFF))
    return 0;
  return n;
}

}  // namespace

bool utf8_valid(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const size_t n = valid_sequence(text, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string utf8_sanitize(std::string_view text) {
  if (utf8_valid(text)) return std::string(text);
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const size_t n = valid_sequence(text, i);
    if (n == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
  return out;
}

uint32_t next_codepoint(std::string_view text, size_t& pos) {
  const size_t n = valid_sequence(text, pos);
  if (n == 0) {
    ++pos;
    return 0xFFFD;
  }
  const auto b = [&](size_t i) { return static_cast<uint32_t>(static_cast<uint8_t>(text[pos + i])); };
  uint32_t cp;
  switch (n) {
    case 1: cp = b(0); break;
    case 2: cp = ((b(0) & 0x1F) << 6) | (b(1) & 0x3F); break;
    case 3: cp = ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F); break;
    default: cp = ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F); break;
  }
  pos += n;
  return cp;
}

namespace {

struct ByteLevelTables {
  std::array<std::string, 256> chars;
  std::array<uint32_t, 256> cps{};
  ByteLevelTables() {
    // Printable bytes stand for themselves; the others are moved to 256 + n in byte order.
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      cps[b] = printable ? static_cast<uint32_t>(b) : next++;
      chars[b] = codepoint_to_utf8(cps[b]);
    }
  }
};

const ByteLevelTables& tables() {
  static const ByteLevelTables t;
  return t;
}

}  // namespace

const std::array<std::string, 256>& byte_level_chars() { return tables().chars; }

int byte_level_byte(uint32_t cp) {
  if (cp < 256) {
    const bool printable = (cp >= '!' && cp <= '~') || (cp >= 0xA1 && cp <= 0xAC) || (cp >= 0xAE && cp <= 0xFF);
    return printable ? static_cast<int>(cp) : -1;
  }
  if (cp >= 256 + 68) return -1;  // 68 bytes are remapped
  const auto& t = tables();
  for (int b = 0; b < 256; ++b)
    if (t.cps[b] == cp) return b;
  return -1;
}

std::string byte_level_encode(std::string_view bytes) {
  const auto& chars = byte_level_chars();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out += chars[static_cast<uint8_t>(c)];
  return out;
}

bool byte_level_decode(std::string_view text, std::string& out) {
  out.clear();
  for (size_t pos = 0; pos < text.size();) {
    const int b = byte_level_byte(next_codepoint(text, pos));
    if (b < 0) return false;
    out += static_cast<char>(b);
  }
  return true;
}

std::string normalize(std::string_view text, const std::string& form) {
  int options = UTF8PROC_STABLE;
  if (form == "NFC") options |= UTF8PROC_COMPOSE;
  else if (form == "NFD") options |= UTF8PROC_DECOMPOSE;
  else if (form == "NFKC") options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
  else if (form == "NFKD") options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
  else throw std::invalid_argument("unknown normal form " + form);
  const std::string valid = utf8_sanitize(text);
  utf8proc_uint8_t* result = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(valid.data()),
                                          static_cast<utf8proc_ssize_t>(valid.size()), &result,
                                          static_cast<utf8proc_option_t>(options));
  if (n < 0) return valid;
  std::string out(reinterpret_cast<const char*>(result), static_cast<size_t>(n));
  std::free(result);
  return out;
}

bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

}  // namespace kvpipe::text
