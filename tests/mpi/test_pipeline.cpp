// Pipeline runs under mpirun against the one-rank run of the same job on the same
// random-weight model: greedy tokens identical, log-probabilities within 1e-5.
#include "tests/support/command.h"
#include "tests/support/job_run.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;

using kvpipe::testing::JobRun;

class Pipeline : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(kvpipe::testing::make_scratch_dir());
    // Seven layers so that [3, 2, 2] is a real uneven split; std 0.1 keeps greedy choices
    // away from the near-ties of flatter random models.
    const CommandResult r = kvpipe::testing::run_command(
        std::string(KVPIPE_BINARY) + " init-model --out " + (*dir_ / "model").string() +
            " --hidden 64 --layers 7 --heads 4 --kv-heads 2 --intermediate 96 --vocab 128"
            " --max-position 256 --std 0.1 --seed 3",
        *dir_);
    ASSERT_EQ(r.code, 0) << r.err;
    std::ofstream job(*dir_ / "job.yaml");
    job << "model: {path: " << (*dir_ / "model").string() << "}\n"
        << "cache: {block_size: 4, memory: 1MiB}\n"
        << "scheduler: {max_batch: 4, max_tokens_per_step: 24}\n"
        << "sampling: {ignore_eos: true}\n"
        << "requests:\n";
    const int lengths[] = {3, 30, 9, 17, 1, 41, 12, 5};
    for (int i = 0; i < 8; ++i) {
      job << "  - {prompt_ids: [";
      for (int t = 0; t < lengths[i]; ++t) job << (t ? ", " : "") << (t * 37 + i * 11 + 1) % 128;
      job << "], max_new_tokens: " << 6 + 2 * i << ", arrival_step: " << (i % 4) * 2 << "}\n";
    }
    job.close();
    reference_ = new JobRun(generate(1, ""));
    ASSERT_EQ(reference_->result.code, 0) << reference_->result.err;
    ASSERT_EQ(reference_->outputs.size(), 8u);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
    delete reference_;
  }

  static JobRun generate(int ranks, const std::string& args, const std::string& env = "") {
    const fs::path lp = *dir_ / ("logprobs_" + std::to_string(ranks) + ".jsonl");
    std::string cmd = env + " " + KVPIPE_MPIRUN + " --oversubscribe -np " + std::to_string(ranks) + " " +
                      KVPIPE_BINARY + " generate --config " + (*dir_ / "job.yaml").string() +
                      " --logprobs-out " + lp.string() + " " + args;
    return kvpipe::testing::parse_job_run(kvpipe::testing::run_command(cmd, *dir_), lp);
  }

  static void expect_same_as_one_rank(const JobRun& run, double tolerance = 1e-5,
                                      const JobRun* reference = nullptr) {
    const JobRun& ref_run = reference ? *reference : *reference_;
    ASSERT_EQ(run.result.code, 0) << run.result.err;
    ASSERT_EQ(ref_run.result.code, 0) << ref_run.result.err;
    EXPECT_EQ(run.outputs, ref_run.outputs);
    EXPECT_LE(kvpipe::testing::max_logprob_difference(run, ref_run), tolerance);
    // One summary line per rank on stderr.
    EXPECT_NE(run.result.err.find("rank 0: busy"), std::string::npos) << run.result.err;
  }

  static fs::path* dir_;
  static JobRun* reference_;
};

fs::path* Pipeline::dir_ = nullptr;
JobRun* Pipeline::reference_ = nullptr;

TEST_F(Pipeline, TwoRanksAuto) { expect_same_as_one_rank(generate(2, "")); }

TEST_F(Pipeline, TwoRanksOneMicroBatch) {
  expect_same_as_one_rank(generate(2, "--set parallel.micro_batches=1"));
}

TEST_F(Pipeline, ThreeRanksPinnedUnevenSplit) {
  const JobRun run = generate(3, "--set parallel.layers=[3,2,2]");
  expect_same_as_one_rank(run);
  EXPECT_NE(run.result.err.find("split [3, 2, 2]"), std::string::npos) << run.result.err;
}

TEST_F(Pipeline, ThreeRanksAutoOneMicroBatch) {
  expect_same_as_one_rank(generate(3, "--set parallel.micro_batches=1"));
}

TEST_F(Pipeline, FourRanksAuto) { expect_same_as_one_rank(generate(4, "")); }

TEST_F(Pipeline, SampledTokensMatchOneRank) {
  const std::string sampling = "--set sampling.temperature=0.8 --set sampling.top_p=0.9 --set sampling.seed=7";
  const JobRun one = generate(1, sampling);
  const JobRun three = generate(3, sampling);
  ASSERT_EQ(one.result.code, 0) << one.result.err;
  ASSERT_EQ(three.result.code, 0) << three.result.err;
  EXPECT_EQ(three.outputs, one.outputs);
  EXPECT_NE(one.outputs, reference_->outputs);  // sampling did change the tokens
}

TEST_F(Pipeline, UnevenBudgetsSplitLayersByMemory) {
  // Rank 0 has twice rank 1's KV memory: the split that maximises the common block count
  // gives it about twice the layers.
  const JobRun run = generate(2, "--set cache.memory=[1MiB,512KiB]");
  expect_same_as_one_rank(run);
  EXPECT_NE(run.result.err.find("split [5, 2]"), std::string::npos) << run.result.err;
}

TEST_F(Pipeline, CachedLayersOnTwoRanksMatchAllLayers) {
  // The last 3 of 7 layers keep K/V; with the split [4, 3] rank 0 keeps none at all and
  // recomputes its layers over whole sequences every step.
  const JobRun run = generate(2, "--set cache.cached_layers=3 --set parallel.layers=[4,3]");
  expect_same_as_one_rank(run, 1e-4);
  EXPECT_NE(run.result.err.find("0 cached layer(s)"), std::string::npos) << run.result.err;
}

TEST_F(Pipeline, WindowOnThreeRanksMatchesOneRank) {
  const std::string window = "--set 'cache.window={sinks: 2, recent: 8}'";
  const JobRun one = generate(1, window);
  expect_same_as_one_rank(generate(3, window), 1e-5, &one);
  EXPECT_NE(one.outputs, reference_->outputs);  // the window does change what the model sees
}

TEST_F(Pipeline, PrefixReuseOffMatches) {
  expect_same_as_one_rank(generate(2, "--set cache.prefix_reuse=false"));
}

TEST_F(Pipeline, RankThatThrowsMidRunStopsTheJob) {
  const JobRun run = generate(3, "", "KVPIPE_INJECT_FAULT=2:3");
  EXPECT_NE(run.result.code, 0);
  EXPECT_LT(run.result.seconds, 30.0);
  EXPECT_NE(run.result.err.find("rank 2"), std::string::npos) << run.result.err;
  EXPECT_NE(run.result.err.find("injected fault"), std::string::npos) << run.result.err;
}

TEST_F(Pipeline, BadShardIsRefusedByEveryRanksPlan) {
  // Shard the model so that the last layers live in their own file, then corrupt that
  // file: only the rank that holds those layers loads from it, but every rank's plan reads
  // the header of every shard first (as validate does), so the job stops before any weight
  // loads, on every rank.
  const fs::path model = *dir_ / "sharded";
  fs::create_directories(model);
  fs::copy_file(*dir_ / "model" / "config.json", model / "config.json");
  fs::copy_file(*dir_ / "model" / "model.safetensors", model / "first.safetensors");
  std::ofstream(model / "last.safetensors") << "not a safetensors file";
  nlohmann::json index;
  for (int l = 0; l < 7; ++l)
    for (const char* t : {"input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                          "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"})
      index["weight_map"]["model.layers." + std::to_string(l) + "." + t] = l < 4 ? "first.safetensors" : "last.safetensors";
  index["weight_map"]["model.embed_tokens.weight"] = "first.safetensors";
  index["weight_map"]["model.norm.weight"] = "last.safetensors";
  index["weight_map"]["lm_head.weight"] = "last.safetensors";
  std::ofstream(model / "model.safetensors.index.json") << index.dump();
  const JobRun run = generate(2, "--set model.path=" + model.string() + " --set parallel.layers=[4,3]");
  EXPECT_EQ(run.result.code, 2) << run.result.err;
  EXPECT_LT(run.result.seconds, 30.0);
  EXPECT_NE(run.result.err.find("last.safetensors"), std::string::npos) << run.result.err;
  EXPECT_NE(run.result.err.find("model.path"), std::string::npos) << run.result.err;
  for (const char* rank : {"rank 0: error", "rank 1: error"})
    EXPECT_NE(run.result.err.find(rank), std::string::npos) << run.result.err;
}

TEST_F(Pipeline, NcclWithoutGpuIsBadInput) {
  const JobRun run = generate(2, "--set parallel.backend=nccl");
  EXPECT_EQ(run.result.code, 2);
  EXPECT_NE(run.result.err.find("parallel.backend: nccl"), std::string::npos) << run.result.err;
  EXPECT_LT(run.result.seconds, 30.0);
}

TEST_F(Pipeline, ImpossibleSplitsAreBadInput) {
  JobRun run = generate(2, "--set parallel.layers=[4,4]");
  EXPECT_EQ(run.result.code, 2);
  EXPECT_NE(run.result.err.find("parallel.layers"), std::string::npos) << run.result.err;
  run = generate(8, "");
  EXPECT_EQ(run.result.code, 2);
  EXPECT_NE(run.result.err.find("8 ranks"), std::string::npos) << run.result.err;
}

// The example jobs in configs/ print the same lines (timings aside) as their one-rank run.
TEST(PipelineConfigs, ExampleJobsMatchOneRank) {
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  const std::string configs = std::string(KVPIPE_SOURCE_DIR) + "/configs/";
  auto outputs = [&](const std::string& cmd) {
    const CommandResult r = kvpipe::testing::run_command(cmd, dir);
    EXPECT_EQ(r.code, 0) << cmd << "\n" << r.err;
    std::vector<std::string> lines;
    std::istringstream in(r.out);
    std::string line;
    while (std::getline(in, line)) {
      auto j = nlohmann::ordered_json::parse(line);
      j.erase("ttft_ms");
      j.erase("tpot_ms");
      lines.push_back(j.dump());
    }
    // Each request's line is printed as it finishes: compare the sets of lines.
    std::sort(lines.begin(), lines.end());
    return lines;
  };
  const std::string one_rank = " --set parallel.layers=auto --set parallel.micro_batches=auto";
  for (const auto& [file, ranks, extra] : std::vector<std::tuple<std::string, int, std::string>>{
           {"tiny-3rank.yaml", 3, ""}, {"tiny-2rank.yaml", 2, " --set model.path=dummy:tiny"}}) {
    const std::string base = std::string(KVPIPE_BINARY) + " generate --config " + configs + file + extra;
    const auto one = outputs(base + one_rank);
    const auto many = outputs(std::string(KVPIPE_MPIRUN) + " --oversubscribe -np " + std::to_string(ranks) + " " + base);
    EXPECT_FALSE(one.empty());
    EXPECT_EQ(many, one) << file;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvpipe
