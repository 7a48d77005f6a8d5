// TextStream: text released token by token never cuts a UTF-8 character or shows part of a
// stop string, and stops exactly where a stop string begins, also across tokens.
#include "engine/text/text_stream.h"
#include "engine/text/tokenizer.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvpipe {
namespace {

// A vocabulary of raw byte strings; id 0 is a special token (EOS).
class BytesTokenizer : public Tokenizer {
 public:
  explicit BytesTokenizer(std::vector<std::string> pieces) : pieces_(std::move(pieces)) {}
  std::vector<int64_t> encode(const std::string&, bool) const override { return {}; }
  std::string token_bytes(int64_t id) const override { return id == 0 ? "</s>" : pieces_.at(id); }
  std::string decode(const std::vector<int64_t>& ids, bool) const override {
    std::string s;
    for (int64_t id : ids) s += token_bytes(id);
    return s;
  }
  bool strips_leading_space() const override { return false; }
  std::string piece(int64_t id) const override { return pieces_.at(id); }
  bool is_special(int64_t id) const override { return id == 0; }
  int64_t vocab_size() const override { return static_cast<int64_t>(pieces_.size()); }
  int64_t bos_id() const override { return -1; }
  std::vector<int64_t> eos_ids() const override { return {0}; }
  bool add_bos() const override { return false; }
  const std::string& chat_template() const override { return empty_; }
  const std::string& chat_template_source() const override { return empty_; }

 private:
  std::vector<std::string> pieces_;
  std::string empty_;
};

// Pushes every token; returns what each push released.
std::vector<std::string> stream(TextStream& s, const std::vector<int64_t>& ids) {
  std::vector<std::string> out;
  for (int64_t id : ids) out.push_back(s.push(id));
  return out;
}

bool valid_utf8_prefixes(const std::vector<std::string>& parts) {
  for (const std::string& p : parts) {
    std::string copy = p;
    if (take_complete_utf8(copy) != p || !copy.empty()) return false;
  }
  return true;
}

TEST(TextStream, HoldsBackSplitCharacters) {
  // "€" is E2 82 AC; "😀" is F0 9F 98 80.
  const BytesTokenizer tok({"</s>", "a", "\xE2", "\x82\xAC", "\xF0\x9F", "\x98", "\x80", "b"});
  TextStream s(tok, {});
  const std::vector<std::string> parts = stream(s, {1, 2, 3, 4, 5, 6, 7, 0});
  EXPECT_EQ(parts, (std::vector<std::string>{"a", "", "\xE2\x82\xAC", "", "", "\xF0\x9F\x98\x80", "b", ""}));
  EXPECT_TRUE(valid_utf8_prefixes(parts));
  EXPECT_EQ(s.finish(), "");
  EXPECT_EQ(s.text(), "a\xE2\x82\xAC\xF0\x9F\x98\x80" "b");
}

TEST(TextStream, InvalidBytesBecomeReplacementCharactersAsPythonDecodes) {
  const BytesTokenizer tok({"</s>", "\xFF", "\xE2\x82", "x", "\xC0\xAF", "\xED\xA0\x80", "\xF0\x9F"});
  TextStream s(tok, {});
  for (int64_t id : {1, 2, 3, 4, 5, 6}) s.push(id);
  s.finish();
  // bytes(b"\xff\xe2\x82x\xc0\xaf\xed\xa0\x80\xf0\x9f").decode("utf-8", "replace")
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(s.text(), r + r + "x" + r + r + r + r + r + r);
}

TEST(TextStream, StopStringAcrossTokensCutsWhereItBegins) {
  const BytesTokenizer tok({"</s>", "Hello", " wor", "ld", "!", " EN", "D", " more"});
  TextStream s(tok, {" END", "xyz"});
  const std::vector<std::string> parts = stream(s, {1, 2, 3, 4, 5, 6, 7});
  EXPECT_EQ(parts, (std::vector<std::string>{"Hello", " wor", "ld", "!", "", "", ""}));
  EXPECT_TRUE(s.stopped());
  EXPECT_EQ(s.finish(), "");
  EXPECT_EQ(s.text(), "Hello world!");
}

TEST(TextStream, HeldBackPrefixIsReleasedWhenItDoesNotBecomeAStop) {
  const BytesTokenizer tok({"</s>", "a <", "|en", "x", "<|end|>"});
  TextStream s(tok, {"<|end|>"});
  EXPECT_EQ(s.push(1), "a ");
  EXPECT_EQ(s.push(2), "");      // "<|en" may still become "<|end|>"
  EXPECT_EQ(s.push(3), "<|enx");
  EXPECT_FALSE(s.stopped());
  EXPECT_EQ(s.push(4), "");
  EXPECT_TRUE(s.stopped());
  EXPECT_EQ(s.text(), "a <|enx");
}

TEST(TextStream, EarliestStopWinsAndStopInsideOneToken) {
  const BytesTokenizer tok({"</s>", "one\ntwo###three"});
  TextStream s(tok, {"###", "\n"});
  EXPECT_EQ(s.push(1), "one");
  EXPECT_TRUE(s.stopped());
  EXPECT_EQ(s.push(1), "");
}

TEST(TextStream, FinishReleasesAHeldPrefixAndACutCharacter) {
  const BytesTokenizer tok({"</s>", "ab#", "\xE2\x82"});
  TextStream s(tok, {"##"});
  EXPECT_EQ(s.push(1), "ab");
  EXPECT_EQ(s.push(2), "");
  EXPECT_EQ(s.finish(), "#\xEF\xBF\xBD");
  EXPECT_EQ(s.text(), "ab#\xEF\xBF\xBD");
}

TEST(TextStream, SpecialTokensAddNoText) {
  const BytesTokenizer tok({"</s>", "hi"});
  TextStream s(tok, {});
  EXPECT_EQ(s.push(0), "");
  EXPECT_EQ(s.push(1), "hi");
  EXPECT_EQ(s.text(), "hi");
}

}  // namespace
}  // namespace kvpipe
