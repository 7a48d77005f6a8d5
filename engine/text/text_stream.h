// TextStream: the text of one request's generated tokens, released as they arrive.
//
// Owns the bytes that cannot be shown yet: the tail of a UTF-8 character split between
// tokens, and a tail that could still become one of the request's stop strings. Guarantees:
// push() never returns half a UTF-8 character nor any part of a stop string; once a stop
// string appears (also across token boundaries) the text ends exactly where it begins and
// stopped() is true; special tokens (EOS, control tokens) add no text, as vLLM's and
// transformers' skip_special_tokens do. Concatenating every push() and finish() gives text().
// Bytes that can never form a character are released as U+FFFD, as Python's
// errors="replace" decoding does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvpipe {

class Tokenizer;

class TextStream {
 public:
  TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop);

  // Adds a generated token; returns the text that became final with it (maybe empty).
  // After a stop string was found, further tokens add nothing.
  std::string push(int64_t token);
  // The request ended (EOS, length, cancelled): releases what was held back.
  std::string finish();

  bool stopped() const { return stopped_; }
  const std::string& text() const { return text_; }

 private:
  std::string release(std::string s);  // appends to text_, returns s

  const Tokenizer& tokenizer_;
  std::vector<std::string> stop_;
  std::string bytes_;    // undecoded tail: an incomplete UTF-8 character
  std::string held_;     // decoded, withheld: may be the start of a stop string
  std::string text_;
  bool stopped_ = false;
};

// Splits `bytes` into its longest prefix of whole UTF-8 characters (invalid bytes replaced
// by U+FFFD) and leaves in `bytes` only a tail that may still become a character.
std::string take_complete_utf8(std::string& bytes);

}  // namespace kvpipe
