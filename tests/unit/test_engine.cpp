// The paged, batched engine against a full recompute without cache, and against itself run
// one request at a time.
#include "cache/block_pool.h"
#include "engine/engine.h"
#include "engine/layers.h"
#include "engine/model_shard.h"
#include "engine/model/model_weights.h"
#include "engine/step_arena.h"
#include "tests/support/engine_run.h"
#include "tests/support/reference_model.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <tuple>

namespace kvpipe {
namespace {

using kvpipe::testing::make_request;

ModelConfig small_config(int64_t heads, int64_t kv_heads, bool qkv_bias = false) {
  ModelConfig c;
  c.architecture = qkv_bias ? "Qwen2ForCausalLM" : "LlamaForCausalLM";
  c.qkv_bias = qkv_bias;
  c.vocab_size = 97;
  c.hidden_size = 64;
  c.num_layers = 3;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = 64 / heads;
  c.intermediate_size = 96;
  c.max_position = 512;
  c.rope_theta = 10000.0;
  c.rms_eps = 1e-5;
  c.eos_token_ids = {2};
  return c;
}

WeightSelection whole(const ModelConfig& c) { return {{0, c.num_layers}, true, true, {}}; }

using kvpipe::testing::Generated;

Generated run_engine(const ModelShard& shard, int64_t block_size, int64_t num_blocks,
                     const std::vector<Request>& requests, int64_t max_batch = 32,
                     int64_t max_tokens_per_step = 2048) {
  SchedulerOptions o;
  o.block_size = block_size;
  o.max_batch = max_batch;
  o.max_tokens_per_step = max_tokens_per_step;
  return kvpipe::testing::run_engine(shard, o, num_blocks, requests);
}

std::vector<int64_t> prompt_of(int64_t len, int64_t salt, int64_t vocab) {
  std::vector<int64_t> p(len);
  for (int64_t i = 0; i < len; ++i) p[i] = (i * 31 + salt * 17 + 3) % vocab;
  return p;
}

class CachedDecode : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t>> {};

TEST_P(CachedDecode, MatchesFullRecomputeFor64Steps) {
  const auto [block_size, kv_heads, prompt_len] = GetParam();
  const ModelConfig cfg = small_config(4, kv_heads);
  const ModelWeights w = random_weights(cfg, whole(cfg), 7, 0.1, at::kFloat);
  const ModelShard shard(w);
  const std::vector<int64_t> prompt = prompt_of(prompt_len, 1, cfg.vocab_size);
  const int64_t steps = 64;
  const Generated g = run_engine(shard, block_size, 512 / block_size, {make_request(0, prompt, steps)});
  ASSERT_EQ(static_cast<int64_t>(g.tokens.at(0).size()), steps);

  std::vector<int64_t> all = prompt;
  all.insert(all.end(), g.tokens.at(0).begin(), g.tokens.at(0).end());
  const at::Tensor ref = kvpipe::testing::full_recompute_logits(w, all);
  double worst = 0.0;
  for (int64_t s = 0; s < steps; ++s) {
    const at::Tensor expected = ref[prompt_len - 1 + s];
    worst = std::max(worst, (g.logits.at(0)[s] - expected).abs().max().item<double>());
  }
  EXPECT_LE(worst, 1e-4) << "block_size " << block_size << ", kv_heads " << kv_heads;
}

// Block sizes 1, 16, 32; MHA (4 kv heads) and GQA (2 kv heads); prompts shorter and longer
// than a block.
INSTANTIATE_TEST_SUITE_P(Engine, CachedDecode,
                         ::testing::Combine(::testing::Values(1, 16, 32), ::testing::Values(4, 2),
                                            ::testing::Values(5, 45)));

TEST(EngineQwen2, BiasedProjectionsMatchFullRecompute) {
  const ModelConfig cfg = small_config(4, 1, /*qkv_bias=*/true);
  const ModelWeights w = random_weights(cfg, whole(cfg), 3, 0.1, at::kFloat);
  const ModelShard shard(w);
  const std::vector<int64_t> prompt = prompt_of(20, 2, cfg.vocab_size);
  const Generated g = run_engine(shard, 16, 32, {make_request(0, prompt, 16)});
  std::vector<int64_t> all = prompt;
  all.insert(all.end(), g.tokens.at(0).begin(), g.tokens.at(0).end());
  const at::Tensor ref = kvpipe::testing::full_recompute_logits(w, all);
  for (size_t s = 0; s < g.logits.at(0).size(); ++s)
    EXPECT_LE((g.logits.at(0)[s] - ref[prompt.size() - 1 + s]).abs().max().item<double>(), 1e-4);
}

// Requests of different lengths joining at different steps, with prompts split into chunks
// by a small token budget, must each get what they get alone.
void expect_batch_matches_alone(const SamplingParams& sampling) {
  const ModelConfig cfg = small_config(4, 2);
  const ModelShard shard(random_weights(cfg, whole(cfg), 11, 0.1, at::kFloat));
  std::vector<Request> requests;
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {3, 20, 0}, {37, 12, 0}, {16, 25, 2}, {70, 8, 5}, {1, 30, 9}, {9, 15, 9}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto [len, max_new, arrival] = shapes[i];
    Request r = make_request(static_cast<int64_t>(i), prompt_of(len, static_cast<int64_t>(i), cfg.vocab_size),
                             max_new, arrival);
    r.sampling = sampling;
    requests.push_back(r);
  }
  const Generated batched = run_engine(shard, 16, 64, requests, /*max_batch=*/4, /*max_tokens_per_step=*/24);
  for (const Request& r : requests) {
    Request alone = r;
    alone.arrival_step = 0;
    const Generated single = run_engine(shard, 16, 64, {alone});
    ASSERT_EQ(batched.tokens.at(r.id), single.tokens.at(r.id)) << "request " << r.id;
    for (size_t s = 0; s < single.logits.at(r.id).size(); ++s)
      EXPECT_LE((batched.logits.at(r.id)[s] - single.logits.at(r.id)[s]).abs().max().item<double>(), 1e-4)
          << "request " << r.id << " step " << s;
  }
}

TEST(EngineBatching, GreedyBatchMatchesEachRequestAlone) { expect_batch_matches_alone({}); }

TEST(EngineBatching, SampledBatchMatchesEachRequestAlone) {
  expect_batch_matches_alone(SamplingParams{0.8, 20, 0.9, 1234});
}

// The step loop allocates no cache tensor, and after the first steps every decode step's
// tensors come from the blocks of the step before (engine/step_arena.h): the system is asked
// for no tensor memory.
TEST(EngineCache, NoCacheTensorIsAllocatedInTheStepLoopNorDecodeTensorMemory) {
  const ModelConfig cfg = small_config(4, 2);
  const ModelShard shard(random_weights(cfg, whole(cfg), 1, 0.1, at::kFloat));
  BlockPool pool(shard.kv_shape(16), 32, at::kFloat, at::kCPU);
  const void* storage = pool.keys(0).data_ptr();
  const int64_t before = BlockPool::tensors_allocated();
  LocalExecutor executor(shard, pool);
  EngineOptions o;
  o.scheduler.max_context = cfg.max_position;
  Engine engine(executor, cfg, 32, o);
  for (int64_t i = 0; i < 4; ++i) engine.add(make_request(i, prompt_of(10 + 7 * i, i, cfg.vocab_size), 40));
  // Every step gives request 0 its next token (all four prompts fill the first step).
  std::vector<StepArena::Stats> after_step;
  engine.run([&](const TokenEvent& ev) {
    if (ev.request_id == 0) after_step.push_back(StepArena::stats());
  });
  EXPECT_EQ(BlockPool::tensors_allocated(), before);
  EXPECT_EQ(pool.keys(0).data_ptr(), storage);
  EXPECT_GE(engine.stats().steps(), 40);  // one prefill step, then 39 decode steps
  ASSERT_EQ(after_step.size(), 40u);
  // Steps 0-3 (the prefill and the first decode steps) may meet new sizes; none after.
  EXPECT_EQ(after_step.back().fresh_blocks, after_step[3].fresh_blocks);
  // Every layer's outputs came from the arena: far more reuses than steps.
  EXPECT_GE(after_step.back().reused_blocks - after_step[3].reused_blocks, 36 * cfg.num_layers * 5);
}

TEST(EngineCache, PressurePreemptsAndKeepsOutputs) {
  const ModelConfig cfg = small_config(4, 2);
  const ModelShard shard(random_weights(cfg, whole(cfg), 5, 0.1, at::kFloat));
  std::vector<Request> requests;
  for (int64_t i = 0; i < 6; ++i) requests.push_back(make_request(i, prompt_of(12 + i, i, cfg.vocab_size), 30));
  const Generated ample = run_engine(shard, 8, 128, requests);
  const Generated tight = run_engine(shard, 8, 7, requests);  // 7 blocks of 8 tokens for six requests
  EXPECT_GT(tight.preemptions, 0);
  EXPECT_EQ(ample.preemptions, 0);
  for (const Request& r : requests) EXPECT_EQ(tight.tokens.at(r.id), ample.tokens.at(r.id)) << "request " << r.id;
}

TEST(EngineRequests, BadRequestsAreRefused) {
  const ModelConfig cfg = small_config(4, 2);
  const ModelShard shard(random_weights(cfg, whole(cfg), 5, 0.1, at::kFloat));
  BlockPool pool(shard.kv_shape(16), 4, at::kFloat, at::kCPU);
  LocalExecutor executor(shard, pool);
  EngineOptions o;
  o.scheduler.max_context = cfg.max_position;
  Engine engine(executor, cfg, 4, o);
  auto message = [&](const Request& r) {
    try {
      engine.add(r);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message(make_request(1, {1, 2, 97}, 4)).find("outside the vocabulary"), std::string::npos);
  EXPECT_NE(message(make_request(2, prompt_of(600, 0, 97), 4)).find("context"), std::string::npos);
  EXPECT_NE(message(make_request(3, prompt_of(40, 0, 97), 40)).find("KV blocks"), std::string::npos);
  EXPECT_EQ(message(make_request(4, prompt_of(40, 0, 97), 20)), "accepted");  // 59 tokens in 64 slots
}

TEST(EngineRequests, StopsAtEos) {
  const ModelConfig cfg = small_config(4, 2);
  const ModelShard shard(random_weights(cfg, whole(cfg), 5, 0.1, at::kFloat));
  Request r = make_request(0, prompt_of(8, 0, cfg.vocab_size), 20);
  const Generated free_run = run_engine(shard, 16, 8, {r});
  // Make the third generated token the end of sequence: generation must stop right there.
  ModelConfig with_eos = cfg;
  with_eos.eos_token_ids = {free_run.tokens.at(0)[2]};
  BlockPool pool(shard.kv_shape(16), 8, at::kFloat, at::kCPU);
  LocalExecutor executor(shard, pool);
  EngineOptions o;
  o.scheduler.max_context = cfg.max_position;
  Engine engine(executor, with_eos, 8, o);
  r.ignore_eos = false;
  engine.add(r);
  engine.run();
  const RequestResult res = engine.results().at(0);
  EXPECT_EQ(res.finish_reason, "stop");
  const auto first = std::find(free_run.tokens.at(0).begin(), free_run.tokens.at(0).end(), with_eos.eos_token_ids[0]);
  EXPECT_EQ(res.output_ids.size(), static_cast<size_t>(first - free_run.tokens.at(0).begin()) + 1);
}

TEST(EngineRequests, FinishEndsARequestEarlyAndFreesItsBlocks) {
  const ModelConfig cfg = small_config(4, 2);
  const ModelShard shard(random_weights(cfg, whole(cfg), 5, 0.1, at::kFloat));
  BlockPool pool(shard.kv_shape(8), 32, at::kFloat, at::kCPU);
  LocalExecutor executor(shard, pool);
  EngineOptions o;
  o.scheduler.block_size = 8;
  o.scheduler.max_context = cfg.max_position;
  o.scheduler.max_tokens_per_step = 8;  // request 2's prompt takes three steps
  Engine engine(executor, cfg, 32, o);
  engine.add(make_request(0, prompt_of(8, 0, cfg.vocab_size), 20));
  engine.add(make_request(1, prompt_of(8, 1, cfg.vocab_size), 20));
  engine.add(make_request(2, prompt_of(20, 2, cfg.vocab_size), 20, 1));
  engine.add(make_request(3, prompt_of(8, 3, cfg.vocab_size), 20, 1000));  // never arrives
  std::map<int64_t, int64_t> seen;
  engine.run([&](const TokenEvent& ev) {
    ++seen[ev.request_id];
    // From the callback: the request is in flight, so the token it brings is kept.
    if (ev.request_id == 0 && ev.index == 4) EXPECT_TRUE(engine.finish(0, "stop"));
    if (ev.request_id == 1 && ev.index == 0) {
      EXPECT_TRUE(engine.finish(2, "abort"));  // still computing its prompt
      EXPECT_TRUE(engine.finish(3, "abort"));  // not arrived yet
      EXPECT_FALSE(engine.finish(42, "abort"));
    }
  });
  const std::vector<RequestResult> res = engine.results();
  EXPECT_EQ(res[0].finish_reason, "stop");
  EXPECT_EQ(res[0].output_ids.size(), 5u);
  EXPECT_EQ(res[1].finish_reason, "length");
  EXPECT_EQ(res[1].output_ids.size(), 20u);
  EXPECT_EQ(res[2].finish_reason, "abort");
  EXPECT_EQ(res[3].finish_reason, "abort");
  EXPECT_TRUE(res[3].output_ids.empty());
  EXPECT_FALSE(engine.finish(0, "stop"));  // already finished
  EXPECT_EQ(engine.scheduler().blocks().num_used(), 0);
  EXPECT_EQ(engine.unfinished(), 0);
}

}  // namespace
}  // namespace kvpipe
