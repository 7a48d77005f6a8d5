// ChatTemplate (engine/text/chat_template.h): each construct of the supported Jinja subset
// against the output Python's jinja2 gives in transformers' environment (trim_blocks,
// lstrip_blocks, loop controls, the tojson override), whitespace control, Python-style
// printing, and errors that name the template and the line. The expected strings are jinja2's
// renderings of the same template and context (Jinja2 3.1.6, transformers' _compile_jinja_template).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "engine/text/chat_template.h"
#include "tests/support/command.h"

namespace kvpipe {
namespace {

std::string render(const std::string& source, const std::string& context) {
  return ChatTemplate(source, "t.jinja").render(nlohmann::ordered_json::parse(context));
}

// The message of the std::invalid_argument that parsing or rendering throws.
std::string error_of(const std::string& source, const std::string& context = "{}", const std::string& name = "t.jinja") {
  try {
    ChatTemplate(source, name).render(nlohmann::ordered_json::parse(context));
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no error";
}

std::string read_template(const std::string& file) {
  return kvpipe::testing::slurp(std::filesystem::path(KVPIPE_SOURCE_DIR) / "tests/data/chat_templates" / file);
}

TEST(ChatTemplate, PrintsValuesAsPython) {
  EXPECT_EQ(render(R"j({{ 1.0 }}|{{ 2.5e-7 }}|{{ 1e20 }}|{{ 0.1 + 0.2 }}|{{ 10 / 4 }}|{{ 7 // 2 }}|{{ -7 // 2 }}|{{ -7 % 3 }}|{{ 2 ** 10 }})j",
                   R"j({})j"),
            R"j(1.0|2.5e-07|1e+20|0.30000000000000004|2.5|3|-4|2|1024)j");
  EXPECT_EQ(render(R"j({{ true }}|{{ false }}|{{ none }}|{{ True }}|{{ None }}|{{ [1, 'a', none, true, 1.5] }}|{{ {'k': 'v', 'n': [1]} }}|{{ ('a',) }})j",
                   R"j({})j"),
            R"j(True|False|None|True|None|[1, 'a', None, True, 1.5]|{'k': 'v', 'n': [1]}|('a',))j");
  EXPECT_EQ(render(R"j({{ ["it's", 'say "hi"', 'tab\t'] }}|{{ x }}|{{ f }}|{{ i }}|{{ big }})j",
                   R"j({"f": 2.0, "i": 7, "big": 1e+21})j"),
            R"j(["it's", 'say "hi"', 'tab\t']||2.0|7|1e+21)j");
  EXPECT_EQ(render(R"j({{ 'x' * 3 }}|{{ [1] * 2 }}|{{ 1 + 1.0 }}|{{ '%s=%d' % ('n', 3) }}|{{ 'a' ~ 1 ~ none ~ x }})j",
                   R"j({})j"),
            R"j(xxx|[1, 1]|2.0|n=3|a1None)j");
}

TEST(ChatTemplate, WhitespaceControl) {
  EXPECT_EQ(render(R"j(  {% if true %}
    x
  {% endif %}
  {{ 'v' }}  
{# c #}
end)j",
                   R"j({})j"),
            R"j(    x
  v  
end)j");
  EXPECT_EQ(render(R"j(a  {%- if true -%}  b  {%- endif -%}  c
{{- ' d ' -}}
 e)j",
                   R"j({})j"),
            R"j(abc d e)j");
  EXPECT_EQ(render(R"j( {%+ if true %}z{% endif +%}
next
{#- comment -#}
  last
)j",
                   R"j({})j"),
            R"j( z
nextlast)j");
  EXPECT_EQ(render(R"j({% raw %}{{ literal }} {% if %}{% endraw %})j",
                   R"j({})j"),
            R"j({{ literal }} {% if %})j");
  EXPECT_EQ(render(R"j({%- for m in messages -%}
{{- m }}
{% endfor %})j",
                   R"j({"messages": ["a", "b"]})j"),
            R"j(a
b
)j");
}

TEST(ChatTemplate, ForLoops) {
  EXPECT_EQ(render(R"j({% for k, v in d.items() %}{{ loop.index }}:{{ k }}={{ v }}{{ ',' if not loop.last }}{% endfor %})j",
                   R"j({"d": {"z": 1, "a": [1, 2]}})j"),
            R"j(1:z=1,2:a=[1, 2])j");
  EXPECT_EQ(render(R"j({% for x in l if x > 1 %}{{ loop.index0 }}/{{ loop.length }}/{{ loop.revindex }}/{{ loop.first }}/{{ loop.previtem }}/{{ loop.nextitem }};{% endfor %})j",
                   R"j({"l": [1, 2, 3, 4]})j"),
            R"j(0/3/3/True//3;1/3/2/False/2/4;2/3/1/False/3/;)j");
  EXPECT_EQ(render(R"j({% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% endif %}{{ i }}{% endfor %})j",
                   R"j({})j"),
            R"j(0134)j");
  EXPECT_EQ(render(R"j({% for a in missing %}a{% else %}empty{% endfor %}|{% for c in 'hé' %}[{{ c }}]{% endfor %}|{% for x, y in [[1, 2], [3, 4]] %}{{ x + y }}{% endfor %})j",
                   R"j({})j"),
            R"j(empty|[h][é]|37)j");
  EXPECT_EQ(render(R"j({% set x = 'outer' %}{% for i in range(2) %}[{{ x }}]{% set x = i %}[{{ x }}]{% endfor %}[{{ x }}])j",
                   R"j({})j"),
            R"j([outer][0][outer][1][outer])j");
  EXPECT_EQ(render(R"j({% for i in range(2) %}{% for j in range(2) %}{{ loop.index }}{% endfor %}{{ loop.index }};{% endfor %}{{ loop is defined }})j",
                   R"j({})j"),
            R"j(121;122;False)j");
}

TEST(ChatTemplate, SetNamespaceMacrosAndBlocks) {
  EXPECT_EQ(render(R"j({% set ns = namespace(total=0, seen=false) %}{% for i in range(4) %}{% set ns.total = ns.total + i %}{% endfor %}{{ ns.total }} {{ ns.seen }})j",
                   R"j({})j"),
            R"j(6 False)j");
  EXPECT_EQ(render(R"j({% set a, b = [1, 2] %}{{ a }}{{ b }}{% set x %}block {{ 1 + 1 }}{% endset %}[{{ x }}]{% set y | upper %}abc{% endset %}{{ y }})j",
                   R"j({})j"),
            R"j(12[block 2]ABC)j");
  EXPECT_EQ(render(R"j({% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Bob') }} {{ greet('Al', punct='?') }} {{ greet(name='Zed') }})j",
                   R"j({})j"),
            R"j(Hi Bob! Hi Al? Hi Zed!)j");
  EXPECT_EQ(render(R"j({% filter upper %}up {{ 'x' }}{% endfilter %}{% generation %} gen {{ 1 }}{% endgeneration %})j",
                   R"j({})j"),
            R"j(UP X gen 1)j");
  EXPECT_EQ(render(R"j({% if false %}a{% elif x is defined %}b{% elif 1 %}c{% else %}d{% endif %})j",
                   R"j({})j"),
            R"j(c)j");
}

TEST(ChatTemplate, ExpressionsAndTests) {
  EXPECT_EQ(render(R"j({{ 'a' in 'abc' }}{{ 'z' not in 'abc' }}{{ 1 in [1, 2] }}{{ 'k' in {'k': 1} }}{{ 1 < 2 < 3 }}{{ 1 < 3 < 2 }}{{ [1, 2] == [1, 2] }}{{ {'a': 1, 'b': 2} == {'b': 2, 'a': 1} }}{{ 1 == 1.0 }})j",
                   R"j({})j"),
            R"j(TrueTrueTrueTrueTrueFalseTrueTrueTrue)j");
  EXPECT_EQ(render(R"j({{ not none }}|{{ 0 or 'x' }}|{{ 1 and 'y' }}|{{ '' or [] }}|{{ 'a' if false else 'b' if false else 'c' }}|{{ 'shown' if false }}|{{ -3 | abs }})j",
                   R"j({})j"),
            R"j(True|x|y|[]|c||3)j");
  EXPECT_EQ(render(R"j({{ 1 is number }}{{ 1.0 is float }}{{ true is number }}{{ true is integer }}{{ 'a' is string }}{{ {} is mapping }}{{ 'a' is iterable }}{{ none is none }}{{ x is undefined }}{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 1 is not string }}{{ 'a' is eq 'a' }}{{ x is iterable }})j",
                   R"j({})j"),
            R"j(TrueTrueTrueFalseTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrue)j");
  EXPECT_EQ(render(R"j({{ 'abc'[::-1] }} {{ [1, 2, 3][-2:] }} {{ 'héllo'[1:4] }} {{ [1, 2, 3, 4, 5][::2] }} {{ 'abc'[-1] }} {{ l[10] }}|{{ d.missing }}|{{ d['missing'] }}|{{ none.attr }})j",
                   R"j({"l": [1], "d": {}})j"),
            R"j(cba [2, 3] éll [1, 3, 5] c |||)j");
  EXPECT_EQ(render(R"j({{ d['items'] }}{{ d.get('z', 'dflt') }}{{ d.get('q') }}{{ d.keys() | list }}{{ d.values() | list }})j",
                   R"j({"d": {"items": 5, "z": 0}})j"),
            R"j(50None['items', 'z'][5, 0])j");
}

TEST(ChatTemplate, Filters) {
  EXPECT_EQ(render(R"j({{ '  x  ' | trim }}|{{ 'xxaxx' | trim('x') }}|{{ 'abc' | upper }}|{{ 'ABC' | lower }}|{{ 'hello world-foo' | title }}|{{ 'hELLO' | capitalize }}|{{ 'a-b-c' | replace('-', '+') }}|{{ 'a-b' | replace('-', '', 1) }})j",
                   R"j({})j"),
            R"j(x|a|ABC|abc|Hello World-Foo|Hello|a+b+c|ab)j");
  EXPECT_EQ(render(R"j({{ [3, 1, 2] | sort }}|{{ [3, 1, 2] | sort(reverse=true) | join(',') }}|{{ ['A', 'a', 'b'] | unique | list }}|{{ [1, 2] | reverse | list }}|{{ 'ab' | reverse }}|{{ [1, 2, 3] | first }}{{ [1, 2, 3] | last }}|{{ [1, 2, 3] | length }}{{ 'hé' | count }}|{{ missing | length }})j",
                   R"j({})j"),
            R"j([1, 2, 3]|3,2,1|['A', 'b']|[2, 1]|ba|13|32|0)j");
  EXPECT_EQ(render(R"j({{ 2.567 | round(2) }}|{{ 2.5 | round }}|{{ 3.5 | round }}|{{ '3' | int + 1 }}|{{ '3.5' | int }}|{{ 'x' | int }}|{{ '3.5' | float }}|{{ 1 | string ~ 'x' }}|{{ missing | default('d') }}|{{ '' | default('e', true) }}|{{ none | d('n') }})j",
                   R"j({})j"),
            R"j(2.57|2.0|4.0|4|3|0|3.5|1x|d|e|None)j");
  EXPECT_EQ(render(R"j({{ {'b': 1, 'a': 2} | dictsort }}|{{ {'b': 1, 'a': 2} | items | list }}|{{ range(1, 10, 3) | list }}|{{ {'a': 1} | list }})j",
                   R"j({})j"),
            R"j([('a', 2), ('b', 1)]|[('b', 1), ('a', 2)]|[1, 4, 7]|['a'])j");
  EXPECT_EQ(render(R"j({{ l | map(attribute='n') | join(',') }}|{{ l | selectattr('n', 'gt', 1) | map(attribute='n') | list }}|{{ l | rejectattr('n', 'equalto', 1) | list | length }}|{{ [1, 2, 3, 4] | select('odd') | list }}|{{ [1, 2, 3, 4] | reject('even') | list }}|{{ ['a', 'b'] | map('upper') | list }}|{{ l | selectattr('flag') | list }})j",
                   R"j({"l": [{"n": 1, "flag": true}, {"n": 2}, {"n": 3, "flag": false}]})j"),
            R"j(1,2,3|[2, 3]|2|[1, 3]|[1, 3]|['A', 'B']|[{'n': 1, 'flag': True}])j");
  EXPECT_EQ(render(R"j({{ {'b': 1, 'a': 'é"\n', 'c': [1.0, none, true]} | tojson }}|{{ {'a': {'b': [1]}, 'e': []} | tojson(indent=2) }}|{{ {'a': 1} | tojson(separators=(',', ':')) }}|{{ 'é' | tojson(ensure_ascii=true) }})j",
                   R"j({})j"),
            R"j({"b": 1, "a": "é\"\n", "c": [1.0, null, true]}|{
  "a": {
    "b": [
      1
    ]
  },
  "e": []
}|{"a":1}|"\u00e9")j");
  EXPECT_EQ(render(R"j({{ 'l1
l2

l3' | indent(2) }}|{{ 'a
b' | indent(2, true) }}|{{ 'a b  c' | wordcount }}|{{ '<a>&' | e }}|{{ [1, 2, 3] | sum }}|{{ [3, 1, 2] | min }}{{ [3, 1, 2] | max }}|{{ '%s and %s' | format('a', 'b') }})j",
                   R"j({})j"),
            R"j(l1
  l2

  l3|  a
  b|3|&lt;a&gt;&amp;|6|13|a and b)j");
}

TEST(ChatTemplate, StringMethods) {
  EXPECT_EQ(render(R"j({{ '  x '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ ' x '.lstrip() }}|{{ ' x '.rstrip() }}|{{ 'a b  c'.split() }}|{{ 'a,b'.split(',') }}|{{ 'a b c'.rsplit(' ', 1) }}|{{ 'a,b,c'.split(',', 1) }})j",
                   R"j({})j"),
            R"j(x|a|x | x|['a', 'b', 'c']|['a', 'b']|['a b', 'c']|['a', 'b,c'])j");
  EXPECT_EQ(render(R"j({{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}|{{ 'a-b'.replace('-', '+') }}|{{ ','.join(['a', 'b']) }}|{{ 'abcabc'.find('c') }}|{{ 'abc'.upper() }}{{ 'ABC'.lower() }}|{{ "it's a test".title() }}|{{ 'hello'.capitalize() }}|{{ 'Hi {}, {n}!'.format('A', n=3) }})j",
                   R"j({})j"),
            R"j(TrueTrue|a+b|a,b|2|ABCabc|It'S A Test|Hello|Hi A, 3!)j");
}

TEST(ChatTemplate, UndefinedFollowsJinja2) {
  EXPECT_EQ(render("[{{ x }}][{{ x | trim }}][{{ x is defined }}][{{ not x }}][{{ x == x }}]", "{}"),
            "[][][False][True][True]");
  EXPECT_EQ(error_of("{{ x.y }}"), "t.jinja:1: 'x' is undefined");
  EXPECT_EQ(error_of("{{ d.a.b }}", R"({"d": {}})"), "t.jinja:1: 'dict object' has no attribute 'a'");
  EXPECT_EQ(error_of("{{ x + 1 }}"), "t.jinja:1: 'x' is undefined");
  EXPECT_EQ(error_of("{{ x | tojson }}"), "t.jinja:1: Object of type Undefined is not JSON serializable");
}

TEST(ChatTemplate, ErrorsNameTemplateAndLine) {
  EXPECT_EQ(error_of("line one\n{% if %}", "{}", "model.gguf: tokenizer.chat_template"),
            "model.gguf: tokenizer.chat_template:2: Expected an expression, got end of statement block");
  EXPECT_EQ(error_of("a\nb\n{% for x in y %}\n{{ x }}"),
            "t.jinja:4: Unexpected end of template. Jinja was looking for the following tags: 'endfor' or 'else'.");
  EXPECT_EQ(error_of("{% include 'x' %}"), "t.jinja:1: Encountered unknown tag 'include'.");
  EXPECT_EQ(error_of("\n{% for x in [] %}{{ x | no_such_filter }}{% endfor %}"), "t.jinja:2: No filter named 'no_such_filter'.");
  EXPECT_EQ(render("{% if false %}{{ x | no_such_filter }}{% endif %}{{ 1 if true else 2 | nope }}", "{}"), "1");
  EXPECT_EQ(error_of("{% if true %}{{ x | no_such_filter }}{% endif %}"), "t.jinja:1: No filter named 'no_such_filter' found.");
  EXPECT_EQ(error_of("{{ 'unterminated }}"), "t.jinja:1: unexpected end of string");
  EXPECT_EQ(error_of("{# open comment"), "t.jinja:1: Missing end of comment tag");
  EXPECT_EQ(error_of("ok\n\n  {{ raise_exception('Roles must alternate: ' ~ n) }}", R"({"n": 3})"),
            "t.jinja:3: Roles must alternate: 3");
  EXPECT_EQ(error_of("{{ 'a' + 1 }}"), "t.jinja:1: can only concatenate str (not \"int\") to str");
  EXPECT_EQ(error_of("{% for m in none %}{% endfor %}"), "t.jinja:1: 'NoneType' object is not iterable");
  EXPECT_EQ(error_of("{% set l = [] %}\n{{ l.append(1) }}"), "t.jinja:2: access to attribute 'append' of 'list' object is unsafe.");
  EXPECT_EQ(error_of("{% set ns = namespace() %}{% set ns._x = 1 %}"),
            "t.jinja:1: Chat templates cannot store underscore-prefixed attributes on a namespace, but got '_x'. Please "
            "rename the attribute.");
}

TEST(ChatTemplate, RendersRealTemplates) {
  const ChatTemplate smol(read_template("smollm2-135m-instruct.jinja"), "smollm2");
  EXPECT_EQ(smol.render_chat({{"user", "Hi"}}, true, "<|im_start|>", "<|im_end|>"),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(smol.name(), "smollm2");

  const ChatTemplate llama3(read_template("llama-3-8b-instruct.jinja"), "llama3");
  EXPECT_EQ(llama3.render_chat({{"system", "Be brief."}, {"user", "  Hi  "}}, true, "<|begin_of_text|>", "<|eot_id|>"),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");

  const ChatTemplate mistral(read_template("mistral-7b-instruct-v0.3.jinja"), "mistral");
  EXPECT_EQ(mistral.render_chat({{"user", "a"}, {"assistant", " b "}, {"user", "c"}}, false, "<s>", "</s>"),
            "<s>[INST] a[/INST] b</s>[INST] c[/INST]");
  try {
    mistral.render_chat({{"user", "a"}, {"user", "b"}}, false, "<s>", "</s>");
    ADD_FAILURE() << "expected the role-alternation error";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "mistral:18: After the optional system message, conversation roles must alternate "
              "user/assistant/user/assistant/...");
  }

  const ChatTemplate qwen(read_template("qwen2.5-7b-instruct.jinja"), "qwen");
  nlohmann::ordered_json context = {
      {"messages", {{{"role", "user"}, {"content", "Weather?"}}}},
      {"tools", {{{"type", "function"}, {"function", {{"name", "get_weather"}, {"parameters", {{"type", "object"}}}}}}}},
      {"add_generation_prompt", true}};
  EXPECT_EQ(qwen.render(context),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
            "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
            "signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": "
            "\"get_weather\", \"parameters\": {\"type\": \"object\"}}}\n</tools>\n\nFor each function call, return a "
            "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
            "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplate, RendersConcurrentlyAndMoves) {
  ChatTemplate tmpl(read_template("llama-3.1-8b-instruct.jinja"), "llama31");
  const std::vector<ChatMessage> chat = {{"system", "S"}, {"user", "U"}, {"assistant", "A"}, {"user", "V"}};
  const std::string expected = tmpl.render_chat(chat, true, "<|begin_of_text|>", "<|eot_id|>");
  EXPECT_NE(expected.find("Today Date: 26 Jul 2024"), std::string::npos);
  std::vector<std::string> results(4);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < results.size(); ++t)
    threads.emplace_back([&, t] {
      for (int k = 0; k < 50; ++k) results[t] = tmpl.render_chat(chat, true, "<|begin_of_text|>", "<|eot_id|>");
    });
  for (auto& th : threads) th.join();
  for (const auto& r : results) EXPECT_EQ(r, expected);
  ChatTemplate moved = std::move(tmpl);
  EXPECT_EQ(moved.render_chat(chat, true, "<|begin_of_text|>", "<|eot_id|>"), expected);
  EXPECT_EQ(moved.name(), "llama31");
}

// A template comes with a model file: what it computes is bounded (64-bit integers that refuse
// to overflow, strings, lists, nesting, recursion and running time), each a line-numbered error
// instead of undefined behaviour, a crash or a hang. Found by tests/fuzz/fuzz_chat_template.
TEST(ChatTemplateBounds, IntegerOverflowIsAnError) {
  EXPECT_EQ(error_of("{{ 9223372036854775807 + 1 }}"), "t.jinja:1: integer overflow in + (template integers are 64-bit)");
  EXPECT_EQ(error_of("{{ -9223372036854775807 - 2 }}"), "t.jinja:1: integer overflow in - (template integers are 64-bit)");
  EXPECT_EQ(error_of("{{ 9223372036854775807 * 2 }}"), "t.jinja:1: integer overflow in * (template integers are 64-bit)");
  EXPECT_EQ(error_of("{{ 2 ** 63 }}"), "t.jinja:1: integer overflow in ** (template integers are 64-bit)");
  EXPECT_EQ(error_of("{{ 2 ** 9223372036854775807 }}"), "t.jinja:1: integer overflow in ** (template integers are 64-bit)");
  EXPECT_EQ(error_of("{% set m = -9223372036854775807 - 1 %}{{ m // -1 }}"),
            "t.jinja:1: integer overflow in // (template integers are 64-bit)");
  EXPECT_EQ(error_of("{% set m = -9223372036854775807 - 1 %}{{ -m }}"),
            "t.jinja:1: integer overflow in unary - (template integers are 64-bit)");
  // In range, Python's results: the largest integers, powers, remainders with the divisor's sign.
  EXPECT_EQ(render("{{ 9223372036854775806 + 1 }}|{{ 2 ** 62 }}|{{ (-2) ** 63 }}|{{ 1 ** 9223372036854775807 }}", "{}"),
            "9223372036854775807|4611686018427387904|-9223372036854775808|1");
  EXPECT_EQ(render("{% set m = -9223372036854775807 - 1 %}{{ m % -1 }}|{{ 9223372036854775807 % -2 }}|{{ m % 3 }}", "{}"),
            "0|-1|1");
  EXPECT_EQ(render("{{ range(9223372036854775800, 9223372036854775807, 5) | list }}", "{}"),
            "[9223372036854775800, 9223372036854775805]");
}

TEST(ChatTemplateBounds, StringsListsAndOutputAreBounded) {
  EXPECT_EQ(error_of(R"({{ "x" * 2000000000 }})"), "t.jinja:1: string of 18446744073709551615 bytes is larger than the 16777216 a template may build");
  EXPECT_EQ(error_of(R"({{ [1, 2] * 4611686018427387904 }})"), "t.jinja:1: list of 18446744073709551615 items is larger than the 1048576 a template may build");
  const std::string doubling =
      R"({% set ns = namespace(s="ab") %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }})";
  EXPECT_NE(error_of(doubling).find("a template may build"), std::string::npos) << error_of(doubling);
  const std::string output = R"({% for i in range(100000) %}{{ "y" * 200 }}{% endfor %})";
  EXPECT_NE(error_of(output).find("a template may build"), std::string::npos) << error_of(output);
  EXPECT_EQ(render(R"({{ ("ab" * 3) ~ "|" ~ ([0] * 3) | length ~ "|" ~ ("x" * -2) }})", "{}"), "ababab|3|");
  // An empty sequence times a huge count is empty at once (the fuzzer's timeout of 2 billion
  // empty appends).
  EXPECT_EQ(render(R"({{ ("" * 2000000070) ~ "|" ~ ([] * 4611686018427387904) | length }})", "{}"), "|0");
  // Each use of a variable copies its string: the bytes copied in all are bounded too.
  EXPECT_EQ(error_of(R"({% set s = "x" * 10000000 %}{% for i in range(1000) %}{{ s | length }}{% endfor %})"),
            "t.jinja:1: the template copied more than 256 MiB of strings");
}

// Namespaces are the one thing a template can change, so they are where a value could come to
// hold itself; printing or comparing it would then never end, and it would never be freed.
TEST(ChatTemplateBounds, NamespacesCannotHoldThemselves) {
  EXPECT_EQ(error_of("{% set ns = namespace(s=1) %}{% set ns.S = ns %}"),
            "t.jinja:1: cannot store a namespace inside itself ('ns.S')");
  EXPECT_EQ(error_of("{% set ns = namespace() %}{% set l = [1, {'k': ns}] %}{% set ns.x = l %}"),
            "t.jinja:1: cannot store a namespace inside itself ('ns.x')");
  // Through a bound method the cycle is allowed, as in jinja2; the render frees it when it ends
  // (the sanitize preset's leak checker holds this test to that).
  EXPECT_EQ(render("{% set ns = namespace(n=2) %}{% set d = {'a': ns} %}{% set ns.f = d.get %}{{ ns.f('a').n }}", "{}"),
            "2");
  EXPECT_EQ(render("{% set a = namespace(v=1) %}{% set b = namespace(a=a) %}{% set a.v = 5 %}{{ b.a.v }}", "{}"), "5");
}

TEST(ChatTemplateBounds, NestingRecursionAndStepsAreBounded) {
  EXPECT_EQ(error_of("{{ " + std::string(150, '(') + "1" + std::string(150, ')') + " }}"),
            "t.jinja:1: the template nests deeper than 100 levels");
  std::string blocks;
  for (int i = 0; i < 150; ++i) blocks += "{% if 1 %}";
  EXPECT_EQ(error_of(blocks), "t.jinja:1: the template nests deeper than 100 levels");
  std::string chain = "{{ 1";
  for (int i = 0; i < 100000; ++i) chain += " ~ 1";
  EXPECT_EQ(error_of(chain + " }}"), "t.jinja:1: expression nested deeper than 256 levels");
  EXPECT_EQ(error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
            "t.jinja:1: maximum recursion depth exceeded (400 nested calls)");
  EXPECT_EQ(error_of("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
            "t.jinja:1: the template ran more than 1000000 statements and loop iterations");
  // Recursion as real templates use it (nested tool schemas) stays well inside the bounds.
  EXPECT_EQ(render("{% macro f(n) %}{% if n > 0 %}[{{ f(n - 1) }}]{% endif %}{% endmacro %}{{ f(20) }}", "{}"),
            std::string(20, '[') + std::string(20, ']'));
}

}  // namespace
}  // namespace kvpipe
