#include "launch/serve/tool_calls.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <functional>

namespace kvpipe {

namespace {

using ojson = nlohmann::ordered_json;

const std::string kHermesOpen = "<tool_call>";
const std::string kHermesClose = "</tool_call>";
const std::string kMistralMarker = "[TOOL_CALLS]";
const std::string kMistralArgs = "[ARGS]";       // v11+: between a call's name and arguments
const std::string kMistralCallId = "[CALL_ID]";  // v13: an id the model writes before [ARGS]
const std::string kPythonTag = "<|python_tag|>";

const ojson* member(const ojson& o, const char* key) {
  const auto it = o.find(key);
  return it == o.end() || it->is_null() ? nullptr : &*it;
}

// OpenAI's rule for function names.
bool valid_function_name(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isalnum(c) || c == '_' || c == '-'; });
}

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

size_t skip_space(const std::string& s, size_t i) {
  while (i < s.size() && is_space(s[i])) ++i;
  return i;
}

bool all_space(const std::string& s, size_t from = 0) { return skip_space(s, from) == s.size(); }

// Where the object or list that opens at s[begin] ends (one past its closing bracket), or
// npos when it does not close: brackets balanced outside strings. Only finds the extent;
// nlohmann parses it.
size_t json_value_end(const std::string& s, size_t begin) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = begin; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      if (--depth == 0) return i + 1;
      if (depth < 0) return std::string::npos;
    }
  }
  return std::string::npos;
}

// The longest end of `text` that is the start of `marker` (it may still become one).
size_t marker_prefix_at_end(const std::string& text, const std::string& marker) {
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n)
    if (text.compare(text.size() - n, n, marker, 0, n) == 0) return n;
  return 0;
}

// A call object ({"name", "arguments" | "parameters"}) naming one of `names`, or false.
bool call_of(const ojson& o, const std::vector<std::string>& names, ToolCall* out) {
  if (!o.is_object()) return false;
  const ojson* name = member(o, "name");
  if (!name || !name->is_string()) return false;
  if (std::find(names.begin(), names.end(), name->get<std::string>()) == names.end()) return false;
  const ojson* args = member(o, "arguments");
  if (!args) args = member(o, "parameters");
  ojson parsed;
  if (!args) {
    parsed = ojson::object();
  } else if (args->is_string()) {
    parsed = ojson::parse(args->get<std::string>(), nullptr, false);
  } else {
    parsed = *args;
  }
  if (!parsed.is_object()) return false;
  out->name = name->get<std::string>();
  out->arguments = parsed.dump();
  return true;
}

ojson parse_or_discard(const std::string& text) { return ojson::parse(text, nullptr, false); }

// The calls of `text` in `syntax` (text starts at the call syntax), or false.
bool calls_in(const std::string& text, ToolChoice::Kind kind, ToolCallSyntax syntax,
              const std::vector<std::string>& names, std::vector<ToolCall>* calls, std::string* trailing) {
  auto add_list = [&](const ojson& list) {
    if (list.is_object()) {
      ToolCall c;
      if (!call_of(list, names, &c)) return false;
      calls->push_back(c);
      return true;
    }
    if (!list.is_array() || list.empty()) return false;
    for (const ojson& o : list) {
      ToolCall c;
      if (!call_of(o, names, &c)) return false;
      calls->push_back(c);
    }
    return true;
  };
  if (kind == ToolChoice::Kind::kRequired) {
    const ojson list = parse_or_discard(text);
    return list.is_array() && add_list(list);
  }
  switch (syntax) {
    case ToolCallSyntax::kHermes: {
      size_t at = 0;
      while (at < text.size() && text.compare(at, kHermesOpen.size(), kHermesOpen) == 0) {
        const size_t body = at + kHermesOpen.size();
        size_t close = text.find(kHermesClose, body);
        const bool closed = close != std::string::npos;
        if (!closed) close = text.size();  // the last call may lose its closing tag to a stop
        ToolCall c;
        if (!call_of(parse_or_discard(text.substr(body, close - body)), names, &c)) return false;
        calls->push_back(c);
        at = skip_space(text, closed ? close + kHermesClose.size() : close);
      }
      *trailing = text.substr(at);
      return !calls->empty();
    }
    case ToolCallSyntax::kMistral: {
      if (text.compare(0, kMistralMarker.size(), kMistralMarker) != 0) return false;
      const size_t first = skip_space(text, kMistralMarker.size());
      if (first < text.size() && (text[first] == '[' || text[first] == '{'))
        return add_list(parse_or_discard(text.substr(kMistralMarker.size())));  // v3: a JSON list
      // v11+: [TOOL_CALLS]name[ARGS]{...} per call (v13: name[CALL_ID]id[ARGS]{...}).
      size_t at = 0;
      while (text.compare(at, kMistralMarker.size(), kMistralMarker) == 0) {
        const size_t name_at = at + kMistralMarker.size();
        const size_t args_at = text.find(kMistralArgs, name_at);
        if (args_at == std::string::npos) return false;
        std::string name = text.substr(name_at, args_at - name_at);
        if (const size_t id = name.find(kMistralCallId); id != std::string::npos) name.resize(id);
        while (!name.empty() && is_space(name.back())) name.pop_back();
        name.erase(0, skip_space(name, 0));
        const size_t body = skip_space(text, args_at + kMistralArgs.size());
        if (body >= text.size() || text[body] != '{') return false;
        const size_t end = json_value_end(text, body);
        if (end == std::string::npos) return false;
        const ojson args = parse_or_discard(text.substr(body, end - body));
        ToolCall c;
        if (!args.is_object() || !call_of(ojson{{"name", name}, {"arguments", args}}, names, &c)) return false;
        calls->push_back(c);
        at = skip_space(text, end);
      }
      *trailing = text.substr(at);
      return !calls->empty();
    }
    case ToolCallSyntax::kLlama3Json: {
      size_t at = skip_space(text, 0);
      if (text.compare(at, kPythonTag.size(), kPythonTag) == 0) at += kPythonTag.size();
      for (;;) {
        at = skip_space(text, at);
        if (at >= text.size() || text[at] != '{') return false;
        const size_t end = json_value_end(text, at);
        if (end == std::string::npos) return false;
        ToolCall c;
        if (!call_of(parse_or_discard(text.substr(at, end - at)), names, &c)) return false;
        calls->push_back(c);
        at = skip_space(text, end);
        if (at == text.size()) return true;
        if (text[at] != ';') return false;
        ++at;
      }
    }
    case ToolCallSyntax::kNone: break;
  }
  return false;
}

// Moves a function's $defs (and definitions) into `root`'s, as $ref resolves from the root
// of the whole schema once the function's schema sits inside it.
void hoist_definitions(ojson& params, ojson& root, const std::string& where) {
  for (const char* key : {"$defs", "definitions"}) {
    const auto it = params.find(key);
    if (it == params.end()) continue;
    if (!it->is_object()) throw ToolRequestError(where + "." + key, "must be an object of schemas");
    for (const auto& [name, schema] : it->items()) {
      ojson& slot = root[key][name];
      if (!slot.is_null() && slot != schema)
        throw ToolRequestError(where + "." + key + "." + name,
                               "differs from another function's definition of the same name");
      slot = schema;
    }
    params.erase(it);
  }
}

}  // namespace

ToolCallSyntax tool_call_syntax_named(const std::string& name) {
  if (name == "hermes") return ToolCallSyntax::kHermes;
  if (name == "llama3_json") return ToolCallSyntax::kLlama3Json;
  if (name == "mistral") return ToolCallSyntax::kMistral;
  throw std::invalid_argument("unknown tool-call parser \"" + name + "\" (hermes, llama3_json, mistral)");
}

const char* tool_call_syntax_name(ToolCallSyntax syntax) {
  switch (syntax) {
    case ToolCallSyntax::kHermes: return "hermes";
    case ToolCallSyntax::kLlama3Json: return "llama3_json";
    case ToolCallSyntax::kMistral: return "mistral";
    case ToolCallSyntax::kNone: break;
  }
  return "none";
}

ToolCallSyntax tool_call_syntax_of_template(const std::string& source) {
  if (source.find(kHermesOpen) != std::string::npos) return ToolCallSyntax::kHermes;
  if (source.find(kMistralMarker) != std::string::npos) return ToolCallSyntax::kMistral;
  if (source.find(kPythonTag) != std::string::npos) return ToolCallSyntax::kLlama3Json;
  return ToolCallSyntax::kNone;
}

bool template_renders_tools(const std::string& source) { return source.find("tools") != std::string::npos; }

bool is_tool_call_marker(ToolCallSyntax syntax, const std::string& piece) {
  switch (syntax) {
    case ToolCallSyntax::kHermes: return piece == kHermesOpen || piece == kHermesClose;
    case ToolCallSyntax::kMistral: return piece == kMistralMarker || piece == kMistralArgs || piece == kMistralCallId;
    case ToolCallSyntax::kLlama3Json: return piece == kPythonTag;
    case ToolCallSyntax::kNone: break;
  }
  return false;
}

ToolRequest parse_tool_request(const ojson& body, ToolCallSyntax syntax, bool renders_tools) {
  using Kind = ToolChoice::Kind;
  ToolRequest r;
  if (const ojson* p = member(body, "parallel_tool_calls")) {
    if (!p->is_boolean()) throw ToolRequestError("parallel_tool_calls", "must be true or false");
    r.choice.parallel = p->get<bool>();
  }
  const ojson* tools = member(body, "tools");
  if (tools && (!tools->is_array() || tools->size() > 128))
    throw ToolRequestError("tools", "must be a list of at most 128 tools");
  const bool has_tools = tools && !tools->empty();
  std::vector<ojson> parameters;
  if (has_tools) {
    for (size_t i = 0; i < tools->size(); ++i) {
      const ojson& tool = (*tools)[i];
      const std::string where = "tools[" + std::to_string(i) + "]";
      if (!tool.is_object()) throw ToolRequestError(where, "must be an object {type, function}");
      for (const auto& [k, v] : tool.items())
        if (k != "type" && k != "function")
          throw ToolRequestError(where + "." + k, "is not supported by kvpipe (type, function)");
      const ojson* type = member(tool, "type");
      if (!type || *type != "function")
        throw ToolRequestError(where + ".type", "must be \"function\" (the only kind of tool kvpipe calls)");
      const ojson* fn = member(tool, "function");
      if (!fn || !fn->is_object()) throw ToolRequestError(where + ".function", "must be an object {name, description, parameters}");
      for (const auto& [k, v] : fn->items())
        if (k != "name" && k != "description" && k != "parameters" && k != "strict")
          throw ToolRequestError(where + ".function." + k,
                                 "is not supported by kvpipe (name, description, parameters, strict)");
      const ojson* name = member(*fn, "name");
      if (!name || !name->is_string() || !valid_function_name(name->get<std::string>()))
        throw ToolRequestError(where + ".function.name", "must be 1 to 64 letters, digits, '_' or '-'");
      if (std::find(r.choice.names.begin(), r.choice.names.end(), name->get<std::string>()) != r.choice.names.end())
        throw ToolRequestError(where + ".function.name", "\"" + name->get<std::string>() + "\" names two tools");
      if (const ojson* d = member(*fn, "description"); d && !d->is_string())
        throw ToolRequestError(where + ".function.description", "must be a string");
      if (const ojson* s = member(*fn, "strict"); s && !s->is_boolean())
        throw ToolRequestError(where + ".function.strict", "must be true or false");
      const ojson* params = member(*fn, "parameters");
      if (params && !params->is_object())
        throw ToolRequestError(where + ".function.parameters", "must be a JSON Schema (an object)");
      r.choice.names.push_back(name->get<std::string>());
      // No parameters: the function takes none, so its arguments are {}.
      parameters.push_back(params ? *params : ojson{{"type", "object"}, {"properties", ojson::object()}});
    }
    r.tools = std::make_shared<const ojson>(*tools);
  }

  const ojson* choice = member(body, "tool_choice");
  const char* kChoices = "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}";
  if (!choice) {
    r.choice.kind = has_tools ? Kind::kAuto : Kind::kNone;
  } else if (choice->is_string()) {
    const std::string c = choice->get<std::string>();
    if (c == "none") r.choice.kind = Kind::kNone;
    else if (c == "auto") r.choice.kind = has_tools ? Kind::kAuto : Kind::kNone;
    else if (c == "required") r.choice.kind = Kind::kRequired;
    else throw ToolRequestError("tool_choice", kChoices);
  } else if (choice->is_object()) {
    for (const auto& [k, v] : choice->items())
      if (k != "type" && k != "function") throw ToolRequestError("tool_choice." + k, "is not supported (type, function)");
    const ojson* type = member(*choice, "type");
    const ojson* fn = member(*choice, "function");
    const ojson* name = fn && fn->is_object() ? member(*fn, "name") : nullptr;
    if (!type || *type != "function" || !name || !name->is_string()) throw ToolRequestError("tool_choice", kChoices);
    r.choice.kind = Kind::kNamed;
    r.choice.function = name->get<std::string>();
    if (std::find(r.choice.names.begin(), r.choice.names.end(), r.choice.function) == r.choice.names.end())
      throw ToolRequestError("tool_choice.function.name", "\"" + r.choice.function + "\" is not one of the request's tools");
  } else {
    throw ToolRequestError("tool_choice", kChoices);
  }
  if ((r.choice.kind == Kind::kRequired || r.choice.kind == Kind::kNamed) && !has_tools)
    throw ToolRequestError("tool_choice", "asks for a call, and the request has no tools");
  if (r.choice.kind == Kind::kNone) return r;

  if (!renders_tools)
    throw ToolRequestError("tools", "the chat template does not show the model its tools (start the server with "
                                    "--chat-template FILE, a template that renders `tools`)");
  if (r.choice.kind == Kind::kAuto && syntax == ToolCallSyntax::kNone)
    throw ToolRequestError("tool_choice",
                           "\"auto\" reads tool calls in the syntax the chat template teaches, and kvpipe knows none "
                           "for this template (start the server with --tool-call-parser hermes|llama3_json|mistral, "
                           "or ask for \"required\" or a named function)");
  r.choice.syntax = syntax;

  if (r.choice.kind == Kind::kNamed) {
    const size_t i = std::find(r.choice.names.begin(), r.choice.names.end(), r.choice.function) - r.choice.names.begin();
    r.schema = std::make_shared<const ojson>(parameters[i]);
  } else if (r.choice.kind == Kind::kRequired) {
    // vLLM's shape for required: a list of calls, each naming its function.
    ojson root{{"type", "array"}, {"minItems", 1}};
    if (!r.choice.parallel) root["maxItems"] = 1;
    ojson alternatives = ojson::array();
    for (size_t i = 0; i < parameters.size(); ++i) {
      ojson params = parameters[i];
      hoist_definitions(params, root, "tools[" + std::to_string(i) + "].function.parameters");
      alternatives.push_back({{"type", "object"},
                              {"properties", {{"name", {{"const", r.choice.names[i]}}}, {"parameters", params}}},
                              {"required", {"name", "parameters"}},
                              {"additionalProperties", false}});
    }
    root["items"] = alternatives.size() == 1 ? alternatives[0] : ojson{{"anyOf", alternatives}};
    r.schema = std::make_shared<const ojson>(std::move(root));
  }
  return r;
}

ojson template_tool_calls(const ojson& calls, const std::string& where) {
  if (!calls.is_array()) throw ToolRequestError(where, "must be a list of tool calls");
  ojson out = ojson::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    const std::string at = where + "[" + std::to_string(i) + "]";
    const ojson& call = calls[i];
    if (!call.is_object()) throw ToolRequestError(at, "must be an object {id, type, function}");
    const ojson* fn = member(call, "function");
    if (!fn || !fn->is_object()) throw ToolRequestError(at + ".function", "must be an object {name, arguments}");
    const ojson* name = member(*fn, "name");
    if (!name || !name->is_string()) throw ToolRequestError(at + ".function.name", "must be a string");
    if (const ojson* id = member(call, "id"); id && !id->is_string()) throw ToolRequestError(at + ".id", "must be a string");
    ojson copy = call;
    const ojson* args = member(*fn, "arguments");
    ojson parsed = ojson::object();
    if (args && args->is_string()) {
      parsed = ojson::parse(args->get<std::string>(), nullptr, false);
      if (!parsed.is_object()) throw ToolRequestError(at + ".function.arguments", "must be the JSON text of an object");
    } else if (args) {
      if (!args->is_object()) throw ToolRequestError(at + ".function.arguments", "must be the JSON text of an object");
      parsed = *args;
    }
    copy["function"]["arguments"] = parsed;
    if (!copy.contains("type")) copy["type"] = "function";
    out.push_back(copy);
  }
  return out;
}

ToolCallStream::ToolCallStream(const ToolChoice& choice, const std::string& id_seed)
    : choice_(choice), id_seed_(id_seed) {}

std::string ToolCallStream::call_id(size_t index) const {
  const std::hash<std::string> h;
  const size_t a = h(id_seed_ + "#" + std::to_string(index));
  const size_t b = h(std::to_string(a) + id_seed_);
  char id[40];
  std::snprintf(id, sizeof id, "call_%016zx%08zx", a, b & 0xffffffffu);
  return id;
}

void ToolCallStream::read_calls(const std::string& text, Update& out) {
  std::vector<ToolCall> calls;
  std::string trailing;
  if (!calls_in(text, choice_.kind, choice_.syntax, choice_.names, &calls, &trailing)) {
    content_ += text;
    out.content += text;
    return;
  }
  if (!choice_.parallel && calls.size() > 1) calls.resize(1);
  for (ToolCall& c : calls) {
    c.id = call_id(calls_.size());
    out.calls.push_back({static_cast<int>(calls_.size()), c.id, c.name, c.arguments});
    calls_.push_back(c);
  }
  if (!all_space(trailing)) {
    content_ += trailing;
    out.content += trailing;
  }
}

ToolCallStream::Update ToolCallStream::push(const std::string& text, const std::string& marker) {
  using Kind = ToolChoice::Kind;
  Update out;
  auto release = [&](size_t n) {
    out.content += held_.substr(0, n);
    content_ += held_.substr(0, n);
    held_.erase(0, n);
  };
  switch (choice_.kind) {
    case Kind::kNone:
      held_ += text;
      release(held_.size());
      return out;
    case Kind::kNamed:
      // The whole output is the function's arguments: they stream as they come.
      if (text.empty()) return out;
      if (calls_.empty()) {
        calls_.push_back({call_id(0), choice_.function, ""});
        out.calls.push_back({0, calls_[0].id, calls_[0].name, ""});
      }
      calls_[0].arguments += text;
      if (out.calls.empty()) out.calls.push_back({0, "", "", text});
      else out.calls[0].arguments = text;
      return out;
    case Kind::kRequired:
      held_ += text;
      return out;
    case Kind::kAuto: break;
  }
  held_ += text;
  held_ += marker;
  if (in_calls_) return out;
  switch (choice_.syntax) {
    case ToolCallSyntax::kHermes:
    case ToolCallSyntax::kMistral: {
      const std::string& open = choice_.syntax == ToolCallSyntax::kHermes ? kHermesOpen : kMistralMarker;
      const size_t at = held_.find(open);
      if (at != std::string::npos) {
        release(at);
        in_calls_ = true;
      } else {
        release(held_.size() - marker_prefix_at_end(held_, open));
      }
      break;
    }
    case ToolCallSyntax::kLlama3Json:
      if (!decided_) {
        // A Llama 3 call is the whole output: it opens with '{' or <|python_tag|>.
        const size_t first = skip_space(held_, 0);
        if (first == held_.size()) return out;
        const std::string rest = held_.substr(first);
        if (rest[0] == '{' || rest.compare(0, kPythonTag.size(), kPythonTag) == 0) {
          decided_ = in_calls_ = true;
          return out;
        }
        if (rest.size() < kPythonTag.size() && kPythonTag.compare(0, rest.size(), rest) == 0) return out;
        decided_ = true;
      }
      release(held_.size());
      break;
    case ToolCallSyntax::kNone:
      release(held_.size());
      break;
  }
  return out;
}

ToolCallStream::Update ToolCallStream::finish(const std::string& finish_reason) {
  Update out;
  const bool calls_expected = in_calls_ || choice_.kind == ToolChoice::Kind::kRequired;
  if (calls_expected && finish_reason == "stop") {
    read_calls(held_, out);
  } else {
    content_ += held_;
    out.content = held_;
  }
  held_.clear();
  return out;
}

std::string ToolCallStream::finish_reason(const std::string& engine_reason) const {
  if (engine_reason == "stop" && !calls_.empty() && choice_.kind != ToolChoice::Kind::kNamed) return "tool_calls";
  return engine_reason;
}

}  // namespace kvpipe
