// Tensor parallelism under mpirun against the one-rank run of the same job: a stage's ranks
// split every layer's heads, MLP units and vocabulary (parallel.tensor), alone or as stages
// of a pipeline, on HF and GGUF files, with replicated KV heads, Qwen2's biases and tied
// embeddings, and with every cache policy; greedy tokens identical and log-probabilities of
// the whole vocabulary within 1e-4 (the all-reduces sum in another order). Grids that
// cannot be split are bad input naming parallel.tensor, and a failing tensor rank ends the job.
#include "tests/support/command.h"
#include "tests/support/job_run.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;

using kvpipe::testing::JobRun;

class TensorParallel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(kvpipe::testing::make_scratch_dir());
    // 4 heads over 2 KV heads: T = 2 splits both, T = 4 replicates each KV head on 2 ranks.
    // std 0.1 keeps greedy choices away from the near-ties of flatter random models.
    const std::string shape =
        " --hidden 64 --layers 4 --heads 4 --kv-heads 2 --intermediate 96 --vocab 128 --max-position 256 --std 0.1"
        " --seed 3";
    for (const std::string& args :
         {"--out " + (*dir_ / "hf").string() + shape, "--out " + (*dir_ / "model.gguf").string() + " --format gguf" + shape,
          "--out " + (*dir_ / "qwen2").string() + " --architecture Qwen2ForCausalLM --tie-embeddings" + shape,
          // 6 heads: T = 4 cannot split them.
          "--out " + (*dir_ / "six_heads").string() +
              " --hidden 48 --layers 2 --heads 6 --kv-heads 2 --intermediate 64 --vocab 64 --max-position 64",
          // A draft model: the vocabulary of the others, another shape, other weights.
          "--out " + (*dir_ / "draft").string() +
              " --hidden 32 --layers 2 --heads 4 --kv-heads 2 --intermediate 48 --vocab 128 --max-position 256"
              " --seed 8"}) {
      const CommandResult r = kvpipe::testing::run_command(std::string(KVPIPE_BINARY) + " init-model " + args, *dir_);
      ASSERT_EQ(r.code, 0) << r.err;
    }
    std::ofstream job(*dir_ / "job.yaml");
    job << "model: {path: " << (*dir_ / "hf").string() << "}\n"
        << "cache: {block_size: 4, memory: 1MiB}\n"
        << "scheduler: {max_batch: 4, max_tokens_per_step: 24}\n"
        << "sampling: {ignore_eos: true}\n"
        << "requests:\n";
    // Requests 4..7 repeat the first 12 tokens of request 1's prompt: prefix reuse serves them.
    const int lengths[] = {3, 30, 9, 17, 13, 41, 12, 5};
    for (int i = 0; i < 8; ++i) {
      job << "  - {prompt_ids: [";
      for (int t = 0; t < lengths[i]; ++t) {
        const int id = i >= 4 && t < 12 ? (t * 37 + 11 + 1) % 128 : (t * 37 + i * 11 + 1) % 128;
        job << (t ? ", " : "") << id;
      }
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
    static int run_index = 0;
    const fs::path lp = *dir_ / ("logprobs_" + std::to_string(run_index++) + ".jsonl");
    const std::string cmd = env + " " + KVPIPE_MPIRUN + " --oversubscribe -np " + std::to_string(ranks) + " " +
                            KVPIPE_BINARY + " generate --config " + (*dir_ / "job.yaml").string() +
                            " --logprobs-out " + lp.string() + " " + args;
    return kvpipe::testing::parse_job_run(kvpipe::testing::run_command(cmd, *dir_), lp);
  }

  static void expect_same(const JobRun& run, const JobRun& ref, double tolerance = 1e-4) {
    ASSERT_EQ(run.result.code, 0) << run.result.err;
    ASSERT_EQ(ref.result.code, 0) << ref.result.err;
    EXPECT_EQ(run.outputs, ref.outputs);
    // The whole vocabulary at every step, gathered from every rank.
    const double worst = kvpipe::testing::max_logprob_difference(run, ref);
    std::printf("[ tensor ] max |log-probability difference| %.3g over %zu steps\n", worst, ref.logprobs.size());
    EXPECT_LE(worst, tolerance);
  }

  static void expect_bad_grid(const JobRun& run, const std::string& numbers) {
    EXPECT_EQ(run.result.code, 2) << run.result.err;
    EXPECT_LT(run.result.seconds, 30.0);
    EXPECT_NE(run.result.err.find("parallel.tensor"), std::string::npos) << run.result.err;
    EXPECT_NE(run.result.err.find(numbers), std::string::npos) << run.result.err;
  }

  static fs::path* dir_;
  static JobRun* reference_;
};

fs::path* TensorParallel::dir_ = nullptr;
JobRun* TensorParallel::reference_ = nullptr;

TEST_F(TensorParallel, TwoTensorRanksMatchOneRank) {
  const JobRun run = generate(2, "--set parallel.tensor=2");
  expect_same(run, *reference_);
  // The plan shows the grid and each rank's heads; each rank reports its all-reduces.
  EXPECT_NE(run.result.err.find("1 stage(s) x 2 tensor ranks"), std::string::npos) << run.result.err;
  EXPECT_NE(run.result.err.find("tensor rank 1: heads 2..3, KV heads 1..1"), std::string::npos) << run.result.err;
  EXPECT_NE(run.result.err.find("rank 1: all-reduce"), std::string::npos) << run.result.err;
}

TEST_F(TensorParallel, TwoStagesOfTwoTensorRanksMatchOneRank) {
  const JobRun run = generate(4, "--set parallel.tensor=2 --set parallel.layers=[3,1]");
  expect_same(run, *reference_);
  EXPECT_NE(run.result.err.find("2 stage(s) x 2 tensor ranks"), std::string::npos) << run.result.err;
  EXPECT_NE(run.result.err.find("rank 3 (stage 1, tensor rank 1"), std::string::npos) << run.result.err;
}

TEST_F(TensorParallel, MoreTensorRanksThanKvHeadsReplicateThem) {
  const JobRun run = generate(4, "--set parallel.tensor=4");
  expect_same(run, *reference_);
  // Ranks 2 and 3 share KV head 1, as ranks 0 and 1 share KV head 0.
  EXPECT_NE(run.result.err.find("tensor rank 3: heads 3..3, KV heads 1..1"), std::string::npos) << run.result.err;
  EXPECT_NE(run.result.err.find("tensor rank 1: heads 1..1, KV heads 0..0"), std::string::npos) << run.result.err;
}

TEST_F(TensorParallel, GgufFileMatchesOneRank) {
  const std::string gguf = "--set model.path=" + (*dir_ / "model.gguf").string();
  const JobRun one = generate(1, gguf);
  expect_same(generate(4, gguf + " --set parallel.tensor=2"), one);
}

TEST_F(TensorParallel, Qwen2BiasesAndTiedEmbeddingsMatchOneRank) {
  const std::string qwen = "--set model.path=" + (*dir_ / "qwen2").string();
  const JobRun one = generate(1, qwen);
  EXPECT_NE(one.outputs, reference_->outputs);  // another model
  expect_same(generate(2, qwen + " --set parallel.tensor=2"), one);
}

TEST_F(TensorParallel, SampledTokensMatchOneRank) {
  const std::string sampling = "--set sampling.temperature=0.8 --set sampling.top_p=0.9 --set sampling.seed=7";
  const JobRun one = generate(1, sampling);
  const JobRun two = generate(2, sampling + " --set parallel.tensor=2");
  ASSERT_EQ(two.result.code, 0) << two.result.err;
  EXPECT_EQ(two.outputs, one.outputs);
  EXPECT_NE(one.outputs, reference_->outputs);
}

TEST_F(TensorParallel, PrefixReuseAndPreemptionMatchOneRank) {
  // A pool of 20 blocks of 4 tokens cannot hold every request at once: the coordinator evicts
  // and preempts, on every rank's pool the same way. A tensor rank keeps half the KV heads, so
  // half the memory holds as many blocks.
  const JobRun one = generate(1, "--set cache.memory=80KiB");
  ASSERT_EQ(one.result.code, 0) << one.result.err;
  const JobRun two = generate(2, "--set cache.memory=40KiB --set parallel.tensor=2");
  EXPECT_NE(two.result.err.find("20 blocks of 4 tokens"), std::string::npos) << two.result.err;
  EXPECT_NE(one.result.err.find("20 blocks of 4 tokens"), std::string::npos) << one.result.err;
  expect_same(two, one);
  EXPECT_EQ(one.outputs, reference_->outputs);  // pressure changes no token
  EXPECT_EQ(two.result.err.find(", 0 preemptions"), std::string::npos) << "no preemption happened: " << two.result.err;
  EXPECT_EQ(two.result.err.find("prefix hits 0 of"), std::string::npos) << "no prefix was reused: " << two.result.err;
}

TEST_F(TensorParallel, WindowAndCachedLayersMatchOneRank) {
  const std::string window = "--set 'cache.window={sinks: 2, recent: 8}'";
  const JobRun one = generate(1, window);
  expect_same(generate(2, window + " --set parallel.tensor=2"), one);
  EXPECT_NE(one.outputs, reference_->outputs);
  const std::string reuse = "--set cache.cached_layers=2 --set parallel.layers=[2,2]";
  expect_same(generate(4, reuse + " --set parallel.tensor=2"), *reference_);
}

// Drafts verified in one step through every stage and tensor rank: the tokens and every
// step's log-probabilities are those of the one-rank run without speculation.
TEST_F(TensorParallel, SpeculativeDraftsThroughStagesAndTensorRanksMatchOneRank) {
  const std::string spec = "--set speculative.method=ngram --set speculative.num_tokens=4";
  for (const auto& [ranks, grid] : std::vector<std::pair<int, std::string>>{
           {1, ""}, {2, " --set parallel.layers=[2,2]"}, {2, " --set parallel.tensor=2"}}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks" + grid);
    const JobRun run = generate(ranks, spec + grid);
    expect_same(run, *reference_);
    const size_t at = run.result.err.find("speculative: ");
    ASSERT_NE(at, std::string::npos) << run.result.err;
    const std::string line = run.result.err.substr(at, run.result.err.find('\n', at) - at);
    EXPECT_EQ(line.find(" 0 drafts"), std::string::npos) << line;
    EXPECT_EQ(line.find(", 0 of "), std::string::npos) << "no draft token was accepted: " << line;
  }
}

// generate's "speculative: D drafts, A of T draft tokens accepted" as {D, A, T}.
std::vector<long long> speculative_counts(const JobRun& run) {
  const size_t at = run.result.err.find("speculative: ");
  if (at == std::string::npos) return {};
  long long d = 0, a = 0, t = 0;
  if (std::sscanf(run.result.err.c_str() + at, "speculative: %lld drafts, %lld of %lld", &d, &a, &t) != 3) return {};
  return {d, a, t};
}

// A draft model on rank 0 beside stage 0, through stages and tensor ranks: the tokens and
// log-probabilities are the one-rank run's without speculation. The target as its own draft
// has every draft token kept; a random draft of another shape has most rejected.
TEST_F(TensorParallel, DraftModelOnTheCoordinatorMatchesOneRankThroughStagesAndTensorRanks) {
  const std::string draft = "--set speculative.method=draft --set speculative.num_tokens=3 --set speculative.model=";
  for (const auto& [ranks, grid] : std::vector<std::pair<int, std::string>>{
           {1, ""}, {2, " --set parallel.layers=[2,2]"}, {2, " --set parallel.tensor=2"}}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks" + grid);
    const JobRun run = generate(ranks, draft + (*dir_ / "hf").string() + grid);
    expect_same(run, *reference_);
    const std::vector<long long> c = speculative_counts(run);
    ASSERT_EQ(c.size(), 3u) << run.result.err;
    EXPECT_GT(c[0], 0);
    EXPECT_EQ(c[1], c[2]) << "the target as its own draft had a draft token rejected";
  }
  const JobRun other = generate(2, draft + (*dir_ / "draft").string() + " --set parallel.layers=[2,2]");
  expect_same(other, *reference_);
  const std::vector<long long> c = speculative_counts(other);
  ASSERT_EQ(c.size(), 3u) << other.result.err;
  EXPECT_GT(c[0], 0);
  EXPECT_LT(c[1], c[2]);

  // Another vocabulary is bad input naming the key and both files.
  const JobRun refused = generate(1, draft + (*dir_ / "six_heads").string());
  EXPECT_EQ(refused.result.code, 2) << refused.result.err;
  for (const std::string& part : {std::string("speculative.model"), (*dir_ / "six_heads").string(),
                                  (*dir_ / "hf").string(), std::string("vocabularies"), std::string("64 tokens")})
    EXPECT_NE(refused.result.err.find(part), std::string::npos) << part << " in: " << refused.result.err;
}

// Speculation under memory pressure: drafts take only free blocks, a preempted request resumes
// by recomputation, and tokens and log-probabilities stay those of the one-rank run without
// speculation under the same pressure, with prompt lookup through two tensor ranks and with a
// draft model through two stages.
TEST_F(TensorParallel, SpeculationUnderPreemptionMatchesOneRank) {
  const JobRun one = generate(1, "--set cache.memory=80KiB");
  ASSERT_EQ(one.result.code, 0) << one.result.err;
  const std::string draft = "--set speculative.method=draft --set speculative.num_tokens=3 --set speculative.model=";
  for (const auto& [ranks, args] : std::vector<std::pair<int, std::string>>{
           {2, "--set speculative.method=ngram --set speculative.num_tokens=4 --set parallel.tensor=2"
               " --set cache.memory=40KiB"},
           {2, draft + (*dir_ / "draft").string() + " --set parallel.layers=[2,2] --set cache.memory=40KiB"}}) {
    SCOPED_TRACE(args);
    const JobRun run = generate(ranks, args);
    expect_same(run, one);
    EXPECT_NE(run.result.err.find("20 blocks of 4 tokens"), std::string::npos) << run.result.err;
    EXPECT_EQ(run.result.err.find(", 0 preemptions"), std::string::npos) << "no preemption happened: " << run.result.err;
    const std::vector<long long> c = speculative_counts(run);
    ASSERT_EQ(c.size(), 3u) << run.result.err;
    EXPECT_GT(c[0], 0) << "nothing was drafted: " << run.result.err;
  }
}

TEST_F(TensorParallel, TensorRankThatThrowsMidRunStopsTheJob) {
  const JobRun run = generate(2, "--set parallel.tensor=2", "KVPIPE_INJECT_FAULT=1:3");
  EXPECT_NE(run.result.code, 0);
  EXPECT_LT(run.result.seconds, 30.0);
  EXPECT_NE(run.result.err.find("rank 1"), std::string::npos) << run.result.err;
  EXPECT_NE(run.result.err.find("injected fault"), std::string::npos) << run.result.err;
}

TEST_F(TensorParallel, GridsThatCannotSplitAreBadInput) {
  expect_bad_grid(generate(4, "--set parallel.tensor=3"), "3 does not divide the job's 4 ranks");
  expect_bad_grid(generate(4, "--set parallel.tensor=4 --set model.path=" + (*dir_ / "six_heads").string()),
                  "4 does not divide the model's 6 attention heads");
  // 3 tensor ranks split 6 heads but not 2 KV heads (nor replicate them evenly).
  expect_bad_grid(generate(3, "--set parallel.tensor=3 --set model.path=" + (*dir_ / "six_heads").string()),
                  "the model's 2 KV heads");
  expect_bad_grid(generate(4, "--set parallel.tensor=2 --set parallel.layers=[1,1,2]"),
                  "pins 3 stages for 2 stages");
}

}  // namespace
}  // namespace kvpipe
