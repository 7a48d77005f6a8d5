// jinja::Value: the dynamic value of the chat-template interpreter (engine/text/chat_template.h),
// with the Python semantics jinja2 gives its values: truthiness, equality and ordering,
// arithmetic on ints and floats, str() and repr() formatting, json.dumps as transformers'
// `tojson` calls it, and jinja2's default Undefined.
//
// Guarantees: lists and dicts have reference semantics (a copy shares the container, as Python
// objects do) and dicts keep insertion order; str() of a value is byte for byte what Python
// prints for the same value (floats in shortest round-trip form, `True`, `None`, `['a', 1]`);
// every operation that Python or jinja2 rejects throws RenderError with a Python-like message.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kvpipe::jinja {

// A failure while rendering; the interpreter adds the template name and line.
class RenderError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What one render may build. jinja2 bounds range() alone (MAX_RANGE) and leaves the rest to the
// machine; a template comes with a model file, so kvpipe bounds what it can grow to as well:
// any string (the output included) and any list, and the statements one render executes.
// Real chat templates stay far below each: 16 MiB of text is some four million tokens.
constexpr size_t kMaxStringBytes = size_t{1} << 24;
constexpr size_t kMaxListItems = size_t{1} << 20;
constexpr uint64_t kMaxRenderSteps = 1'000'000;

// Bytes of strings a render may copy in all (each use of a variable copies its value): a
// loop over one large string would otherwise run for hours within the bounds above.
constexpr uint64_t kMaxCopiedBytes = uint64_t{1} << 28;

// Throws RenderError when a string of `bytes` would pass kMaxStringBytes.
void check_string_size(size_t bytes);

// Counts `bytes` copied against kMaxCopiedBytes while a RenderScope lives on this thread.
void charge_copy(size_t bytes);

// A value's string: a std::string whose copies are charged to the render (charge_copy).
class TemplateString : public std::string {
 public:
  TemplateString() = default;
  TemplateString(std::string s) : std::string(std::move(s)) {}  // NOLINT: implicit, as std::string
  TemplateString(const TemplateString& o) : std::string(o) { charge_copy(size()); }
  TemplateString(TemplateString&&) noexcept = default;
  TemplateString& operator=(const TemplateString& o) {
    charge_copy(o.size());
    std::string::operator=(o);
    return *this;
  }
  TemplateString& operator=(TemplateString&&) noexcept = default;
  TemplateString& operator=(std::string s) {
    std::string::operator=(std::move(s));
    return *this;
  }
  const std::string& str() const { return *this; }
};

struct Value;
using List = std::vector<Value>;

// Keys are strings as JSON objects have them; a template's dict literal may use other scalars
// (`{0: 'a'}`), which dict_key() encodes so that 0 and '0' stay distinct keys.
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(const std::string& key) const;
  Value* find(const std::string& key);
  void set(const std::string& key, Value v);
};

// Call arguments: positional, then keyword in call order.
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  const Value* kwarg(const std::string& name) const;
  // The argument at `index` or called `name`, or nullptr.
  const Value* get(size_t index, const std::string& name) const;
};
using Function = std::function<Value(Args&)>;

struct Value {
  enum class Type { Undefined, None, Bool, Int, Float, String, List, Dict, Function };
  Type type = Type::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  // The string of a String; the error hint of an Undefined ("'x' is undefined").
  TemplateString s;
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  std::shared_ptr<Function> fn;
  bool is_tuple = false;      // a List printed as (a, b)
  bool is_generator = false;  // a List standing for a Python generator: single pass, no len()
  bool is_namespace = false;  // a Dict whose attributes templates may assign
  bool is_safe = false;       // a String that is markupsafe.Markup (|safe, |escape)

  Value() = default;
  static Value undefined(std::string hint);
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value number(double v);
  static Value string(std::string v);
  static Value make_list(List items = {});
  static Value make_tuple(List items);
  static Value make_dict();
  static Value function(Function fn);

  bool is_undefined() const { return type == Type::Undefined; }
  bool is_none() const { return type == Type::None; }
  bool is_string() const { return type == Type::String; }
  bool is_list() const { return type == Type::List; }
  bool is_dict() const { return type == Type::Dict; }
  bool is_number() const { return type == Type::Int || type == Type::Float || type == Type::Bool; }
  bool is_integral() const { return type == Type::Int || type == Type::Bool; }
  double as_double() const;
  int64_t as_int() const;  // of an Int or Bool

  bool truthy() const;
  // Raises the UndefinedError of an Undefined; a no-op otherwise.
  void require_defined() const;
  // Python's type name, as error messages print it ("str", "dict", "NoneType").
  std::string type_name() const;
};

// Whether `v` is `dict` or holds it at any depth. Namespaces are the only containers a
// template can change after making them, so refusing to store a namespace inside itself keeps
// every value acyclic: printing, comparing and freeing values never loop.
bool holds(const Value& v, const Dict* dict);

// What one render owns, for as long as a RenderScope lives on this thread: the bytes its
// values copied (charge_copy), and its namespaces, emptied when it ends: a namespace may still
// reach itself through a bound method it holds (`ns.f = d.get` where d holds ns), a cycle that
// reference counting alone would never free.
void track_namespace(const std::shared_ptr<Dict>& dict);
class RenderScope {
 public:
  RenderScope();
  ~RenderScope();
  RenderScope(const RenderScope&) = delete;
  RenderScope& operator=(const RenderScope&) = delete;

 private:
  friend void track_namespace(const std::shared_ptr<Dict>& dict);
  friend void charge_copy(size_t bytes);
  std::vector<std::weak_ptr<Dict>> namespaces_;
  uint64_t copied_bytes_ = 0;
  RenderScope* outer_;
};

// The Dict key of a value, and the value a Dict key stands for.
std::string dict_key(const Value& key);
Value key_value(const std::string& key);

// A generator over `items`, as jinja2's map, select, selectattr, unique, ... filters return.
Value make_generator(List items);

// Conversions between the template's values and JSON (the render context).
Value from_json(const nlohmann::ordered_json& j);

// Python str() and repr().
std::string py_str(const Value& v);
std::string py_repr(const Value& v);
std::string py_float_repr(double v);
std::string py_string_repr(const std::string& s);

// json.dumps(v, ensure_ascii, indent, separators, sort_keys); indent < 0 is None, and
// `indent_string` (when not empty) is a string indent.
struct JsonOptions {
  bool ensure_ascii = false;
  int indent = -1;
  std::string indent_string;
  bool has_separators = false;
  std::string item_separator, key_separator;
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonOptions& options);

// markupsafe.escape of a str: & < > " ' as HTML entities.
std::string html_escape(const std::string& s);

// Python operators.
bool py_equal(const Value& a, const Value& b);
// <0, 0, >0 as Python orders a and b; throws RenderError where Python raises TypeError.
int py_compare(const Value& a, const Value& b, const char* op);
bool py_contains(const Value& container, const Value& item);
Value py_binary(const std::string& op, const Value& a, const Value& b);
Value py_negate(const Value& v);
// Python len(); throws for types without one.
size_t py_len(const Value& v);
// The items a for loop (or list()) walks: list items, dict keys, string characters; walking a
// generator consumes it.
List py_iterate(const Value& v);

// UTF-8 helpers: code points in and out, so that string length, indexing and slicing count
// characters as Python does.
std::u32string utf8_decode(const std::string& s);
std::string utf8_encode(const std::u32string& s);
bool py_isspace(char32_t c);

}  // namespace kvpipe::jinja
