// Tokenizers (engine/text/tokenizer.h) on vocabularies built here: GGUF SentencePiece-style
// and byte-level BPE metadata, tokenizer.json files, and the tokenizer init-model writes in
// both formats. Parity with llama.cpp and `tokenizers` on real vocabularies is in
// tests/peer/test_tokenizer_parity.cpp.
#include "engine/model/gguf.h"
#include "engine/text/tokenizer.h"
#include "engine/text/tokenizer_builder.h"
#include "launch/init_model.h"
#include "tests/support/command.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;

class TokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = kvpipe::testing::make_scratch_dir(); }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  void write(const std::string& name, const std::string& text) const {
    fs::create_directories((dir_ / name).parent_path());
    std::ofstream(dir_ / name, std::ios::binary) << text;
  }
  // The message of the std::invalid_argument that loading `model` throws, "" when none.
  static std::string load_error(const std::string& model) {
    try {
      Tokenizer::load(model);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  }
  fs::path dir_;
};

// A SentencePiece-style vocabulary: specials, the 256 byte tokens, then scored pieces.
std::string write_spm_gguf(const std::string& path, const std::vector<std::pair<std::string, float>>& pieces) {
  GgufWriter w;
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<float> scores = {0, 0, 0};
  std::vector<int32_t> types = {2, 3, 3};
  for (int b = 0; b < 256; ++b) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "<0x%02X>", b);
    tokens.push_back(hex), scores.push_back(0), types.push_back(6);
  }
  for (const auto& [text, score] : pieces) tokens.push_back(text), scores.push_back(score), types.push_back(1);
  w.add_string("general.architecture", "llama");
  w.add_string("tokenizer.ggml.model", "llama");
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_f32_array("tokenizer.ggml.scores", scores);
  w.add_i32_array("tokenizer.ggml.token_type", types);
  w.add_u32("tokenizer.ggml.bos_token_id", 1);
  w.add_u32("tokenizer.ggml.eos_token_id", 2);
  w.add_string("tokenizer.chat_template", "{{ messages }}");
  w.write(path);
  return path;
}

TEST_F(TokenizerTest, GgufArraysReadBackWithTheirTypes) {
  GgufWriter w;
  w.add_string_array("s", {"a", "", "\xE2\x96\x81x"});
  w.add_i32_array("i", {3, -1, 7});
  w.add_f32_array("f", {0.5f, -2.0f});
  w.write(path("a.gguf"));
  const GgufFile f(path("a.gguf"));
  EXPECT_EQ(f.get_string_array("s"), (std::vector<std::string>{"a", "", "\xE2\x96\x81x"}));
  EXPECT_EQ(f.get_int_array("i"), (std::vector<int64_t>{3, -1, 7}));
  EXPECT_EQ(f.get_float_array("f"), (std::vector<float>{0.5f, -2.0f}));
  EXPECT_EQ(f.get_float_array("i"), (std::vector<float>{3, -1, 7}));
  try {
    f.get_int_array("s");
    FAIL() << "a string array read as integers";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("a.gguf"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'s'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(f.get_string_array("missing"), std::invalid_argument);
}

TEST_F(TokenizerTest, SentencePieceMergesByScoreAndFallsBackToBytes) {
  const std::string U = "\xE2\x96\x81";  // U+2581
  const auto tok = Tokenizer::load(write_spm_gguf(
      path("spm.gguf"), {{U, -1}, {"h", -2}, {"i", -3}, {"hi", -4}, {U + "hi", -1.5f}, {"!", -6}}));
  ASSERT_NE(tok, nullptr);
  const int64_t base = 3 + 256;  // first scored piece
  // " hi" -> "▁hi" (add_space_prefix), then "!", then bytes for the unknown "€".
  EXPECT_EQ(tok->encode("hi!\xE2\x82\xAC", false),
            (std::vector<int64_t>{base + 4, base + 5, 3 + 0xE2, 3 + 0x82, 3 + 0xAC}));
  EXPECT_EQ(tok->encode("hi", true), (std::vector<int64_t>{1, base + 4}));
  EXPECT_TRUE(tok->add_bos());
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_ids(), (std::vector<int64_t>{2}));
  EXPECT_TRUE(tok->strips_leading_space());
  EXPECT_EQ(tok->decode(tok->encode("hi!\xE2\x82\xAC", false)), "hi!\xE2\x82\xAC");
  EXPECT_EQ(tok->token_bytes(base + 4), " hi");
  EXPECT_EQ(tok->token_bytes(3 + 0xE2), "\xE2");
  EXPECT_EQ(tok->piece(base + 4), U + "hi");
  // Special tokens in the text are recognised; a space prefix follows each of them.
  EXPECT_EQ(tok->encode("</s>hi", false), (std::vector<int64_t>{2, base + 4}));
  EXPECT_TRUE(tok->is_special(2));
  EXPECT_FALSE(tok->is_special(base));
  // As llama.cpp's detokenize: the leading space is dropped from the first token only, so a
  // skipped BOS leaves it.
  EXPECT_EQ(tok->decode({base + 4, 2}, true), "hi");
  EXPECT_EQ(tok->decode({1, base + 4, 2}, true), " hi");
  EXPECT_EQ(tok->decode({1, base + 4, 2}), "<s> hi</s>");
  EXPECT_EQ(tok->chat_template(), "{{ messages }}");
  EXPECT_EQ(tok->chat_template_source(), path("spm.gguf") + ": tokenizer.chat_template");
  EXPECT_THROW(tok->token_bytes(tok->vocab_size()), std::out_of_range);
  EXPECT_THROW(tok->decode({-1}), std::out_of_range);
}

TEST_F(TokenizerTest, UnknownGgufPreTokenizerIsNamed) {
  GgufWriter w;
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", "no-such-pre");
  w.add_string_array("tokenizer.ggml.tokens", {"a", "b", "ab"});
  w.add_string_array("tokenizer.ggml.merges", {"a b"});
  w.write(path("bad.gguf"));
  const std::string e = load_error(path("bad.gguf"));
  EXPECT_NE(e.find(path("bad.gguf") + ": tokenizer.ggml.pre 'no-such-pre' is not supported (supported: "),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("llama-bpe"), std::string::npos) << e;
  EXPECT_NE(e.find("smollm"), std::string::npos) << e;
}

TEST_F(TokenizerTest, GgufWithoutTokenizerHasNone) {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.write(path("none.gguf"));
  EXPECT_EQ(Tokenizer::load(path("none.gguf")), nullptr);
  fs::create_directories(dir_ / "empty_dir");
  EXPECT_EQ(Tokenizer::load(path("empty_dir")), nullptr);
}

// A minimal byte-level tokenizer.json with `pre_tokenizer` and `extra` merged in.
std::string byte_level_json(const std::string& pre_tokenizer, const std::string& merges = R"([["a", "b"]])") {
  std::string vocab;
  for (int c = 'a'; c <= 'z'; ++c) vocab += std::string("\"") + char(c) + "\": " + std::to_string(c - 'a') + ", ";
  vocab += "\"ab\": 26, \"\\u0120\": 27";
  return R"({"version": "1.0", "added_tokens": [{"id": 28, "content": "<|end|>", "single_word": false,
    "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
    "normalizer": null, "pre_tokenizer": )" + pre_tokenizer + R"(, "post_processor": null,
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {)" + vocab + R"(}, "merges": )" + merges + "}}";
}

TEST_F(TokenizerTest, TokenizerJsonErrorsNameFileAndPath) {
  write("foo/tokenizer.json", byte_level_json(R"({"type": "Foo"})"));
  EXPECT_EQ(load_error(path("foo")), path("foo/tokenizer.json") + ": pre_tokenizer.type 'Foo' is not supported");

  write("seq/tokenizer.json",
        byte_level_json(R"({"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}, {"type": "Bar"}]})"));
  EXPECT_EQ(load_error(path("seq")),
            path("seq/tokenizer.json") + ": pre_tokenizer.pretokenizers[1].type 'Bar' is not supported");

  write("merge/tokenizer.json", byte_level_json(R"({"type": "ByteLevel"})", R"(["a b", "q zz"])"));
  EXPECT_NE(load_error(path("merge")).find("tokenizer.json: model.merges[1] names a token that is not in model.vocab"),
            std::string::npos)
      << load_error(path("merge"));

  write("broken/tokenizer.json", "{\"model\": ");
  EXPECT_NE(load_error(path("broken")).find(path("broken/tokenizer.json") + ": not valid JSON"), std::string::npos);

  // Shapes met deep in the file are refused as bad input too, never escaping as an internal
  // error (both found by tests/fuzz/fuzz_tokenizer_json).
  auto with_post = [](const std::string& post) {
    std::string json = byte_level_json(R"({"type": "ByteLevel"})");
    const std::string null_post = R"("post_processor": null)";
    return json.replace(json.find(null_post), null_post.size(), R"("post_processor": )" + post);
  };
  write("ids/tokenizer.json", with_post(R"({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}}],
      "special_tokens": {"<s>": {"id": "<s>"}}})"));
  EXPECT_EQ(load_error(path("ids")), path("ids/tokenizer.json") + ": post_processor.special_tokens.<s>.ids is missing");
  write("far/tokenizer.json", with_post(R"({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}}],
      "special_tokens": {"<s>": {"id": "<s>", "ids": [29]}}})"));
  EXPECT_EQ(load_error(path("far")),
            path("far/tokenizer.json") + ": post_processor adds token id 29, outside the vocabulary of 29 tokens");
  std::string duplicate = byte_level_json(R"({"type": "ByteLevel"})");
  duplicate.replace(duplicate.find("\"b\": 1,"), 7, "\"b\": 0,");
  write("dup/tokenizer.json", duplicate);
  EXPECT_EQ(load_error(path("dup")), path("dup/tokenizer.json") + ": model.vocab.b has the id of model.vocab.a");
  std::string huge = byte_level_json(R"({"type": "ByteLevel"})");
  huge.replace(huge.find("\"ab\": 26"), 8, "\"ab\": 4294967296");
  write("huge/tokenizer.json", huge);
  EXPECT_EQ(load_error(path("huge")),
            path("huge/tokenizer.json") + ": model.vocab.ab is not a token id (an integer in [0, 16777215])");
  write("cls/tokenizer.json", with_post(R"({"type": "RobertaProcessing", "cls": ["<s>", "zero"], "sep": ["</s>", 2]})"));
  EXPECT_NE(load_error(path("cls")).find(path("cls/tokenizer.json") + " (or tokenizer_config.json beside it): unexpected JSON shape"),
            std::string::npos)
      << load_error(path("cls"));
}

TEST_F(TokenizerTest, TokenizerJsonMergesInBothFormsAgree) {
  write("pairs/tokenizer.json", byte_level_json(R"({"type": "ByteLevel", "add_prefix_space": false})"));
  write("strings/tokenizer.json", byte_level_json(R"({"type": "ByteLevel", "add_prefix_space": false})", R"(["a b"])"));
  const auto pairs = Tokenizer::load(path("pairs"));
  const auto strings = Tokenizer::load(path("strings"));
  ASSERT_NE(pairs, nullptr);
  ASSERT_NE(strings, nullptr);
  // "ab c" -> "ab", "Ġ" (no "Ġc" token: byte-level chars only merge through merges), "c".
  const std::vector<int64_t> expected = {26, 27, 2, 28, 0};
  EXPECT_EQ(pairs->encode("ab c<|end|>a", false), expected);
  EXPECT_EQ(strings->encode("ab c<|end|>a", false), expected);
  EXPECT_EQ(pairs->decode(expected), "ab c<|end|>a");
  EXPECT_EQ(pairs->decode(expected, true), "ab ca");
  EXPECT_TRUE(pairs->is_special(28));
  EXPECT_EQ(pairs->token_bytes(27), " ");
}

// init-model's tokenizer, written through init_model() in both formats.
class InitModelTokenizer : public TokenizerTest {
 protected:
  std::unique_ptr<Tokenizer> make(const std::string& format, int64_t vocab) {
    InitModelOptions o;
    o.format = format;
    o.out = path(format == "gguf" ? "m" + std::to_string(vocab) + ".gguf" : "m" + std::to_string(vocab) + "_hf");
    o.config = preset_config("tiny");
    o.config.vocab_size = vocab;
    o.config.num_layers = 1;
    init_model(o);
    return Tokenizer::load(o.out);
  }
};

const std::vector<std::string> kTexts = {
    "",
    "Hello world! The morning train left the station at seven.",
    "  spaces\t\ttabs\n\nnewlines  ",
    "caf\xC3\xA9 \xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x91\x8B\xF0\x9F\x8F\xBD 12345",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "</s><s><unk>",
};

TEST_F(InitModelTokenizer, GgufAndHfGiveTheSameIdsAndRoundTrip) {
  const auto gguf = make("gguf", 512);
  const auto hf = make("hf", 512);
  ASSERT_NE(gguf, nullptr);
  ASSERT_NE(hf, nullptr);
  EXPECT_EQ(gguf->vocab_size(), 512);
  EXPECT_EQ(hf->vocab_size(), 512);
  EXPECT_EQ(gguf->bos_id(), 1);
  EXPECT_EQ(hf->bos_id(), 1);
  EXPECT_EQ(gguf->eos_ids().front(), 2);
  EXPECT_EQ(hf->eos_ids().front(), 2);
  for (const std::string& t : kTexts) {
    const std::vector<int64_t> ids = gguf->encode(t, true);
    EXPECT_EQ(ids, hf->encode(t, true)) << t;
    EXPECT_EQ(gguf->decode(ids), t);
    EXPECT_EQ(hf->decode(ids), t);
    std::string bytes;
    for (int64_t id : ids) bytes += gguf->token_bytes(id);
    EXPECT_EQ(bytes, t);
  }
  // Merges learned from English make common words single tokens.
  EXPECT_LT(gguf->encode(" the", false).size(), 2u);
  const std::vector<int64_t> chat = gguf->encode("<|im_start|>user", false);
  ASSERT_GE(chat.size(), 2u);
  EXPECT_EQ(gguf->piece(chat[0]), "<|im_start|>");
  EXPECT_TRUE(gguf->is_special(chat[0]));
  EXPECT_NE(gguf->chat_template().find("<|im_start|>"), std::string::npos);
  EXPECT_EQ(gguf->chat_template(), hf->chat_template());
  EXPECT_NE(hf->chat_template_source().find("tokenizer_config.json: chat_template"), std::string::npos);
}

TEST_F(InitModelTokenizer, SmallVocabulariesKeepAWorkingTokenizer) {
  // Just the byte-level alphabet and three specials: no merges, no ChatML markers.
  const auto gguf = make("gguf", kMinByteLevelVocab);
  const auto hf = make("hf", kMinByteLevelVocab);
  ASSERT_NE(gguf, nullptr);
  ASSERT_NE(hf, nullptr);
  EXPECT_EQ(gguf->encode("ab", false), hf->encode("ab", false));
  EXPECT_EQ(gguf->encode("ab", false).size(), 2u);
  EXPECT_TRUE(gguf->chat_template().empty());
  // Below it: a placeholder vocabulary in GGUF, no tokenizer.json.
  EXPECT_NE(make("gguf", 100), nullptr);
  EXPECT_EQ(make("hf", 100), nullptr);
}

TEST_F(InitModelTokenizer, EncodesLongPromptsQuicklyAndFromManyThreads) {
  const auto tok = make("gguf", 8192);
  std::string text;
  while (text.size() < 48000) text += "The quick brown fox, 1234 jumps over the lazy dog; caf\xC3\xA9 \xE4\xBD\xA0\xE5\xA5\xBD!\n";
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int64_t> ids = tok->encode(text, false);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GT(ids.size(), 8000u);
  EXPECT_LT(seconds, 1.0) << ids.size() << " tokens";
  EXPECT_EQ(tok->decode(ids), text);
  std::vector<std::vector<int64_t>> results(4);
  std::vector<std::thread> threads;
  for (auto& r : results) threads.emplace_back([&] { r = tok->encode(text, false); });
  for (auto& t : threads) t.join();
  for (const auto& r : results) EXPECT_EQ(r, ids);
}

}  // namespace
}  // namespace kvpipe
