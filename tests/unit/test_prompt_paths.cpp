// The prompt products over a whole generation: a BF16 model's prompt through the bfloat16
// products (bf16_gemm.h) against the same job with KVPIPE_CPU_MATMUL=blas (sgemm on float32
// activations), greedy, every step's full-vocabulary log-probabilities compared.
#include "engine/kernels/cpu/bf16_gemm.h"
#include "tests/support/command.h"
#include "tests/support/logprob_compare.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;

TEST(PromptPaths, Bf16ProductsMatchTheFloatPathOverAGeneration) {
  if (!bf16_gemm_choice()) GTEST_SKIP() << "avx512-bf16 does not run on this processor: BF16 prompts use BLAS";
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  const std::string model = (dir / "m.gguf").string();
  CommandResult r = kvpipe::testing::run_command(
      std::string(KVPIPE_BINARY) + " init-model --format gguf --dtype bfloat16 --out " + model +
          " --hidden 128 --layers 2 --heads 4 --kv-heads 2 --intermediate 256 --vocab 256 --max-position 512"
          " --seed 4 --std 0.05",
      dir);
  ASSERT_EQ(r.code, 0) << r.err;
  // 96 prompt tokens: past the 64 inputs up to which the decode kernels serve a product.
  std::string prompt;
  for (int i = 0; i < 96; ++i) prompt += (i ? "," : "") + std::to_string((i * 37 + 11) % 256);
  constexpr int kSteps = 8;
  std::ofstream(dir / "job.yaml") << "model: {path: " << model << "}\n"
                                  << "runtime: {threads: 2}\n"
                                  << "cache: {block_size: 16, memory: 16MiB}\n"
                                  << "sampling: {temperature: 0.0, ignore_eos: true}\n"
                                  << "requests: [{prompt_ids: [" << prompt << "], max_new_tokens: " << kSteps << "}]\n";
  auto run = [&](const std::string& path) {
    const fs::path lp = dir / (path + ".jsonl");
    const CommandResult c = kvpipe::testing::run_command(
        "KVPIPE_CPU_MATMUL=" + path + " " + KVPIPE_BINARY + " generate --config " + (dir / "job.yaml").string() +
            " --logprobs-out " + lp.string(),
        dir);
    EXPECT_EQ(c.code, 0) << path << ": " << c.err;
    return kvpipe::testing::parse_logprob_steps(kvpipe::testing::slurp(lp));
  };
  const auto blas = run("blas"), bf16 = run("auto");
  // Each activation rounded to bfloat16 (2^-9 relative) in the prompt's products, and in the
  // decode steps' (bf16_decode): the log-probabilities move by up to about 1.1e-2 on this model;
  // a wrong pairing or a skipped row moves them by whole units.
  const kvpipe::testing::LogprobComparison c = kvpipe::testing::compare_logprob_steps(bf16, blas, kSteps, 2e-2, 2e-2);
  EXPECT_TRUE(c.failure.empty()) << c.failure;
  EXPECT_GT(c.max_delta, 0.0) << "the two runs took the same path";
  std::printf("bfloat16 prompt products against sgemm: %s\n", kvpipe::testing::summary(c).c_str());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvpipe
