// Tool calls: reading `tools` / `tool_choice`, the schema required and named choices
// constrain to, and the calls read back out of hand-written model outputs in each syntax
// (whole, and streamed a few bytes at a time).
#include "engine/grammar/json_schema.h"
#include "engine/grammar/regex_dfa.h"
#include "launch/serve/tool_calls.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace kvpipe {
namespace {

using ojson = nlohmann::ordered_json;

const char* kWeatherTools = R"({"tools": [
  {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
   "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                  "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}},
  {"type": "function", "function": {"name": "get_time"}}]})";

ojson body_with(const std::string& extra) {
  ojson body = ojson::parse(kWeatherTools);
  if (!extra.empty()) body.update(ojson::parse(extra));
  return body;
}

ToolChoice auto_choice(ToolCallSyntax syntax) {
  ToolChoice c;
  c.kind = ToolChoice::Kind::kAuto;
  c.names = {"get_weather", "get_time"};
  c.syntax = syntax;
  return c;
}

// The stream fed `text` in pieces of `step` bytes, then finished with `reason`.
struct Read {
  std::string content;  // as released while streaming
  std::vector<ToolCallDelta> deltas;
  std::string finish_reason;
  ToolCallStream stream;
};
Read read(const ToolChoice& choice, const std::string& text, size_t step, const std::string& reason = "stop") {
  Read r{"", {}, "", ToolCallStream(choice, "seed")};
  auto take = [&r](const ToolCallStream::Update& u) {
    r.content += u.content;
    r.deltas.insert(r.deltas.end(), u.calls.begin(), u.calls.end());
  };
  for (size_t at = 0; at < text.size(); at += step) take(r.stream.push(text.substr(at, step)));
  take(r.stream.finish(reason));
  r.finish_reason = r.stream.finish_reason(reason);
  return r;
}

TEST(ToolCalls, ReadsHermesCallsWithContentBefore) {
  const std::string out =
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n"
      "</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
  for (size_t step : {out.size(), size_t{1}, size_t{3}, size_t{7}}) {
    SCOPED_TRACE(step);
    const Read r = read(auto_choice(ToolCallSyntax::kHermes), out, step);
    EXPECT_EQ(r.content, "Let me check.\n");
    ASSERT_EQ(r.stream.calls().size(), 2u);
    EXPECT_EQ(r.stream.calls()[0].name, "get_weather");
    EXPECT_EQ(ojson::parse(r.stream.calls()[0].arguments), ojson::parse(R"({"city": "Paris", "unit": "celsius"})"));
    EXPECT_EQ(r.stream.calls()[1].name, "get_time");
    EXPECT_EQ(r.stream.calls()[1].arguments, "{}");
    EXPECT_EQ(r.finish_reason, "tool_calls");
    ASSERT_EQ(r.deltas.size(), 2u);
    EXPECT_EQ(r.deltas[1].index, 1);
    EXPECT_EQ(r.deltas[0].id.rfind("call_", 0), 0u);
    EXPECT_NE(r.deltas[0].id, r.deltas[1].id);
  }
}

TEST(ToolCalls, HermesTextThatOnlyLooksLikeACallStaysContent) {
  // A marker's start that never completes is released; a call with bad JSON or an unknown
  // function is the model's text, not a call.
  for (const std::string& out : {std::string("a <tool_ and more"), std::string("x <tool_call>{\"name\": \"get_weather\", "),
                                std::string("<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>"),
                                std::string("<tool_call>{\"name\": \"get_time\", \"arguments\": [1]}</tool_call>")}) {
    SCOPED_TRACE(out);
    const Read r = read(auto_choice(ToolCallSyntax::kHermes), out, 2);
    EXPECT_EQ(r.content, out);
    EXPECT_TRUE(r.stream.calls().empty());
    EXPECT_EQ(r.finish_reason, "stop");
  }
}

TEST(ToolCalls, ACallCutByTheLengthLimitIsContent) {
  const std::string out = "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}";
  const Read r = read(auto_choice(ToolCallSyntax::kHermes), out, 5, "length");
  EXPECT_EQ(r.content, out);
  EXPECT_EQ(r.finish_reason, "length");
  // A stop string may cut the closing tag: the call still counts.
  EXPECT_EQ(read(auto_choice(ToolCallSyntax::kHermes), out, 5).stream.calls().size(), 1u);
}

TEST(ToolCalls, ReadsLlama3JsonCalls) {
  const std::string one = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\", \"unit\": \"celsius\"}}";
  const std::string two = "<|python_tag|>" + one + "; {\"name\": \"get_time\", \"parameters\": {}}";
  for (size_t step : {size_t{1}, size_t{4}, two.size()}) {
    SCOPED_TRACE(step);
    Read r = read(auto_choice(ToolCallSyntax::kLlama3Json), "  " + one, step);
    ASSERT_EQ(r.stream.calls().size(), 1u);
    EXPECT_EQ(r.content, "");
    EXPECT_EQ(ojson::parse(r.stream.calls()[0].arguments)["city"], "Oslo");
    r = read(auto_choice(ToolCallSyntax::kLlama3Json), two, step);
    ASSERT_EQ(r.stream.calls().size(), 2u);
    EXPECT_EQ(r.stream.calls()[1].name, "get_time");
  }
  // The special token arrives as a marker, outside the text.
  ToolCallStream s(auto_choice(ToolCallSyntax::kLlama3Json), "seed");
  EXPECT_EQ(s.push("", "<|python_tag|>").content, "");
  EXPECT_EQ(s.push(one).content, "");
  EXPECT_EQ(s.finish("stop").calls.size(), 1u);
  // Prose, and JSON that is no call, are content.
  for (const std::string& out : {std::string("The weather is fine."), std::string("{\"answer\": 42}")}) {
    const Read r = read(auto_choice(ToolCallSyntax::kLlama3Json), out, 3);
    EXPECT_EQ(r.content, out);
    EXPECT_TRUE(r.stream.calls().empty());
  }
}

TEST(ToolCalls, ReadsMistralCalls) {
  const std::string out =
      "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\", \"unit\": \"celsius\"}}, "
      "{\"name\": \"get_time\", \"arguments\": {}}]";
  for (size_t step : {size_t{1}, size_t{6}, out.size()}) {
    const Read r = read(auto_choice(ToolCallSyntax::kMistral), out, step);
    ASSERT_EQ(r.stream.calls().size(), 2u);
    EXPECT_EQ(r.content, "");
    EXPECT_EQ(r.finish_reason, "tool_calls");
  }
  ToolCallStream s(auto_choice(ToolCallSyntax::kMistral), "seed");
  EXPECT_EQ(s.push("Sure. ").content, "Sure. ");
  EXPECT_EQ(s.push("", "[TOOL_CALLS]").content, "");
  EXPECT_EQ(s.push("[{\"name\": \"get_time\", \"arguments\": \"{}\"}]").content, "");  // arguments as JSON text
  const ToolCallStream::Update end = s.finish("stop");
  ASSERT_EQ(end.calls.size(), 1u);
  EXPECT_EQ(end.calls[0].arguments, "{}");
}

// Mistral's tokenizer v11+ (Mistral Small 3.1+, Devstral) writes each call as
// [TOOL_CALLS]name[ARGS]{...}; v13 puts [CALL_ID]id before [ARGS].
TEST(ToolCalls, ReadsMistralV11Calls) {
  const std::string out =
      "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Rome\", \"unit\": \"celsius\"}"
      "[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}";
  for (size_t step : {size_t{1}, size_t{7}, out.size()}) {
    const Read r = read(auto_choice(ToolCallSyntax::kMistral), out, step);
    ASSERT_EQ(r.stream.calls().size(), 2u) << step;
    EXPECT_EQ(r.stream.calls()[0].name, "get_weather");
    EXPECT_EQ(r.stream.calls()[0].arguments, "{\"city\":\"Rome\",\"unit\":\"celsius\"}");
    EXPECT_EQ(r.stream.calls()[1].name, "get_time");
    EXPECT_EQ(r.stream.calls()[1].arguments, "{}");
    EXPECT_EQ(r.content, "");
    EXPECT_EQ(r.finish_reason, "tool_calls");
  }
  // The markers as special tokens (no text of their own), after some prose.
  EXPECT_TRUE(is_tool_call_marker(ToolCallSyntax::kMistral, "[ARGS]"));
  EXPECT_TRUE(is_tool_call_marker(ToolCallSyntax::kMistral, "[CALL_ID]"));
  ToolCallStream s(auto_choice(ToolCallSyntax::kMistral), "seed");
  EXPECT_EQ(s.push("Checking. ").content, "Checking. ");
  EXPECT_EQ(s.push("", "[TOOL_CALLS]").content, "");
  EXPECT_EQ(s.push("get_time").content, "");
  EXPECT_EQ(s.push("", "[ARGS]").content, "");
  EXPECT_EQ(s.push("{}").content, "");
  const ToolCallStream::Update end = s.finish("stop");
  ASSERT_EQ(end.calls.size(), 1u);
  EXPECT_EQ(end.calls[0].name, "get_time");
  EXPECT_EQ(s.finish_reason("stop"), "tool_calls");
  // A function the request lacks, arguments that are no object, or text after the calls'
  // end that is no call: content, as written.
  for (const std::string& bad : {std::string("[TOOL_CALLS]get_stock[ARGS]{}"),
                                 std::string("[TOOL_CALLS]get_time[ARGS][1, 2]"),
                                 std::string("[TOOL_CALLS]get_time[ARGS]{\"a\": "),
                                 std::string("[TOOL_CALLS]get_time{}")}) {
    const Read r = read(auto_choice(ToolCallSyntax::kMistral), bad, 4);
    EXPECT_TRUE(r.stream.calls().empty()) << bad;
    EXPECT_EQ(r.content, bad);
    EXPECT_EQ(r.finish_reason, "stop") << bad;
  }
  const Read tail = read(auto_choice(ToolCallSyntax::kMistral), "[TOOL_CALLS]get_time[ARGS]{} Done.", 5);
  ASSERT_EQ(tail.stream.calls().size(), 1u);
  EXPECT_EQ(tail.content, "Done.");
}

TEST(ToolCalls, ParallelFalseKeepsOneCall) {
  ToolChoice c = auto_choice(ToolCallSyntax::kMistral);
  c.parallel = false;
  const Read r = read(c, "[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {}}, {\"name\": \"get_time\", \"arguments\": {}}]", 8);
  EXPECT_EQ(r.stream.calls().size(), 1u);
}

TEST(ToolCalls, NamedStreamsArgumentsAndEndsStop) {
  ToolChoice c = auto_choice(ToolCallSyntax::kNone);
  c.kind = ToolChoice::Kind::kNamed;
  c.function = "get_weather";
  const std::string args = "{\"city\": \"Lima\", \"unit\": \"celsius\"}";
  const Read r = read(c, args, 5);
  ASSERT_EQ(r.stream.calls().size(), 1u);
  EXPECT_EQ(r.stream.calls()[0].arguments, args);
  EXPECT_EQ(r.finish_reason, "stop");
  ASSERT_GT(r.deltas.size(), 2u);
  EXPECT_EQ(r.deltas[0].name, "get_weather");
  EXPECT_FALSE(r.deltas[0].id.empty());
  std::string joined;
  for (const ToolCallDelta& d : r.deltas) {
    EXPECT_EQ(d.index, 0);
    joined += d.arguments;
    if (&d != &r.deltas[0]) {
      EXPECT_TRUE(d.id.empty() && d.name.empty());
    }
  }
  EXPECT_EQ(joined, args);
}

TEST(ToolCalls, RequiredSchemaMatchesACallListOnly) {
  const ToolRequest t = parse_tool_request(body_with(R"({"tool_choice": "required"})"), ToolCallSyntax::kNone, true);
  ASSERT_TRUE(t.schema);
  const RegexDfa dfa(json_schema_regex(*t.schema), 50000);
  EXPECT_TRUE(dfa.full_match(R"([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}])"));
  EXPECT_TRUE(dfa.full_match(R"([{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}])"));
  EXPECT_FALSE(dfa.full_match(R"([])"));
  EXPECT_FALSE(dfa.full_match(R"([{"name": "get_weather", "parameters": {"city": "Paris"}}])"));
  EXPECT_FALSE(dfa.full_match(R"([{"name": "other", "parameters": {}}])"));
  // The constrained output reads back as the calls.
  ToolChoice c = t.choice;
  const Read r = read(c, R"([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}])", 9);
  ASSERT_EQ(r.stream.calls().size(), 1u);
  EXPECT_EQ(r.finish_reason, "tool_calls");

  const ToolRequest one =
      parse_tool_request(body_with(R"({"tool_choice": "required", "parallel_tool_calls": false})"), ToolCallSyntax::kNone, true);
  EXPECT_FALSE(RegexDfa(json_schema_regex(*one.schema), 50000)
                   .full_match(R"([{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}])"));
}

TEST(ToolCalls, NamedSchemaIsTheFunctionsParameters) {
  const ToolRequest t = parse_tool_request(
      body_with(R"({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}})"), ToolCallSyntax::kNone, true);
  EXPECT_EQ(t.choice.kind, ToolChoice::Kind::kNamed);
  EXPECT_EQ((*t.schema)["required"], ojson::parse(R"(["city", "unit"])"));
  const ToolRequest none_params = parse_tool_request(
      body_with(R"({"tool_choice": {"type": "function", "function": {"name": "get_time"}}})"), ToolCallSyntax::kNone, true);
  EXPECT_TRUE(RegexDfa(json_schema_regex(*none_params.schema)).full_match("{}"));
}

TEST(ToolCalls, DefinitionsOfEachFunctionMoveToTheRoot) {
  const ojson body = ojson::parse(R"({"tool_choice": "required", "tools": [
    {"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/X"}},
      "required": ["x"], "$defs": {"X": {"enum": [1, 2]}}}}}]})");
  const ToolRequest t = parse_tool_request(body, ToolCallSyntax::kNone, true);
  EXPECT_TRUE(RegexDfa(json_schema_regex(*t.schema)).full_match(R"([{"name": "a", "parameters": {"x": 2}}])"));
}

void expect_refused(const std::string& extra, const std::string& param, ToolCallSyntax syntax = ToolCallSyntax::kHermes,
                    bool renders = true, const char* tools = kWeatherTools) {
  SCOPED_TRACE(extra);
  ojson body = ojson::parse(tools);
  if (!extra.empty()) body.update(ojson::parse(extra));
  try {
    parse_tool_request(body, syntax, renders);
    ADD_FAILURE() << "accepted";
  } catch (const ToolRequestError& e) {
    EXPECT_EQ(e.param, param) << e.what();
  }
}

TEST(ToolCalls, BadToolFieldsAreNamed) {
  expect_refused(R"({"tool_choice": "sometimes"})", "tool_choice");
  expect_refused(R"({"tool_choice": {"type": "function", "function": {"name": "nope"}}})", "tool_choice.function.name");
  expect_refused(R"({"parallel_tool_calls": "yes"})", "parallel_tool_calls");
  expect_refused("", "tools", ToolCallSyntax::kHermes, false);  // the template would drop them
  expect_refused("", "tool_choice", ToolCallSyntax::kNone);     // auto, and no syntax to read
  expect_refused("", "tools[0].type", ToolCallSyntax::kHermes, true, R"({"tools": [{"type": "code_interpreter"}]})");
  expect_refused("", "tools[0].function.name", ToolCallSyntax::kHermes, true,
                 R"({"tools": [{"type": "function", "function": {"name": "two words"}}]})");
  expect_refused("", "tools[1].function.name", ToolCallSyntax::kHermes, true,
                 R"({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]})");
  expect_refused("", "tools[0].function.examples", ToolCallSyntax::kHermes, true,
                 R"({"tools": [{"type": "function", "function": {"name": "f", "examples": []}}]})");
  expect_refused(R"({"tool_choice": "required"})", "tool_choice", ToolCallSyntax::kHermes, true, R"({"tools": []})");
  // No tools and nothing asked: fine; "none" with tools renders them but reads no calls.
  EXPECT_EQ(parse_tool_request(ojson::parse(R"({"tool_choice": "auto"})"), ToolCallSyntax::kNone, false).choice.kind,
            ToolChoice::Kind::kNone);
  const ToolRequest none = parse_tool_request(body_with(R"({"tool_choice": "none"})"), ToolCallSyntax::kNone, false);
  EXPECT_EQ(none.choice.kind, ToolChoice::Kind::kNone);
  EXPECT_TRUE(none.tools);
}

TEST(ToolCalls, AssistantCallsReachTheTemplateWithObjectArguments) {
  const ojson calls = ojson::parse(
      R"([{"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"UTC\"}"}}])");
  const ojson out = template_tool_calls(calls, "messages[1].tool_calls");
  EXPECT_EQ(out[0]["function"]["arguments"]["tz"], "UTC");
  EXPECT_EQ(out[0]["id"], "call_1");
  try {
    template_tool_calls(ojson::parse(R"([{"function": {"name": "f", "arguments": "[1"}}])"), "messages[1].tool_calls");
    ADD_FAILURE() << "accepted";
  } catch (const ToolRequestError& e) {
    EXPECT_EQ(e.param, "messages[1].tool_calls[0].function.arguments");
  }
}

TEST(ToolCalls, TemplatesNameTheirSyntax) {
  EXPECT_EQ(tool_call_syntax_of_template("{{ '<tool_call>' }}{% for t in tools %}{% endfor %}"), ToolCallSyntax::kHermes);
  EXPECT_EQ(tool_call_syntax_of_template("[AVAILABLE_TOOLS] [TOOL_CALLS]"), ToolCallSyntax::kMistral);
  EXPECT_EQ(tool_call_syntax_of_template("<|python_tag|>"), ToolCallSyntax::kLlama3Json);
  EXPECT_EQ(tool_call_syntax_of_template("{{ messages }}"), ToolCallSyntax::kNone);
  EXPECT_FALSE(template_renders_tools("{% for m in messages %}{{ m.content }}{% endfor %}"));
  EXPECT_EQ(tool_call_syntax_named("llama3_json"), ToolCallSyntax::kLlama3Json);
  EXPECT_THROW(tool_call_syntax_named("pythonic"), std::invalid_argument);
}

}  // namespace
}  // namespace kvpipe
