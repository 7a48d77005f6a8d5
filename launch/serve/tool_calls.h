// ToolCalls: OpenAI's function calling as `kvpipe serve` speaks it.
//
// Owns three things: reading a request's `tools`, `tool_choice` and `parallel_tool_calls`
// (ToolRequest); the JSON Schema that `tool_choice: "required"` or a named function
// constrains the output to (vLLM's design: a JSON list of {"name", "parameters"} for
// required, the function's arguments alone for a named one); and reading the calls back out
// of the generated text (ToolCallStream), for `auto` in the model's own syntax:
//   hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one or more
//                (Hermes, Qwen2/2.5, SmolLM3 and other ChatML templates);
//   llama3_json  {"name": ..., "parameters": {...}}, optionally after <|python_tag|>,
//                several separated by ';' (Llama 3.1/3.2/3.3);
//   mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (Mistral v0.3, Nemo),
//                or [TOOL_CALLS]name[ARGS]{...} per call (tokenizer v11+: Mistral Small
//                3.1+, Devstral; v13's name[CALL_ID]id[ARGS]{...}, whose id is not kept).
// Guarantees: a call comes out only when its text parses as JSON naming one of the
// request's functions with an object of arguments; anything else stays content, as the
// model wrote it (vLLM's parsers do the same); `finish_reason` becomes "tool_calls" only on
// a natural stop with at least one call (a named function ends "stop", as OpenAI's do).
// A bad field is a ToolRequestError naming it.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {

enum class ToolCallSyntax { kNone, kHermes, kLlama3Json, kMistral };

// "hermes", "llama3_json", "mistral" (std::invalid_argument for another name).
ToolCallSyntax tool_call_syntax_named(const std::string& name);
const char* tool_call_syntax_name(ToolCallSyntax syntax);
// The syntax a chat template teaches its model (from the markers it writes), or kNone.
ToolCallSyntax tool_call_syntax_of_template(const std::string& source);
// Whether a chat template reads the `tools` variable at all (SmolLM2's does not).
bool template_renders_tools(const std::string& source);

struct ToolChoice {
  enum class Kind { kNone, kAuto, kRequired, kNamed };
  Kind kind = Kind::kNone;
  std::string function;             // kNamed: the function
  std::vector<std::string> names;   // every function of the request
  bool parallel = true;             // parallel_tool_calls: false keeps at most one call
  ToolCallSyntax syntax = ToolCallSyntax::kNone;  // how `auto` output is read
};

struct ToolRequestError : std::invalid_argument {
  ToolRequestError(std::string param, const std::string& message)
      : std::invalid_argument(message), param(std::move(param)) {}
  std::string param;
};

struct ToolRequest {
  ToolChoice choice;
  // `tools` as the chat template receives it (transformers passes the request's list);
  // null when the request has none.
  std::shared_ptr<const nlohmann::ordered_json> tools;
  // The schema the output must match (required or named), or null.
  std::shared_ptr<const nlohmann::ordered_json> schema;
};

// Reads `tools`, `tool_choice` and `parallel_tool_calls` of a chat body (keys in the
// order written). `syntax` is how the server reads `auto` output (kNone: it cannot);
// `renders_tools` whether its chat template shows the model the tools.
ToolRequest parse_tool_request(const nlohmann::ordered_json& body, ToolCallSyntax syntax, bool renders_tools);

// An assistant message's `tool_calls` as chat templates expect them: `arguments` as an
// object (the API sends it as JSON text; vLLM and transformers' templates read a mapping).
nlohmann::ordered_json template_tool_calls(const nlohmann::ordered_json& calls, const std::string& where);

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text of an object
};

// A piece of a streamed call: OpenAI's `delta.tool_calls[]` entry. The first piece of a
// call carries its id and name; later ones only more of its arguments.
struct ToolCallDelta {
  int index = 0;
  std::string id;    // "" after the first piece
  std::string name;  // "" after the first piece
  std::string arguments;
};

// One choice's generated text, split into content and tool calls as it arrives.
class ToolCallStream {
 public:
  // `id_seed` makes the calls' ids ("call_" + 24 hex digits) unique to the choice.
  ToolCallStream(const ToolChoice& choice, const std::string& id_seed);

  struct Update {
    std::string content;
    std::vector<ToolCallDelta> calls;
  };
  // More generated text; `marker` is the piece of a special token that tool-call syntaxes
  // use ([TOOL_CALLS], [ARGS], <|python_tag|>), which the text leaves out.
  Update push(const std::string& text, const std::string& marker = "");
  // The choice ended with `finish_reason`: what was held back, read as calls if it parses.
  Update finish(const std::string& finish_reason);
  // The finish_reason the client sees.
  std::string finish_reason(const std::string& engine_reason) const;

  const std::string& content() const { return content_; }
  const std::vector<ToolCall>& calls() const { return calls_; }

 private:
  std::string call_id(size_t index) const;
  void read_calls(const std::string& text, Update& out);

  ToolChoice choice_;
  std::string id_seed_;
  std::string held_;       // text not yet released: maybe the start of a call, or calls
  bool in_calls_ = false;  // held_ is (the start of) tool calls
  bool decided_ = false;   // llama3_json: whether the output opens with a call is known
  std::string content_;
  std::vector<ToolCall> calls_;
};

// Whether `piece` (a special token's text) is a marker of `syntax`.
bool is_tool_call_marker(ToolCallSyntax syntax, const std::string& piece);

}  // namespace kvpipe
