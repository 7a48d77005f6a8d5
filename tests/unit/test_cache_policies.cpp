// KV-cache policies: prefix reuse across requests, layer-level reuse, the window with
// sinks, and eviction; each against a run without the policy or a full recompute.
#include "cache/block_manager.h"
#include "engine/engine.h"
#include "engine/model_shard.h"
#include "engine/model/model_weights.h"
#include "tests/support/engine_run.h"
#include "tests/support/reference_model.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace kvpipe {
namespace {

using kvpipe::testing::Generated;
using kvpipe::testing::run_engine;
using kvpipe::testing::make_request;

ModelConfig test_config() {
  ModelConfig c;
  c.vocab_size = 97;
  c.hidden_size = 64;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.intermediate_size = 96;
  c.max_position = 512;
  c.rms_eps = 1e-5;
  c.eos_token_ids = {2};
  return c;
}

ModelWeights test_weights(uint64_t seed = 21) {
  const ModelConfig c = test_config();
  return random_weights(c, {{0, c.num_layers}, true, true, {}}, seed, 0.1, at::kFloat);
}

std::vector<int64_t> tokens(int64_t len, int64_t salt) {
  std::vector<int64_t> t(len);
  for (int64_t i = 0; i < len; ++i) t[i] = (i * 29 + salt * 13 + 5) % 97;
  return t;
}

std::vector<int64_t> concat(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

double max_logit_diff(const Generated& a, const Generated& b) {
  double worst = 0;
  for (const auto& [id, rows] : a.logits)
    for (size_t s = 0; s < rows.size(); ++s)
      worst = std::max(worst, (rows[s] - b.logits.at(id).at(s)).abs().max().item<double>());
  return worst;
}

// --- eviction and reference counting -------------------------------------------------

TEST(BlockManagerEviction, LeastRecentlyUnreferencedGoesFirstAndBlocksInUseNever) {
  BlockManager m(4, 2, /*prefix_reuse=*/true);
  std::vector<int32_t> b;
  for (int i = 0; i < 4; ++i) b.push_back(m.allocate());
  const int64_t t[3][2] = {{1, 2}, {3, 4}, {5, 6}};
  uint64_t h = 0;
  for (int i = 0; i < 3; ++i) {
    h = BlockManager::chain_hash(h, t[i], 2);
    m.insert(h, b[i], t[i]);
  }
  // Unreferenced in the order 0, 2, 1; block 3 (not cached) stays in use.
  m.release(b[0]);
  m.release(b[2]);
  m.release(b[1]);
  EXPECT_EQ(m.num_available(), 3);
  EXPECT_EQ(m.users(b[0]), 0);
  EXPECT_EQ(m.users(b[3]), 1);
  EXPECT_EQ(m.allocate(), b[0]);
  EXPECT_EQ(m.allocate(), b[2]);
  EXPECT_EQ(m.allocate(), b[1]);
  EXPECT_EQ(m.allocate(), -1);
  EXPECT_EQ(m.stats().evictions, 3);
}

TEST(BlockManagerEviction, ReusedBlockLeavesTheEvictionOrder) {
  BlockManager m(2, 2, true);
  const int32_t a = m.allocate(), b = m.allocate();
  const int64_t ta[2] = {7, 8}, tb[2] = {9, 10};
  const uint64_t ha = BlockManager::chain_hash(0, ta, 2);
  m.insert(ha, a, ta);
  m.insert(BlockManager::chain_hash(ha, tb, 2), b, tb);
  m.release(a);
  m.release(b);
  // A new request with prefix [7, 8, 9, 10] takes both back: nothing is evictable now.
  const std::vector<int32_t> hit = m.match_prefix({7, 8, 9, 10, 11}, 2, 5);
  EXPECT_EQ(hit, (std::vector<int32_t>{a, b}));
  EXPECT_EQ(m.stats().hit_tokens, 4);
  EXPECT_EQ(m.num_available(), 0);
  EXPECT_EQ(m.allocate(), -1);
  // A prefix that differs in its first block shares nothing, even with equal later blocks.
  EXPECT_TRUE(m.match_prefix({0, 8, 9, 10}, 2, 4).empty());
}

TEST(BlockManagerEviction, SharedBlockCountsEveryUser) {
  BlockManager m(1, 2, true);
  const int32_t a = m.allocate();
  const int64_t ta[2] = {1, 1};
  m.insert(BlockManager::chain_hash(0, ta, 2), a, ta);
  EXPECT_EQ(m.match_prefix({1, 1, 5}, 1, 3).size(), 1u);
  EXPECT_EQ(m.users(a), 2);
  m.release(a);
  EXPECT_EQ(m.users(a), 1);
  EXPECT_EQ(m.allocate(), -1);  // still in use by one sequence
  m.release(a);
  EXPECT_EQ(m.users(a), 0);
  EXPECT_EQ(m.allocate(), a);
}

// --- prefix reuse ----------------------------------------------------------------------

TEST(CachePrefixReuse, SameOutputsAndOnlyUnsharedTokensComputed) {
  const ModelShard shard(test_weights());
  const std::vector<int64_t> prefix = tokens(40, 1);  // five blocks of 8
  const std::vector<Request> requests = {
      make_request(0, concat(prefix, {1, 2, 3}), 8), make_request(1, concat(prefix, {4, 5}), 8, 3),
      make_request(2, concat(prefix, {6}), 8, 3), make_request(3, tokens(19, 9), 8, 3)};
  SchedulerOptions o;
  o.block_size = 8;
  o.prefix_reuse = false;
  const Generated off = run_engine(shard, o, 64, requests);
  o.prefix_reuse = true;
  const Generated on = run_engine(shard, o, 64, requests);
  EXPECT_EQ(on.tokens, off.tokens);
  EXPECT_LE(max_logit_diff(on, off), 1e-5);
  // Requests 1 and 2 find the 40-token prefix of request 0; request 3 shares nothing.
  EXPECT_EQ(on.prefix.hit_tokens, 80);
  EXPECT_EQ(on.scheduler.computed_tokens, off.scheduler.computed_tokens - 80);
  EXPECT_EQ(off.prefix.hit_tokens, 0);
}

TEST(CachePrefixReuse, WholePromptCachedStillComputesItsLastBlock) {
  const ModelShard shard(test_weights());
  const std::vector<int64_t> prompt = tokens(32, 4);  // exactly four blocks
  SchedulerOptions o;
  o.block_size = 8;
  o.prefix_reuse = true;
  const Generated g = run_engine(shard, o, 32, {make_request(0, prompt, 4), make_request(1, prompt, 4, 6)});
  EXPECT_EQ(g.tokens.at(0), g.tokens.at(1));
  EXPECT_EQ(g.prefix.hit_tokens, 24);  // the last block is recomputed for its logits
}

TEST(CachePrefixReuse, PressureEvictsAndPreemptsWithoutChangingOutputs) {
  const ModelShard shard(test_weights());
  const std::vector<int64_t> prefix = tokens(16, 2);
  std::vector<Request> requests;
  for (int64_t i = 0; i < 8; ++i) requests.push_back(make_request(i, concat(prefix, tokens(3 + i, 10 + i)), 20, i));
  SchedulerOptions o;
  o.block_size = 4;
  o.prefix_reuse = true;
  const Generated ample = run_engine(shard, o, 256, requests);
  const Generated tight = run_engine(shard, o, 14, requests);
  EXPECT_EQ(tight.tokens, ample.tokens);
  EXPECT_GT(tight.preemptions, 0);
  EXPECT_GT(tight.prefix.evictions, 0);
  EXPECT_GT(ample.prefix.hit_tokens, 0);
}

// --- layer-level reuse -------------------------------------------------------------------

TEST(CacheLayerReuse, FewerCachedLayersGiveTheSameLogits) {
  const ModelWeights w = test_weights();
  const std::vector<Request> requests = {make_request(0, tokens(21, 3), 24), make_request(1, tokens(5, 4), 30, 2),
                                         make_request(2, tokens(40, 5), 12, 4)};
  SchedulerOptions o;
  o.block_size = 8;
  o.max_tokens_per_step = 16;  // chunked prefill through the recomputed layers too
  const Generated all = run_engine(ModelShard(w), o, 64, requests);
  o.full_sequences = true;
  for (int64_t cached : {2, 1, 0}) {
    const ModelShard shard(w, w.config.num_layers - cached);
    EXPECT_EQ(shard.kv_shape(8).num_layers, cached);
    const Generated g = run_engine(shard, o, 64, requests);
    EXPECT_EQ(g.tokens, all.tokens) << cached << " cached layers";
    EXPECT_LE(max_logit_diff(g, all), 1e-4) << cached << " cached layers";
  }
}

// --- window with sinks ---------------------------------------------------------------------

void expect_window_matches_reference(int64_t prompt_len, int64_t first_cached, int64_t max_tokens_per_step) {
  const ModelWeights w = test_weights(8);
  const int64_t sinks = 4, recent = 16, steps = 170;  // over ten windows of generation
  SchedulerOptions o;
  o.block_size = 4;
  o.window_sinks = sinks;
  o.window_recent = recent;
  o.max_tokens_per_step = max_tokens_per_step;
  o.full_sequences = first_cached > 0;
  const std::vector<int64_t> prompt = tokens(prompt_len, 6);
  const Generated g = run_engine(ModelShard(w, first_cached), o, 40, {make_request(0, prompt, steps)});
  ASSERT_EQ(static_cast<int64_t>(g.tokens.at(0).size()), steps);
  const at::Tensor ref =
      kvpipe::testing::full_recompute_logits(w, concat(prompt, g.tokens.at(0)), sinks, recent);
  double worst = 0;
  for (int64_t s = 0; s < steps; ++s)
    worst = std::max(worst, (g.logits.at(0)[s] - ref[prompt_len - 1 + s]).abs().max().item<double>());
  EXPECT_LE(worst, 1e-4);
  // Bounded memory: the sinks' block, the window and the chunk in flight, whatever the length.
  const int64_t chunk = std::min({max_tokens_per_step, prompt_len, recent});
  const int64_t bound = 1 + (recent + chunk + 3) / 4 + 2;
  EXPECT_LE(g.scheduler.peak_blocks_used, bound);
  EXPECT_LT(g.scheduler.peak_blocks_used * 4, prompt_len + steps);
}

TEST(CacheWindow, MatchesMaskedFullRecomputeInBoundedMemory) { expect_window_matches_reference(10, 0, 2048); }

TEST(CacheWindow, ChunkedLongPromptMatchesMaskedFullRecompute) { expect_window_matches_reference(60, 0, 8); }

TEST(CacheWindow, WithLayerLevelReuse) { expect_window_matches_reference(30, 2, 8); }

}  // namespace
}  // namespace kvpipe
