// Tokenizer parity with the references, through kvpipe_tokenizer_tool (tests/tools) and
// tests/peer/tokenizer_reference.py on the same strings (tests/data/tokenizer/hard_strings.json:
// many scripts, emoji sequences, combining marks, digit runs, whitespace runs, special tokens
// inside text, long words, empty and blank strings):
//   - GGUF vocabularies against llama.cpp (llama-cpp-python): llama.cpp's own ggml-vocab files
//     (llama-spm, llama-bpe, qwen2, gpt-2, phi-3; unpacked by scripts/setup.sh --references) and SmolLM2's
//     GGUF (pre smollm): ids without and with BOS, and llama_detokenize's text; plus llama.cpp's
//     own expected tokenizations (the .inp/.out files of its test-tokenizer-0);
//   - tokenizer.json files made by transformers' GGUF conversion of those vocabularies (one with
//     merges rewritten as "a b" strings, one with Llama-2's Prepend/Replace normaliser) against
//     Hugging Face `tokenizers`: ids, ids with the post-processor, decode() with and without
//     special tokens;
//   - init-model's tokenizer in both formats against both references and each other;
//   - an 8k-token prompt: same ids as llama.cpp, encoded in well under a second.
#include "tests/support/command.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;
using kvpipe::testing::reference_ran;
using kvpipe::testing::run_command;
using nlohmann::json;

namespace {

const fs::path kSource = KVPIPE_SOURCE_DIR;
const fs::path kHardStrings = kSource / "tests/data/tokenizer/hard_strings.json";
const fs::path kReference = kSource / "tests/peer/tokenizer_reference.py";

fs::path vocab_dir() { return fs::path(KVPIPE_PYTHON).parent_path().parent_path() / "share/llama-vocab"; }

std::string quote(const fs::path& p) { return "'" + p.string() + "'"; }

class TokenizerParity : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = kvpipe::testing::make_scratch_dir();
    const CommandResult probe = run_command(
        std::string(KVPIPE_PYTHON) + " -c 'import llama_cpp, tokenizers, transformers'", dir_);
    ASSERT_EQ(probe.code, 0) << "llama-cpp-python, tokenizers or transformers is not importable by "
                             << KVPIPE_PYTHON << ": run scripts/setup.sh --references\n" << probe.err;
    ASSERT_TRUE(fs::exists(vocab_dir() / "ggml-vocab-llama-bpe.gguf"))
        << vocab_dir() << " lacks llama.cpp's vocabularies: run scripts/setup.sh --references";
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  json run_json(const std::string& command, const fs::path& out_file = {}) {
    const CommandResult r = run_command(command, dir_);
    EXPECT_TRUE(reference_ran(r, "tokenizer", command));
    if (r.code != 0) return json();
    return json::parse(out_file.empty() ? r.out : kvpipe::testing::slurp(out_file));
  }
  json kvpipe_ids(const fs::path& model, const fs::path& strings) {
    return run_json(std::string(KVPIPE_TOKENIZER_TOOL) + " " + quote(model) + " " + quote(strings));
  }
  json reference(const std::string& mode, const fs::path& model, const fs::path& strings) {
    const fs::path out = dir_ / ("ref_" + std::to_string(counter_++) + ".json");
    return run_json(std::string(KVPIPE_PYTHON) + " " + quote(kReference) + " " + mode + " " + quote(model) + " " +
                        quote(strings) + " " + quote(out),
                    out);
  }
  fs::path convert(const fs::path& gguf, const std::string& name, const std::string& flags = "") {
    const fs::path out = dir_ / name;
    const CommandResult r = run_command(std::string(KVPIPE_PYTHON) + " " + quote(kReference) + " convert " +
                                            quote(gguf) + " " + quote(out) + " " + flags,
                                        dir_);
    EXPECT_TRUE(reference_ran(r, "tokenizer conversion"));
    return out;
  }

  // Compares the fields `keys` of each result, one failure per differing string; returns the
  // number of strings that agree on all of them.
  size_t compare(const std::string& label, const fs::path& strings_file, const json& ours, const json& ref,
                 const std::vector<std::string>& keys) {
    const json strings = json::parse(kvpipe::testing::slurp(strings_file));
    if (ours.is_null() || ref.is_null()) return 0;
    const json& a = ours.at("results");
    const json& b = ref.at("results");
    EXPECT_EQ(a.size(), strings.size());
    EXPECT_EQ(b.size(), strings.size());
    size_t agree = 0;
    for (size_t i = 0; i < strings.size() && i < a.size() && i < b.size(); ++i) {
      bool same = true;
      for (const std::string& k : keys) {
        EXPECT_EQ(a[i].at(k), b[i].at(k)) << label << ": " << k << " of string " << i << " "
                                          << strings[i].dump(-1, ' ', false, json::error_handler_t::replace);
        same = same && a[i].at(k) == b[i].at(k);
      }
      agree += same;
    }
    std::printf("[ PARITY   ] %s: %zu/%zu strings agree (%s)\n", label.c_str(), agree, strings.size(),
                json(keys).dump().c_str());
    return agree;
  }

  fs::path dir_;
  int counter_ = 0;
};

fs::path smollm2() {
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  const CommandResult r = run_command("bash " + quote(kSource / "scripts/smollm2_path.sh"), dir);
  fs::remove_all(dir);
  std::string path = r.out;
  while (!path.empty() && (path.back() == '\n' || path.back() == '\r')) path.pop_back();
  return path;
}

const std::vector<std::string> kVocabularies = {"llama-spm", "llama-bpe", "qwen2", "gpt-2", "phi-3"};

TEST_F(TokenizerParity, GgufMatchesLlamaCpp) {
  std::vector<fs::path> models;
  for (const auto& v : kVocabularies) models.push_back(vocab_dir() / ("ggml-vocab-" + v + ".gguf"));
  const fs::path smol = smollm2();
  ASSERT_TRUE(fs::exists(smol)) << "SmolLM2 GGUF not found (scripts/smollm2_path.sh): run scripts/setup.sh";
  models.push_back(smol);
  for (const fs::path& m : models) {
    const json ours = kvpipe_ids(m, kHardStrings);
    const json ref = reference("llama", m, kHardStrings);
    compare(m.filename().string(), kHardStrings, ours, ref, {"ids", "ids_special", "decoded"});
  }
}

TEST_F(TokenizerParity, GgufMatchesLlamaCppTestFiles) {
  for (const auto& v : kVocabularies) {
    const fs::path gguf = vocab_dir() / ("ggml-vocab-" + v + ".gguf");
    const fs::path expected = dir_ / (v + "_expected.json");
    const CommandResult r = run_command(std::string(KVPIPE_PYTHON) + " " + quote(kReference) + " inp " +
                                            quote(gguf.string() + ".inp") + " " + quote(gguf.string() + ".out") +
                                            " " + quote(expected),
                                        dir_);
    ASSERT_TRUE(reference_ran(r, "llama.cpp tokenizer"));
    const json cases = json::parse(kvpipe::testing::slurp(expected));
    const fs::path strings = dir_ / (v + "_strings.json");
    std::ofstream(strings) << cases.at("strings").dump();
    const json ours = kvpipe_ids(gguf, strings);
    ASSERT_FALSE(ours.is_null());
    ASSERT_GT(cases.at("strings").size(), 10u);
    size_t agree = 0;
    for (size_t i = 0; i < cases.at("strings").size(); ++i) {
      EXPECT_EQ(ours.at("results")[i].at("ids"), cases.at("ids")[i]) << v << ".inp case " << i;
      agree += ours.at("results")[i].at("ids") == cases.at("ids")[i];
    }
    std::printf("[ PARITY   ] %s .inp/.out: %zu/%zu cases agree\n", v.c_str(), agree, cases.at("strings").size());
  }
}

TEST_F(TokenizerParity, TokenizerJsonMatchesHfTokenizers) {
  struct Case {
    std::string name, vocab, flags;
  };
  const std::vector<Case> cases = {
      {"llama-spm", "llama-spm", ""},
      {"llama2-normalizer", "llama-spm", "--llama2-normalizer"},
      {"llama-bpe", "llama-bpe", ""},
      {"qwen2", "qwen2", ""},
      {"gpt-2-merges-as-strings", "gpt-2", "--merges-as-strings"},
  };
  for (const Case& c : cases) {
    const fs::path dir = convert(vocab_dir() / ("ggml-vocab-" + c.vocab + ".gguf"), c.name, c.flags);
    compare(c.name + " tokenizer.json", kHardStrings, kvpipe_ids(dir, kHardStrings), reference("hf", dir, kHardStrings),
            {"ids", "ids_special", "decoded", "decoded_skip"});
  }
  const fs::path smol = convert(smollm2(), "smollm2");
  compare("smollm2 tokenizer.json", kHardStrings, kvpipe_ids(smol, kHardStrings), reference("hf", smol, kHardStrings),
          {"ids", "ids_special", "decoded", "decoded_skip"});
  // The conversion wrote merges as pairs; the rewritten one as strings.
  const json pairs = json::parse(kvpipe::testing::slurp(dir_ / "qwen2/tokenizer.json"));
  const json strings = json::parse(kvpipe::testing::slurp(dir_ / "gpt-2-merges-as-strings/tokenizer.json"));
  EXPECT_TRUE(pairs.at("model").at("merges")[0].is_array());
  EXPECT_TRUE(strings.at("model").at("merges")[0].is_string());
}

TEST_F(TokenizerParity, InitModelTokenizerMatchesBothReferences) {
  for (const std::string preset : {"tiny", "small"}) {
    const fs::path gguf = dir_ / (preset + ".gguf"), hf = dir_ / (preset + "_hf");
    for (const auto& [format, out] : {std::pair<std::string, fs::path>{"gguf", gguf}, {"hf", hf}}) {
      const CommandResult r = run_command(std::string(KVPIPE_BINARY) + " init-model --preset " + preset +
                                              " --layers 1 --format " + format + " --out " + quote(out),
                                          dir_);
      ASSERT_EQ(r.code, 0) << r.err;
    }
    const json from_gguf = kvpipe_ids(gguf, kHardStrings);
    const json from_hf = kvpipe_ids(hf, kHardStrings);
    compare(preset + " init-model GGUF vs llama.cpp", kHardStrings, from_gguf, reference("llama", gguf, kHardStrings),
            {"ids", "ids_special", "decoded"});
    compare(preset + " init-model HF vs tokenizers", kHardStrings, from_hf, reference("hf", hf, kHardStrings),
            {"ids", "ids_special", "decoded", "decoded_skip"});
    compare(preset + " init-model GGUF vs HF", kHardStrings, from_gguf, from_hf, {"ids", "ids_special", "decoded"});
  }
}

TEST_F(TokenizerParity, LongPromptMatchesLlamaCppQuickly) {
  const json hard = json::parse(kvpipe::testing::slurp(kHardStrings));
  std::string text;
  for (int round = 0; text.size() < 40000; ++round)
    for (const auto& s : hard) text += s.get<std::string>() + (round % 2 ? "\n" : " ");
  const fs::path strings = dir_ / "long.json";
  std::ofstream(strings) << json::array({text}).dump();
  const fs::path model = vocab_dir() / "ggml-vocab-llama-bpe.gguf";
  const json ours = kvpipe_ids(model, strings);
  const json ref = reference("llama", model, strings);
  ASSERT_FALSE(ours.is_null());
  ASSERT_FALSE(ref.is_null());
  const json& ids = ours.at("results")[0].at("ids");
  EXPECT_GT(ids.size(), 8000u);
  EXPECT_EQ(ids, ref.at("results")[0].at("ids"));
  const double ms = ours.at("results")[0].at("encode_ms").get<double>();
  std::printf("[ PARITY   ] %zu-token prompt encoded in %.1f ms\n", ids.size(), ms);
  EXPECT_LT(ms, 1000.0);
}

}  // namespace
