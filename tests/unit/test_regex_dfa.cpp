// RegexDfa (regular expressions as byte automata) and TokenConstraint (the token masks they
// give): matches against Python's re.fullmatch meaning, written out by hand, the refusals,
// and the masks of a small vocabulary state by state.
#include "engine/grammar/json_schema.h"
#include "engine/grammar/regex_dfa.h"
#include "engine/grammar/token_constraint.h"
#include "engine/text/unicode_text.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

struct MatchCase {
  const char* pattern;
  std::vector<std::string> matches;
  std::vector<std::string> misses;
};

TEST(RegexDfa, MatchesAsPythonsFullmatch) {
  const std::vector<MatchCase> cases = {
      {"abc", {"abc"}, {"", "ab", "abcd", "xabc"}},
      {"a|bc|", {"a", "bc", ""}, {"b", "abc"}},
      {"(ab)*c", {"c", "abc", "ababc"}, {"ab", "abac", "aabc"}},
      {"a+b?", {"a", "aaab"}, {"", "b", "abb"}},
      {"x{3}", {"xxx"}, {"xx", "xxxx"}},
      {"x{2,}", {"xx", "xxxxx"}, {"x"}},
      {"x{,2}y", {"y", "xy", "xxy"}, {"xxxy"}},
      {"x{1,3}?", {"x", "xxx"}, {"", "xxxx"}},
      {"\\d{3}-\\d{4}", {"555-1234"}, {"5551234", "55-1234", "abc-defg"}},
      {"[a-c]+[^a-c]", {"abz", "c9", "a\xc3\xa9"}, {"ab", "abc", "zz"}},
      {"[^\\d]", {"x", "-"}, {"5", "\xc3\xa9"}},  // with a class escape: ASCII alone
      {"[-a]", {"-", "a"}, {"b"}},
      {"[]a]", {"]", "a"}, {"b"}},
      {"\\w+@\\w+\\.(com|org)", {"a_b@c9.com", "x@y.org"}, {"a@b.net", "@b.com", "a b@c.com"}},
      {"\\s\\S", {" x", "\tA"}, {"  ", "xx"}},
      {"^(?:yes|no)$", {"yes", "no"}, {"yesno", ""}},
      {"(?P<year>\\d{4})-\\d\\d", {"2024-01"}, {"24-01"}},
      {"\\{\"a\": \\d\\}", {"{\"a\": 7}"}, {"{\"a\": 77}"}},
      {"caf\\u00e9|na\\xefve", {"caf\xc3\xa9", "na\xc3\xafve"}, {"cafe"}},
      {"[é-]x", {"\xc3\xa9x", "-x"}, {"ex"}},
      {".{2}", {"ab", "\xc3\xa9\xe4\xb8\xad", "\xf0\x9f\x98\x80z"}, {"a", "a\n", "\xc3", "\xc3\x28z"}},
      {"a.c", {"abc", "a\xe2\x82\xac" "c"}, {"a\nc", "ac"}},
      {"\\.\\*\\+\\?", {".*+?"}, {"a*+?"}},
      {"x{a}", {"x{a}"}, {"xa"}},  // not a repetition: literal braces, as in Python
      {"[a-é]+", {"a", "z\xc3\xa9", "\xc2\x80"}, {"\xc3\xaa", "`"}},
      {"[^aé]", {"b", "\xc3\xa8", "\xf0\x9f\x98\x80", "\n"}, {"a", "\xc3\xa9"}},
      {"[\u00ff-\u0801]", {"\xc3\xbf", "\xc4\x80", "\xdf\xbf", "\xe0\xa0\x80", "\xe0\xa0\x81"},
       {"\xc3\xbe", "\xe0\xa0\x82"}},
      {"[\xf0\x9f\x98\x80-\xf0\x9f\x99\x8f]", {"\xf0\x9f\x98\x80", "\xf0\x9f\x98\xbf", "\xf0\x9f\x99\x8f"},
       {"\xf0\x9f\x99\x90", "\xf0\x9f\x97\xbf"}},
  };
  for (const MatchCase& c : cases) {
    const RegexDfa dfa(c.pattern);
    for (const std::string& m : c.matches) EXPECT_TRUE(dfa.full_match(m)) << c.pattern << " should match " << m;
    for (const std::string& m : c.misses) EXPECT_FALSE(dfa.full_match(m)) << c.pattern << " should not match " << m;
  }
}

TEST(RegexDfa, EveryStateCanStillReachAMatch) {
  const RegexDfa dfa("a(b|c)d");
  int32_t s = dfa.walk(dfa.start(), "a");
  ASSERT_NE(s, RegexDfa::kDead);
  EXPECT_FALSE(dfa.accepting(s));
  EXPECT_TRUE(dfa.continues(s));
  EXPECT_EQ(dfa.next(s, 'x'), RegexDfa::kDead);
  s = dfa.walk(s, "cd");
  EXPECT_TRUE(dfa.accepting(s));
  EXPECT_FALSE(dfa.continues(s));
  // A branch that can never finish is pruned: after "x" only "y" leads to a match.
  const RegexDfa pruned("x(y|[^\\x00-\\x7f\\d])");
  EXPECT_NE(pruned.walk(pruned.start(), "xy"), RegexDfa::kDead);
  for (int b = 0; b < 256; ++b) {
    if (b != 'y') {
      EXPECT_EQ(pruned.next(pruned.walk(pruned.start(), "x"), static_cast<uint8_t>(b)), RegexDfa::kDead) << b;
    }
  }
}

// A class's ranges of characters outside ASCII take each character between their ends
// (those whose UTF-8 encodings differ in length, in their lead byte or in a continuation
// byte alike) and no other, and never the surrogates.
TEST(RegexDfa, RangesOfAnyCharactersTakeExactlyTheirCharacters) {
  const std::vector<std::pair<uint32_t, uint32_t>> ranges = {
      {0x41, 0xE9},       {0xC1, 0x7FF},       {0x7C0, 0x803},     {0x3041, 0x3F0A}, {0xD700, 0xE0FF},
      {0xFFC0, 0x10041},  {0x1F600, 0x1F64F},  {0x10000, 0x10FFFF}, {0x9FFF, 0x9FFF}, {0x80, 0x10FFFF}};
  for (const auto& [lo, hi] : ranges) {
    const std::string pattern = "[" + text::codepoint_to_utf8(lo) + "-" + text::codepoint_to_utf8(hi) + "]";
    const RegexDfa dfa(pattern);
    std::vector<uint32_t> probes;
    for (uint32_t at : {lo, hi, 0x7Fu, 0x7FFu, 0xFFFFu, 0x10000u, 0xD7FFu, 0xE000u, 0x10FFFFu})
      for (uint32_t d = 0; d < 130; ++d) {
        if (at >= d) probes.push_back(at - d);
        probes.push_back(at + d);
      }
    for (uint32_t cp : probes) {
      if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) continue;
      ASSERT_EQ(dfa.full_match(text::codepoint_to_utf8(cp)), cp >= lo && cp <= hi) << std::hex << lo << "-" << hi << " " << cp;
    }
    EXPECT_FALSE(dfa.full_match("\xed\xa0\x80")) << pattern;  // a surrogate's encoding
  }
}

TEST(RegexDfa, RefusesWhatItDoesNotSupportByName) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"(a", "unterminated ("},       {"a)", "unmatched ')'"},          {"[ab", "unterminated ["},
      {"(?=a)", "lookaround"},        {"(?i)a", "inline flags"},        {"\\1", "\\1"},
      {"\\bword", "\\b"},             {"*a", "nothing to repeat"},      {"a{3,1}", "m < n"},
      {"a{5000}", "above 1000"},      {"[z-a]", "below its start"},     {"[\xf4\x90\x80\x80]", "beyond U+10FFFF"},
      {"a^b", "anchor"},              {"[^\\x00-\\x7f\\d]", "matches nothing"}, {"a++", "possessive"},
      {"\xff", "UTF-8"},              {"(a{1000}){1000}", "too complex"}, {"a{2}{3}", "multiple repeat"},
      {"a**", "multiple repeat"}};
  for (const auto& [pattern, want] : cases) {
    try {
      RegexDfa dfa(pattern);
      ADD_FAILURE() << pattern << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << pattern << ": " << e.what();
    }
  }
}

TEST(RegexDfa, EscapedTextMatchesItselfAlone) {
  for (const std::string text : {"a.b*c", "(x|y)", "[1-2]{3}", "tab\there\nnew", "$5 ^ 2 \\ 3?", "a-b#c&d~e"}) {
    const RegexDfa dfa(regex_escape(text));
    EXPECT_TRUE(dfa.full_match(text)) << text;
    EXPECT_FALSE(dfa.full_match(text + "x")) << text;
  }
}

std::shared_ptr<TokenVocabulary> small_vocabulary() {
  auto v = std::make_shared<TokenVocabulary>();
  //          0: EOS (special)  1     2     3      4       5      6     7
  v->bytes = {"",              "a", "b", "ab", "abc", " a",  "ba", "\xc3"};
  v->eos_ids = {0};
  v->index();
  return v;
}

std::vector<bool> allowed_after(const TokenConstraint& c, const std::vector<int64_t>& output, int64_t vocab,
                                int64_t tokens_left = -1) {
  std::vector<float> logits(vocab, 1.0f);
  c.mask(logits.data(), vocab, output.data(), static_cast<int64_t>(output.size()), tokens_left);
  std::vector<bool> out;
  for (float x : logits) out.push_back(std::isfinite(x));
  return out;
}

TEST(TokenConstraint, MasksTokensByTheStateTheOutputReached) {
  auto vocab = small_vocabulary();
  const TokenConstraint c(std::make_shared<const RegexDfa>("(ab)+"), vocab);
  // Start: "a" and "ab" begin a match; "abc" leaves it; EOS only at a whole match.
  EXPECT_EQ(allowed_after(c, {}, 8), (std::vector<bool>{false, true, false, true, false, false, false, false}));
  EXPECT_EQ(allowed_after(c, {1}, 8), (std::vector<bool>{false, false, true, false, false, false, true, false}));
  EXPECT_EQ(allowed_after(c, {3}, 8), (std::vector<bool>{true, true, false, true, false, false, false, false}));
  EXPECT_EQ(allowed_after(c, {1, 6}, 8), (std::vector<bool>{false, false, true, false, false, false, true, false}));
  EXPECT_EQ(c.state_after(std::vector<int64_t>{4}.data(), 1), RegexDfa::kDead);
  // A state seen before costs a lookup: its mask is not built again.
  const size_t cached = c.cached_states();
  EXPECT_LE(cached, 4u);
  allowed_after(c, {1}, 8);
  allowed_after(c, {3, 1}, 8);
  EXPECT_EQ(c.cached_states(), cached);
  // Rows longer than the vocabulary (a padded head) are masked beyond it.
  EXPECT_FALSE(allowed_after(c, {}, 10)[9]);
}

TEST(TokenConstraint, NearTheEndOfItsBudgetOnlyTokensThatStillFinishAreKept) {
  auto vocab = small_vocabulary();
  const TokenConstraint c(std::make_shared<const RegexDfa>("(ab)+(ba)?"), vocab);
  const RegexDfa& probe = RegexDfa("(ab)+(ba)?");
  EXPECT_EQ(probe.distance(probe.start()), 2);
  auto allowed = [&](const std::vector<int64_t>& output, int64_t left) { return allowed_after(c, output, 8, left); };
  // Plenty left: "a" and "ab" start a match.
  EXPECT_EQ(allowed({}, 50), (std::vector<bool>{false, true, false, true, false, false, false, false}));
  // Two tokens left (this one and EOS): only "ab", which completes a match at once.
  EXPECT_EQ(allowed({}, 2), (std::vector<bool>{false, false, false, true, false, false, false, false}));
  // After "ab" with two left: EOS, or "ab"/"ba" which end at a match; "a" (one byte short) is out.
  EXPECT_EQ(allowed({3}, 2), (std::vector<bool>{true, false, false, true, false, false, true, false}));
  // The last token: a match already made ends with EOS, or a token that makes one.
  EXPECT_EQ(allowed({3}, 1), (std::vector<bool>{true, false, false, true, false, false, true, false}));
}

TEST(TokenConstraint, FirstTokenLosesTheSpaceASentencePieceDecoderDrops) {
  auto vocab = small_vocabulary();
  vocab->strips_leading_space = true;
  vocab->index();
  const TokenConstraint c(std::make_shared<const RegexDfa>("ab"), vocab);
  // " a" writes "a" as the first token of a SentencePiece output, " a" after it.
  EXPECT_TRUE(allowed_after(c, {}, 8)[5]);
  EXPECT_EQ(c.state_after(std::vector<int64_t>{5, 2}.data(), 2), c.state_after(std::vector<int64_t>{1, 2}.data(), 2));
  const TokenConstraint spaced(std::make_shared<const RegexDfa>("a a"), vocab);
  EXPECT_TRUE(allowed_after(spaced, {1}, 8)[5]);
}

TEST(TokenConstraint, MasksEqualAWalkOfEveryTokenAlone) {
  // Every string of 1 to 3 bytes over an alphabet the patterns treat in different ways
  // (tokens spelled alike in an automaton's classes share one walk; the mask must not care).
  auto v = std::make_shared<TokenVocabulary>();
  v->bytes.push_back("");  // EOS
  const std::string alphabet = "ab1\"{} \xc3";
  for (char x : alphabet) {
    v->bytes.push_back(std::string(1, x));
    for (char y : alphabet) {
      v->bytes.push_back(std::string{x, y});
      for (char z : alphabet) v->bytes.push_back(std::string{x, y, z});
    }
  }
  v->eos_ids = {0};
  v->index();
  const int64_t vocab = static_cast<int64_t>(v->bytes.size());
  // The strings' patterns send most first bytes down one chain of states (counted, looping,
  // or parting ways after a few bytes), which the masks take a shorter way through.
  for (const char* pattern : {"[ab]{2,5}1?", "\\{\"a\": [0-9]+\\}", "(ab|ba)*\"[^\"]{0,4}\"", "\u00e9a|b+",
                              "\"[^\"]*\"", "[^\"]{0,2}(a[^\"]|b1)[^\"]*\"\\}?"}) {
    const RegexDfa dfa(pattern);
    const TokenConstraint c(std::make_shared<const RegexDfa>(pattern), v);
    // Outputs along a few paths: every single token that keeps the text alive, then one more.
    std::vector<std::vector<int64_t>> outputs = {{}};
    for (int64_t id = 1; id < vocab; ++id)
      if (dfa.walk(dfa.start(), v->bytes[id]) != RegexDfa::kDead) outputs.push_back({id});
    for (const std::vector<int64_t>& out : outputs) {
      const std::vector<bool> got = allowed_after(c, out, vocab);
      const int32_t state = c.state_after(out.data(), static_cast<int64_t>(out.size()));
      for (int64_t id = 1; id < vocab; ++id)
        ASSERT_EQ(got[id], dfa.walk(state, v->bytes[id]) != RegexDfa::kDead) << pattern << " token " << id;
      ASSERT_EQ(got[0], dfa.accepting(state)) << pattern;
      // Two tokens left: those that end at most a byte from a match, where any does.
      const std::vector<bool> near = allowed_after(c, out, vocab, 3);
      std::vector<bool> finishing(vocab, false);
      bool any = dfa.accepting(state);
      for (int64_t id = 1; id < vocab; ++id) {
        const int32_t end = dfa.walk(state, v->bytes[id]);
        finishing[id] = end != RegexDfa::kDead && dfa.distance(end) <= 1;
        any = any || finishing[id];
      }
      for (int64_t id = 1; id < vocab; ++id)
        ASSERT_EQ(near[id], any ? finishing[id] : got[id]) << pattern << " token " << id << " near the end";
    }
  }
}

TEST(ConstraintStats, CountEveryMaskAndCompileAndWhatTheCachesHold) {
  ConstraintCache cache(small_vocabulary());
  const auto stats = cache.stats();
  auto total = [](const ConstraintStats::Histogram& h) {
    int64_t n = 0;
    for (int64_t c : h.counts) n += c;
    return n;
  };
  {
    const auto c = cache.get("(ab)+", 100);
    EXPECT_EQ(cache.get("(ab)+", 100), c);  // the second request compiles nothing
    for (int i = 0; i < 3; ++i) {
      allowed_after(*c, {}, 8);
      allowed_after(*c, {1}, 8);
    }
    const ConstraintStats::Snapshot s = stats->snapshot();
    EXPECT_EQ(total(s.mask), 6);
    EXPECT_EQ(s.mask.counts.size(), s.mask.bounds.size() + 1);
    EXPECT_GT(s.mask.sum, 0.0);
    EXPECT_EQ(total(s.compile), 1);
    EXPECT_EQ(s.cached_states, static_cast<int64_t>(c->cached_states()));
    EXPECT_GE(s.cache_bytes, static_cast<int64_t>(2 * sizeof(int32_t) * c->cached_states()));
  }
  // Pushed out of the cache by newer patterns and held by no request: its masks are gone.
  for (int i = 0; i < 70; ++i) cache.get("x{" + std::to_string(i + 1) + "}", 100);
  EXPECT_EQ(total(stats->snapshot().compile), 71);
  EXPECT_EQ(stats->snapshot().cached_states, 0);
  EXPECT_EQ(stats->snapshot().cache_bytes, 0);
}

TEST(JsonSchemaRegex, MatchesTheJsonTheSchemaAllowsAsJsonDumpsWritesIt) {
  const nlohmann::ordered_json schema = nlohmann::ordered_json::parse(R"({
    "$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"],
                      "additionalProperties": false}},
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                   "pet": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}]},
                   "born": {"type": "string", "format": "date"}},
    "required": ["name", "pet"], "additionalProperties": false})");
  const RegexDfa dfa(json_schema_regex(schema), 50000);
  for (const std::string ok : {R"({"name": "Ann", "pet": null})", R"({"name": "", "age": -3, "pet": {"kind": "cat"}})",
                               R"({"name": "Bo", "tags": [], "pet": null, "born": "2020-02-29"})",
                               R"({"name": "Bo", "tags": ["a", "b\n"], "pet": {"kind": "dog"}})"})
    EXPECT_TRUE(dfa.full_match(ok)) << ok;
  for (const std::string bad : {R"({"pet": null})", R"({"name": "Ann"})", R"({"name": "Annabel", "pet": null})",
                                R"({"name": "A", "pet": {"kind": "cow"}})", R"({"name": "A", "tags": ["a", "b", "c"], "pet": null})",
                                R"({"pet": null, "name": "A"})", R"({"name":"A","pet":null})",
                                R"({"name": "A", "age": 1.5, "pet": null})", R"({"name": "A", "born": "2020-13-01", "pet": null})"})
    EXPECT_FALSE(dfa.full_match(bad)) << bad;
}

// "format": "date" takes the dates Python's date.fromisoformat takes (what jsonschema checks):
// each month's own days and February 29 only in leap years.
TEST(JsonSchemaRegex, DatesAreCalendarDates) {
  const RegexDfa dfa(json_schema_regex(nlohmann::ordered_json::parse(R"({"type": "string", "format": "date"})")), 50000);
  for (const std::string ok : {"2023-01-31", "2023-02-28", "2024-02-29", "2000-02-29", "0004-02-29", "2023-04-30",
                               "2023-12-31", "0001-01-01", "9999-12-31"})
    EXPECT_TRUE(dfa.full_match("\"" + ok + "\"")) << ok;
  for (const std::string bad : {"2023-02-30", "2023-02-29", "1900-02-29", "2100-02-29", "2023-04-31", "2023-06-31",
                                "2023-09-31", "2023-11-31", "2023-01-32", "0000-01-01", "2023-00-10", "2023-01-00"})
    EXPECT_FALSE(dfa.full_match("\"" + bad + "\"")) << bad;
}

TEST(JsonSchemaRegex, OptionalPropertiesAndFreeValues) {
  const RegexDfa dfa(json_schema_regex(nlohmann::ordered_json::parse(
      R"({"properties": {"a": {"type": "integer"}, "b": {}, "c": {"const": [1, {"x": true}]}}})")), 50000);
  for (const std::string ok : {"{}", R"({"b": [1, "x", {"k": null}]})", R"({"a": 1, "c": [1, {"x": true}]})",
                               R"({"c": [1, {"x": true}]})"})
    EXPECT_TRUE(dfa.full_match(ok)) << ok;
  for (const std::string bad : {R"({, "a": 1})", R"({"a": 1, })", R"({"c": [1]})"}) EXPECT_FALSE(dfa.full_match(bad)) << bad;
  const auto t0 = std::chrono::steady_clock::now();
  const RegexDfa any(json_object_regex(), 50000);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  for (const std::string ok : {"{}", R"({"a": {"b": [1, 2.5e3, "c"]}, "d": false})"}) EXPECT_TRUE(any.full_match(ok)) << ok;
  for (const std::string bad : {"[]", "{", R"({"a": 01})", R"({a: 1})"}) EXPECT_FALSE(any.full_match(bad)) << bad;
  std::printf("json_object automaton: %d states, %.1f ms\n", any.num_states(), ms);
}

TEST(JsonSchemaRegex, RecursiveRefsNestThreeLevelsDeep) {
  // A linked list: "next" is optional, so the fourth level leaves it out.
  const RegexDfa list(json_schema_regex(nlohmann::ordered_json::parse(R"({
      "$defs": {"Node": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/Node"}},
                         "required": ["v"]}},
      "$ref": "#/$defs/Node"})")),
                      50000);
  for (const std::string ok : {R"({"v": 1})", R"({"v": 1, "next": {"v": 2}})", R"({"v": 1, "next": {"v": 2, "next": {"v": 3}}})"})
    EXPECT_TRUE(list.full_match(ok)) << ok;
  EXPECT_FALSE(list.full_match(R"({"v": 1, "next": {"v": 2, "next": {"v": 3, "next": {"v": 4}}}})"));
  // A tree of children (an array that may be empty) and a nullable parent (anyOf with null).
  const RegexDfa tree(json_schema_regex(nlohmann::ordered_json::parse(R"({
      "$defs": {"T": {"type": "object", "properties": {
          "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}, "maxItems": 2},
          "up": {"anyOf": [{"$ref": "#/$defs/T"}, {"type": "null"}]}}, "required": ["kids", "up"]}},
      "$ref": "#/$defs/T"})")),
                      50000);
  EXPECT_TRUE(tree.full_match(R"({"kids": [], "up": null})"));
  EXPECT_TRUE(tree.full_match(R"({"kids": [{"kids": [{"kids": [], "up": null}], "up": null}], "up": null})"));
  EXPECT_FALSE(tree.full_match(R"({"kids": [{"kids": [{"kids": [{"kids": [], "up": null}], "up": null}], "up": null}], "up": null})"));
}

// oneOf is exact where its alternatives exclude each other (a discriminated union): an answer
// then matches one alternative only.
TEST(JsonSchemaRegex, OneOfOfAlternativesThatExcludeEachOther) {
  const RegexDfa dfa(json_schema_regex(nlohmann::ordered_json::parse(
      R"({"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer"}},
                     "required": ["kind", "n"], "additionalProperties": false},
                    {"type": "object", "properties": {"kind": {"const": "b"}, "n": {"type": "number"}},
                     "required": ["kind", "n"], "additionalProperties": false},
                    {"type": "boolean"}]})")));
  EXPECT_TRUE(dfa.full_match(R"({"kind": "a", "n": 5})"));
  EXPECT_TRUE(dfa.full_match(R"({"kind": "b", "n": 5.5})"));
  EXPECT_TRUE(dfa.full_match("true"));
  EXPECT_FALSE(dfa.full_match(R"({"kind": "c", "n": 5})"));
}

// The numbers a bounded integer or number takes: each text below matches exactly where its
// value is inside the bounds (a float64 check), bar "-0", which is never written.
TEST(JsonSchemaRegex, NumberBoundsTakeTheValuesInsideThem) {
  struct Case {
    const char* schema;
    double lo, hi;  // +-inf: none
    bool lo_open, hi_open;
  };
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<Case> integers = {
      {R"({"type": "integer", "minimum": -37, "maximum": 1050})", -37, 1050, false, false},
      {R"({"type": "integer", "exclusiveMinimum": -37, "exclusiveMaximum": 1050})", -37, 1050, true, true},
      {R"({"type": "integer", "minimum": 0})", 0, inf, false, false},
      {R"({"type": "integer", "minimum": 18, "maximum": 130})", 18, 130, false, false},
      {R"({"type": "integer", "maximum": -5})", -inf, -5, false, false},
      {R"({"type": "integer", "minimum": 2.5, "exclusiveMaximum": 199.5})", 2.5, 199.5, false, true},
      {R"({"type": "integer", "minimum": 7, "exclusiveMinimum": 9, "maximum": 7000})", 9, 7000, true, false},
      {R"({"type": "integer", "minimum": 7, "exclusiveMinimum": true, "maximum": 70})", 7, 70, true, false},
      {R"({"type": "integer", "minimum": 1, "maximum": 1})", 1, 1, false, false}};
  auto inside = [](const Case& c, double x) {
    return (c.lo_open ? x > c.lo : x >= c.lo) && (c.hi_open ? x < c.hi : x <= c.hi);
  };
  for (const Case& c : integers) {
    const RegexDfa dfa(json_schema_regex(nlohmann::ordered_json::parse(c.schema)));
    for (int64_t n = -1200; n <= 12000; n += (n < 1200 ? 1 : 7)) {
      const std::string text = std::to_string(n);
      ASSERT_EQ(dfa.full_match(text), inside(c, static_cast<double>(n))) << c.schema << " " << text;
    }
    for (const char* text : {"99999999", "-99999999", "1.0", "01", "-0"})
      EXPECT_EQ(dfa.full_match(text), std::string(text) == "99999999" ? inside(c, 99999999.0)
                                       : std::string(text) == "-99999999" ? inside(c, -99999999.0)
                                                                         : false)
          << c.schema << " " << text;
  }
  const std::vector<Case> numbers = {
      {R"({"type": "number", "minimum": 0, "maximum": 1})", 0, 1, false, false},
      {R"({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1})", 0, 1, true, true},
      {R"({"type": "number", "minimum": -3, "exclusiveMaximum": 12})", -3, 12, false, true},
      {R"({"type": "number", "exclusiveMinimum": -12, "maximum": -2})", -12, -2, true, false},
      {R"({"type": "number", "minimum": 5})", 5, inf, false, false},
      {R"({"type": "number", "exclusiveMaximum": 0})", -inf, 0, false, true},
      {R"({"type": ["number", "null"], "minimum": 2, "maximum": 2})", 2, 2, false, false}};
  for (const Case& c : numbers) {
    const RegexDfa dfa(json_schema_regex(nlohmann::ordered_json::parse(c.schema)));
    for (int whole = -15; whole <= 15; ++whole)
      for (const char* fraction : {"", ".0", ".00", ".5", ".05", ".001", ".999", ".10"})
        for (const char* sign : {"", "-"}) {
          if (whole < 0 && *sign) continue;
          const std::string text = sign + std::to_string(whole) + fraction;
          const double value = std::stod(text);
          if (value == 0 && text[0] == '-') {
            EXPECT_FALSE(dfa.full_match(text)) << c.schema << " " << text;
            continue;
          }
          ASSERT_EQ(dfa.full_match(text), inside(c, value)) << c.schema << " " << text;
        }
    EXPECT_FALSE(dfa.full_match("1e0")) << c.schema;  // bounded numbers take no exponent
  }
}

TEST(RegexDfa, CommonMatchIsAShortestTextOfBoth) {
  std::string text;
  EXPECT_EQ(common_match(RegexDfa("a+b|c"), RegexDfa("[ab]{3}"), 1000, &text), Overlap::kSome);
  EXPECT_EQ(text, "aab");
  EXPECT_EQ(common_match(RegexDfa("[0-9]+"), RegexDfa("[a-z]+"), 1000, &text), Overlap::kNone);
  EXPECT_EQ(common_match(RegexDfa("x[0-9]*y"), RegexDfa("x[0-9]*z"), 1000, &text), Overlap::kNone);
  // Where the pairs run out before an answer.
  EXPECT_EQ(common_match(RegexDfa("[a-z]{40}1"), RegexDfa("[a-z]{40}2"), 10, &text), Overlap::kUnknown);
}

TEST(JsonSchemaRegex, RefusesWhatItDoesNotSupportByKeywordAndPlace) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"type": "integer", "multipleOf": 3})", "multipleOf: is not supported"},
      {R"({"properties": {"age": {"type": "integer", "maximum": "9"}}})", "properties.age.maximum: must be a number"},
      {R"({"type": "integer", "minimum": 5, "exclusiveMaximum": 5})", "exclusiveMaximum: leaves no integer"},
      {R"({"type": "number", "minimum": 0.5})", "minimum: is supported on numbers as a whole number only"},
      {R"({"type": "number", "exclusiveMinimum": 2, "maximum": 2})", "maximum: leaves no number"},
      {R"({"type": "integer", "maximum": 1e16})", "maximum: must be within"},
      {R"({"$defs": {"N": {"properties": {"next": {"$ref": "#/$defs/N"}}, "required": ["next"]}}, "$ref": "#/$defs/N"})",
       "$ref: recurses without an end"},
      {R"({"$defs": {"L": {"type": "array", "items": {"$ref": "#/$defs/L"}, "minItems": 1}}, "$ref": "#/$defs/L"})",
       "recurses without an end"},
      {R"({"$ref": "#/$defs/Missing"})", "not a schema"},
      {R"({"type": "string", "format": "email"})", "format: \"email\""},
      {R"j({"type": "string", "pattern": "(?=x)"})j", "pattern: lookaround"},
      {R"({"type": "wat"})", "unknown type"},
      {R"({"properties": {"a": {}}, "required": ["b"]})", "required"},
      {R"({"allOf": [{}, {}]})", "allOf"},
      {R"({"not": {}})", "not: is not supported"},
      // oneOf whose alternatives share values: 5 is an integer and a number; "a" is a string.
      {R"({"oneOf": [{"type": "integer"}, {"type": "number"}]})", "oneOf: alternatives 0 and 1 both take \"0\""},
      {R"({"properties": {"x": {"oneOf": [{"type": "boolean"}, {"enum": ["a", "b"]}, {"type": "string"}]}}})",
       "properties.x.oneOf: alternatives 1 and 2 both take \"\\\"a\\\"\""},
      {R"({"oneOf": [{}, {"type": "null"}]})", "both take \"null\""}};
  for (const auto& [schema, want] : cases) {
    try {
      json_schema_regex(nlohmann::ordered_json::parse(schema));
      ADD_FAILURE() << schema << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << schema << ": " << e.what();
    }
  }
}

}  // namespace
}  // namespace kvpipe
