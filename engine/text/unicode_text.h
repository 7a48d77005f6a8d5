// Unicode helpers for the tokenizers: UTF-8 walking, GPT-2's byte-level alphabet, Unicode
// normal forms (through utf8proc).
//
// Guarantees: everything here is a pure function of its arguments (the byte-level tables
// are built once, at first use, and never change), so tokenizers may call it from any thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvpipe::text {

// Byte length of the UTF-8 sequence that starts with `lead`, from its high bits alone (as
// llama.cpp counts it): 1 for ASCII and stray continuation bytes, else 2, 3 or 4.
size_t utf8_length(char lead);

std::string codepoint_to_utf8(uint32_t cp);

// `text` with every byte that does not start a well-formed UTF-8 sequence replaced by U+FFFD
// (as llama.cpp and Rust's from_utf8_lossy read malformed input); returns `text` when valid.
std::string utf8_sanitize(std::string_view text);
bool utf8_valid(std::string_view text);

// GPT-2's reversible byte <-> printable code point map (bytes_to_unicode()).
const std::array<std::string, 256>& byte_level_chars();
// The byte that byte-level code point `cp` stands for, or -1.
int byte_level_byte(uint32_t cp);
std::string byte_level_encode(std::string_view bytes);
// Decodes byte-level text; false (and `out` unspecified) when a code point is not in the map.
bool byte_level_decode(std::string_view text, std::string& out);

// Unicode normal forms of valid UTF-8 text ("NFC", "NFD", "NFKC", "NFKD").
std::string normalize(std::string_view text, const std::string& form);

// Unicode White_Space (what llama.cpp, Rust and Oniguruma call \s).
bool is_white_space(uint32_t cp);

// The code point at `pos` (advancing it); U+FFFD for a malformed sequence (one byte consumed).
uint32_t next_codepoint(std::string_view text, size_t& pos);

}  // namespace kvpipe::text
