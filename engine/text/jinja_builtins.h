// The library of the chat-template interpreter: attribute and item access with jinja2's
// sandbox rules, the Python str/list/dict methods templates call, jinja2's filters and tests,
// and the globals transformers defines (range, namespace, dict, raise_exception,
// strftime_now).
//
// Guarantees: each function behaves as its jinja2 / Python counterpart in
// ImmutableSandboxedEnvironment: a missing attribute or key is an Undefined naming what was
// missing, methods that mutate a list or dict are refused as unsafe, tojson is transformers'
// json.dumps(ensure_ascii=False) override; an unknown filter or test, a wrong argument, or a
// Python TypeError throws RenderError.
#pragma once

#include <string>

#include "engine/text/jinja_value.h"

namespace kvpipe::jinja {

// environment.getattr(obj, name): a method or attribute first, then obj[name].
Value get_attr(const Value& obj, const std::string& name);
// environment.getitem(obj, key): obj[key] first, then the attribute of that name.
Value get_item(const Value& obj, const Value& key);
// obj[start:stop:step]; absent parts are Undefined.
Value get_slice(const Value& obj, const Value& start, const Value& stop, const Value& step);
// Calls a function value; Undefined raises its error, anything else is not callable.
Value call_value(const Value& fn, Args& args);

Value apply_filter(const std::string& name, const Value& value, Args& args);
bool apply_test(const std::string& name, const Value& value, Args& args);

// Whether jinja2 knows the filter or test: an unknown one fails when the template is compiled.
bool is_known_filter(const std::string& name);
bool is_known_test(const std::string& name);

// A global function (range, namespace, dict, raise_exception, strftime_now), or Undefined.
Value global_value(const std::string& name);

}  // namespace kvpipe::jinja
