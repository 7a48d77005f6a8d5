#include "engine/grammar/json_schema.h"

#include "engine/grammar/regex_dfa.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>
#include <stdexcept>
#include <vector>

namespace kvpipe {
namespace {

using json = nlohmann::ordered_json;

constexpr int kFreeDepth = 3;
// A recursive $ref nests inside itself at most this many times.
constexpr int kRefDepth = 3;
constexpr size_t kMaxPattern = size_t{512} << 10;
// Numbers have at most 16 digits before the point; bounds stay where a double is exact.
constexpr int64_t kMaxWhole = 9999999999999999;
constexpr double kMaxBound = 1e15;

// Thrown where a schema would need a recursive $ref once more than kRefDepth allows: a
// place that can do without it (an optional property, an array that may be empty, another
// alternative) drops it; elsewhere it propagates, up to "recurses without an end".
// What oneOf's check of its alternatives may visit: the states of each one's automaton, and
// pairs of states of two of them.
constexpr int32_t kMaxOneOfStates = 20000;
constexpr size_t kMaxOneOfPairs = 200000;

struct TooDeep {
  std::string at;
};

const std::string kNull = "null";
const std::string kBoolean = "(true|false)";
const std::string kInteger = "-?(0|[1-9][0-9]{0,15})";
const std::string kNumber = "-?(0|[1-9][0-9]{0,15})(\\.[0-9]{1,16})?([eE][+-]?[0-9]{1,3})?";
// One character of a JSON string: anything but a quote, a backslash or a control character,
// or a short escape.
const std::string kStringChar = "([^\"\\\\\\x00-\\x1f]|\\\\[\"\\\\/bfnrt])";
const std::string kString = "\"" + kStringChar + "*\"";
// Strings of values a schema leaves free (and their keys): short, so that a sampled answer
// ends (a model left free rambles inside an open string), and of printable ASCII, which
// keeps the automaton of free JSON small (each character outside ASCII would add states
// for its continuation bytes at every position).
const std::string kFreeString = "\"([ !#-\\[\\]-~]|\\\\[\"\\\\/bfnrt]){0,32}\"";

std::string group(const std::vector<std::string>& alternatives) {
  std::string out = "(";
  for (size_t i = 0; i < alternatives.size(); ++i) out += (i ? "|" : "") + alternatives[i];
  return out + ")";
}

// Any JSON value nesting at most `depth` more levels.
std::string free_value(int depth) {
  std::vector<std::string> alts = {kFreeString, kNumber, kBoolean, kNull};
  if (depth > 0) {
    const std::string inner = free_value(depth - 1);
    alts.push_back("\\[(" + inner + "(, " + inner + ")*)?\\]");
    alts.push_back("\\{(" + kFreeString + ": " + inner + "(, " + kFreeString + ": " + inner + ")*)?\\}");
  }
  return group(alts);
}

// The literal `value` as json.dumps writes it (", " and ": " separators).
std::string dumps(const json& value) {
  if (value.is_array()) {
    std::string out = "[";
    for (size_t i = 0; i < value.size(); ++i) out += (i ? ", " : "") + dumps(value[i]);
    return out + "]";
  }
  if (value.is_object()) {
    std::string out = "{";
    bool first = true;
    for (const auto& [k, v] : value.items()) {
      out += (first ? "" : ", ") + json(k).dump() + ": " + dumps(v);
      first = false;
    }
    return out + "}";
  }
  return value.dump();
}

// Every digit string of the length of `lo` and `hi` between them (lo <= hi, leading zeros
// taken): digit by digit, the first digit's range whole where the rest may be anything.
std::string fixed_between(const std::string& lo, const std::string& hi) {
  const size_t n = lo.size();
  if (lo == hi) return lo;
  auto digits = [](char a, char b) { return a == b ? std::string(1, a) : std::string("[") + a + "-" + b + "]"; };
  const std::string any = n > 1 ? "[0-9]{" + std::to_string(n - 1) + "}" : "";
  if (lo[0] == hi[0]) return lo.substr(0, 1) + "(" + fixed_between(lo.substr(1), hi.substr(1)) + ")";
  const bool lo_whole = lo.find_first_not_of('0', 1) == std::string::npos;
  const bool hi_whole = hi.find_first_not_of('9', 1) == std::string::npos;
  std::vector<std::string> alts;
  const char first = lo_whole ? lo[0] : static_cast<char>(lo[0] + 1);
  const char last = hi_whole ? hi[0] : static_cast<char>(hi[0] - 1);
  if (!lo_whole) alts.push_back(lo.substr(0, 1) + "(" + fixed_between(lo.substr(1), std::string(n - 1, '9')) + ")");
  if (first <= last) alts.push_back(digits(first, last) + any);
  if (!hi_whole) alts.push_back(hi.substr(0, 1) + "(" + fixed_between(std::string(n - 1, '0'), hi.substr(1)) + ")");
  return group(alts);
}

// The whole numbers in [lo, hi] (0 <= lo <= hi) as JSON writes them: by number of digits.
std::string whole_between(int64_t lo, int64_t hi) {
  std::vector<std::string> alts;
  int64_t low_of_length = 0, top_of_length = 9;  // the numbers of one length of digits
  for (int length = 1; low_of_length <= hi; ++length) {
    const int64_t a = std::max(lo, low_of_length), b = std::min(hi, top_of_length);
    if (a <= b) alts.push_back(fixed_between(std::to_string(a), std::to_string(b)));
    low_of_length = top_of_length + 1;
    if (length == 18) break;
    top_of_length = top_of_length * 10 + 9;
  }
  return group(alts);
}

std::string repeat(const std::string& item, int64_t lo, int64_t hi) {
  return "(" + item + "){" + std::to_string(lo) + "," + (hi < 0 ? "" : std::to_string(hi)) + "}";
}

class Compiler {
 public:
  explicit Compiler(const json& root) : root_(root) {}

  // oneOf takes a value valid against exactly one alternative. Alternatives are written as
  // alternatives of the pattern, so a text two of them match would be valid against both: such
  // a schema is refused, naming a shortest such text, rather than answered with values oneOf
  // rules out.
  void exclusive(const std::vector<std::string>& alts, const std::vector<size_t>& places, const std::string& at) {
    if (alts.size() < 2) return;
    std::vector<RegexDfa> dfas;
    try {
      for (const std::string& a : alts) dfas.emplace_back(a, kMaxOneOfStates);
    } catch (const std::invalid_argument&) {
      fail(at, "alternatives too large to check that they exclude each other (anyOf takes either)");
    }
    for (size_t i = 0; i < dfas.size(); ++i)
      for (size_t j = i + 1; j < dfas.size(); ++j) {
        std::string text;
        const Overlap o = common_match(dfas[i], dfas[j], kMaxOneOfPairs, &text);
        const std::string which =
            "alternatives " + std::to_string(places[i]) + " and " + std::to_string(places[j]);
        if (o == Overlap::kSome) {
          if (text.size() > 60) text = text.substr(0, 57) + "...";
          fail(at, which + " both take " + json(text).dump(-1, ' ', false, json::error_handler_t::replace) +
                       ": oneOf needs alternatives that exclude each other (anyOf takes either)");
        }
        if (o == Overlap::kUnknown)
          fail(at, which + " are too large to check that they exclude each other (anyOf takes either)");
      }
  }

  std::string value(const json& s, const std::string& at) {
    if (s.is_boolean()) {
      if (!s.get<bool>()) fail(at, "false (no value is valid)");
      return free_value(kFreeDepth);
    }
    if (!s.is_object()) fail(at, "a schema must be an object or a boolean");
    for (const auto& [key, v] : s.items()) {
      static const std::set<std::string> known = {
          "type", "properties", "required", "additionalProperties", "enum", "const", "items", "minItems",
          "maxItems", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "minLength", "maxLength",
          "pattern", "format", "title", "description", "default", "examples", "$schema", "$id", "$comment",
          "deprecated", "readOnly", "writeOnly", "discriminator", "strict", "minimum", "maximum",
          "exclusiveMinimum", "exclusiveMaximum"};
      if (!known.count(key)) fail(join(at, key), "is not supported");
    }
    if (s.contains("$ref")) return ref(s, at);
    if (s.contains("const")) return regex_escape(dumps(s["const"]));
    if (s.contains("enum")) {
      const json& e = s["enum"];
      if (!e.is_array() || e.empty()) fail(join(at, "enum"), "must be a non-empty list");
      std::vector<std::string> alts;
      for (const json& v : e) alts.push_back(regex_escape(dumps(v)));
      return group(alts);
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (!s.contains(key)) continue;
      const json& list = s[key];
      if (!list.is_array() || list.empty()) fail(join(at, key), "must be a non-empty list of schemas");
      std::vector<std::string> alts;
      std::vector<size_t> kept;  // the alternatives' places in the list
      std::optional<TooDeep> deep;
      for (size_t i = 0; i < list.size(); ++i) {
        try {
          alts.push_back(value(list[i], join(at, key) + "[" + std::to_string(i) + "]"));
          kept.push_back(i);
        } catch (const TooDeep& d) {
          deep = d;  // this alternative needs more recursion: the others remain
        }
      }
      if (alts.empty()) throw *deep;
      if (std::string(key) == "oneOf") exclusive(alts, kept, join(at, key));
      return group(alts);
    }
    if (s.contains("allOf")) {
      const json& list = s["allOf"];
      if (!list.is_array() || list.size() != 1) fail(join(at, "allOf"), "is supported with one schema only");
      return value(list[0], join(at, "allOf") + "[0]");
    }
    if (!s.contains("type")) {
      if (s.contains("properties")) return object(s, at);
      if (s.contains("items")) return array(s, at);
      return free_value(kFreeDepth);
    }
    const json& type = s["type"];
    if (type.is_array()) {
      std::vector<std::string> alts;
      std::optional<TooDeep> deep;
      for (const json& t : type) {
        if (!t.is_string()) fail(join(at, "type"), "must be a string or a list of strings");
        try {
          alts.push_back(of_type(t.get<std::string>(), s, at));
        } catch (const TooDeep& d) {
          deep = d;
        }
      }
      if (alts.empty() && deep) throw *deep;
      if (alts.empty()) fail(join(at, "type"), "must not be empty");
      return group(alts);
    }
    if (!type.is_string()) fail(join(at, "type"), "must be a string or a list of strings");
    return of_type(type.get<std::string>(), s, at);
  }

 private:
  [[noreturn]] static void fail(const std::string& at, const std::string& what) {
    throw std::invalid_argument((at.empty() ? std::string("the schema") : at) + ": " + what);
  }
  static std::string join(const std::string& at, const std::string& key) { return at.empty() ? key : at + "." + key; }

  static int64_t count(const json& s, const char* key, const std::string& at, int64_t fallback) {
    if (!s.contains(key)) return fallback;
    const json& v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 1000)
      fail(join(at, key), "must be an integer in [0, 1000]");
    return v.get<int64_t>();
  }

  // A number's bounds: the tighter of minimum and exclusiveMinimum (a number, or draft 4's
  // boolean beside minimum), and the same above.
  struct Bounds {
    std::optional<double> lo, hi;
    bool lo_open = false, hi_open = false;
    std::string lo_key, hi_key;  // the keywords that set them
  };
  static Bounds bounds(const json& s, const std::string& at) {
    Bounds b;
    auto bound = [&](const char* key) -> std::optional<double> {
      if (!s.contains(key) || s[key].is_boolean()) return std::nullopt;
      const json& v = s[key];
      if (!v.is_number()) fail(join(at, key), "must be a number");
      const double x = v.get<double>();
      if (!(std::fabs(x) <= kMaxBound)) fail(join(at, key), "must be within 10^15 of 0");
      return x;
    };
    auto open = [&](const char* key) { return s.contains(key) && s[key].is_boolean() && s[key].get<bool>(); };
    auto tighter = [](std::optional<double>* at_most, bool* open_now, std::string* key_now, std::optional<double> x,
                      bool open_x, const char* key, bool lower) {
      if (!x) return;
      const bool better = !*at_most || (lower ? *x > **at_most : *x < **at_most) || (*x == **at_most && open_x);
      if (!better) return;
      *at_most = x;
      *open_now = open_x;
      *key_now = key;
    };
    tighter(&b.lo, &b.lo_open, &b.lo_key, bound("minimum"), open("exclusiveMinimum"), "minimum", true);
    tighter(&b.lo, &b.lo_open, &b.lo_key, bound("exclusiveMinimum"), true, "exclusiveMinimum", true);
    tighter(&b.hi, &b.hi_open, &b.hi_key, bound("maximum"), open("exclusiveMaximum"), "maximum", false);
    tighter(&b.hi, &b.hi_open, &b.hi_key, bound("exclusiveMaximum"), true, "exclusiveMaximum", false);
    return b;
  }

  static std::string integer(const json& s, const std::string& at) {
    const Bounds b = bounds(s, at);
    if (!b.lo && !b.hi) return kInteger;
    const int64_t lo = b.lo ? static_cast<int64_t>(b.lo_open ? std::floor(*b.lo) + 1 : std::ceil(*b.lo)) : -kMaxWhole;
    const int64_t hi = b.hi ? static_cast<int64_t>(b.hi_open ? std::ceil(*b.hi) - 1 : std::floor(*b.hi)) : kMaxWhole;
    if (lo > hi) fail(join(at, b.hi ? b.hi_key : b.lo_key), "leaves no integer");
    std::vector<std::string> alts;
    if (hi >= 0) alts.push_back(whole_between(std::max<int64_t>(lo, 0), hi));
    if (lo < 0) alts.push_back("-" + whole_between(std::max<int64_t>(-hi, 1), -lo));
    return group(alts);
  }

  // Bounded numbers are written without an exponent: the whole part bounded as integers are,
  // and the fraction where the whole part meets a bound.
  static std::string number(const json& s, const std::string& at) {
    const Bounds b = bounds(s, at);
    if (!b.lo && !b.hi) return kNumber;
    for (const auto& [x, key] : {std::make_pair(b.lo, b.lo_key), std::make_pair(b.hi, b.hi_key)})
      if (x && *x != std::floor(*x)) fail(join(at, key), "is supported on numbers as a whole number only");
    if (b.lo && b.hi && (*b.lo > *b.hi || (*b.lo == *b.hi && (b.lo_open || b.hi_open))))
      fail(join(at, b.hi_key), "leaves no number");
    std::vector<std::string> alts;
    // The values >= 0 from [a, b], and those below 0 as "-" and their size.
    if (!b.hi || *b.hi > 0 || !b.hi_open) {
      const bool below_zero = !b.lo || *b.lo < 0;
      const std::string part = non_negative(below_zero ? 0 : static_cast<int64_t>(*b.lo), !below_zero && b.lo_open,
                                            b.hi ? std::optional<int64_t>(static_cast<int64_t>(*b.hi)) : std::nullopt,
                                            b.hi_open);
      if (!part.empty()) alts.push_back(part);
    }
    if (!b.lo || *b.lo < 0) {
      const bool above_zero = !b.hi || *b.hi >= 0;  // then the size only has to exceed 0
      const std::string part =
          non_negative(above_zero ? 0 : static_cast<int64_t>(-*b.hi), above_zero || b.hi_open,
                       b.lo ? std::optional<int64_t>(static_cast<int64_t>(-*b.lo)) : std::nullopt, b.lo_open);
      if (!part.empty()) alts.push_back("-" + part);
    }
    if (alts.empty()) fail(join(at, b.hi ? b.hi_key : b.lo_key), "leaves no number");
    return group(alts);
  }

  // The numbers from a to b (whole, 0 <= a; no b: up to 16 digits), either end left out where
  // open; "" where there are none.
  static std::string non_negative(int64_t a, bool a_open, std::optional<int64_t> b, bool b_open) {
    const std::string any = "(\\.[0-9]{1,16})?", zero = "(\\.0{1,16})?", above = "\\.0{0,8}[1-9][0-9]{0,7}";
    if (b && a > *b) return "";
    if (b && a == *b) return a_open || b_open ? "" : std::to_string(a) + zero;
    std::vector<std::string> alts = {std::to_string(a) + (a_open ? above : any)};
    const int64_t top = b ? *b - 1 : kMaxWhole;
    if (a + 1 <= top) alts.push_back(whole_between(a + 1, top) + any);
    if (b && !b_open) alts.push_back(std::to_string(*b) + zero);
    return group(alts);
  }

  std::string of_type(const std::string& type, const json& s, const std::string& at) {
    if (type == "null") return kNull;
    if (type == "boolean") return kBoolean;
    if (type == "integer") return integer(s, at);
    if (type == "number") return number(s, at);
    if (type == "string") return string(s, at);
    if (type == "array") return array(s, at);
    if (type == "object") return object(s, at);
    fail(join(at, "type"), "unknown type \"" + type + "\"");
  }

  std::string string(const json& s, const std::string& at) {
    if (s.contains("format")) {
      const json& f = s["format"];
      if (!f.is_string()) fail(join(at, "format"), "must be a string");
      // A calendar date, as jsonschema's "date" checker (Python's date.fromisoformat) takes it:
      // years 0001-9999, each month's own days, February 29 only in leap years.
      const std::string year = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])";
      const std::string leap_year = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)";
      const std::string date = "(" + year +
                               "-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|"
                               "02-(0[1-9]|1[0-9]|2[0-8]))|" +
                               leap_year + "-02-29)";
      const std::string time = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])";
      const std::string name = f.get<std::string>();
      if (name == "date") return "\"" + date + "\"";
      if (name == "time") return "\"" + time + "\"";
      if (name == "date-time") return "\"" + date + "T" + time + "\"";
      if (name == "uuid") return "\"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\"";
      fail(join(at, "format"), "\"" + name + "\" is not supported (date, time, date-time, uuid)");
    }
    if (s.contains("pattern")) {
      const json& p = s["pattern"];
      if (!p.is_string()) fail(join(at, "pattern"), "must be a string");
      std::string body = p.get<std::string>();
      if (!body.empty() && body.front() == '^') body.erase(0, 1);
      if (!body.empty() && body.back() == '$' && (body.size() < 2 || body[body.size() - 2] != '\\')) body.pop_back();
      try {
        RegexDfa check(body);
      } catch (const std::invalid_argument& e) {
        fail(join(at, "pattern"), e.what());
      }
      return "\"(" + body + ")\"";
    }
    const int64_t lo = count(s, "minLength", at, 0), hi = count(s, "maxLength", at, -1);
    if (hi >= 0 && hi < lo) fail(join(at, "maxLength"), "is below minLength");
    if (lo == 0 && hi < 0) return kString;
    return "\"" + repeat(kStringChar, lo, hi) + "\"";
  }

  std::string array(const json& s, const std::string& at) {
    const int64_t lo = count(s, "minItems", at, 0), hi = count(s, "maxItems", at, -1);
    if (hi >= 0 && hi < lo) fail(join(at, "maxItems"), "is below minItems");
    if (hi == 0) return "\\[\\]";
    std::string item;
    try {
      item = s.contains("items") ? value(s["items"], join(at, "items")) : free_value(kFreeDepth - 1);
    } catch (const TooDeep&) {
      if (lo > 0) throw;
      return "\\[\\]";  // items that need more recursion: here the array stays empty
    }
    const std::string rest = repeat(", " + item, std::max<int64_t>(lo - 1, 0), hi < 0 ? -1 : hi - 1);
    if (lo == 0) return "\\[(" + item + rest + ")?\\]";
    return "\\[" + item + rest + "\\]";
  }

  std::string object(const json& s, const std::string& at) {
    if (s.contains("additionalProperties")) {
      const json& extra = s["additionalProperties"];
      if (!extra.is_boolean() && !extra.is_object()) fail(join(at, "additionalProperties"), "must be a boolean or a schema");
    }
    if (!s.contains("properties")) {
      if (s.contains("required") && !s["required"].empty()) fail(join(at, "required"), "needs properties");
      const bool closed = s.contains("additionalProperties") && s["additionalProperties"] == false;
      if (closed) return "\\{\\}";
      const std::string v = s.contains("additionalProperties") && s["additionalProperties"].is_object()
                                ? value(s["additionalProperties"], join(at, "additionalProperties"))
                                : free_value(kFreeDepth - 1);
      return "\\{(" + kFreeString + ": " + v + "(, " + kFreeString + ": " + v + ")*)?\\}";
    }
    const json& props = s["properties"];
    if (!props.is_object()) fail(join(at, "properties"), "must be an object");
    std::set<std::string> required;
    if (s.contains("required")) {
      const json& r = s["required"];
      if (!r.is_array()) fail(join(at, "required"), "must be a list of property names");
      for (const json& name : r) {
        if (!name.is_string() || !props.contains(name.get<std::string>()))
          fail(join(at, "required"), "names " + name.dump() + ", which is not among the properties");
        required.insert(name.get<std::string>());
      }
    }
    struct Property {
      std::string regex;
      bool required;
    };
    std::vector<Property> list;
    for (const auto& [name, sub] : props.items()) {
      const bool needed = required.count(name) > 0;
      try {
        list.push_back({regex_escape(json(name).dump()) + ": " + value(sub, join(join(at, "properties"), name)), needed});
      } catch (const TooDeep&) {
        if (needed) throw;  // an optional property that needs more recursion is left out here
      }
    }
    // After the first property written, each later one is ", P" (or optional); before it,
    // one alternative per property that can come first (the first required one ends them).
    auto after = [&](size_t from) {
      std::string out;
      for (size_t i = from; i < list.size(); ++i)
        out += list[i].required ? ", " + list[i].regex : "(, " + list[i].regex + ")?";
      return out;
    };
    std::vector<std::string> firsts;
    bool all_optional = true;
    for (size_t j = 0; j < list.size(); ++j) {
      firsts.push_back(list[j].regex + after(j + 1));
      if (list[j].required) {
        all_optional = false;
        break;
      }
    }
    if (firsts.empty()) return "\\{\\}";
    const std::string body = group(firsts);
    return all_optional ? "\\{" + body + "?\\}" : "\\{" + body + "\\}";
  }

  std::string ref(const json& s, const std::string& at) {
    const json& r = s["$ref"];
    if (!r.is_string()) fail(join(at, "$ref"), "must be a string");
    const std::string target = r.get<std::string>();
    if (std::count(stack_.begin(), stack_.end(), target) >= kRefDepth) throw TooDeep{join(at, "$ref")};
    const json* node = nullptr;
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      const std::string p = prefix;
      if (target.rfind(p, 0) != 0) continue;
      const std::string section = p.substr(2, p.size() - 3);
      const std::string name = target.substr(p.size());
      if (root_.is_object() && root_.contains(section) && root_[section].is_object() && root_[section].contains(name))
        node = &root_[section][name];
    }
    if (node == nullptr) fail(join(at, "$ref"), "\"" + target + "\" is not a schema under #/$defs or #/definitions");
    if (s.size() > 1)
      for (const auto& [key, v] : s.items())
        if (key != "$ref" && key != "title" && key != "description" && key != "default" && key != "$defs" &&
            key != "definitions")
          fail(join(at, key), "beside $ref is not supported");
    stack_.push_back(target);
    std::string out;
    try {
      out = value(*node, target.substr(2));
    } catch (...) {
      stack_.pop_back();
      throw;
    }
    stack_.pop_back();
    if (out.size() > kMaxPattern)
      fail(join(at, "$ref"), "\"" + target + "\" makes the schema too large once its recursion is unrolled to depth " +
                                 std::to_string(kRefDepth));
    return out;
  }

  const json& root_;
  std::vector<std::string> stack_;
};

}  // namespace

std::string json_schema_regex(const nlohmann::ordered_json& schema) {
  try {
    return Compiler(schema).value(schema, "");
  } catch (const TooDeep& d) {
    throw std::invalid_argument(d.at + ": recurses without an end (every answer would need it nested more than " +
                                std::to_string(kRefDepth) + " levels deep)");
  }
}

std::string json_object_regex() {
  const std::string v = free_value(kFreeDepth - 1);
  return "\\{(" + kFreeString + ": " + v + "(, " + kFreeString + ": " + v + ")*)?\\}";
}

}  // namespace kvpipe
