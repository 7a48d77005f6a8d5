#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "engine/sampler.h"

namespace kvpipe {
namespace {

SamplingParams params(double temperature, int top_k = 0, double top_p = 1.0, uint64_t seed = 0) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = seed;
  return p;
}

int64_t sample(const std::vector<float>& logits, const SamplingParams& p, int64_t request_id,
               int64_t output_index) {
  return sample_token(logits.data(), static_cast<int64_t>(logits.size()), p, request_id,
                      output_index);
}

Candidates candidates(const std::vector<float>& logits, const SamplingParams& p) {
  return sampling_candidates(logits.data(), static_cast<int64_t>(logits.size()), p);
}

double sum(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); }

// Probabilities [0.5, 0.2, 0.15, 0.1, 0.05] scrambled over token ids, so that "most probable
// first" cannot coincide with id order.
//                                   id:   0     1     2     3     4
const std::vector<double> kKnownProbs = {0.1, 0.5, 0.05, 0.2, 0.15};
const std::vector<int64_t> kKnownOrder = {1, 3, 4, 0, 2};  // ids by decreasing probability

std::vector<float> log_of(const std::vector<double>& probs) {
  std::vector<float> out;
  for (double p : probs) out.push_back(static_cast<float>(std::log(p)));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Greedy

TEST(SamplerGreedy, returns_argmax) {
  const std::vector<float> logits = {0.1f, 3.0f, -1.0f, 2.9f, -5.0f};
  for (int64_t rid = 0; rid < 5; ++rid) EXPECT_EQ(sample(logits, params(0.0), rid, rid * 3), 1);
  const Candidates c = candidates(logits, params(0.0));
  ASSERT_EQ(c.tokens, std::vector<int64_t>({1}));
  EXPECT_EQ(c.probs, std::vector<double>({1.0}));
}

TEST(SamplerGreedy, ties_go_to_lowest_id) {
  const std::vector<float> logits = {1.0f, 5.0f, 2.0f, 5.0f, 5.0f};
  EXPECT_EQ(sample(logits, params(0.0), 7, 0), 1);
  EXPECT_EQ(candidates(logits, params(0.0)).tokens, std::vector<int64_t>({1}));
}

TEST(SamplerGreedy, ignores_top_k_top_p_and_seed) {
  const std::vector<float> logits = {0.0f, 0.5f, 4.0f, 1.0f};
  EXPECT_EQ(sample(logits, params(0.0, 2, 0.3, 99), 3, 4), 2);
}

// ---------------------------------------------------------------------------------------------
// Determinism

// Nearly flat over 16 tokens: every draw is far from a foregone conclusion.
std::vector<float> flat_logits() {
  std::vector<float> logits(16);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = 0.05f * static_cast<float>(i % 5);
  return logits;
}

TEST(SamplerDeterminism, same_inputs_give_same_token) {
  const std::vector<float> logits = flat_logits();
  for (uint64_t seed : {0ull, 1ull, 12345ull}) {
    const SamplingParams p = params(1.0, 0, 1.0, seed);
    for (int64_t rid : {0, 3, 1000}) {
      for (int64_t idx : {0, 1, 57}) {
        const int64_t first = sample(logits, p, rid, idx);
        for (int call = 0; call < 100; ++call) ASSERT_EQ(sample(logits, p, rid, idx), first);
      }
    }
  }
}

// The draws are a pure function of their inputs, so these counts are fixed: with 16 nearly
// equiprobable tokens a single distinct value over 200 draws would mean the varied input is
// not reaching the seed.
TEST(SamplerDeterminism, request_id_varies_the_draw) {
  const std::vector<float> logits = flat_logits();
  std::set<int64_t> seen;
  for (int64_t rid = 0; rid < 200; ++rid) seen.insert(sample(logits, params(1.0), rid, 0));
  EXPECT_GE(seen.size(), 2u);
}

TEST(SamplerDeterminism, output_index_varies_the_draw) {
  const std::vector<float> logits = flat_logits();
  std::set<int64_t> seen;
  for (int64_t idx = 0; idx < 200; ++idx) seen.insert(sample(logits, params(1.0), 5, idx));
  EXPECT_GE(seen.size(), 2u);
}

TEST(SamplerDeterminism, seed_varies_the_draw) {
  const std::vector<float> logits = flat_logits();
  std::set<int64_t> seen;
  for (uint64_t seed = 0; seed < 200; ++seed) seen.insert(sample(logits, params(1.0, 0, 1.0, seed), 5, 0));
  EXPECT_GE(seen.size(), 2u);
}

// ---------------------------------------------------------------------------------------------
// top_k

//                                        id: 0     1     2      3     4     5     6      7
const std::vector<float> kDistinctLogits = {0.3f, 2.5f, -1.0f, 1.7f, 4.0f, 0.0f, 3.1f, -2.2f};

TEST(SamplerTopK, keeps_exactly_the_k_highest_in_order) {
  const Candidates c = candidates(kDistinctLogits, params(1.0, 3));
  EXPECT_EQ(c.tokens, std::vector<int64_t>({4, 6, 1}));
  ASSERT_EQ(c.probs.size(), 3u);
  // Renormalised softmax over the kept logits only.
  const double z = std::exp(4.0) + std::exp(3.1) + std::exp(2.5);
  EXPECT_NEAR(c.probs[0], std::exp(4.0) / z, 1e-6);
  EXPECT_NEAR(c.probs[1], std::exp(3.1) / z, 1e-6);
  EXPECT_NEAR(c.probs[2], std::exp(2.5) / z, 1e-6);
  EXPECT_NEAR(sum(c.probs), 1.0, 1e-12);
}

TEST(SamplerTopK, one_keeps_the_argmax) {
  const Candidates c = candidates(kDistinctLogits, params(1.0, 1));
  EXPECT_EQ(c.tokens, std::vector<int64_t>({4}));
  EXPECT_NEAR(c.probs[0], 1.0, 1e-12);
}

TEST(SamplerTopK, k_off_or_at_least_vocab_keeps_all_in_descending_order) {
  const std::vector<int64_t> all = {4, 6, 1, 3, 0, 5, 2, 7};
  for (int k : {0, 8, 9, 1000}) {
    const Candidates c = candidates(kDistinctLogits, params(1.0, k));
    EXPECT_EQ(c.tokens, all) << "top_k " << k;
    EXPECT_NEAR(sum(c.probs), 1.0, 1e-12);
  }
}

TEST(SamplerTopK, equal_logits_rank_lower_id_first) {
  // Without a tie rule the kept set would depend on the sort implementation.
  const std::vector<float> logits = {1.0f, 2.0f, 2.0f, 2.0f, 0.0f};
  EXPECT_EQ(candidates(logits, params(1.0, 2)).tokens, std::vector<int64_t>({1, 2}));
}

// ---------------------------------------------------------------------------------------------
// top_p

// The cumulative sums are 0.5, 0.7, 0.85, 0.95, 1.0; top_p values stay clear of them since
// float32 logits make the probabilities exact only to about 1e-7.
TEST(SamplerTopP, keeps_smallest_prefix_reaching_top_p) {
  const std::vector<float> logits = log_of(kKnownProbs);
  const std::vector<std::pair<double, size_t>> cases = {
      {0.01, 1}, {0.49, 1}, {0.55, 2}, {0.69, 2}, {0.71, 3}, {0.84, 3},
      {0.86, 4}, {0.94, 4}, {0.96, 5}, {1.0, 5}};
  for (const auto& [top_p, keep] : cases) {
    SCOPED_TRACE("top_p " + std::to_string(top_p));
    const Candidates c = candidates(logits, params(1.0, 0, top_p));
    ASSERT_EQ(c.tokens.size(), keep);
    ASSERT_EQ(c.probs.size(), keep);
    double kept_mass = 0.0;
    for (size_t i = 0; i < keep; ++i) kept_mass += kKnownProbs[kKnownOrder[i]];
    for (size_t i = 0; i < keep; ++i) {
      EXPECT_EQ(c.tokens[i], kKnownOrder[i]);
      EXPECT_NEAR(c.probs[i], kKnownProbs[kKnownOrder[i]] / kept_mass, 1e-6);
    }
    EXPECT_NEAR(sum(c.probs), 1.0, 1e-12);
  }
}

TEST(SamplerTopP, applies_to_the_top_k_distribution) {
  // As in HF and vLLM, top_p is measured on the distribution left by top_k: after top_k 3
  // the probabilities are 0.5/0.85, 0.2/0.85, 0.15/0.85 with cumulative sums 0.588, 0.824,
  // 1.0, so top_p 0.8 keeps 2 tokens where on the full distribution it would keep 3.
  const std::vector<float> logits = log_of(kKnownProbs);
  const Candidates c = candidates(logits, params(1.0, 3, 0.8));
  EXPECT_EQ(c.tokens, std::vector<int64_t>({1, 3}));
  ASSERT_EQ(c.probs.size(), 2u);
  EXPECT_NEAR(c.probs[0], 0.5 / 0.7, 1e-6);
  EXPECT_NEAR(c.probs[1], 0.2 / 0.7, 1e-6);
  EXPECT_EQ(candidates(logits, params(1.0, 0, 0.8)).tokens.size(), 3u);

  // top_k the tighter of the two.
  EXPECT_EQ(candidates(logits, params(1.0, 2, 0.99)).tokens, std::vector<int64_t>({1, 3}));
  // top_p the tighter of the two.
  EXPECT_EQ(candidates(logits, params(1.0, 4, 0.3)).tokens, std::vector<int64_t>({1}));
}

// ---------------------------------------------------------------------------------------------
// Temperature

TEST(SamplerTemperature, probabilities_follow_exp_logit_over_t) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, -1.0f};
  for (double t : {0.25, 0.5, 1.0, 2.0, 10.0}) {
    SCOPED_TRACE("temperature " + std::to_string(t));
    const Candidates c = candidates(logits, params(t));
    ASSERT_EQ(c.tokens, std::vector<int64_t>({2, 1, 0, 3}));
    double z = 0.0;
    for (float l : logits) z += std::exp(l / t);
    for (size_t i = 0; i < c.tokens.size(); ++i) {
      EXPECT_NEAR(c.probs[i], std::exp(logits[c.tokens[i]] / t) / z, 1e-12);
    }
  }
}

TEST(SamplerTemperature, higher_temperature_flattens) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, -1.0f};
  double previous_top = 1.0;
  for (double t : {0.1, 0.5, 1.0, 2.0, 10.0}) {
    const double top = candidates(logits, params(t)).probs[0];
    EXPECT_LT(top, previous_top) << "temperature " << t;
    previous_top = top;
  }
  EXPECT_GT(previous_top, 0.25);
}

// ---------------------------------------------------------------------------------------------
// sample_token

TEST(SamplerSampleToken, returns_only_kept_candidates) {
  // The top 3 carry comparable mass so that all three come up, while the excluded tokens
  // would be drawn often if top_k were ignored.
  const std::vector<float> logits = {1.0f, 2.0f, 0.9f, 2.2f, 1.9f, 0.8f, 1.5f, 0.7f, 1.2f, 1.0f};
  const std::set<int64_t> kept = {3, 1, 4};
  std::set<int64_t> seen;
  for (int64_t i = 0; i < 1000; ++i) {
    const int64_t token = sample(logits, params(1.0, 3), i % 37, i);
    ASSERT_TRUE(kept.count(token)) << "draw " << i << " gave token " << token;
    seen.insert(token);
  }
  EXPECT_EQ(seen, kept);
}

TEST(SamplerSampleToken, returns_only_top_p_candidates) {
  const std::vector<float> logits = log_of(kKnownProbs);
  const std::set<int64_t> kept = {1, 3};  // top_p 0.6: 0.5 + 0.2
  for (int64_t i = 0; i < 1000; ++i) {
    const int64_t token = sample(logits, params(1.0, 0, 0.6), 11, i);
    ASSERT_TRUE(kept.count(token)) << "draw " << i << " gave token " << token;
  }
}

TEST(SamplerSampleToken, frequencies_follow_probabilities) {
  // 20000 draws: the standard error of each frequency is below 0.004, so ±0.03 is over
  // seven standard errors (and the draws are deterministic anyway).
  const std::vector<double> probs = {0.2, 0.5, 0.3};
  const std::vector<float> logits = log_of(probs);
  const int draws = 20000;
  std::map<int64_t, int> counts;
  for (int64_t i = 0; i < draws; ++i) ++counts[sample(logits, params(1.0, 0, 1.0, 42), i / 100, i % 100)];
  ASSERT_EQ(counts.size(), 3u);
  for (int64_t token = 0; token < 3; ++token) {
    EXPECT_NEAR(static_cast<double>(counts[token]) / draws, probs[token], 0.03) << "token " << token;
  }
}

}  // namespace
}  // namespace kvpipe

namespace kvpipe {
namespace {

// The GPU's greedy path (tensor ops, ids only to the host) against the host sampler, on rows
// with ties, NaN, +inf, a row of -inf only, -inf beside finite values, and a row not sampled.
TEST(SamplerGreedyRows, TensorOpsPickWhatTheHostSamplerPicks) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::vector<float>> rows = {{0.5f, 2.0f, 2.0f, -1.0f},   {3.0f, 1.0f, 3.0f, 3.0f},
                                                {0.0f, nan, 1.0f, 0.0f},     {0.0f, inf, 1.0f, 0.0f},
                                                {-inf, -inf, -inf, -inf},    {-inf, -2.0f, -inf, -3.0f},
                                                {-1e30f, -1e30f, -2e30f, 0.0f}};
  StepBatch batch;
  std::vector<float> flat;
  for (size_t i = 0; i < rows.size() + 1; ++i) {
    SeqStep s;
    s.request_id = static_cast<int64_t>(i);
    s.num_new = 1;
    s.sample = i != 3;  // one sequence is a prefill chunk: no row of its own
    batch.seqs.push_back(s);
  }
  for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
  const at::Tensor logits = at::tensor(flat).view({static_cast<int64_t>(rows.size()), 4});
  const StepOutput host = sample_batch(batch, logits);
  const StepOutput tensor_ops = sample_greedy_rows(batch, logits);
  EXPECT_EQ(tensor_ops.request_ids, host.request_ids);
  EXPECT_EQ(tensor_ops.tokens, host.tokens);
  EXPECT_EQ(host.tokens, (std::vector<int64_t>{1, 0, kNonFiniteToken, kNonFiniteToken, kNonFiniteToken, 1, 3}));
}

}  // namespace
}  // namespace kvpipe
