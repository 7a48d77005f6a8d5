// gbnf_regex (GBNF grammars as RegexDfa patterns): the grammars of llama.cpp's own
// tests/test-grammar-integration.cpp and grammars/*.gbnf matched against the strings llama.cpp's
// grammar engine accepts and refuses there (an independent reference), then each syntax
// feature, the bounded unrolling of recursion, and the refusals with their messages.
#include "engine/grammar/gbnf.h"
#include "engine/grammar/regex_dfa.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

struct GrammarCase {
  const char* name;
  std::string grammar;
  std::vector<std::string> passing;
  std::vector<std::string> failing;
};

void expect_language(const GrammarCase& c, int max_depth = 3) {
  std::string pattern;
  try {
    pattern = gbnf_regex(c.grammar, max_depth);
  } catch (const std::invalid_argument& e) {
    ADD_FAILURE() << c.name << ": refused: " << e.what();
    return;
  }
  const RegexDfa dfa(pattern);
  for (const std::string& s : c.passing)
    EXPECT_TRUE(dfa.full_match(s)) << c.name << " should match \"" << s << "\"";
  for (const std::string& s : c.failing)
    EXPECT_FALSE(dfa.full_match(s)) << c.name << " should not match \"" << s << "\"";
}

// The message of gbnf_regex's refusal, or "" when it compiles.
std::string refusal(const std::string& grammar, int max_depth = 3) {
  try {
    gbnf_regex(grammar, max_depth);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_REFUSED(grammar, substring)                                                    \
  do {                                                                                        \
    const std::string message = refusal(grammar);                                             \
    EXPECT_NE(message.find(substring), std::string::npos) << "grammar: " << (grammar) << "\n" \
                                                          << "message: " << message;          \
  } while (0)

// From llama.cpp tests/test-grammar-integration.cpp (test_grammar calls, grammars and strings
// as there; github.com/ggml-org/llama.cpp).
TEST(Gbnf, LlamaCppIntegrationGrammars) {
  const std::vector<GrammarCase> cases = {
      {"simple grammar",
       R"g(
            root ::= expr
            expr ::= term ("+" term)*
            term ::= number
            number ::= [0-9]+)g",
       {"42", "1+2+3+4+5", "123+456"},
       {"+", "/ 3", "1+2+3+4+5+", "12a45"}},
      // Recursive (factor -> expression), every passing string within depth 3.
      {"medium complexity grammar",
       R"g(
            root ::= expression
            expression ::= term ws (("+"|"-") ws term)*
            term ::= factor ws (("*"|"/") ws factor)*
            factor ::= number | variable | "(" expression ")" | function-call
            number ::= [0-9]+
            variable ::= [a-zA-Z_][a-zA-Z0-9_]*
            function-call ::= variable ws "(" (expression ("," ws expression)*)? ")"
            ws ::= [ \t\n\r]?)g",
       {"42",
        "1*2*3*4*5",
        "x",
        "x+10",
        "x1+y2",
        "(a+b)*(c-d)",
        "func()",
        "func(x,y+2)",
        "a*(b+c)-d/e",
        "f(g(x),h(y,z))",
        "x + 10",
        "x1 + y2",
        "(a + b) * (c - d)",
        "func()",
        "func(x, y + 2)",
        "a * (b + c) - d / e",
        "f(g(x), h(y, z))",
        "123+456",
        "123*456*789-123/456+789*123",
        "123+456*789-123/456+789*123-456/789+123*456-789/123+456*789-123/456+789*123-456"},
       {"+", "/ 3x", "x + + y", "a * / b", "func(,)", "func(x y)", "(a + b", "x + y)",
        "a + b * (c - d", "42 +", "x +", "x + 10 +", "(a + b) * (c - d", "func(", "func(x, y + 2",
        "a * (b + c) - d /", "f(g(x), h(y, z)",
        "123+456*789-123/456+789*123-456/789+123*456-789/123+456*789-123/456+789*123-456/"}},
      {"special characters",
       R"g(
            root ::= ... "abc" ...
            )g",
       {"abcabcabc", "aaaabcccc", "🔵🟠✅abc❌🟠🔵"},
       {"aaabcccc", "aaaaabcccc", "aaaabccc", "aaaabccccc", "🔵🟠✅❌abc❌✅🟠🔵",
        "🔵🟠abc🟠🔵"}},
      {"* quantifier",
       R"g(root ::= "a"*)g",
       {"", "a", "aaaaa", "aaaaaaaaaaaaaaaaaa",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"},
       {"b", "ab", "aab", "ba", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab"}},
      {"+ quantifier",
       R"g(root ::= "a"+)g",
       {"a", "aaaaa", "aaaaaaaaaaaaaaaaaa",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"},
       {"", "b", "ab", "aab", "ba",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab"}},
      {"? quantifier", R"g(root ::= "a"?)g", {"", "a"}, {"b", "ab", "aa", "ba"}},
      {"mixed quantifiers",
       R"g(
            root ::= cons+ vowel* cons? (vowel cons)*
            vowel ::= [aeiouy]
            cons ::= [bcdfghjklmnpqrstvwxyz]
            )g",
       {"yes", "no", "noyes", "crwth", "four", "bryyyy"},
       {"yess", "yesno", "forty", "catyyy"}},
      {"simple exact repetition",
       R"g(
            root ::= [ab]{4}
        )g",
       {"aaaa", "bbbb", "abab"},
       {"a", "b", "aaaaa"}},
      {"simple min repetition",
       R"g(
            root ::= [ab]{4,}
        )g",
       {"aaaa", "aaaaab", "bbbb", "ababab"},
       {"", "aba"}},
      {"simple max repetition",
       R"g(
            root ::= [ab]{0,4}
        )g",
       {"", "a", "aa", "aaa", "aaab"},
       {"aaaaa"}},
      {"min / max repetition",
       R"g(
            root ::= ("0x" [A-F0-9]{2} " "?){3,5}
        )g",
       {"0xFF 0x12 0xAB", "0xFF 0x12 0xAB 0x00 0x00"},
       {"", "0xFF", "0xFF 0x12", "0xFF 0x12 0xAB 0x00 0x00 0x00"}},
      {"segfault",
       R"g(
            root ::= ( [x]* )*
        )g",
       {"", "x", "xx"},
       {"y", "yy"}},
  };
  for (const GrammarCase& c : cases) expect_language(c);
}

// llama.cpp's "hang" grammar: the pattern is small; RegexDfa refuses its automaton quickly.
TEST(Gbnf, LlamaCppHangGrammarIsRefusedByTheAutomaton) {
  const std::string pattern = gbnf_regex(R"g(
            root ::= (((((([^x]*){0,99}){0,99}){0,99}){0,99}){0,99}){0,99}
        )g");
  EXPECT_LT(pattern.size(), 100u);
  EXPECT_THROW(RegexDfa{pattern}, std::invalid_argument);
}

// llama.cpp's failure tests: a missing root, a missing reference, token grammars (which
// kvpipe refuses, matching characters only).
TEST(Gbnf, LlamaCppFailures) {
  EXPECT_EQ(refusal(R"g(
        rot ::= expr
        expr ::= term ("+" term)*
        term ::= number
        number ::= [0-9]+)g"),
            "no rule 'root'");
  EXPECT_EQ(refusal(R"g(root ::= expr
        expr ::= term ("+" term)*
        term ::= numero
        number ::= [0-9]+)g"),
            "line 3, column 18: undefined rule 'numero'");
  EXPECT_REFUSED(R"g(
            root ::= <[10]> content <[11]>
            content ::= (!<[11]>)*)g",
                 "line 2, column 22: token syntax");
  EXPECT_REFUSED(
      "root ::= reasoning+ content\nreasoning ::= <think> (!</think>)* </think>\ncontent ::= \"x\"",
      "line 2, column 15: token syntax");
}

// llama.cpp refuses left recursion (test_failure_left_recursion): its engine would loop. A
// byte automaton has no such limit: a rule's left recursion into itself is a repetition, and
// left recursion through other rules is unrolled as any recursion.
TEST(Gbnf, LeftRecursionIsARepetitionOrUnrolled) {
  expect_language(
      {"simple", R"g(root ::= "a" | root "a")g", {"a", "aa", "aaa", "aaaaaaaaaa"}, {"", "b", "ab"}});
  expect_language({"hard",
                   R"g(
        root ::= asdf
        asdf ::= "a" | foo "b"
        foo ::= "c" | asdf "d" | "e")g",
                   {"a", "cb", "eb", "adb", "cbdb"},
                   {"", "b", "ad", "cbd"}});
}

// From llama.cpp grammars/json.gbnf and grammars/arithmetic.gbnf (the files as there), with
// strings written here.
TEST(Gbnf, LlamaCppGrammarFiles) {
  expect_language(
      {"json.gbnf",
       R"g(# Grammar for subset of JSON - doesn't support full string or number syntax

root  ::= object
value ::= object | array | string | number | boolean

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}"

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]"

string  ::=
  "\"" (
    [\x20\x21\x23-\x5b\x5d-\U0010FFFF] | # any code point except " (\x22) and \ (\x5c)
    "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]) # escapes
  )* "\""

# Only plain integers currently
number  ::= "-"? [0-9]+ ws
boolean ::= ("true" | "false") ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= ([ \t\n] ws)?
)g",
       {"{}", "{\"a\":1}", "{ \"a\": -12 , \"b\": [true, \"x\\u00e9\\n\"]}",
        "{\"caf\xc3\xa9 \xf0\x9f\x98\x80\":false}", "{\"a\":{\"b\":{\"c\":[]}}}",
        "{\"a\":1   }" /* ws is right recursion: exact, any number of blanks */},
       {"", "[]", "{\"a\":1,}", "{\"a\" :1}", "{\"a\":\"\n\"}", "{\"a\":\"\\x\"}", "{'a':1}",
        "{\"a\":{\"b\":{\"c\":[1]}}}" /* four levels of values: past depth 3 */}});
  expect_language({"arithmetic.gbnf",
                   R"g(root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*
)g",
                   {"1+2=3\n", "x = 42\n", "(a +b) *c = (d)\n1=1\n", "((x_1))=y\n"},
                   {"", "1+2=3", "1+=3\n", "(1=1\n", "X=1\n", "(((x)))=1\n" /* depth 4 */}});
}

TEST(Gbnf, Literals) {
  expect_language({"escapes",
                   R"g(root ::= "a\nb\r\t\\\"\[\]\-\x41\u00e9\U0001F600")g",
                   {"a\nb\r\t\\\"[]-A\xc3\xa9\xf0\x9f\x98\x80"},
                   {"a\\nb", ""}});
  // Every character special to a regular expression stands for itself.
  expect_language({"regex specials",
                   R"g(root ::= ".^$|?*+()[]{}-&~# /")g",
                   {".^$|?*+()[]{}-&~# /"},
                   {"", "."}});
  expect_language({"utf-8 text",
                   R"g(root ::= "café ✓ 日本")g",
                   {"caf\xc3\xa9 \xe2\x9c\x93 \xe6\x97\xa5\xe6\x9c\xac"},
                   {"cafe"}});
  expect_language({"empty literal", R"g(root ::= "" "a" "")g", {"a"}, {""}});
  expect_language({"raw newline in a literal", "root ::= \"a\nb\"", {"a\nb"}, {"ab"}});
  expect_language({"nul", R"g(root ::= "a\x00b")g", {std::string("a\0b", 3)}, {"ab"}});
}

TEST(Gbnf, Classes) {
  expect_language(
      {"ranges and members", R"g(root ::= [a-cx0-9_-]+)g", {"abc", "x-_9"}, {"d", "", "A"}});
  expect_language(
      {"dash at the start and end", R"g(root ::= [-a] [a-])g", {"-a", "a-", "--"}, {"b-"}});
  expect_language({"escapes in a class",
                   R"g(root ::= [\]\[\\\-\n\x41-\x43\u00e9])g",
                   {"]", "[", "\\", "-", "\n", "B", "\xc3\xa9"},
                   {"D", "a"}});
  expect_language({"negated, ASCII members: every other character",
                   R"g(root ::= [^a-z"]+)g",
                   {"A", "1\n", "\xc3\xa9\xe6\x97\xa5", "\xf0\x9f\x98\x80"},
                   {"a", "\"", "Ab"}});
  expect_language({"outside ASCII",
                   R"g(root ::= [à-ÿ]+ [\u3040-\u309F])g",
                   {"\xc3\xa0\xc3\xbf\xe3\x81\x82"},
                   {"a\xe3\x81\x82", "\xc3\xa0"}});
  // All characters from ']' on: every character outside ASCII, exact.
  expect_language({"to the last code point",
                   R"g(root ::= [\x5d-\U0010FFFF])g",
                   {"]", "~", "\xc3\xa9", "\xf4\x8f\xbf\xbf"},
                   {"\\", "A"}});
  // A negated class that leaves out a character outside ASCII takes every other one.
  expect_language({"negated with a member outside ASCII",
                   R"g(root ::= [^aé])g",
                   {"b", "\n", "\xc3\xa8", "\xe4\xb8\xad"},
                   {"a", "\xc3\xa9"}});
  expect_language({"a range wider than any list",
                   R"g(root ::= [一-鿿]+ [^\x00-\x7f\u0100])g",
                   {"\xe4\xb8\x80\xe9\xbf\xbf\xc3\xbf", "\xe4\xb8\xad\xc4\x81"},
                   {"\xe3\x80\x80\xc3\xbf", "\xe4\xb8\x80\xc4\x80", "\xe4\xb8\x80a"}});
  expect_language({"negated, short complement outside ASCII",
                   R"g(root ::= [^\x00-\x7f\u0100-\U0010FFFF])g",
                   {"\xc2\x80", "\xc3\xbf"},
                   {"a", "\xc4\x80"}});
  expect_language({"'.' takes any character, a newline too",
                   R"g(root ::= "<" . ">")g",
                   {"<a>", "<\n>", "<\xe6\x97\xa5>"},
                   {"<>", "<ab>"}});
}

TEST(Gbnf, RulesGroupsQuantifiers) {
  expect_language({"names with digits, dashes, underscores",
                   "root ::= item-1 item_2\nitem-1 ::= \"a\"\nitem_2 ::= \"b\"",
                   {"ab"},
                   {"a"}});
  expect_language(
      {"rules defined after use", "root ::= a | b\nb ::= \"y\"\na ::= \"x\"", {"x", "y"}, {"xy"}});
  expect_language({"groups and alternation",
                   R"g(root ::= ("a" | "b" "c")+ ("d" | ))g",
                   {"a", "bcad", "aaa"},
                   {"b", "dd"}});
  expect_language({"an empty alternative", R"g(root ::= "x" | )g", {"x", ""}, {"xx"}});
  expect_language({"an empty rule", "root ::=\n", {""}, {"a"}});
  expect_language({"counts",
                   R"g(root ::= "a"{2} "b"{1,} "c"{0,2} "d"{ 1 , 2 } "e"{0})g",
                   {"aabd", "aabbbccdd"},
                   {"abd", "aad", "aabcccd", "aabddd", "aabde"}});
  expect_language({"a quantifier on a quantified item",
                   R"g(root ::= "ab"{2}{2} "c"?*)g",
                   {"abababab", "ababababcc"},
                   {"ababab"}});
  expect_language(
      {"spaces before a quantifier", R"g(root ::= "a" * "b" +)g", {"b", "aabb"}, {"a"}});
  expect_language(
      {"one rule used many times", "root ::= d d \"-\" d d\nd ::= [0-9]", {"12-34"}, {"1-34"}});
}

TEST(Gbnf, CommentsAndLines) {
  expect_language({"comments and rules over lines",
                   R"g(# a leading comment
root ::= # after ::=
  "a" | # after '|'
  "b" (
    "c" # inside parentheses
    | "d"
  )
# between rules

other ::= "unused"
)g",
                   {"a", "bc", "bd"},
                   {"ab", "b"}});
  expect_language(
      {"CRLF line ends", "root ::= a\r\na ::= \"x\" |\r\n  \"y\"\r\n", {"x", "y"}, {"xy"}});
  expect_language({"'#' inside a literal and a class", R"g(root ::= "#" [#])g", {"##"}, {"#"}});
}

TEST(Gbnf, RecursionIsUnrolledToMaxDepth) {
  // Depth 1 is root's first expansion: ((x)) nests root three times, (((x))) four.
  const std::string nested = R"g(root ::= "(" root ")" | "x")g";
  expect_language({"depth 3", nested, {"x", "(x)", "((x))"}, {"(((x)))", "()"}});
  expect_language({"depth 4", nested, {"(((x)))"}, {"((((x))))"}}, 4);
  expect_language({"depth 1: no recursion", nested, {"x"}, {"(x)"}}, 1);
  // Through other rules: each rule counts its own nesting.
  expect_language(
      {"mutual recursion",
       "root ::= list\nlist ::= \"[\" (item (\",\" item)*)? \"]\"\nitem ::= \"0\" | list",
       {"[]", "[0,[0,[]]]", "[[[]]]"},
       {"[[[[]]]]", "[0,[0,[0,[]]]]"}});
  // An optional part that needs one more level is dropped at the deepest level.
  expect_language({"right recursion through another rule",
                   "root ::= \"<\" ws \">\"\nws ::= ([ \\t\\n] more)?\nmore ::= ws",
                   {"<>", "< >", "<  >"},
                   {"<   >"}});
}

// A rule that recurs into itself only at the end (or only at the start) of its texts is a
// regular language, and exact whatever the depth.
TEST(Gbnf, LinearRecursionIntoItselfIsExact) {
  expect_language({"optional tail", "root ::= \"<\" ws \">\"\nws ::= ([ \\t\\n] ws)?",
                   {"<>", "< >", "<  >", "<\t\n \n \t>"},
                   {"<x>", "<", " <>"}});
  expect_language({"list", "root ::= items\nitems ::= [0-9] (\",\" items)?",
                   {"1", "1,2", "1,2,3,4,5,6,7,8,9,0"},
                   {"", "1,", ",1", "1,,2", "12"}});
  expect_language({"several alternatives", "root ::= \"a\" root | \"b\" root | \"c\" | \"d\" \"e\"",
                   {"c", "de", "abababc", "bbbbde"},
                   {"", "a", "ab", "ca", "dea"}});
  expect_language({"left, with a separator", "root ::= root \",\" [0-9] | [0-9]",
                   {"1", "1,2", "1,2,3,4,5,6"},
                   {"", ",1", "1,", "1,,2"}});
  expect_language({"R ::= R | B is B", "root ::= root | \"x\"", {"x"}, {"", "xx"}});
  // In the middle it is not regular: unrolled.
  expect_language({"middle", "root ::= \"(\" root \")\" | \"x\"", {"((x))"}, {"(((x)))"}});
  // A rule that also comes back to itself through another is unrolled, not rewritten.
  expect_language({"also through another rule",
                   "root ::= \"a\" root | \"[\" other \"]\" | \"x\"\nother ::= root",
                   {"x", "aax", "[x]", "[ax]"},
                   {"aaax", "a[ax]"} /* four levels of root */});
}

TEST(Gbnf, Refusals) {
  EXPECT_EQ(refusal("root ::= \"a\"\nother ::= \"b\" value"),
            "line 2, column 15: undefined rule 'value'");
  EXPECT_EQ(refusal(""), "no rule 'root'");
  EXPECT_EQ(refusal("# nothing\n"), "no rule 'root'");
  EXPECT_EQ(refusal("root ::= \"abc"), "line 1, column 10: unterminated string");
  EXPECT_REFUSED("root ::= [abc", "line 1, column 10: unterminated character class");
  EXPECT_REFUSED("root ::= [a-", "unterminated character class");
  EXPECT_REFUSED("root ::= (\"a\" | \"b\"", "line 1, column 10: unterminated group");
  EXPECT_REFUSED("root ::= \"a\" )", "line 1, column 14: an unmatched ')'");
  EXPECT_REFUSED("root ::= (\"a\" ]", "line 1, column 15: unexpected ']' inside parentheses");
  EXPECT_REFUSED(R"g(root ::= "\q")g", "line 1, column 11: unknown escape '\\q'");
  EXPECT_REFUSED(R"g(root ::= [\d])g", "unknown escape '\\d'");
  EXPECT_REFUSED(R"g(root ::= "\x4")g", "expected 2 hexadecimal digits after '\\x'");
  EXPECT_REFUSED(R"g(root ::= "\uD800")g", "not a Unicode character");
  EXPECT_REFUSED(R"g(root ::= "\U00110000")g", "not a Unicode character");
  EXPECT_REFUSED("root ::= \"\xc3\"", "invalid UTF-8");
  EXPECT_REFUSED("root ::= * \"a\"", "line 1, column 10: a quantifier '*' with nothing to repeat");
  EXPECT_REFUSED("root ::= \"a\"{2,1}", "n below m");
  EXPECT_REFUSED("root ::= \"a\"{1001}", "a repetition count above 1000");
  EXPECT_REFUSED("root ::= \"a\"{x}", "expected a number after '{'");
  EXPECT_REFUSED("root ::= \"a\"{1;}", "expected ',' or '}'");
  EXPECT_REFUSED("root ::= \"a\"{1,2", "expected '}'");
  EXPECT_REFUSED("root ::= []", "an empty character class");
  EXPECT_REFUSED("root ::= [^\\x00-\\U0010FFFF]", "takes no character");
  EXPECT_EQ(refusal("root ::= [^a\\u0100]"), "");  // compiles (see Classes)
  EXPECT_REFUSED("root ::= <[10]>", "token syntax");
  EXPECT_REFUSED("root ::= !<[11]>", "token syntax");
  EXPECT_REFUSED("root ::= \"a\"\nroot ::= \"b\"",
                 "line 2, column 1: rule 'root' is defined twice");
  EXPECT_REFUSED("root ::= \"a\"\n  \"b\"", "line 2, column 3: expected a rule name");
  EXPECT_REFUSED("root = \"a\"", "expected '::=' after the rule name 'root'");
  EXPECT_REFUSED("root ::= \"a\" @", "unexpected '@' in rule 'root'");
  EXPECT_REFUSED(std::string("root ::= ") + std::string(101, '(') + "\"a\"" + std::string(101, ')'),
                 "parentheses nested deeper than 100");
  EXPECT_REFUSED("root ::= \"a\"" + std::string(17, '?'), "more than 16 quantifiers in a row");
  // Recursion without an end, directly or through other rules (a reachable rule only).
  EXPECT_EQ(refusal("root ::= \"a\" root"),
            "line 1, column 1: rule 'root' recurses without an end");
  EXPECT_EQ(refusal("root ::= \"<\" a \">\"\na ::= \"x\" b\nb ::= \"y\" a | \"z\" b"),
            "line 2, column 1: rule 'a' recurses without an end");
  EXPECT_REFUSED("root ::= \"a\" b?\nb ::= b \"x\"", "rule 'b' recurses without an end");
  EXPECT_EQ(refusal("root ::= \"a\"\nunused ::= unused"), "");
  // Blow-up: 2^30 copies of "x", and recursion too deep to nest.
  std::string doubling = "root ::= r0 r0\n";
  for (int i = 0; i < 30; ++i)
    doubling += "r" + std::to_string(i) + " ::= r" + std::to_string(i + 1) + " r" +
                std::to_string(i + 1) + "\n";
  doubling += "r30 ::= \"x\"\n";
  EXPECT_REFUSED(doubling, "the grammar is too large once its recursion is unrolled to depth 3");
  EXPECT_NE(refusal(R"g(root ::= "(" root ")" | "x")g", 1000)
                .find("too large once its recursion is unrolled to depth 1000"),
            std::string::npos);
  EXPECT_NE(refusal("root ::= \"a\"", 0).find("max_depth must be at least 1"), std::string::npos);
}

}  // namespace
}  // namespace kvpipe
