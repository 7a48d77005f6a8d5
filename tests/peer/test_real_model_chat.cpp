// SmolLM2-135M-Instruct end to end, text in and text out (configs/smollm2.yaml, the Q4_1 GGUF
// that scripts/setup.sh installs): the chat prompt kvpipe builds is the one transformers'
// apply_chat_template renders from the file's template and llama.cpp tokenises; greedy
// decoding from it gives llama.cpp's tokens for 64 steps (a different choice only at a
// near-tie), on one rank, on two pipeline stages and on three tensor ranks; and the "text" of
// the answer is llama.cpp's detokenisation of those tokens. Re-quantised by llama.cpp's quantiser into Q4_K_M and
// Q5_K_M (whose rows of 576 values take the fallback types Q5_0 and Q5_1), it still answers.
#include "tests/support/command.h"
#include "tests/support/logprob_compare.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;
using kvpipe::testing::reference_ran;
using kvpipe::testing::run_command;

namespace {

constexpr int kSteps = 64;
// Q4_1 weights with 8-bit activations through 30 layers: both engines round differently, and
// on this prompt their log-probabilities differ from a float64 recompute of the dequantised
// weights by 0.10-0.20 (kvpipe) and 0.20-0.48 (llama.cpp) on average, up to about 1.4 on
// unlikely tokens. So the log-probabilities only guard against gross errors, and two tokens
// closer than kTieTolerance are a near-tie that either engine may choose.
constexpr double kTieTolerance = 0.5;
constexpr double kLogprobTolerance = 3.0;
const char* kMessage = "What is the capital of France? Answer in one sentence.";

class SmolLm2Chat : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = kvpipe::testing::make_scratch_dir();
    model_ = fs::path(KVPIPE_SOURCE_DIR) / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf";
    ASSERT_TRUE(fs::is_regular_file(model_)) << model_ << " is missing: run scripts/setup.sh";
    std::ofstream(dir_ / "message.txt") << kMessage;
    const CommandResult r = run_command(std::string(KVPIPE_PYTHON) + " " + KVPIPE_SOURCE_DIR +
                                            "/tests/peer/smollm2_chat_reference.py --model " + model_.string() +
                                            " --message-file " + (dir_ / "message.txt").string(),
                                        dir_);
    ASSERT_TRUE(reference_ran(r, "transformers chat template + llama.cpp tokenizer"));
    reference_ = nlohmann::json::parse(r.out.substr(0, r.out.find('\n')));
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  // kvpipe from the source folder, as the README runs it.
  CommandResult kvpipe(const std::string& args, int ranks = 1) {
    std::string cmd = "cd " + std::string(KVPIPE_SOURCE_DIR) + " && ";
    if (ranks > 1) cmd += std::string(KVPIPE_MPIRUN) + " --oversubscribe -np " + std::to_string(ranks) + " ";
    return run_command(cmd + KVPIPE_BINARY + " " + args, dir_);
  }

  std::string chat_flag() const { return std::string("--chat '") + kMessage + "'"; }

  fs::path dir_, model_;
  nlohmann::json reference_;
};

TEST_F(SmolLm2Chat, PromptIsTheOneTransformersRendersAndLlamaCppTokenises) {
  const CommandResult r = kvpipe("tokenize --config configs/smollm2.yaml " + chat_flag());
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json out = nlohmann::json::parse(r.out);
  EXPECT_EQ(out.at("ids"), reference_.at("ids")) << "reference prompt: " << reference_.at("text");
  EXPECT_EQ(out.at("pieces").size(), out.at("ids").size());
}

TEST_F(SmolLm2Chat, GreedyAnswerMatchesLlamaCppOnOneTwoAndThreeTensorRanks) {
  std::string prompt;
  for (const auto& id : reference_.at("ids")) prompt += (prompt.empty() ? "" : ",") + std::to_string(id.get<int64_t>());
  const CommandResult ref = run_command(std::string(KVPIPE_PYTHON) + " " + KVPIPE_SOURCE_DIR +
                                            "/tests/peer/llama_logprobs.py --model " + model_.string() +
                                            " --prompt " + prompt + " --steps " + std::to_string(kSteps),
                                        dir_);
  ASSERT_TRUE(reference_ran(ref, "llama.cpp"));
  const std::vector<kvpipe::testing::LogprobStep> ref_steps = kvpipe::testing::parse_logprob_steps(ref.out);
  ASSERT_EQ(ref_steps.size(), static_cast<size_t>(kSteps));

  // One rank, two pipeline stages, and three tensor ranks (9 heads and 3 KV heads in thirds).
  for (const auto& [ranks, tensor] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {3, 3}}) {
    const fs::path lp = dir_ / ("logprobs_" + std::to_string(ranks) + ".jsonl");
    const CommandResult r = kvpipe("generate --config configs/smollm2.yaml " + chat_flag() +
                                       " --max-new-tokens " + std::to_string(kSteps) +
                                       " --set sampling.ignore_eos=true --set parallel.tensor=" +
                                       std::to_string(tensor) + " --logprobs-out " + lp.string(),
                                   ranks);
    ASSERT_EQ(r.code, 0) << r.err;
    const nlohmann::json line = nlohmann::json::parse(r.out.substr(0, r.out.find('\n')));
    EXPECT_EQ(line.at("prompt_ids"), reference_.at("ids"));
    const kvpipe::testing::LogprobComparison c = kvpipe::testing::compare_logprob_steps(
        kvpipe::testing::parse_logprob_steps(kvpipe::testing::slurp(lp)), ref_steps, kSteps,
        kLogprobTolerance, kTieTolerance);
    std::printf("[ parity ] SmolLM2 chat vs llama.cpp, %d rank(s), %d tensor rank(s) per stage: %s\n", ranks,
                tensor, kvpipe::testing::summary(c).c_str());
    if (tensor > 1) {
      // Against the one-rank run of the same prompt, with the same tolerances (the kernels'
      // 8-bit activations round partial sums differently: see kLogprobTolerance).
      const kvpipe::testing::LogprobComparison one = kvpipe::testing::compare_logprob_steps(
          kvpipe::testing::parse_logprob_steps(kvpipe::testing::slurp(lp)),
          kvpipe::testing::parse_logprob_steps(kvpipe::testing::slurp(dir_ / "logprobs_1.jsonl")), kSteps,
          kLogprobTolerance, kTieTolerance);
      std::printf("[ parity ] SmolLM2 chat, %d tensor ranks vs one rank: %s\n", tensor,
                  kvpipe::testing::summary(one).c_str());
      EXPECT_TRUE(one.failure.empty()) << one.failure;
      EXPECT_GE(one.compared, 16) << "the tensor-parallel run left the one-rank run early";
    }
    EXPECT_TRUE(c.failure.empty()) << ranks << " rank(s): " << c.failure;
    EXPECT_GE(c.compared, 16) << ranks << " rank(s): the runs diverged early";

    // The answer's text is llama.cpp's detokenisation of the same ids (control tokens left out).
    std::string ids;
    for (const auto& id : line.at("output_ids")) ids += (ids.empty() ? "" : ",") + std::to_string(id.get<int64_t>());
    const CommandResult text = run_command(
        std::string(KVPIPE_PYTHON) + " -c 'import sys, json, llama_cpp; "
        "m = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False); "
        "print(json.dumps(m.detokenize([int(t) for t in sys.argv[2].split(\",\")], special=False)"
        ".decode(\"utf-8\", \"replace\")))' " + model_.string() + " " + ids, dir_);
    ASSERT_TRUE(reference_ran(text, "llama.cpp detokenizer"));
    EXPECT_EQ(line.at("text"), nlohmann::json::parse(text.out)) << ranks << " rank(s)";
    if (ranks == 1) std::printf("[ answer ] %s\n", line.at("text").dump().c_str());
  }
}

TEST_F(SmolLm2Chat, RequantisedToQ4_K_MAndQ5_K_MItStillAnswers) {
  for (const std::string mix : {"Q4_K_M", "Q5_K_M"}) {
    const fs::path file = dir_ / ("SmolLM2-135M-Instruct." + mix + ".gguf");
    const CommandResult q = run_command(std::string(KVPIPE_PYTHON) + " " + KVPIPE_SOURCE_DIR +
                                            "/tests/peer/llama_quantize.py " + model_.string() + " " + file.string() +
                                            " " + mix + " --allow-requantize",
                                        dir_);
    ASSERT_TRUE(reference_ran(q, "llama.cpp quantiser")) << mix;
    const CommandResult r = kvpipe("generate --config configs/smollm2.yaml --set model.path=" + file.string() + " " +
                                   chat_flag() + " --max-new-tokens 24");
    ASSERT_EQ(r.code, 0) << mix << "\n" << r.err;
    const nlohmann::json line = nlohmann::json::parse(r.out.substr(0, r.out.find('\n')));
    const std::string text = line.at("text").get<std::string>();
    std::printf("[ answer ] %s: %s\n", mix.c_str(), line.at("text").dump().c_str());
    EXPECT_NE(text.find("Paris"), std::string::npos) << mix << ": " << text;
  }
}

}  // namespace
