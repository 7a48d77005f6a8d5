// Logit bias and repetition, frequency and presence penalties against llama.cpp's own
// samplers (tests/peer/llama_sampling.py: llama_sampler_init_logit_bias and
// llama_sampler_init_penalties, chained as llama-server chains them) on SmolLM2-135M-Instruct,
// greedy: along kvpipe's answer, on one rank and on two pipeline stages (where the
// coordinator draws the processed rows again), each token is the argmax of llama.cpp's
// processed logits of the same step, or within a near-tie of it. The bias and penalties must
// decide tokens (llama.cpp's processed argmax differs from its raw one), or the comparison
// would say nothing.
#include "tests/support/command.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;
using kvpipe::testing::reference_ran;
using kvpipe::testing::run_command;

namespace {

constexpr int kSteps = 48;
// As in test_real_model_chat.cpp: Q4_1 weights round differently in the two engines, so two
// tokens whose processed logits are closer than this are a near-tie either may choose.
constexpr double kTieTolerance = 0.5;
const char* kMessage = "Write a short poem about the sea, the waves and the sea again.";

std::string join(const std::vector<int64_t>& ids) {
  std::string s;
  for (int64_t id : ids) s += (s.empty() ? "" : ",") + std::to_string(id);
  return s;
}

class SamplingParity : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = kvpipe::testing::make_scratch_dir();
    model_ = fs::path(KVPIPE_SOURCE_DIR) / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf";
    ASSERT_TRUE(fs::is_regular_file(model_)) << model_ << " is missing: run scripts/setup.sh";
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  // `kvpipe generate` of the chat message, greedy, kSteps tokens: its first output line.
  nlohmann::json generate(const std::string& sets, int ranks = 1) {
    std::string cmd = "cd " + std::string(KVPIPE_SOURCE_DIR) + " && ";
    if (ranks > 1) cmd += std::string(KVPIPE_MPIRUN) + " --oversubscribe -np " + std::to_string(ranks) + " ";
    const CommandResult r = run_command(cmd + KVPIPE_BINARY + " generate --config configs/smollm2.yaml --chat '" +
                                            kMessage + "' --max-new-tokens " + std::to_string(kSteps) +
                                            " --set sampling.ignore_eos=true" + sets,
                                        dir_);
    EXPECT_EQ(r.code, 0) << r.err;
    if (r.code != 0) return nullptr;
    return nlohmann::json::parse(r.out.substr(0, r.out.find('\n')));
  }

  fs::path dir_, model_;
};

TEST_F(SamplingParity, PenaltiesAndBiasGiveLlamaCppSamplersTokens) {
  const nlohmann::json plain = generate("");
  ASSERT_FALSE(plain.is_null());
  const std::vector<int64_t> prompt = plain.at("prompt_ids").get<std::vector<int64_t>>();
  const std::vector<int64_t> unprocessed = plain.at("output_ids").get<std::vector<int64_t>>();
  ASSERT_EQ(unprocessed.size(), static_cast<size_t>(kSteps));

  const double rp = 1.1, fp = 0.6, pp = 1.5;
  // Against the answer's own second token, for one of its later ones, and for a token the
  // answer does not hold.
  std::vector<std::pair<int64_t, double>> bias = {{unprocessed[1], -3.0}};
  for (int64_t id : {unprocessed[5], unprocessed[6], unprocessed[7]})
    if (id != unprocessed[1] && bias.size() < 2) bias.emplace_back(id, 1.5);
  if (unprocessed[1] != 1000 && bias.back().first != 1000) bias.emplace_back(1000, 2.0);
  std::string bias_yaml, bias_flag;
  for (const auto& [id, b] : bias) {
    std::ostringstream v;
    v << b;
    bias_yaml += (bias_yaml.empty() ? "" : ", ") + std::to_string(id) + ": " + v.str();
    bias_flag += (bias_flag.empty() ? "" : ",") + std::to_string(id) + ":" + v.str();
  }
  const std::string sets = " --set sampling.repetition_penalty=" + std::to_string(rp) +
                           " --set sampling.frequency_penalty=" + std::to_string(fp) +
                           " --set sampling.presence_penalty=" + std::to_string(pp) + " --set 'sampling.logit_bias={" +
                           bias_yaml + "}'";

  for (int ranks : {1, 2}) {
    const nlohmann::json got = generate(sets, ranks);
    ASSERT_FALSE(got.is_null()) << ranks << " rank(s)";
    EXPECT_EQ(got.at("prompt_ids"), plain.at("prompt_ids"));
    const std::vector<int64_t> ids = got.at("output_ids").get<std::vector<int64_t>>();
    ASSERT_EQ(ids.size(), static_cast<size_t>(kSteps));
    EXPECT_NE(ids, unprocessed) << "the penalties and bias changed nothing";

    // llama.cpp's processed logits along kvpipe's answer: each of kvpipe's tokens is
    // llama.cpp's choice there, or within a near-tie of it.
    const CommandResult ref = run_command(
        std::string(KVPIPE_PYTHON) + " " + KVPIPE_SOURCE_DIR + "/tests/peer/llama_sampling.py --model " +
            model_.string() + " --prompt " + join(prompt) + " --tokens " + join(ids) + " --repetition-penalty " +
            std::to_string(rp) + " --frequency-penalty " + std::to_string(fp) + " --presence-penalty " +
            std::to_string(pp) + " --logit-bias " + bias_flag,
        dir_);
    ASSERT_TRUE(reference_ran(ref, "llama.cpp samplers"));
    std::vector<nlohmann::json> steps;
    std::istringstream lines(ref.out);
    for (std::string line; std::getline(lines, line);)
      if (!line.empty()) steps.push_back(nlohmann::json::parse(line));
    ASSERT_EQ(steps.size(), static_cast<size_t>(kSteps));
    int same = 0, processed_differs = 0;
    for (int step = 0; step < kSteps; ++step) {
      const int64_t want = steps[step].at("token").get<int64_t>();
      if (ids[step] == want) {
        ++same;
        if (want != steps[step].at("raw_token").get<int64_t>()) ++processed_differs;
        continue;
      }
      EXPECT_LT(steps[step].at("fed_gap").get<double>(), kTieTolerance)
          << ranks << " rank(s), step " << step << ": kvpipe chose " << ids[step] << ", llama.cpp " << want
          << " (its best five: " << steps[step].at("logits_top").dump() << ")";
    }
    std::printf("[ parity ] SmolLM2 penalties and bias along kvpipe's answer, %d rank(s): llama.cpp's samplers "
                "choose kvpipe's token at %d of %d steps (%d where the raw argmax is another), near-ties at the "
                "others\n",
                ranks, same, kSteps, processed_differs);
    EXPECT_GE(same, kSteps * 3 / 4) << ranks << " rank(s): too many near-ties to say anything";
    EXPECT_GE(processed_differs, 3) << "the bias and penalties hardly decided a token";
  }
}

}  // namespace
