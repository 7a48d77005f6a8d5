#include "engine/text/jinja_value.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <unordered_set>

namespace kvpipe::jinja {

const Value* Dict::find(const std::string& key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

Value* Dict::find(const std::string& key) {
  for (auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void Dict::set(const std::string& key, Value v) {
  if (Value* slot = find(key))
    *slot = std::move(v);
  else
    items.emplace_back(key, std::move(v));
}

const Value* Args::kwarg(const std::string& name) const {
  for (const auto& [k, v] : kw)
    if (k == name) return &v;
  return nullptr;
}

const Value* Args::get(size_t index, const std::string& name) const {
  if (index < pos.size()) return &pos[index];
  return kwarg(name);
}

Value Value::undefined(std::string hint) {
  Value v;
  v.s = std::move(hint);
  return v;
}
Value Value::none() {
  Value v;
  v.type = Type::None;
  return v;
}
Value Value::boolean(bool x) {
  Value v;
  v.type = Type::Bool;
  v.b = x;
  return v;
}
Value Value::integer(int64_t x) {
  Value v;
  v.type = Type::Int;
  v.i = x;
  return v;
}
Value Value::number(double x) {
  Value v;
  v.type = Type::Float;
  v.f = x;
  return v;
}
void check_string_size(size_t bytes) {
  if (bytes > kMaxStringBytes)
    throw RenderError("string of " + std::to_string(bytes) + " bytes is larger than the " +
                      std::to_string(kMaxStringBytes) + " a template may build");
}

static void check_list_size(size_t items) {
  if (items > kMaxListItems)
    throw RenderError("list of " + std::to_string(items) + " items is larger than the " +
                      std::to_string(kMaxListItems) + " a template may build");
}

namespace {
thread_local RenderScope* current_render = nullptr;
}

RenderScope::RenderScope() : outer_(current_render) { current_render = this; }

RenderScope::~RenderScope() {
  current_render = outer_;
  // Moved out first: freeing the values may free other namespaces of this list.
  std::vector<std::vector<std::pair<std::string, Value>>> contents;
  for (const auto& weak : namespaces_)
    if (const std::shared_ptr<Dict> dict = weak.lock()) contents.push_back(std::move(dict->items));
}

void track_namespace(const std::shared_ptr<Dict>& dict) {
  if (current_render) current_render->namespaces_.push_back(dict);
}

void charge_copy(size_t bytes) {
  if (!current_render || bytes == 0) return;
  current_render->copied_bytes_ += bytes;
  if (current_render->copied_bytes_ > kMaxCopiedBytes)
    throw RenderError("the template copied more than " + std::to_string(kMaxCopiedBytes >> 20) +
                      " MiB of strings");
}

bool holds(const Value& v, const Dict* dict) {
  std::vector<const Value*> pending{&v};
  std::unordered_set<const void*> seen;
  while (!pending.empty()) {
    const Value* x = pending.back();
    pending.pop_back();
    if (x->is_dict()) {
      if (x->dict.get() == dict) return true;
      if (!seen.insert(x->dict.get()).second) continue;
      for (const auto& item : x->dict->items) pending.push_back(&item.second);
    } else if (x->is_list()) {
      if (!seen.insert(x->list.get()).second) continue;
      for (const Value& item : *x->list) pending.push_back(&item);
    }
  }
  return false;
}

Value Value::string(std::string x) {
  check_string_size(x.size());
  Value v;
  v.type = Type::String;
  v.s = std::move(x);
  return v;
}
Value Value::make_list(List items) {
  check_list_size(items.size());
  Value v;
  v.type = Type::List;
  v.list = std::make_shared<List>(std::move(items));
  return v;
}
Value Value::make_tuple(List items) {
  Value v = make_list(std::move(items));
  v.is_tuple = true;
  return v;
}
Value Value::make_dict() {
  Value v;
  v.type = Type::Dict;
  v.dict = std::make_shared<Dict>();
  return v;
}
Value Value::function(Function f) {
  Value v;
  v.type = Type::Function;
  v.fn = std::make_shared<Function>(std::move(f));
  return v;
}

std::string dict_key(const Value& key) {
  if (key.is_string()) return key.s;
  if (key.is_none() || key.is_number()) return "\x01" + py_repr(key);
  throw RenderError("unhashable type: '" + key.type_name() + "'");
}

Value key_value(const std::string& key) {
  if (key.empty() || key[0] != '\x01') return Value::string(key);
  const std::string r = key.substr(1);
  if (r == "None") return Value::none();
  if (r == "True" || r == "False") return Value::boolean(r == "True");
  if (r.find_first_of(".en") != std::string::npos) return Value::number(std::strtod(r.c_str(), nullptr));
  return Value::integer(std::strtoll(r.c_str(), nullptr, 10));
}

// json.dumps turns non-string keys into strings: 1 -> "1", True -> "true", None -> "null".
static std::string json_key(const std::string& key) {
  const Value v = key_value(key);
  if (v.is_string()) return v.s;
  if (v.is_none()) return "null";
  if (v.type == Value::Type::Bool) return v.b ? "true" : "false";
  return py_str(v);
}

Value make_generator(List items) {
  Value v = Value::make_list(std::move(items));
  v.is_generator = true;
  return v;
}

double Value::as_double() const {
  switch (type) {
    case Type::Float: return f;
    case Type::Int: return static_cast<double>(i);
    case Type::Bool: return b ? 1.0 : 0.0;
    default: throw RenderError("must be real number, not " + type_name());
  }
}

int64_t Value::as_int() const {
  if (type == Type::Int) return i;
  if (type == Type::Bool) return b ? 1 : 0;
  throw RenderError("'" + type_name() + "' object cannot be interpreted as an integer");
}

bool Value::truthy() const {
  switch (type) {
    case Type::Undefined:
    case Type::None: return false;
    case Type::Bool: return b;
    case Type::Int: return i != 0;
    case Type::Float: return f != 0.0;
    case Type::String: return !s.empty();
    case Type::List: return is_generator || !list->empty();
    case Type::Dict: return is_namespace || !dict->items.empty();
    case Type::Function: return true;
  }
  return false;
}

void Value::require_defined() const {
  if (type == Type::Undefined) throw RenderError(s.empty() ? "value is undefined" : s.str());
}

std::string Value::type_name() const {
  switch (type) {
    case Type::Undefined: return "Undefined";
    case Type::None: return "NoneType";
    case Type::Bool: return "bool";
    case Type::Int: return "int";
    case Type::Float: return "float";
    case Type::String: return "str";
    case Type::List: return is_generator ? "generator" : is_tuple ? "tuple" : "list";
    case Type::Dict: return is_namespace ? "Namespace" : "dict";
    case Type::Function: return "function";
  }
  return "object";
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Value::integer(static_cast<int64_t>(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e));
      return Value::make_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = Value::make_dict();
      for (auto it = j.begin(); it != j.end(); ++it) d.dict->items.emplace_back(it.key(), from_json(it.value()));
      return d;
    }
    default: return Value::none();
  }
}

// ---- UTF-8 ----

std::u32string utf8_decode(const std::string& s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    char32_t cp;
    size_t n;
    if (c < 0x80) {
      cp = c;
      n = 1;
    } else if ((c >> 5) == 6) {
      cp = c & 0x1f;
      n = 2;
    } else if ((c >> 4) == 14) {
      cp = c & 0x0f;
      n = 3;
    } else if ((c >> 3) == 30) {
      cp = c & 0x07;
      n = 4;
    } else {
      out.push_back(0xfffd);
      ++i;
      continue;
    }
    if (i + n > s.size()) {
      out.push_back(0xfffd);
      break;
    }
    for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
    out.push_back(cp);
    i += n;
  }
  return out;
}

static void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xc0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xe0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out.push_back(static_cast<char>(0xf0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

std::string utf8_encode(const std::u32string& s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t cp : s) append_utf8(out, cp);
  return out;
}

bool py_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
         c == 0x202f || c == 0x205f || c == 0x3000;
}

// ---- str() and repr() ----

std::string py_float_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  if (v == 0) return std::signbit(v) ? "-0.0" : "0.0";
  // Shortest digits that read back to the same double, as Python's repr() prints.
  char buf[64];
  int precision = 1;
  for (; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*e", precision - 1, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string e(buf);
  const bool negative = e[0] == '-';
  if (negative) e.erase(0, 1);
  const size_t epos = e.find('e');
  const int exponent = std::atoi(e.c_str() + epos + 1);
  std::string digits;
  for (size_t k = 0; k < epos; ++k)
    if (e[k] != '.') digits.push_back(e[k]);
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out = negative ? "-" : "";
  if (exponent < -4 || exponent >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char ebuf[16];
    std::snprintf(ebuf, sizeof ebuf, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += ebuf;
  } else if (exponent < 0) {
    out += "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
  } else {
    const size_t int_digits = static_cast<size_t>(exponent) + 1;
    if (digits.size() <= int_digits) {
      out += digits + std::string(int_digits - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, int_digits) + "." + digits.substr(int_digits);
    }
  }
  return out;
}

static bool py_printable(char32_t c) {
  if (c < 0x20 || c == 0x7f) return false;
  if (c >= 0x80 && c <= 0xa0) return false;
  if (c == 0xad || c == 0x2028 || c == 0x2029 || (c >= 0x200b && c <= 0x200f) || c == 0xfeff) return false;
  if (c >= 0xd800 && c <= 0xdfff) return false;
  return !py_isspace(c) || c == ' ';
}

std::string py_string_repr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : utf8_decode(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (!py_printable(c)) {
      char buf[16];
      if (c < 0x100)
        std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(c));
      else if (c < 0x10000)
        std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      else
        std::snprintf(buf, sizeof buf, "\\U%08x", static_cast<unsigned>(c));
      out += buf;
    } else {
      append_utf8(out, c);
    }
  }
  out.push_back(quote);
  return out;
}

std::string py_repr(const Value& v) {
  switch (v.type) {
    case Value::Type::String: return py_string_repr(v.s);
    case Value::Type::Undefined: return "Undefined";
    case Value::Type::List: {
      if (v.is_generator) return "<generator object>";
      std::string out = v.is_tuple ? "(" : "[";
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += ", ";
        out += py_repr((*v.list)[k]);
      }
      if (v.is_tuple && v.list->size() == 1) out += ",";
      out += v.is_tuple ? ")" : "]";
      return out;
    }
    case Value::Type::Dict: {
      std::string out = v.is_namespace ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& [k, item] : v.dict->items) {
        if (!first) out += ", ";
        first = false;
        out += py_repr(key_value(k)) + ": " + py_repr(item);
      }
      return out + (v.is_namespace ? "}>" : "}");
    }
    default: return py_str(v);
  }
}

std::string py_str(const Value& v) {
  switch (v.type) {
    case Value::Type::Undefined: return "";
    case Value::Type::None: return "None";
    case Value::Type::Bool: return v.b ? "True" : "False";
    case Value::Type::Int: return std::to_string(v.i);
    case Value::Type::Float: return py_float_repr(v.f);
    case Value::Type::String: return v.s;
    case Value::Type::Function: return "<function>";
    default: return py_repr(v);
  }
}

// ---- json.dumps ----

static void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out.push_back('"');
  for (char32_t c : utf8_decode(s)) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default: {
        char buf[16];
        if (c < 0x20 || (ensure_ascii && c > 0x7e && c < 0x10000)) {
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else if (ensure_ascii && c >= 0x10000) {
          const char32_t u = c - 0x10000;
          std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", static_cast<unsigned>(0xd800 + (u >> 10)),
                        static_cast<unsigned>(0xdc00 + (u & 0x3ff)));
          out += buf;
        } else {
          append_utf8(out, c);
        }
      }
    }
  }
  out.push_back('"');
}

static void json_dump(std::string& out, const Value& v, const JsonOptions& o, int depth) {
  const bool indented = o.indent >= 0 || !o.indent_string.empty();
  const std::string item_sep = o.has_separators ? o.item_separator : (indented ? "," : ", ");
  const std::string key_sep = o.has_separators ? o.key_separator : ": ";
  auto newline = [&](int d) {
    out.push_back('\n');
    for (int k = 0; k < d; ++k) out += o.indent_string.empty() ? std::string(static_cast<size_t>(o.indent), ' ') : o.indent_string;
  };
  switch (v.type) {
    case Value::Type::None: out += "null"; return;
    case Value::Type::Bool: out += v.b ? "true" : "false"; return;
    case Value::Type::Int: out += std::to_string(v.i); return;
    case Value::Type::Float:
      if (std::isnan(v.f))
        out += "NaN";
      else if (std::isinf(v.f))
        out += v.f < 0 ? "-Infinity" : "Infinity";
      else
        out += py_float_repr(v.f);
      return;
    case Value::Type::String: json_string(out, v.s, o.ensure_ascii); return;
    case Value::Type::List: {
      if (v.is_generator) throw RenderError("Object of type generator is not JSON serializable");
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += item_sep;
        if (indented) newline(depth + 1);
        json_dump(out, (*v.list)[k], o, depth + 1);
      }
      if (indented) newline(depth);
      out.push_back(']');
      return;
    }
    case Value::Type::Dict: {
      if (v.is_namespace) throw RenderError("Object of type Namespace is not JSON serializable");
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& item : v.dict->items) items.push_back(&item);
      if (o.sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return py_compare(key_value(a->first), key_value(b->first), "<") < 0; });
      out.push_back('{');
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += item_sep;
        if (indented) newline(depth + 1);
        json_string(out, json_key(items[k]->first), o.ensure_ascii);
        out += key_sep;
        json_dump(out, items[k]->second, o, depth + 1);
      }
      if (indented) newline(depth);
      out.push_back('}');
      return;
    }
    default: throw RenderError("Object of type " + v.type_name() + " is not JSON serializable");
  }
}

std::string to_json(const Value& v, const JsonOptions& options) {
  std::string out;
  json_dump(out, v, options, 0);
  return out;
}

// ---- operators ----

bool py_equal(const Value& a, const Value& b) {
  using T = Value::Type;
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() == b.as_int();
    return a.as_double() == b.as_double();
  }
  if (a.type != b.type) return false;
  switch (a.type) {
    case T::Undefined:
    case T::None: return true;
    case T::String: return a.s == b.s;
    case T::List: {
      if (a.is_generator || b.is_generator) return a.list == b.list;
      if (a.is_tuple != b.is_tuple || a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!py_equal((*a.list)[k], (*b.list)[k])) return false;
      return true;
    }
    case T::Dict: {
      if (a.dict == b.dict) return true;
      if (a.is_namespace || b.is_namespace) return false;
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, v] : a.dict->items) {
        const Value* other = b.dict->find(k);
        if (!other || !py_equal(v, *other)) return false;
      }
      return true;
    }
    case T::Function: return a.fn == b.fn;
    default: return false;
  }
}

int py_compare(const Value& a, const Value& b, const char* op) {
  a.require_defined();
  b.require_defined();
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int();
    const double x = a.as_double(), y = b.as_double();
    return x < y ? -1 : x > y;
  }
  if (a.is_string() && b.is_string()) return a.s < b.s ? -1 : a.s > b.s;  // UTF-8 order is code point order
  if (a.is_list() && b.is_list() && a.is_tuple == b.is_tuple) {
    for (size_t k = 0; k < a.list->size() && k < b.list->size(); ++k) {
      if (py_equal((*a.list)[k], (*b.list)[k])) continue;
      return py_compare((*a.list)[k], (*b.list)[k], op);
    }
    return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size();
  }
  throw RenderError(std::string("'") + op + "' not supported between instances of '" + a.type_name() +
                    "' and '" + b.type_name() + "'");
}

bool py_contains(const Value& container, const Value& item) {
  switch (container.type) {
    case Value::Type::String:
      if (!item.is_string())
        throw RenderError("'in <string>' requires string as left operand, not " + item.type_name());
      return container.s.find(item.s) != std::string::npos;
    case Value::Type::List:
      for (const auto& e : container.is_generator ? py_iterate(container) : *container.list)
        if (py_equal(e, item)) return true;
      return false;
    case Value::Type::Dict:
      return (item.is_string() || item.is_number() || item.is_none()) && container.dict->find(dict_key(item)) != nullptr;
    case Value::Type::Undefined: return false;
    default: throw RenderError("argument of type '" + container.type_name() + "' is not iterable");
  }
}

// Python integers do not overflow; kvpipe's are 64-bit and refuse to instead.
[[noreturn]] static void integer_overflow(const std::string& op) {
  throw RenderError("integer overflow in " + op + " (template integers are 64-bit)");
}

static int64_t floor_div(int64_t a, int64_t b) {
  if (a == INT64_MIN && b == -1) integer_overflow("//");
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

static Value percent_format(const std::string& format, const Value& args);

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

Value py_binary(const std::string& op, const Value& a, const Value& b) {
  a.require_defined();
  b.require_defined();
  auto unsupported = [&]() -> Value {
    throw RenderError("unsupported operand type(s) for " + op + ": '" + a.type_name() + "' and '" +
                      b.type_name() + "'");
  };
  if (a.is_number() && b.is_number()) {
    const bool ints = a.is_integral() && b.is_integral();
    if (op == "/") {
      if (b.as_double() == 0) throw RenderError("division by zero");
      return Value::number(a.as_double() / b.as_double());
    }
    if (ints) {
      const int64_t x = a.as_int(), y = b.as_int();
      int64_t r = 0;
      if (op == "+" || op == "-" || op == "*") {
        const bool overflow = op == "+"   ? __builtin_add_overflow(x, y, &r)
                              : op == "-" ? __builtin_sub_overflow(x, y, &r)
                                          : __builtin_mul_overflow(x, y, &r);
        if (overflow) integer_overflow(op);
        return Value::integer(r);
      }
      if (op == "//" || op == "%") {
        if (y == 0) throw RenderError("integer division or modulo by zero");
        if (op == "//") return Value::integer(floor_div(x, y));
        if (y == -1) return Value::integer(0);  // x % -1, INT64_MIN's included
        // The remainder with the divisor's sign, as Python's; x - (x // y) * y may overflow.
        int64_t m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) m += y;
        return Value::integer(m);
      }
      if (op == "**") {
        if (y < 0) return Value::number(std::pow(static_cast<double>(x), static_cast<double>(y)));
        // By squaring: y may be as large as the integers go.
        r = 1;
        int64_t base = x;
        for (int64_t e = y; e > 0; e >>= 1) {
          if ((e & 1) && __builtin_mul_overflow(r, base, &r)) integer_overflow(op);
          if (e > 1 && __builtin_mul_overflow(base, base, &base)) integer_overflow(op);
        }
        return Value::integer(r);
      }
    } else {
      const double x = a.as_double(), y = b.as_double();
      if (op == "+") return Value::number(x + y);
      if (op == "-") return Value::number(x - y);
      if (op == "*") return Value::number(x * y);
      if (op == "//" || op == "%") {
        if (y == 0) throw RenderError("float floor division by zero");
        const double q = std::floor(x / y);
        return op == "//" ? Value::number(q) : Value::number(x - q * y);
      }
      if (op == "**") return Value::number(std::pow(x, y));
    }
    return unsupported();
  }
  if (op == "+") {
    if (a.is_string() && b.is_string() && (a.is_safe || b.is_safe)) {
      // Markup + str escapes the str, as markupsafe does.
      Value r = Value::string((a.is_safe ? a.s.str() : html_escape(a.s)) + (b.is_safe ? b.s.str() : html_escape(b.s)));
      r.is_safe = true;
      return r;
    }
    if (a.is_string() && b.is_string()) {
      check_string_size(a.s.size() + b.s.size());
      return Value::string(a.s + b.s);
    }
    if (a.is_list() && b.is_list() && a.is_tuple == b.is_tuple) {
      check_list_size(a.list->size() + b.list->size());
      List items = *a.list;
      items.insert(items.end(), b.list->begin(), b.list->end());
      Value r = Value::make_list(std::move(items));
      r.is_tuple = a.is_tuple;
      return r;
    }
    if (a.is_string())
      throw RenderError("can only concatenate str (not \"" + b.type_name() + "\") to str");
    if (a.is_list() && !a.is_tuple)
      throw RenderError("can only concatenate list (not \"" + b.type_name() + "\") to list");
    return unsupported();
  }
  if (op == "*") {
    const Value* seq = a.is_number() ? &b : &a;
    const Value* count = a.is_number() ? &a : &b;
    if (!count->is_integral() || !(seq->is_string() || seq->is_list())) return unsupported();
    const size_t unit = seq->is_string() ? seq->s.size() : seq->list->size();
    // An empty sequence repeated stays empty, however large the count: no loop over it.
    const int64_t n = unit == 0 ? 0 : std::max<int64_t>(count->as_int(), 0);
    // Checked before building, as the product may not fit memory or even size_t.
    if (unit != 0 && static_cast<uint64_t>(n) > (seq->is_string() ? kMaxStringBytes : kMaxListItems) / unit) {
      if (seq->is_string()) check_string_size(SIZE_MAX);
      check_list_size(SIZE_MAX);
    }
    if (seq->is_string()) {
      std::string r;
      r.reserve(unit * static_cast<size_t>(n));
      for (int64_t k = 0; k < n; ++k) r += seq->s;
      return Value::string(r);
    }
    List items;
    for (int64_t k = 0; k < n; ++k) items.insert(items.end(), seq->list->begin(), seq->list->end());
    Value r = Value::make_list(std::move(items));
    r.is_tuple = seq->is_tuple;
    return r;
  }
  if (op == "%" && a.is_string()) return percent_format(a.s, b);
  return unsupported();
}

// printf-style `str % args` for the conversions templates use (%s %r %d %i %f %%).
static Value percent_format(const std::string& format, const Value& args) {
  List values = args.is_list() && args.is_tuple ? *args.list : List{args};
  size_t next = 0;
  std::string out;
  for (size_t k = 0; k < format.size(); ++k) {
    if (format[k] != '%') {
      out.push_back(format[k]);
      continue;
    }
    if (++k >= format.size()) throw RenderError("incomplete format");
    const char c = format[k];
    if (c == '%') {
      out.push_back('%');
      continue;
    }
    if (next >= values.size()) throw RenderError("not enough arguments for format string");
    const Value& v = values[next++];
    if (c == 's')
      out += py_str(v);
    else if (c == 'r')
      out += py_repr(v);
    else if (c == 'd' || c == 'i')
      out += std::to_string(v.is_integral() ? v.as_int() : static_cast<int64_t>(v.as_double()));
    else if (c == 'f') {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%f", v.as_double());
      out += buf;
    } else
      throw RenderError(std::string("unsupported format character '") + c + "'");
  }
  if (next < values.size()) throw RenderError("not all arguments converted during string formatting");
  return Value::string(out);
}

Value py_negate(const Value& v) {
  v.require_defined();
  if (v.type == Value::Type::Float) return Value::number(-v.f);
  if (v.is_integral()) {
    if (v.as_int() == INT64_MIN) integer_overflow("unary -");
    return Value::integer(-v.as_int());
  }
  throw RenderError("bad operand type for unary -: '" + v.type_name() + "'");
}

size_t py_len(const Value& v) {
  switch (v.type) {
    case Value::Type::Undefined: return 0;
    case Value::Type::String: return utf8_decode(v.s).size();
    case Value::Type::List:
      if (v.is_generator) throw RenderError("object of type 'generator' has no len()");
      return v.list->size();
    case Value::Type::Dict: return v.dict->items.size();
    default: throw RenderError("object of type '" + v.type_name() + "' has no len()");
  }
}

List py_iterate(const Value& v) {
  switch (v.type) {
    case Value::Type::Undefined: return {};
    case Value::Type::List: {
      if (!v.is_generator) return *v.list;
      List items = std::move(*v.list);
      v.list->clear();
      return items;
    }
    case Value::Type::Dict: {
      List keys;
      for (const auto& item : v.dict->items) keys.push_back(key_value(item.first));
      return keys;
    }
    case Value::Type::String: {
      List chars;
      for (char32_t c : utf8_decode(v.s)) chars.push_back(Value::string(utf8_encode(std::u32string(1, c))));
      return chars;
    }
    default: throw RenderError("'" + v.type_name() + "' object is not iterable");
  }
}

}  // namespace kvpipe::jinja
