#include "engine/text/jinja_builtins.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <map>

namespace kvpipe::jinja {
namespace {

using U32 = std::u32string;

std::string describe_object(const Value& v) {
  if (v.is_none()) return "'None'";
  return "'" + v.type_name() + " object'";
}

Value missing_attribute(const Value& obj, const std::string& name) {
  return Value::undefined(describe_object(obj) + " has no attribute '" + name + "'");
}

Value arg_or(const Args& args, size_t index, const std::string& name, const Value& fallback) {
  const Value* v = args.get(index, name);
  return v ? *v : fallback;
}

std::string require_string(const Value& v, const char* what) {
  if (!v.is_string()) throw RenderError(std::string(what) + " must be str, not " + v.type_name());
  return v.s;
}

// ---- Python str helpers on code points ----

char32_t to_upper(char32_t c) {
  if (c >= 'a' && c <= 'z') return c - 32;
  if ((c >= 0xe0 && c <= 0xfe && c != 0xf7)) return c - 32;
  if (c >= 0x3b1 && c <= 0x3c9 && c != 0x3c2) return c - 32;
  if (c >= 0x430 && c <= 0x44f) return c - 32;
  if (c >= 0x450 && c <= 0x45f) return c - 80;
  return c;
}
char32_t to_lower(char32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if ((c >= 0xc0 && c <= 0xde && c != 0xd7)) return c + 32;
  if (c >= 0x391 && c <= 0x3a9 && c != 0x3a2) return c + 32;
  if (c >= 0x410 && c <= 0x42f) return c + 32;
  if (c >= 0x400 && c <= 0x40f) return c + 80;
  return c;
}
bool is_cased(char32_t c) { return to_upper(c) != c || to_lower(c) != c; }
bool is_alpha(char32_t c) { return (c < 0x80 && std::isalpha(static_cast<int>(c))) || (c >= 0xc0 && is_cased(c)); }
bool is_digit(char32_t c) { return c >= '0' && c <= '9'; }

std::string str_upper(const std::string& s) {
  U32 u = utf8_decode(s);
  for (auto& c : u) c = to_upper(c);
  return utf8_encode(u);
}
std::string str_lower(const std::string& s) {
  U32 u = utf8_decode(s);
  for (auto& c : u) c = to_lower(c);
  return utf8_encode(u);
}
std::string str_capitalize(const std::string& s) {
  U32 u = utf8_decode(s);
  for (size_t k = 0; k < u.size(); ++k) u[k] = k == 0 ? to_upper(u[k]) : to_lower(u[k]);
  return utf8_encode(u);
}
// Python's str.title(): a cased character after an uncased one starts a word.
std::string str_title(const std::string& s) {
  U32 u = utf8_decode(s);
  bool prev_cased = false;
  for (auto& c : u) {
    const bool cased = is_cased(c);
    c = cased ? (prev_cased ? to_lower(c) : to_upper(c)) : c;
    prev_cased = cased;
  }
  return utf8_encode(u);
}
// jinja2's title filter: words start after whitespace, '-', '(', '{', '[' or '<'.
std::string filter_title(const std::string& s) {
  U32 u = utf8_decode(s);
  bool start = true;
  for (auto& c : u) {
    const bool sep = py_isspace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    if (sep) {
      start = true;
      continue;
    }
    c = start ? to_upper(c) : to_lower(c);
    start = false;
  }
  return utf8_encode(u);
}

std::string str_strip(const std::string& s, const Value& chars, bool left, bool right) {
  U32 u = utf8_decode(s);
  U32 set;
  const bool whitespace = chars.is_none() || chars.is_undefined();
  if (!whitespace) set = utf8_decode(require_string(chars, "strip arg"));
  auto strip_it = [&](char32_t c) { return whitespace ? py_isspace(c) : set.find(c) != U32::npos; };
  size_t b = 0, e = u.size();
  if (left)
    while (b < e && strip_it(u[b])) ++b;
  if (right)
    while (e > b && strip_it(u[e - 1])) --e;
  return utf8_encode(u.substr(b, e - b));
}

List str_split(const std::string& s, const Value& sep, int64_t maxsplit) {
  List out;
  if (sep.is_none() || sep.is_undefined()) {
    U32 u = utf8_decode(s);
    size_t k = 0;
    while (k < u.size()) {
      while (k < u.size() && py_isspace(u[k])) ++k;
      if (k >= u.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        U32 rest = u.substr(k);
        size_t e = rest.size();
        while (e > 0 && py_isspace(rest[e - 1])) --e;
        out.push_back(Value::string(utf8_encode(rest.substr(0, e))));
        return out;
      }
      size_t e = k;
      while (e < u.size() && !py_isspace(u[e])) ++e;
      out.push_back(Value::string(utf8_encode(u.substr(k, e - k))));
      k = e;
    }
    return out;
  }
  const std::string d = require_string(sep, "separator");
  if (d.empty()) throw RenderError("empty separator");
  size_t pos = 0;
  while (true) {
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) break;
    const size_t hit = s.find(d, pos);
    if (hit == std::string::npos) break;
    out.push_back(Value::string(s.substr(pos, hit - pos)));
    pos = hit + d.size();
  }
  out.push_back(Value::string(s.substr(pos)));
  return out;
}

List str_rsplit(const std::string& s, const Value& sep, int64_t maxsplit) {
  if (maxsplit < 0) return str_split(s, sep, maxsplit);
  if (sep.is_none() || sep.is_undefined()) {
    U32 u = utf8_decode(s);
    List rev;
    size_t e = u.size();
    while (e > 0) {
      while (e > 0 && py_isspace(u[e - 1])) --e;
      if (e == 0) break;
      if (static_cast<int64_t>(rev.size()) == maxsplit) {
        size_t b = 0;
        while (b < e && py_isspace(u[b])) ++b;
        rev.push_back(Value::string(utf8_encode(u.substr(b, e - b))));
        break;
      }
      size_t b = e;
      while (b > 0 && !py_isspace(u[b - 1])) --b;
      rev.push_back(Value::string(utf8_encode(u.substr(b, e - b))));
      e = b;
    }
    std::reverse(rev.begin(), rev.end());
    return rev;
  }
  const std::string d = require_string(sep, "separator");
  if (d.empty()) throw RenderError("empty separator");
  List rev;
  size_t end = s.size();
  while (static_cast<int64_t>(rev.size()) < maxsplit) {
    if (end < d.size()) break;
    const size_t hit = s.rfind(d, end - d.size());
    if (hit == std::string::npos) break;
    rev.push_back(Value::string(s.substr(hit + d.size(), end - hit - d.size())));
    end = hit;
  }
  rev.push_back(Value::string(s.substr(0, end)));
  std::reverse(rev.begin(), rev.end());
  return rev;
}

std::string str_replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count) {
  std::string out;
  if (old.empty()) {
    U32 u = utf8_decode(s);
    int64_t n = 0;
    for (size_t k = 0; k <= u.size(); ++k) {
      if (count < 0 || n < count) {
        out += repl;
        ++n;
      }
      if (k < u.size()) out += utf8_encode(U32(1, u[k]));
    }
    return out;
  }
  size_t pos = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    const size_t hit = s.find(old, pos);
    if (hit == std::string::npos) break;
    out += s.substr(pos, hit - pos) + repl;
    pos = hit + old.size();
    ++n;
  }
  return out + s.substr(pos);
}

List splitlines(const std::string& s) {
  List out;
  U32 u = utf8_decode(s);
  U32 line;
  for (size_t k = 0; k < u.size(); ++k) {
    const char32_t c = u[k];
    if (c == '\n' || c == '\r' || c == '\v' || c == '\f' || (c >= 0x1c && c <= 0x1e) || c == 0x85 ||
        c == 0x2028 || c == 0x2029) {
      out.push_back(Value::string(utf8_encode(line)));
      line.clear();
      if (c == '\r' && k + 1 < u.size() && u[k + 1] == '\n') ++k;
    } else {
      line.push_back(c);
    }
  }
  if (!line.empty()) out.push_back(Value::string(utf8_encode(line)));
  return out;
}

bool matches_affix(const std::string& s, const Value& affix, bool prefix) {
  auto one = [&](const Value& a) {
    const std::string x = require_string(a, prefix ? "startswith arg" : "endswith arg");
    if (x.size() > s.size()) return false;
    return prefix ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  if (affix.is_list() && affix.is_tuple) {
    for (const auto& a : *affix.list)
      if (one(a)) return true;
    return false;
  }
  return one(affix);
}

// Python str.format with {}, {0}, {name} and {{ }} (no format specs beyond plain fields).
std::string str_format(const std::string& f, const Args& args) {
  std::string out;
  size_t auto_index = 0;
  for (size_t k = 0; k < f.size(); ++k) {
    const char c = f[k];
    if (c == '{') {
      if (k + 1 < f.size() && f[k + 1] == '{') {
        out.push_back('{');
        ++k;
        continue;
      }
      const size_t close = f.find('}', k);
      if (close == std::string::npos) throw RenderError("Single '{' encountered in format string");
      std::string field = f.substr(k + 1, close - k - 1);
      std::string conversion;
      if (const size_t bang = field.find('!'); bang != std::string::npos) {
        conversion = field.substr(bang + 1);
        field = field.substr(0, bang);
      }
      if (field.find(':') != std::string::npos) throw RenderError("format specs are not supported");
      const Value* v = nullptr;
      if (field.empty()) {
        if (auto_index >= args.pos.size()) throw RenderError("Replacement index out of range");
        v = &args.pos[auto_index++];
      } else if (std::all_of(field.begin(), field.end(), [](char d) { return std::isdigit(static_cast<unsigned char>(d)); })) {
        const size_t idx = std::stoul(field);
        if (idx >= args.pos.size()) throw RenderError("Replacement index out of range");
        v = &args.pos[idx];
      } else {
        v = args.kwarg(field);
        if (!v) throw RenderError("KeyError: '" + field + "'");
      }
      out += conversion == "r" ? py_repr(*v) : py_str(*v);
      k = close;
    } else if (c == '}') {
      if (k + 1 < f.size() && f[k + 1] == '}') ++k;
      out.push_back('}');
    } else {
      out.push_back(c);
    }
  }
  return out;
}

Value bound(std::function<Value(Args&)> fn) { return Value::function(std::move(fn)); }

int64_t int_arg(const Args& args, size_t index, const std::string& name, int64_t fallback) {
  const Value* v = args.get(index, name);
  if (!v || v->is_none()) return fallback;
  return v->as_int();
}

Value string_method(const std::string& s, const std::string& name) {
  if (name == "strip" || name == "lstrip" || name == "rstrip")
    return bound([s, name](Args& a) {
      return Value::string(str_strip(s, arg_or(a, 0, "chars", Value::none()), name != "rstrip", name != "lstrip"));
    });
  if (name == "upper") return bound([s](Args&) { return Value::string(str_upper(s)); });
  if (name == "lower") return bound([s](Args&) { return Value::string(str_lower(s)); });
  if (name == "title") return bound([s](Args&) { return Value::string(str_title(s)); });
  if (name == "capitalize") return bound([s](Args&) { return Value::string(str_capitalize(s)); });
  if (name == "startswith" || name == "endswith")
    return bound([s, name](Args& a) {
      if (a.pos.empty()) throw RenderError(name + "() takes at least 1 argument (0 given)");
      return Value::boolean(matches_affix(s, a.pos[0], name == "startswith"));
    });
  if (name == "split" || name == "rsplit")
    return bound([s, name](Args& a) {
      const Value sep = arg_or(a, 0, "sep", Value::none());
      const int64_t maxsplit = int_arg(a, 1, "maxsplit", -1);
      return Value::make_list(name == "split" ? str_split(s, sep, maxsplit) : str_rsplit(s, sep, maxsplit));
    });
  if (name == "splitlines") return bound([s](Args&) { return Value::make_list(splitlines(s)); });
  if (name == "replace")
    return bound([s](Args& a) {
      if (a.pos.size() < 2) throw RenderError("replace expected at least 2 arguments");
      return Value::string(str_replace(s, require_string(a.pos[0], "replace arg"),
                                       require_string(a.pos[1], "replace arg"), int_arg(a, 2, "count", -1)));
    });
  if (name == "join")
    return bound([s](Args& a) {
      if (a.pos.empty()) throw RenderError("join() takes exactly one argument (0 given)");
      std::string out;
      bool first = true;
      for (const auto& item : py_iterate(a.pos[0])) {
        if (!first) out += s;
        first = false;
        out += require_string(item, "sequence item");
      }
      return Value::string(out);
    });
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count")
    return bound([s, name](Args& a) {
      if (a.pos.empty()) throw RenderError(name + "() takes at least 1 argument (0 given)");
      const std::string sub = require_string(a.pos[0], "substring");
      if (name == "count") {
        if (sub.empty()) return Value::integer(static_cast<int64_t>(utf8_decode(s).size() + 1));
        int64_t n = 0;
        for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
        return Value::integer(n);
      }
      const size_t hit = name[0] == 'r' ? s.rfind(sub) : s.find(sub);
      if (hit == std::string::npos) {
        if (name == "index" || name == "rindex") throw RenderError("substring not found");
        return Value::integer(-1);
      }
      return Value::integer(static_cast<int64_t>(utf8_decode(s.substr(0, hit)).size()));
    });
  if (name == "format") return bound([s](Args& a) { return Value::string(str_format(s, a)); });
  if (name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace" || name == "islower" ||
      name == "isupper" || name == "isnumeric" || name == "isdecimal")
    return bound([s, name](Args&) {
      const U32 u = utf8_decode(s);
      if (u.empty()) return Value::boolean(false);
      if (name == "islower" || name == "isupper") {
        bool any = false;
        for (char32_t c : u) {
          if (!is_cased(c)) continue;
          any = true;
          if ((name == "islower") != (to_lower(c) == c)) return Value::boolean(false);
        }
        return Value::boolean(any);
      }
      for (char32_t c : u) {
        bool ok;
        if (name == "isalpha")
          ok = is_alpha(c);
        else if (name == "isalnum")
          ok = is_alpha(c) || is_digit(c);
        else if (name == "isspace")
          ok = py_isspace(c);
        else
          ok = is_digit(c);
        if (!ok) return Value::boolean(false);
      }
      return Value::boolean(true);
    });
  return Value();
}

Value items_of(const Value& d) {
  List out;
  for (const auto& [k, v] : d.dict->items) out.push_back(Value::make_tuple({key_value(k), v}));
  return Value::make_list(std::move(out));
}

Value dict_method(const Value& d, const std::string& name) {
  if (name == "items") return bound([d](Args&) { return items_of(d); });
  if (name == "keys")
    return bound([d](Args&) {
      List out;
      for (const auto& item : d.dict->items) out.push_back(key_value(item.first));
      return Value::make_list(std::move(out));
    });
  if (name == "values")
    return bound([d](Args&) {
      List out;
      for (const auto& item : d.dict->items) out.push_back(item.second);
      return Value::make_list(std::move(out));
    });
  if (name == "get")
    return bound([d](Args& a) {
      if (a.pos.empty()) throw RenderError("get expected at least 1 argument, got 0");
      const Value* v = d.dict->find(dict_key(a.pos[0]));
      return v ? *v : arg_or(a, 1, "default", Value::none());
    });
  if (name == "copy")
    return bound([d](Args&) {
      Value c = Value::make_dict();
      c.dict->items = d.dict->items;
      return c;
    });
  if (name == "clear" || name == "pop" || name == "popitem" || name == "setdefault" || name == "update")
    return Value::undefined("access to attribute '" + name + "' of 'dict' object is unsafe.");
  return Value();
}

Value list_method(const Value& l, const std::string& name) {
  if (name == "index" || name == "count")
    return bound([l, name](Args& a) {
      if (a.pos.empty()) throw RenderError(name + "() takes at least 1 argument (0 given)");
      int64_t n = 0;
      for (size_t k = 0; k < l.list->size(); ++k)
        if (py_equal((*l.list)[k], a.pos[0])) {
          if (name == "index") return Value::integer(static_cast<int64_t>(k));
          ++n;
        }
      if (name == "index") throw RenderError(py_repr(a.pos[0]) + " is not in list");
      return Value::integer(n);
    });
  if (name == "copy") return bound([l](Args&) { return Value::make_list(*l.list); });
  if (name == "append" || name == "clear" || name == "extend" || name == "insert" || name == "pop" ||
      name == "remove" || name == "reverse" || name == "sort")
    return Value::undefined("access to attribute '" + name + "' of '" + l.type_name() + "' object is unsafe.");
  return Value();
}

// ---- attribute paths and sorting ----

// jinja2's make_attrgetter: "a.b.0" walks getitem with ints for digit parts.
Value attribute_path(const Value& item, const Value& path) {
  if (path.is_integral()) return get_item(item, path);
  Value cur = item;
  const std::string p = py_str(path);
  size_t start = 0;
  while (true) {
    const size_t dot = p.find('.', start);
    const std::string part = p.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
    cur = get_item(cur, digits ? Value::integer(std::stoll(part)) : Value::string(part));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return cur;
}

Value fold_case(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::string(str_lower(v.s));
  return v;
}

void sort_values(List& items, bool reverse, const std::function<Value(const Value&)>& key) {
  std::vector<std::pair<Value, Value>> keyed;
  for (auto& v : items) keyed.emplace_back(key(v), v);
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& a, const auto& b) {
    return reverse ? py_compare(b.first, a.first, "<") < 0 : py_compare(a.first, b.first, "<") < 0;
  });
  for (size_t k = 0; k < items.size(); ++k) items[k] = keyed[k].second;
}

bool truthy_bool_arg(const Args& args, size_t index, const std::string& name, bool fallback) {
  const Value* v = args.get(index, name);
  return v ? v->truthy() : fallback;
}


Value select_items(const Value& value, Args& args, bool select, bool by_attribute) {
  List out;
  size_t next = 0;
  Value attribute;
  if (by_attribute) {
    if (args.pos.empty()) throw RenderError("selectattr/rejectattr need an attribute");
    attribute = args.pos[next++];
  }
  std::string test;
  if (next < args.pos.size()) test = require_string(args.pos[next++], "test name");
  // jinja2's select_or_reject starts with `if seq:`, so a falsy input (None) selects nothing.
  if (!value.truthy()) return make_generator({});
  Args test_args;
  test_args.pos.assign(args.pos.begin() + static_cast<std::ptrdiff_t>(std::min(next, args.pos.size())), args.pos.end());
  for (const auto& item : py_iterate(value)) {
    const Value subject = by_attribute ? attribute_path(item, attribute) : item;
    bool ok;
    if (test.empty()) {
      ok = subject.truthy();
    } else {
      Args a = test_args;
      ok = apply_test(test, subject, a);
    }
    if (ok == select) out.push_back(item);
  }
  return make_generator(std::move(out));
}

double round_half_even(double v, int64_t precision) {
  char buf[512];
  std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(std::max<int64_t>(precision, 0)), v);
  return std::strtod(buf, nullptr);
}

std::string indent_filter(const std::string& s_in, const Value& width, bool first, bool blank) {
  const std::string indention = width.is_string() ? width.s.str() : std::string(static_cast<size_t>(width.as_int()), ' ');
  const std::string s = s_in + "\n";
  List lines = splitlines(s);
  std::string rv;
  if (blank) {
    for (size_t k = 0; k < lines.size(); ++k) rv += (k ? "\n" + indention : std::string()) + lines[k].s;
  } else {
    rv = lines.empty() ? std::string() : std::string(lines[0].s);
    if (lines.size() > 1) {
      rv += "\n";
      for (size_t k = 1; k < lines.size(); ++k) {
        if (k > 1) rv += "\n";
        rv += lines[k].s.empty() ? "" : indention + lines[k].s;
      }
    }
  }
  if (first) rv = indention + rv;
  return rv;
}

Value tojson_filter(const Value& value, const Args& args) {
  JsonOptions o;
  o.ensure_ascii = truthy_bool_arg(args, 0, "ensure_ascii", false);
  const Value* indent = args.get(1, "indent");
  if (indent && !indent->is_none()) {
    if (indent->is_string())
      o.indent_string = indent->s, o.indent = 0;
    else
      o.indent = static_cast<int>(indent->as_int());
  }
  const Value* separators = args.get(2, "separators");
  if (separators && !separators->is_none()) {
    if (!separators->is_list() || separators->list->size() != 2) throw RenderError("separators must be a pair");
    o.has_separators = true;
    o.item_separator = py_str((*separators->list)[0]);
    o.key_separator = py_str((*separators->list)[1]);
  }
  o.sort_keys = truthy_bool_arg(args, 3, "sort_keys", false);
  return Value::string(to_json(value, o));
}

Value to_number(const Value& v, bool integer, const Value& fallback) {
  if (v.type == Value::Type::Int || v.type == Value::Type::Bool) return integer ? Value::integer(v.as_int()) : Value::number(v.as_double());
  if (v.type == Value::Type::Float) return integer ? Value::integer(static_cast<int64_t>(v.f)) : v;
  if (v.is_string()) {
    const std::string t = str_strip(v.s, Value::none(), true, true);
    std::string clean;
    for (char c : t)
      if (c != '_') clean.push_back(c);
    char* end = nullptr;
    if (integer) {
      const long long n = std::strtoll(clean.c_str(), &end, 10);
      if (!clean.empty() && *end == 0) return Value::integer(n);
    }
    const double d = std::strtod(clean.c_str(), &end);
    if (!clean.empty() && *end == 0) return integer ? Value::integer(static_cast<int64_t>(d)) : Value::number(d);
  }
  return fallback;
}

}  // namespace

// ---- access ----

Value get_attr(const Value& obj, const std::string& name) {
  switch (obj.type) {
    case Value::Type::Undefined: obj.require_defined(); break;
    case Value::Type::Dict: {
      if (obj.is_namespace) {
        if (const Value* v = obj.dict->find(name)) return *v;
        return Value::undefined("'Namespace' object has no attribute '" + name + "'");
      }
      Value m = dict_method(obj, name);
      if (!m.is_undefined() || !m.s.empty()) return m;
      if (const Value* v = obj.dict->find(name)) return *v;
      break;
    }
    case Value::Type::String: {
      Value m = string_method(obj.s, name);
      if (!m.is_undefined()) return m;
      break;
    }
    case Value::Type::List: {
      Value m = list_method(obj, name);
      if (!m.is_undefined() || !m.s.empty()) return m;
      break;
    }
    default: break;
  }
  return missing_attribute(obj, name);
}

Value get_item(const Value& obj, const Value& key) {
  obj.require_defined();
  if (obj.is_dict() && !obj.is_namespace) {
    if (key.is_string() || key.is_number() || key.is_none())
      if (const Value* v = obj.dict->find(dict_key(key))) return *v;
    if (key.is_string()) return get_attr(obj, key.s);
    return Value::undefined(describe_object(obj) + " has no attribute " + py_repr(key));
  }
  if (obj.is_generator) return Value::undefined("'generator object' has no attribute " + py_repr(key));
  if ((obj.is_list() || obj.is_string()) && key.is_integral()) {
    const U32 chars = obj.is_string() ? utf8_decode(obj.s) : U32();
    const int64_t n = obj.is_list() ? static_cast<int64_t>(obj.list->size()) : static_cast<int64_t>(chars.size());
    int64_t k = key.as_int();
    if (k < 0) k += n;
    if (k < 0 || k >= n) return Value::undefined(describe_object(obj) + " has no element " + py_str(key));
    if (obj.is_list()) return (*obj.list)[static_cast<size_t>(k)];
    return Value::string(utf8_encode(U32(1, chars[static_cast<size_t>(k)])));
  }
  if (key.is_string()) return get_attr(obj, key.s);
  return Value::undefined(describe_object(obj) + " has no element " + py_repr(key));
}

Value get_slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  obj.require_defined();
  auto opt = [](const Value& v, const char* what) -> const Value* {
    if (v.is_undefined() || v.is_none()) return nullptr;
    if (!v.is_integral()) throw RenderError(std::string("slice ") + what + " must be an integer or None");
    return &v;
  };
  const Value* a = opt(start, "indices");
  const Value* b = opt(stop, "indices");
  const Value* c = opt(step, "indices");
  const int64_t st = c ? c->as_int() : 1;
  if (st == 0) throw RenderError("slice step cannot be zero");
  U32 chars;
  int64_t n;
  if (obj.is_string()) {
    chars = utf8_decode(obj.s);
    n = static_cast<int64_t>(chars.size());
  } else if (obj.is_list() && !obj.is_generator) {
    n = static_cast<int64_t>(obj.list->size());
  } else {
    throw RenderError("'" + obj.type_name() + "' object is not subscriptable");
  }
  auto clamp = [&](const Value* v, int64_t def) {
    if (!v) return def;
    int64_t x = v->as_int();
    if (x < 0) x += n;
    if (st > 0) return std::min(std::max<int64_t>(x, 0), n);
    return std::min(std::max<int64_t>(x, -1), n - 1);
  };
  const int64_t lo = clamp(a, st > 0 ? 0 : n - 1);
  const int64_t hi = clamp(b, st > 0 ? n : -1);
  std::vector<int64_t> idx;
  if (st > 0)
    for (int64_t k = lo; k < hi; k += st) idx.push_back(k);
  else
    for (int64_t k = lo; k > hi; k += st) idx.push_back(k);
  if (obj.is_string()) {
    U32 out;
    for (int64_t k : idx) out.push_back(chars[static_cast<size_t>(k)]);
    return Value::string(utf8_encode(out));
  }
  List out;
  for (int64_t k : idx) out.push_back((*obj.list)[static_cast<size_t>(k)]);
  Value r = Value::make_list(std::move(out));
  r.is_tuple = obj.is_tuple;
  return r;
}

Value call_value(const Value& fn, Args& args) {
  if (fn.type == Value::Type::Function) return (*fn.fn)(args);
  fn.require_defined();
  throw RenderError("'" + fn.type_name() + "' object is not callable");
}

// ---- filters ----

Value apply_filter(const std::string& name, const Value& value, Args& args) {
  const Value none = Value::none();
  if (name == "default" || name == "d") {
    const Value fallback = args.pos.size() > 0 ? args.pos[0] : (args.kwarg("default_value") ? *args.kwarg("default_value") : Value::string(""));
    const bool boolean = truthy_bool_arg(args, 1, "boolean", false);
    if (value.is_undefined() || (boolean && !value.truthy())) return fallback;
    return value;
  }
  if (name == "length" || name == "count") return Value::integer(static_cast<int64_t>(py_len(value)));
  if (name == "string") return Value::string(py_str(value));
  if (name == "safe" || name == "forceescape" || name == "escape" || name == "e") {
    if (value.is_string() && value.is_safe && name != "forceescape") return value;
    Value r = Value::string(name == "safe" ? py_str(value) : html_escape(py_str(value)));
    r.is_safe = true;
    return r;
  }
  if (name == "trim") return Value::string(str_strip(py_str(value), arg_or(args, 0, "chars", none), true, true));
  if (name == "upper") return Value::string(str_upper(py_str(value)));
  if (name == "lower") return Value::string(str_lower(py_str(value)));
  if (name == "capitalize") return Value::string(str_capitalize(py_str(value)));
  if (name == "title") return Value::string(filter_title(py_str(value)));
  if (name == "tojson") return tojson_filter(value, args);
  if (name == "pprint") return Value::string(py_repr(value));
  if (name == "list") return Value::make_list(py_iterate(value));
  if (name == "join") {
    const std::string sep = py_str(arg_or(args, 0, "d", Value::string("")));
    const Value* attribute = args.get(1, "attribute");
    std::string out;
    bool first = true;
    for (const auto& item : py_iterate(value)) {
      if (!first) out += sep;
      first = false;
      out += py_str(attribute && !attribute->is_none() ? attribute_path(item, *attribute) : item);
    }
    return Value::string(out);
  }
  if (name == "first" && value.is_generator) {
    if (value.list->empty()) return Value::undefined("No first item, sequence was empty.");
    Value item = value.list->front();
    value.list->erase(value.list->begin());
    return item;
  }
  if (name == "last" && value.is_generator) throw RenderError("'generator' object is not reversible");
  if (name == "first" || name == "last") {
    List items = py_iterate(value);
    if (items.empty()) return Value::undefined(std::string("No ") + name + " item, sequence was empty.");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "items") {
    if (value.is_undefined()) return Value::make_list();
    if (!value.is_dict()) throw RenderError("Can only get item pairs from a mapping.");
    return make_generator(*items_of(value).list);
  }
  if (name == "dictsort") {
    if (!value.is_dict()) throw RenderError("You can only sort by either \"key\" or \"value\"");
    const bool case_sensitive = truthy_bool_arg(args, 0, "case_sensitive", false);
    const std::string by = py_str(arg_or(args, 1, "by", Value::string("key")));
    const bool reverse = truthy_bool_arg(args, 2, "reverse", false);
    List items = *items_of(value).list;
    const size_t pos = by == "value" ? 1 : 0;
    sort_values(items, reverse, [&](const Value& v) { return fold_case((*v.list)[pos], case_sensitive); });
    return Value::make_list(std::move(items));
  }
  if (name == "sort") {
    const bool reverse = truthy_bool_arg(args, 0, "reverse", false);
    const bool case_sensitive = truthy_bool_arg(args, 1, "case_sensitive", false);
    const Value* attribute = args.get(2, "attribute");
    List items = py_iterate(value);
    sort_values(items, reverse, [&](const Value& v) {
      return fold_case(attribute && !attribute->is_none() ? attribute_path(v, *attribute) : v, case_sensitive);
    });
    return Value::make_list(std::move(items));
  }
  if (name == "unique") {
    const bool case_sensitive = truthy_bool_arg(args, 0, "case_sensitive", false);
    const Value* attribute = args.get(1, "attribute");
    List out, seen;
    for (const auto& item : py_iterate(value)) {
      const Value key = fold_case(attribute && !attribute->is_none() ? attribute_path(item, *attribute) : item, case_sensitive);
      if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return py_equal(s, key); })) continue;
      seen.push_back(key);
      out.push_back(item);
    }
    return make_generator(std::move(out));
  }
  if (name == "reverse") {
    if (value.is_string()) {
      U32 u = utf8_decode(value.s);
      std::reverse(u.begin(), u.end());
      return Value::string(utf8_encode(u));
    }
    const bool reversible = value.is_list() && !value.is_generator;
    List items = py_iterate(value);
    std::reverse(items.begin(), items.end());
    return reversible ? make_generator(std::move(items)) : Value::make_list(std::move(items));
  }
  if (name == "map") {
    List out;
    if (!value.truthy()) return make_generator({});  // jinja2's do_map starts with `if seq:`
    if (const Value* attribute = args.kwarg("attribute")) {
      const Value* fallback = args.kwarg("default");
      for (const auto& item : py_iterate(value)) {
        Value v = attribute_path(item, *attribute);
        out.push_back(v.is_undefined() && fallback ? *fallback : v);
      }
      return make_generator(std::move(out));
    }
    if (args.pos.empty()) throw RenderError("map requires a filter argument");
    const std::string filter = require_string(args.pos[0], "filter name");
    for (const auto& item : py_iterate(value)) {
      Args a;
      a.pos.assign(args.pos.begin() + 1, args.pos.end());
      a.kw = args.kw;
      out.push_back(apply_filter(filter, item, a));
    }
    return make_generator(std::move(out));
  }
  if (name == "select" || name == "reject") return select_items(value, args, name == "select", false);
  if (name == "selectattr" || name == "rejectattr") return select_items(value, args, name == "selectattr", true);
  if (name == "replace") {
    if (args.pos.size() < 2) throw RenderError("replace needs old and new");
    return Value::string(str_replace(py_str(value), py_str(args.pos[0]), py_str(args.pos[1]), int_arg(args, 2, "count", -1)));
  }
  if (name == "int") return to_number(value, true, arg_or(args, 0, "default", Value::integer(0)));
  if (name == "float") return to_number(value, false, arg_or(args, 0, "default", Value::number(0.0)));
  if (name == "abs") {
    value.require_defined();
    if (value.type == Value::Type::Float) return Value::number(std::fabs(value.f));
    if (value.is_integral()) return Value::integer(std::llabs(value.as_int()));
    throw RenderError("bad operand type for abs(): '" + value.type_name() + "'");
  }
  if (name == "round") {
    const int64_t precision = int_arg(args, 0, "precision", 0);
    const std::string method = py_str(arg_or(args, 1, "method", Value::string("common")));
    if (method == "common") {
      if (value.is_integral()) return Value::integer(value.as_int());
      return Value::number(round_half_even(value.as_double(), precision));
    }
    const double scale = std::pow(10.0, static_cast<double>(precision));
    const double x = value.as_double() * scale;
    if (method == "ceil") return Value::number(std::ceil(x) / scale);
    if (method == "floor") return Value::number(std::floor(x) / scale);
    throw RenderError("method must be common, ceil or floor");
  }
  if (name == "sum") {
    const Value* attribute = args.get(0, "attribute");
    Value total = arg_or(args, 1, "start", Value::integer(0));
    for (const auto& item : py_iterate(value))
      total = py_binary("+", total, attribute && !attribute->is_none() ? attribute_path(item, *attribute) : item);
    return total;
  }
  if (name == "min" || name == "max") {
    const bool case_sensitive = truthy_bool_arg(args, 0, "case_sensitive", false);
    const Value* attribute = args.get(1, "attribute");
    List items = py_iterate(value);
    if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
    auto key = [&](const Value& v) {
      return fold_case(attribute && !attribute->is_none() ? attribute_path(v, *attribute) : v, case_sensitive);
    };
    Value best = items[0];
    for (size_t k = 1; k < items.size(); ++k) {
      const int c = py_compare(key(items[k]), key(best), "<");
      if (name == "min" ? c < 0 : c > 0) best = items[k];
    }
    return best;
  }
  if (name == "indent") {
    return Value::string(indent_filter(py_str(value), arg_or(args, 0, "width", Value::integer(4)),
                                       truthy_bool_arg(args, 1, "first", false), truthy_bool_arg(args, 2, "blank", false)));
  }
  if (name == "wordcount") {
    int64_t n = 0;
    bool in_word = false;
    for (char32_t c : utf8_decode(py_str(value))) {
      const bool w = is_alpha(c) || is_digit(c) || c == '_';
      if (w && !in_word) ++n;
      in_word = w;
    }
    return Value::integer(n);
  }
  if (name == "format") {
    Value tuple = Value::make_tuple(args.pos);
    return py_binary("%", Value::string(py_str(value)), tuple);
  }
  if (name == "attr") {
    if (args.pos.empty()) throw RenderError("attr needs a name");
    return get_attr(value, py_str(args.pos[0]));
  }
  if (name == "batch" || name == "slice" || name == "groupby" || name == "truncate" || name == "wordwrap" ||
      name == "center" || name == "urlencode" || name == "xmlattr" || name == "filesizeformat" || name == "random" ||
      name == "striptags" || name == "urlize")
    throw RenderError("filter '" + name + "' is not supported");
  throw RenderError("No filter named '" + name + "' found.");
}

// ---- tests ----

bool apply_test(const std::string& name, const Value& v, Args& args) {
  using T = Value::Type;
  auto arg = [&](size_t k) -> const Value& {
    if (k >= args.pos.size()) throw RenderError("test '" + name + "' needs an argument");
    return args.pos[k];
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.type == T::Bool;
  if (name == "true") return v.type == T::Bool && v.b;
  if (name == "false") return v.type == T::Bool && !v.b;
  if (name == "string") return v.is_string();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.type == T::Int;
  if (name == "float") return v.type == T::Float;
  if (name == "mapping") return v.is_dict() && !v.is_namespace;
  if (name == "iterable") return v.is_undefined() || v.is_string() || v.is_list() || (v.is_dict() && !v.is_namespace);
  if (name == "sequence") return v.is_string() || (v.is_list() && !v.is_generator) || (v.is_dict() && !v.is_namespace);
  if (name == "callable") return v.type == T::Function;
  if (name == "odd" || name == "even") {
    v.require_defined();
    const int64_t x = v.as_int();
    return (((x % 2) + 2) % 2 == 1) == (name == "odd");
  }
  if (name == "divisibleby") {
    const int64_t d = arg(0).as_int();
    if (d == 0) throw RenderError("integer division or modulo by zero");
    return v.as_int() % d == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return py_equal(v, arg(0));
  if (name == "ne" || name == "!=") return !py_equal(v, arg(0));
  if (name == "lt" || name == "lessthan" || name == "<") return py_compare(v, arg(0), "<") < 0;
  if (name == "le" || name == "<=") return py_compare(v, arg(0), "<=") <= 0;
  if (name == "gt" || name == "greaterthan" || name == ">") return py_compare(v, arg(0), ">") > 0;
  if (name == "ge" || name == ">=") return py_compare(v, arg(0), ">=") >= 0;
  if (name == "in") return py_contains(arg(0), v);
  if (name == "sameas") {
    const Value& o = arg(0);
    if (v.type != o.type) return false;
    if (v.is_list()) return v.list == o.list;
    if (v.is_dict()) return v.dict == o.dict;
    return py_equal(v, o);
  }
  if (name == "lower" || name == "upper") {
    if (!v.is_string()) return false;
    const std::string t = name == "lower" ? str_lower(v.s) : str_upper(v.s);
    return t == v.s && std::any_of(v.s.begin(), v.s.end(), [](char c) { return std::isalpha(static_cast<unsigned char>(c)); });
  }
  if (name == "escaped") return false;
  if (name == "filter") return v.is_string() && is_known_filter(v.s);
  if (name == "test") return v.is_string() && is_known_test(v.s);
  throw RenderError("No test named '" + name + "' found.");
}

bool is_known_filter(const std::string& name) {
  static const char* const names[] = {
      "abs", "attr", "batch", "capitalize", "center", "count", "d", "default", "dictsort", "e", "escape",
      "filesizeformat", "first", "float", "forceescape", "format", "groupby", "indent", "int", "items", "join",
      "last", "length", "list", "lower", "map", "max", "min", "pprint", "random", "reject", "rejectattr",
      "replace", "reverse", "round", "safe", "select", "selectattr", "slice", "sort", "string", "striptags",
      "sum", "title", "tojson", "trim", "truncate", "unique", "upper", "urlencode", "urlize", "wordcount",
      "wordwrap", "xmlattr"};
  return std::find(std::begin(names), std::end(names), name) != std::end(names);
}

bool is_known_test(const std::string& name) {
  static const char* const names[] = {
      "defined", "undefined", "none", "boolean", "true", "false", "string", "number", "integer", "float",
      "mapping", "iterable", "sequence", "callable", "odd", "even", "divisibleby", "eq", "equalto", "==", "ne",
      "!=", "lt", "lessthan", "<", "le", "<=", "gt", "greaterthan", ">", "ge", ">=", "in", "sameas", "lower",
      "upper", "escaped", "filter", "test"};
  return std::find(std::begin(names), std::end(names), name) != std::end(names);
}

// ---- globals ----

Value global_value(const std::string& name) {
  if (name == "range")
    return bound([](Args& a) {
      if (a.pos.empty() || a.pos.size() > 3) throw RenderError("range expected 1 to 3 arguments");
      int64_t start = 0, stop, step = 1;
      if (a.pos.size() == 1) {
        stop = a.pos[0].as_int();
      } else {
        start = a.pos[0].as_int();
        stop = a.pos[1].as_int();
        if (a.pos.size() == 3) step = a.pos[2].as_int();
      }
      if (step == 0) throw RenderError("range() arg 3 must not be zero");
      List out;
      for (int64_t k = start; step > 0 ? k < stop : k > stop;) {
        if (out.size() >= 100000)
          throw RenderError("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
        out.push_back(Value::integer(k));
        if (__builtin_add_overflow(k, step, &k)) break;  // past the last int64_t: past stop too
      }
      return Value::make_list(std::move(out));
    });
  if (name == "namespace" || name == "dict")
    return bound([name](Args& a) {
      Value d = Value::make_dict();
      d.is_namespace = name == "namespace";
      if (d.is_namespace) track_namespace(d.dict);
      for (const auto& p : a.pos) {
        if (p.is_dict()) {
          for (const auto& [k, v] : p.dict->items) d.dict->set(k, v);
        } else {
          for (const auto& pair : py_iterate(p)) {
            if (!pair.is_list() || pair.list->size() != 2) throw RenderError("dictionary update sequence element has wrong length");
            d.dict->set(dict_key((*pair.list)[0]), (*pair.list)[1]);
          }
        }
      }
      for (const auto& [k, v] : a.kw) d.dict->set(k, v);
      if (d.is_namespace)
        for (const auto& item : d.dict->items)
          if (!item.first.empty() && item.first[0] == '_')
            throw RenderError("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" +
                              item.first + "'. Please rename the attribute.");
      return d;
    });
  if (name == "raise_exception")
    return bound([](Args& a) -> Value {
      throw RenderError(a.pos.empty() ? std::string() : py_str(a.pos[0]));
    });
  if (name == "strftime_now")
    return bound([](Args& a) {
      if (a.pos.empty()) throw RenderError("strftime_now() missing 1 required positional argument: 'format'");
      const std::string format = py_str(a.pos[0]);
      const std::time_t now = std::time(nullptr);
      std::tm local{};
      localtime_r(&now, &local);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof buf, format.c_str(), &local);
      return Value::string(std::string(buf, n));
    });
  return Value::undefined("'" + name + "' is undefined");
}

}  // namespace kvpipe::jinja
