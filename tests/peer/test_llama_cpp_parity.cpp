// Parity with llama.cpp (llama-cpp-python, F32 weights and F32 KV cache) on the same random
// GGUF models: kvpipe from the GGUF file (one and two ranks) and from the same model in HF
// layout must give, at every greedy step, full-vocabulary log-probabilities within 1e-4 of
// llama.cpp's while the chosen tokens agree (a near-tie, top two within 1e-3, may diverge).
#include "tests/support/command.h"
#include "tests/support/logprob_compare.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;
using kvpipe::testing::LogprobComparison;
using kvpipe::testing::LogprobStep;
using kvpipe::testing::reference_ran;
using kvpipe::testing::run_command;

namespace {

constexpr int kSteps = 32;
constexpr double kLogprobTolerance = 1e-4;
constexpr double kTieTolerance = 1e-3;
const char* kPrompt = "1,17,42,99,5,300,12,7,250,251,3,64";

LogprobComparison compare(const std::vector<LogprobStep>& ours, const std::vector<LogprobStep>& ref) {
  return kvpipe::testing::compare_logprob_steps(ours, ref, kSteps, kLogprobTolerance, kTieTolerance);
}

class LlamaCppParity : public ::testing::Test {
 protected:
  void SetUp() override {
    const CommandResult probe =
        run_command(std::string(KVPIPE_PYTHON) + " -c 'import llama_cpp'", fs::temp_directory_path());
    ASSERT_EQ(probe.code, 0) << "llama-cpp-python is not importable by " << KVPIPE_PYTHON
                             << ": run scripts/setup.sh --references\n" << probe.err;
    dir_ = kvpipe::testing::make_scratch_dir();
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  void init_model(const std::string& flags) {
    for (const std::string format : {"gguf", "hf"}) {
      const std::string out = (dir_ / (format == "gguf" ? "model.gguf" : "model_hf")).string();
      const CommandResult r = run_command(std::string(KVPIPE_BINARY) + " init-model --format " +
                                              format + " --out " + out + " " + flags, dir_);
      ASSERT_EQ(r.code, 0) << r.err;
    }
    kvpipe::testing::write_greedy_job(dir_, (dir_ / "model.gguf").string(), kPrompt, kSteps);
  }

  std::vector<LogprobStep> kvpipe_run(const std::string& model, int ranks) {
    const auto run = kvpipe::testing::run_kvpipe_logprobs(KVPIPE_BINARY, KVPIPE_MPIRUN, dir_, model, ranks);
    EXPECT_EQ(run.result.code, 0) << run.command << "\n" << run.result.err;
    return run.steps;
  }


  std::vector<LogprobStep> llama_run() {
    const std::string cmd = std::string(KVPIPE_PYTHON) + " " + KVPIPE_SOURCE_DIR +
                            "/tests/peer/llama_logprobs.py --model " + (dir_ / "model.gguf").string() +
                            " --prompt " + kPrompt + " --steps " + std::to_string(kSteps) + " --threads 1";
    const CommandResult r = run_command(cmd, dir_);
    EXPECT_TRUE(reference_ran(r, "llama.cpp", cmd));
    return kvpipe::testing::parse_logprob_steps(r.out);
  }

  void check_all(const std::string& label) {
    const std::vector<LogprobStep> ref = llama_run();
    ASSERT_EQ(ref.size(), static_cast<size_t>(kSteps)) << "llama.cpp run gave no usable output";
    const struct {
      std::string name, model;
      int ranks;
    } runs[] = {{"gguf, 1 rank", (dir_ / "model.gguf").string(), 1},
                {"hf, 1 rank", (dir_ / "model_hf").string(), 1},
                {"gguf, 2 ranks", (dir_ / "model.gguf").string(), 2}};
    for (const auto& run : runs) {
      const LogprobComparison c = compare(kvpipe_run(run.model, run.ranks), ref);
      std::printf("[ parity ] llama.cpp, %s, %s: %s\n", label.c_str(), run.name.c_str(),
                  kvpipe::testing::summary(c).c_str());
      EXPECT_TRUE(c.failure.empty()) << label << ", " << run.name << ": " << c.failure;
      // A run that stops comparing early proves little; the prompts were chosen so that
      // most of the 32 steps are compared.
      EXPECT_GE(c.compared, 8) << label << ", " << run.name;
    }
  }

  fs::path dir_;
};

TEST_F(LlamaCppParity, TinyPreset) {
  init_model("--preset tiny");
  check_all("tiny");
}

TEST_F(LlamaCppParity, GqaHeadDim64RopeTheta500k) {
  init_model("--preset tiny --hidden 512 --layers 6 --heads 8 --kv-heads 2 --head-dim 64 "
             "--rope-theta 500000 --std 0.05 --seed 7");
  check_all("gqa");
}

// The comparison itself must be able to fail: a perturbed copy of the reference is refused.
TEST(LogprobParityRule, RejectsDifferencesBeyondTolerance) {
  std::vector<LogprobStep> ref(kSteps);
  for (int i = 0; i < kSteps; ++i) ref[i] = {1, {-0.5, -1.5, -2.5}};
  auto off = ref;
  off[5].logprobs[2] += 2e-4;
  EXPECT_FALSE(compare(off, ref).failure.empty());
  auto swap = ref;
  swap[3].token = 0;  // 1.0 apart: not a near-tie
  EXPECT_FALSE(compare(swap, ref).failure.empty());
  auto tie = ref;
  for (auto* s : {&tie[4], &ref[4]}) s->logprobs = {-0.6930, -0.6935, -9.0};
  tie[4].token = 0;
  const LogprobComparison c = compare(tie, ref);
  EXPECT_TRUE(c.failure.empty()) << c.failure;
  EXPECT_EQ(c.diverged_at, 4);
  auto short_run = ref;
  short_run.pop_back();
  EXPECT_FALSE(compare(short_run, ref).failure.empty());
}

}  // namespace
