// Logits processing (penalties, bias, banned words, min_tokens) and min_p: the formulas on
// hand-made rows, and in the engine: every token a processed request gets is the one drawn
// from its raw logits processed in float64 with the history it had, whatever it is batched
// with, preempted or not.
#include "engine/engine.h"
#include "engine/logits_processor.h"
#include "engine/model/model_weights.h"
#include "engine/sampler.h"
#include "tests/support/engine_run.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <vector>

namespace kvpipe {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<float> processed(std::vector<float> logits, const LogitsProcessing& p, const std::vector<int64_t>& tokens,
                             int64_t prompt_len, const std::vector<int64_t>& stop_ids = {}) {
  apply_logits_processing(logits.data(), static_cast<int64_t>(logits.size()), p, tokens, prompt_len, stop_ids);
  return logits;
}

// vLLM's formulas written out in float64, one token at a time, for the engine test.
std::vector<double> reference(const std::vector<float>& raw, const LogitsProcessing& p,
                              const std::vector<int64_t>& tokens, int64_t prompt_len,
                              const std::vector<int64_t>& stop_ids) {
  std::vector<double> x(raw.begin(), raw.end());
  const int64_t outputs = static_cast<int64_t>(tokens.size()) - prompt_len;
  for (const auto& word : p.bad_words) {
    const size_t before = word.size() - 1;
    bool match = static_cast<int64_t>(before) <= outputs;
    for (size_t i = 0; match && i < before; ++i) match = tokens[tokens.size() - before + i] == word[i];
    if (match) x[word.back()] = -INFINITY;
  }
  if (outputs < p.min_tokens)
    for (int64_t id : stop_ids) x[id] = -INFINITY;
  for (const auto& [id, bias] : p.logit_bias) x[id] += bias;
  std::map<int64_t, int> count;
  std::set<int64_t> seen(tokens.begin(), tokens.end());
  for (size_t i = prompt_len; i < tokens.size(); ++i) ++count[tokens[i]];
  for (int64_t id : seen) {
    if (x[id] > 0) x[id] /= p.repetition_penalty;
    else x[id] *= p.repetition_penalty;
    x[id] -= p.frequency_penalty * count[id] + p.presence_penalty * (count[id] > 0 ? 1 : 0);
  }
  return x;
}

TEST(LogitsProcessing, PenaltiesFollowVllmFormulas) {
  // prompt {0, 1}, output {1, 3, 3}: 1 is in both, 3 twice in the output, 0 in the prompt only.
  const std::vector<int64_t> tokens = {0, 1, 1, 3, 3};
  LogitsProcessing p;
  p.repetition_penalty = 2.0;
  const std::vector<float> raw = {4.0f, -1.0f, 0.5f, 3.0f, 1.0f};
  EXPECT_EQ(processed(raw, p, tokens, 2), (std::vector<float>{2.0f, -2.0f, 0.5f, 1.5f, 1.0f}));
  p = {};
  p.frequency_penalty = 0.5;
  p.presence_penalty = 0.25;
  // The prompt-only token is untouched; 1 once: -0.75; 3 twice: -1.25.
  EXPECT_EQ(processed(raw, p, tokens, 2), (std::vector<float>{4.0f, -1.75f, 0.5f, 1.75f, 1.0f}));
  p = {};
  p.logit_bias = {{2, 10.0f}, {0, -100.0f}};
  EXPECT_EQ(processed(raw, p, tokens, 2), (std::vector<float>{-96.0f, -1.0f, 10.5f, 3.0f, 1.0f}));
  EXPECT_FALSE(LogitsProcessing{}.active());
  EXPECT_TRUE(p.active());
}

TEST(LogitsProcessing, BiasComesBeforeTheRepetitionPenalty) {
  // vLLM's order: the bias turns token 1's logit positive, so the penalty then divides it.
  LogitsProcessing p;
  p.logit_bias = {{1, 3.0f}};
  p.repetition_penalty = 2.0;
  EXPECT_EQ(processed({0.0f, -1.0f}, p, {1}, 1), (std::vector<float>{0.0f, 1.0f}));
}

TEST(LogitsProcessing, BadWordsAndMinTokens) {
  LogitsProcessing p;
  p.bad_words = {{4}, {2, 3}};
  const std::vector<float> raw(6, 1.0f);
  // {4} always; {2, 3}: 3 only right after a 2 in the output.
  EXPECT_EQ(processed(raw, p, {0, 2}, 1), (std::vector<float>{1, 1, 1, -kInf, -kInf, 1}));
  EXPECT_EQ(processed(raw, p, {0, 2, 1}, 1), (std::vector<float>{1, 1, 1, 1, -kInf, 1}));
  // A 2 in the prompt does not start a bad word (vLLM reads the output only).
  EXPECT_EQ(processed(raw, p, {2}, 1), (std::vector<float>{1, 1, 1, 1, -kInf, 1}));
  p = {};
  p.min_tokens = 2;
  EXPECT_EQ(processed(raw, p, {0, 5}, 1, {5}), (std::vector<float>{1, 1, 1, 1, 1, -kInf}));
  EXPECT_EQ(processed(raw, p, {0, 5, 1}, 1, {5}), raw);
}

TEST(LogitsProcessing, MinPDropsTokensBelowItsShareOfTheMostLikely) {
  // Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.25 keeps those >= 0.125 and renormalises.
  const std::vector<float> logits = {std::log(0.15f), std::log(0.5f), std::log(0.05f), std::log(0.3f)};
  SamplingParams sp;
  sp.temperature = 1.0;
  sp.min_p = 0.25;
  const Candidates c = sampling_candidates(logits.data(), 4, sp);
  ASSERT_EQ(c.tokens, (std::vector<int64_t>{1, 3, 0}));
  EXPECT_NEAR(c.probs[0], 0.5 / 0.95, 1e-6);
  EXPECT_NEAR(c.probs[2], 0.15 / 0.95, 1e-6);
  sp.min_p = 0.0;
  EXPECT_EQ(sampling_candidates(logits.data(), 4, sp).tokens.size(), 4u);
}

ModelConfig tiny_config() {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = 61;
  c.hidden_size = 32;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.intermediate_size = 48;
  c.max_position = 256;
  c.rope_theta = 10000.0;
  c.rms_eps = 1e-5;
  c.eos_token_ids = {2};
  return c;
}

TEST(EngineLogitsProcessing, EveryTokenIsDrawnFromItsProcessedLogitsInAnyBatch) {
  const ModelConfig cfg = tiny_config();
  const ModelShard shard(random_weights(cfg, {{0, cfg.num_layers}, true, true, {}}, 3, 0.3, at::kFloat));
  std::vector<Request> requests;
  for (int64_t i = 0; i < 5; ++i) {
    std::vector<int64_t> prompt;
    for (int64_t t = 0; t < 6 + 5 * i; ++t) prompt.push_back((t * 7 + i * 13 + 1) % cfg.vocab_size);
    Request r = testing::make_request(i, prompt, 24);
    if (i != 2) {  // request 2 asks for nothing: it must keep the tokens it gets alone
      r.processing.repetition_penalty = 1.3 + 0.1 * i;
      r.processing.frequency_penalty = 0.4;
      r.processing.presence_penalty = i % 2 ? 0.6 : -0.3;
      r.processing.logit_bias = {{5, 2.5f}, {11, -100.0f}};
      r.processing.bad_words = {{7}, {9, 10}};
      r.processing.min_tokens = 8;
      r.ignore_eos = false;
    }
    if (i >= 3) {  // sampled: the draw must be the sampler's on the processed row
      r.sampling.temperature = 0.9;
      r.sampling.min_p = 0.05;
      r.sampling.seed = 99;
    }
    requests.push_back(r);
  }
  SchedulerOptions o;
  o.block_size = 8;
  o.max_batch = 3;
  const testing::Generated ample = testing::run_engine(shard, o, 64, requests);
  const testing::Generated tight = testing::run_engine(shard, o, 9, requests);
  EXPECT_GT(tight.preemptions, 0);
  for (const Request& r : requests) {
    ASSERT_EQ(tight.tokens.at(r.id), ample.tokens.at(r.id)) << "request " << r.id;
    const testing::Generated alone = testing::run_engine(shard, o, 64, {r});
    ASSERT_EQ(alone.tokens.at(r.id), ample.tokens.at(r.id)) << "request " << r.id;
    std::vector<int64_t> history = r.prompt;
    const auto& out = ample.tokens.at(r.id);
    for (size_t s = 0; s < out.size(); ++s) {
      const at::Tensor& row = ample.logits.at(r.id)[s];
      std::vector<float> raw(row.data_ptr<float>(), row.data_ptr<float>() + cfg.vocab_size);
      if (r.processing.active()) {
        const std::vector<double> want =
            reference(raw, r.processing, history, static_cast<int64_t>(r.prompt.size()), cfg.eos_token_ids);
        EXPECT_TRUE(std::isfinite(want[out[s]])) << "request " << r.id << " step " << s << ": a banned token";
        if (r.sampling.temperature == 0.0) {
          const int64_t best = std::max_element(want.begin(), want.end()) - want.begin();
          EXPECT_EQ(out[s], best) << "request " << r.id << " step " << s;
        }
        std::vector<float> mine = raw;
        apply_logits_processing(mine.data(), cfg.vocab_size, r.processing, history,
                                static_cast<int64_t>(r.prompt.size()), cfg.eos_token_ids);
        for (int64_t v = 0; v < cfg.vocab_size; ++v)
          if (std::isfinite(want[v])) EXPECT_NEAR(mine[v], want[v], 1e-5) << "token " << v;
          else EXPECT_EQ(mine[v], -kInf);
        EXPECT_EQ(out[s], sample_token(mine.data(), cfg.vocab_size, r.sampling, r.id, static_cast<int64_t>(s)));
        if (s < 8) EXPECT_NE(out[s], 2) << "EOS before min_tokens";
      }
      history.push_back(out[s]);
    }
  }
  // The processing changed something: the processed greedy request differs from it unprocessed.
  Request plain = requests[0];
  plain.processing = {};
  plain.ignore_eos = true;
  EXPECT_NE(testing::run_engine(shard, o, 64, {plain}).tokens.at(0), ample.tokens.at(0));
}

}  // namespace
}  // namespace kvpipe
