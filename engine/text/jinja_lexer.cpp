#include "engine/text/jinja_lexer.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "engine/text/jinja_value.h"

namespace kvpipe::jinja {
namespace {

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// Python's str.rstrip() with no argument.
std::string py_rstrip(const std::string& s) {
  std::u32string u = utf8_decode(s);
  size_t end = u.size();
  while (end > 0 && py_isspace(u[end - 1])) --end;
  return utf8_encode(u.substr(0, end));
}

bool all_space(const std::string& s) {
  if (s.empty()) return false;
  for (char32_t c : utf8_decode(s))
    if (!py_isspace(c)) return false;
  return true;
}

// Python string-literal escapes, as jinja2 decodes them (unicode-escape).
std::string unescape(const std::string& body, int line) {
  std::u32string out;
  const std::u32string in = utf8_decode(body);
  for (size_t k = 0; k < in.size(); ++k) {
    if (in[k] != '\\' || k + 1 >= in.size()) {
      out.push_back(in[k]);
      continue;
    }
    const char32_t c = in[++k];
    auto hex = [&](size_t digits) {
      char32_t v = 0;
      for (size_t d = 1; d <= digits; ++d) {
        if (k + d >= in.size()) throw TemplateError("truncated escape in string", line);
        const char32_t h = in[k + d];
        int x;
        if (h >= '0' && h <= '9')
          x = static_cast<int>(h - '0');
        else if (h >= 'a' && h <= 'f')
          x = static_cast<int>(h - 'a' + 10);
        else if (h >= 'A' && h <= 'F')
          x = static_cast<int>(h - 'A' + 10);
        else
          throw TemplateError("truncated escape in string", line);
        v = v * 16 + static_cast<char32_t>(x);
      }
      k += digits;
      return v;
    };
    switch (c) {
      case 'n': out.push_back('\n'); break;
      case 't': out.push_back('\t'); break;
      case 'r': out.push_back('\r'); break;
      case '\\': out.push_back('\\'); break;
      case '\'': out.push_back('\''); break;
      case '"': out.push_back('"'); break;
      case 'a': out.push_back('\a'); break;
      case 'b': out.push_back('\b'); break;
      case 'f': out.push_back('\f'); break;
      case 'v': out.push_back('\v'); break;
      case '\n': break;
      case 'x': out.push_back(hex(2)); break;
      case 'u': out.push_back(hex(4)); break;
      case 'U': out.push_back(hex(8)); break;
      default:
        if (c >= '0' && c <= '7') {
          char32_t v = c - '0';
          for (int d = 0; d < 2 && k + 1 < in.size() && in[k + 1] >= '0' && in[k + 1] <= '7'; ++d)
            v = v * 8 + (in[++k] - '0');
          out.push_back(v);
        } else {
          out.push_back('\\');
          out.push_back(c);
        }
    }
  }
  return utf8_encode(out);
}

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {
    line_starts_.push_back(0);
    for (size_t k = 0; k < src_.size(); ++k)
      if (src_[k] == '\n') line_starts_.push_back(k + 1);
  }

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      size_t tag = find_tag(pos);
      if (tag == std::string::npos) {
        emit_text(src_.substr(pos), pos);
        break;
      }
      std::string text = src_.substr(pos, tag - pos);
      const char kind = src_[tag + 1];
      const char sign = tag + 2 < src_.size() && (src_[tag + 2] == '-' || src_[tag + 2] == '+') ? src_[tag + 2] : 0;
      if (sign == '-') {
        text = py_rstrip(text);
      } else if (sign != '+' && kind != '{') {
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        if ((l_pos > 0 || line_starting) && all_space(text.substr(l_pos))) text.resize(l_pos);
      }
      emit_text(text, pos);
      size_t p = tag + 2 + (sign ? 1 : 0);
      if (kind == '#') {
        const size_t q = src_.find("#}", p);
        if (q == std::string::npos) throw TemplateError("Missing end of comment tag", line_at(tag));
        const char end_sign = q > p && (src_[q - 1] == '-' || src_[q - 1] == '+') ? src_[q - 1] : 0;
        pos = finish_tag(q + 2, end_sign, true, line_starting);
        continue;
      }
      if (kind == '%' && is_raw(p)) {
        pos = lex_raw(p, line_starting);
        continue;
      }
      pos = lex_tag(kind == '{', tag, p, line_starting);
    }
    tokens_.push_back(Token{TokenType::End, "", line_at(src_.size())});
    return std::move(tokens_);
  }

 private:
  int line_at(size_t offset) const {
    return static_cast<int>(std::upper_bound(line_starts_.begin(), line_starts_.end(), offset) - line_starts_.begin());
  }

  size_t find_tag(size_t from) const {
    for (size_t k = src_.find('{', from); k != std::string::npos; k = src_.find('{', k + 1))
      if (k + 1 < src_.size() && (src_[k + 1] == '{' || src_[k + 1] == '%' || src_[k + 1] == '#')) return k;
    return std::string::npos;
  }

  void emit_text(const std::string& text, size_t offset) {
    if (!text.empty()) tokens_.push_back(Token{TokenType::Text, text, line_at(offset)});
  }

  // Consumes what follows a closing delimiter ending at `after`: all whitespace after `-`,
  // one newline for block and comment tags under trim_blocks unless `+`.
  size_t finish_tag(size_t after, char end_sign, bool trims, bool& line_starting) {
    const size_t start = after;
    if (end_sign == '-') {
      while (after < src_.size() && is_ws(src_[after])) ++after;
    } else if (end_sign != '+' && trims && after < src_.size() && src_[after] == '\n') {
      ++after;
    }
    line_starting = after > start && src_[after - 1] == '\n';
    return after;
  }

  bool is_raw(size_t p) const {
    while (p < src_.size() && is_ws(src_[p])) ++p;
    if (src_.compare(p, 3, "raw") != 0) return false;
    p += 3;
    while (p < src_.size() && is_ws(src_[p])) ++p;
    return src_.compare(p, 2, "%}") == 0 || src_.compare(p, 3, "-%}") == 0;
  }

  size_t lex_raw(size_t p, bool& line_starting) {
    const int line = line_at(p);
    size_t q = src_.find("%}", p);
    const bool strip = src_[q - 1] == '-';
    size_t body = q + 2;
    if (strip)
      while (body < src_.size() && is_ws(src_[body])) ++body;
    // The end tag: {% endraw %} with optional whitespace control.
    for (size_t k = find_tag(body); k != std::string::npos; k = find_tag(k + 1)) {
      if (src_[k + 1] != '%') continue;
      size_t e = k + 2;
      const char sign = e < src_.size() && (src_[e] == '-' || src_[e] == '+') ? src_[e] : 0;
      if (sign) ++e;
      while (e < src_.size() && is_ws(src_[e])) ++e;
      if (src_.compare(e, 6, "endraw") != 0) continue;
      e += 6;
      while (e < src_.size() && is_ws(src_[e])) ++e;
      char end_sign = 0;
      if (src_.compare(e, 3, "-%}") == 0 || src_.compare(e, 3, "+%}") == 0) {
        end_sign = src_[e];
        ++e;
      }
      if (src_.compare(e, 2, "%}") != 0) continue;
      std::string text = src_.substr(body, k - body);
      if (sign == '-') {
        text = py_rstrip(text);
      } else if (sign != '+') {
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        if (all_space(text.substr(l_pos))) text.resize(l_pos);
      }
      emit_text(text, body);
      return finish_tag(e + 2, end_sign, true, line_starting);
    }
    throw TemplateError("Missing end of raw directive", line);
  }

  size_t lex_tag(bool variable, size_t tag, size_t p, bool& line_starting) {
    tokens_.push_back(Token{variable ? TokenType::VariableBegin : TokenType::BlockBegin, "", line_at(tag)});
    std::vector<char> balance;
    while (true) {
      while (p < src_.size() && is_ws(src_[p])) ++p;
      if (p >= src_.size())
        throw TemplateError(std::string("unexpected end of template, expected '") + (variable ? "}}" : "%}") + "'",
                            line_at(tag));
      if (balance.empty()) {
        if (variable) {
          if (src_.compare(p, 3, "-}}") == 0 || src_.compare(p, 2, "}}") == 0) {
            const bool minus = src_[p] == '-';
            tokens_.push_back(Token{TokenType::VariableEnd, "", line_at(p)});
            return finish_tag(p + (minus ? 3 : 2), minus ? '-' : 0, false, line_starting);
          }
        } else if (src_.compare(p, 3, "-%}") == 0 || src_.compare(p, 3, "+%}") == 0 || src_.compare(p, 2, "%}") == 0) {
          const char sign = src_[p] == '%' ? 0 : src_[p];
          tokens_.push_back(Token{TokenType::BlockEnd, "", line_at(p)});
          return finish_tag(p + (sign ? 3 : 2), sign, true, line_starting);
        }
      }
      p = lex_token(p, balance);
    }
  }

  size_t lex_token(size_t p, std::vector<char>& balance) {
    const int line = line_at(p);
    const char c = src_[p];
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t e = p;
      while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
      tokens_.push_back(Token{TokenType::Name, src_.substr(p, e - p), line});
      return e;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t e = p;
      auto digits = [&] {
        while (e < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
      };
      digits();
      bool is_float = false;
      const bool after_dot = p > 0 && src_[p - 1] == '.';
      if (!after_dot && e + 1 < src_.size() && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
        ++e;
        digits();
        is_float = true;
      }
      if (!after_dot && e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
        size_t x = e + 1;
        if (x < src_.size() && (src_[x] == '+' || src_[x] == '-')) ++x;
        if (x < src_.size() && std::isdigit(static_cast<unsigned char>(src_[x]))) {
          e = x;
          digits();
          is_float = true;
        }
      }
      std::string text = src_.substr(p, e - p);
      text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
      Token t{is_float ? TokenType::Float : TokenType::Integer, text, line};
      if (is_float)
        t.number = std::strtod(text.c_str(), nullptr);
      else
        t.integer = std::strtoll(text.c_str(), nullptr, 10);
      tokens_.push_back(t);
      return e;
    }
    if (c == '\'' || c == '"') {
      size_t e = p + 1;
      while (e < src_.size() && src_[e] != c) e += src_[e] == '\\' ? 2 : 1;
      if (e >= src_.size()) throw TemplateError("unexpected end of string", line);
      tokens_.push_back(Token{TokenType::String, unescape(src_.substr(p + 1, e - p - 1), line), line});
      return e + 1;
    }
    static const char* const two[] = {"//", "**", "==", "!=", ">=", "<="};
    for (const char* op : two)
      if (src_.compare(p, 2, op) == 0) {
        tokens_.push_back(Token{TokenType::Operator, op, line});
        return p + 2;
      }
    static const std::string one = "+-/*%~[](){}<>=.:|,;";
    if (one.find(c) == std::string::npos) throw TemplateError(std::string("unexpected char '") + c + "'", line);
    if (c == '(' || c == '[' || c == '{') balance.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
    if (c == ')' || c == ']' || c == '}') {
      if (balance.empty()) throw TemplateError(std::string("unexpected '") + c + "'", line);
      if (balance.back() != c)
        throw TemplateError(std::string("unexpected '") + c + "', expected '" + balance.back() + "'", line);
      balance.pop_back();
    }
    tokens_.push_back(Token{TokenType::Operator, std::string(1, c), line});
    return p + 1;
  }

  std::string src_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex(const std::string& source) {
  // jinja2 normalises \r\n and \r to \n and drops one trailing newline.
  std::string s;
  s.reserve(source.size());
  for (size_t k = 0; k < source.size(); ++k) {
    if (source[k] == '\r') {
      s.push_back('\n');
      if (k + 1 < source.size() && source[k + 1] == '\n') ++k;
    } else {
      s.push_back(source[k]);
    }
  }
  if (!s.empty() && s.back() == '\n') s.pop_back();
  return Lexer(std::move(s)).run();
}

}  // namespace kvpipe::jinja
