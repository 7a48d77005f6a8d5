// jinja::lex: splits a chat template into text and tag tokens as jinja2's lexer does in the
// environment transformers' apply_chat_template uses: trim_blocks and lstrip_blocks on,
// `{%-`/`-%}`/`{{-`/`-}}`/`{#-`/`-#}` strip whitespace, `{%+`/`+%}` keep it, comments and
// {% raw %} handled here, newlines normalised to \n and one trailing newline dropped
// (keep_trailing_newline=False).
//
// Guarantees: the text tokens carry exactly the bytes jinja2 would output for them; every token
// knows its 1-based source line; a malformed template throws TemplateError with the line.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe::jinja {

// A parse or render failure at a template line (the line is 0 when unknown).
class TemplateError : public std::runtime_error {
 public:
  TemplateError(const std::string& message, int line) : std::runtime_error(message), line(line) {}
  int line;
};

enum class TokenType { Text, VariableBegin, VariableEnd, BlockBegin, BlockEnd, Name, String, Integer, Float, Operator, End };

struct Token {
  TokenType type;
  std::string text;  // text, name, operator, or the unescaped string literal
  int line = 1;
  int64_t integer = 0;
  double number = 0;
};

std::vector<Token> lex(const std::string& source);

}  // namespace kvpipe::jinja
