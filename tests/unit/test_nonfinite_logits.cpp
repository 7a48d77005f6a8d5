// A NaN or infinite logit never becomes a token: the sampler refuses the row, and the engine
// ends that request with finish_reason "error" naming the step while the others go on.
#include "cache/block_pool.h"
#include "engine/engine.h"
#include "engine/model_shard.h"
#include "engine/model/model_weights.h"
#include "engine/sampler.h"
#include "launch/serve/serve_metrics.h"
#include "tests/support/engine_run.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <vector>

namespace kvpipe {
namespace {

using kvpipe::testing::make_request;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

SamplingParams greedy() { return SamplingParams{}; }

SamplingParams sampled() {
  SamplingParams p;
  p.temperature = 0.8;
  p.top_k = 3;
  p.top_p = 0.9;
  p.seed = 7;
  return p;
}

int64_t sample(const std::vector<float>& row, const SamplingParams& p) {
  return sample_token(row.data(), static_cast<int64_t>(row.size()), p, 1, 0);
}

TEST(SamplerNonFinite, NanRowIsRefusedNotTokenZero) {
  // NaN first (max_element would take it as the maximum) and NaN later (it would skip it).
  for (const std::vector<float>& row : {std::vector<float>{kNaN, 1.0f, 2.0f, 0.5f},
                                        std::vector<float>{0.1f, 3.0f, kNaN, 0.5f},
                                        std::vector<float>{-kNaN, 0.0f, 0.0f, 0.0f},
                                        std::vector<float>(4, kNaN)}) {
    EXPECT_FALSE(logits_usable(row.data(), 4));
    EXPECT_EQ(sample(row, greedy()), kNonFiniteToken);
    EXPECT_EQ(sample(row, sampled()), kNonFiniteToken);
  }
}

TEST(SamplerNonFinite, PositiveInfinityIsRefused) {
  const std::vector<float> row = {0.1f, kInf, 2.0f, 0.5f};
  EXPECT_FALSE(logits_usable(row.data(), 4));
  EXPECT_EQ(sample(row, greedy()), kNonFiniteToken);
  EXPECT_EQ(sample(row, sampled()), kNonFiniteToken);
}

TEST(SamplerNonFinite, NegativeInfinityMasksATokenUnlessEveryTokenIsMasked) {
  const std::vector<float> masked = {-kInf, 1.0f, -kInf, 0.5f};
  EXPECT_TRUE(logits_usable(masked.data(), 4));
  EXPECT_EQ(sample(masked, greedy()), 1);
  const int64_t drawn = sample(masked, sampled());
  EXPECT_TRUE(drawn == 1 || drawn == 3) << drawn;
  const std::vector<float> all(4, -kInf);
  EXPECT_FALSE(logits_usable(all.data(), 4));
  EXPECT_EQ(sample(all, greedy()), kNonFiniteToken);
  EXPECT_EQ(sample(all, sampled()), kNonFiniteToken);
}

TEST(SamplerNonFinite, FiniteExtremesAreUsable) {
  const float big = std::numeric_limits<float>::max(), tiny = std::numeric_limits<float>::denorm_min();
  const std::vector<float> row = {-big, big, tiny, -0.0f};
  EXPECT_TRUE(logits_usable(row.data(), 4));
  EXPECT_EQ(sample(row, greedy()), 1);
}

// Sampling a batch whose logits hold a bad row for one sequence only.
TEST(SamplerNonFinite, SampleBatchFailsOnlyTheBadRow) {
  StepBatch batch;
  for (int64_t id = 0; id < 3; ++id) {
    SeqStep s;
    s.request_id = id;
    s.num_new = 1;
    s.sample = true;
    batch.seqs.push_back(s);
  }
  at::Tensor logits = at::zeros({3, 5});
  logits[0][2] = 1.0f;
  logits[1][4] = kInf;
  logits[2][3] = 1.0f;
  const StepOutput out = sample_batch(batch, logits);
  EXPECT_EQ(out.tokens, (std::vector<int64_t>{2, kNonFiniteToken, 3}));
}

ModelConfig tiny_config() {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = 97;
  c.hidden_size = 64;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.intermediate_size = 96;
  c.max_position = 256;
  c.rope_theta = 10000.0;
  c.rms_eps = 1e-5;
  c.eos_token_ids = {2};
  c.tie_embeddings = false;
  return c;
}

ModelWeights weights(const ModelConfig& c) { return random_weights(c, {{0, c.num_layers}, true, true, {}}, 5, 0.1, at::kFloat); }

// Token `id`'s embedding row set to `value`: a request that feeds that token gets non-finite
// hidden states from there on, and no other request is touched.
ModelWeights poisoned(const ModelConfig& c, int64_t id, float value) {
  ModelWeights w = weights(c);
  w.embedding.parts().at(0).data[id].fill_(value);
  return w;
}

struct Outcome {
  std::vector<RequestResult> results;
  std::map<int64_t, std::vector<int64_t>> streamed;  // what on_token saw, per request
  std::vector<int64_t> finished_order;
};

Outcome run(const ModelShard& shard, const std::vector<Request>& requests) {
  BlockPool pool(shard.kv_shape(16), 64, at::kFloat, at::kCPU);
  LocalExecutor executor(shard, pool);
  EngineOptions o;
  o.scheduler.max_context = shard.config().max_position;
  o.keep_logits = true;
  Outcome out;
  o.on_finished = [&](const Sequence& s) { out.finished_order.push_back(s.request.id); };
  Engine engine(executor, shard.config(), 64, o);
  for (const Request& r : requests) engine.add(r);
  engine.run([&](const TokenEvent& ev) {
    EXPECT_GE(ev.token, 0);
    EXPECT_LT(ev.token, shard.config().vocab_size);
    for (int64_t v = 0; v < ev.vocab; ++v) ASSERT_TRUE(std::isfinite(ev.logits[v])) << "request " << ev.request_id;
    out.streamed[ev.request_id].push_back(ev.token);
  });
  out.results = engine.results();
  return out;
}

TEST(NonFiniteLogits, PoisonedWeightFailsTheRequestAtItsFirstStep) {
  const ModelConfig cfg = tiny_config();
  for (const float value : {kNaN, kInf, -kInf}) {
    const ModelShard shard(poisoned(cfg, 13, value));
    const Outcome o = run(shard, {make_request(0, {5, 6, 7, 8}, 6), make_request(1, {5, 13, 7, 8}, 6),
                                  make_request(2, {9, 10, 11}, 6)});
    ASSERT_EQ(o.results.size(), 3u);
    EXPECT_EQ(o.results[1].finish_reason, "error") << value;
    EXPECT_EQ(o.results[1].error, "non-finite logits at step 0");
    EXPECT_TRUE(o.results[1].output_ids.empty());
    EXPECT_EQ(o.streamed.count(1), 0u) << "a token came from non-finite logits";
    // The other requests run to their end, unharmed.
    for (const int i : {0, 2}) {
      EXPECT_EQ(o.results[i].finish_reason, "length");
      EXPECT_TRUE(o.results[i].error.empty());
      EXPECT_EQ(o.results[i].output_ids.size(), 6u);
      EXPECT_EQ(o.streamed.at(i), o.results[i].output_ids);
    }
    EXPECT_EQ(o.finished_order.size(), 3u);
  }
}

TEST(NonFiniteLogits, FailureLaterInTheRequestNamesTheStepAndKeepsEarlierTokens) {
  const ModelConfig cfg = tiny_config();
  const Request r = make_request(0, {5, 6, 7, 8}, 8);
  const ModelShard clean(weights(cfg));
  const Outcome free_run = run(clean, {r});
  const std::vector<int64_t> tokens = free_run.results.at(0).output_ids;
  ASSERT_EQ(tokens.size(), 8u);
  // Poison the token generated at step 2: it is fed back at step 3, whose logits turn NaN
  // (the first step that generates it, if it came earlier, decides).
  const int64_t bad = tokens[2];
  int64_t first = 0;
  while (tokens[first] != bad) ++first;
  ASSERT_FALSE(bad == 5 || bad == 6 || bad == 7 || bad == 8) << "pick another seed: the prompt holds the token";
  const ModelShard shard(poisoned(cfg, bad, kNaN));
  const Outcome o = run(shard, {r});
  const RequestResult& res = o.results.at(0);
  EXPECT_EQ(res.finish_reason, "error");
  EXPECT_EQ(res.error, "non-finite logits at step " + std::to_string(first + 1));
  EXPECT_EQ(res.output_ids, std::vector<int64_t>(tokens.begin(), tokens.begin() + first + 1));
  EXPECT_EQ(o.streamed.at(0), res.output_ids);
}

// The server counts such requests apart from those that ended well.
TEST(NonFiniteLogits, ServerMetricsCountFailedRequests) {
  ServeMetrics m("tiny");
  m.observe_finished("error", 0.5, -1.0);
  const std::string text = m.render();
  EXPECT_NE(text.find("kvpipe:request_success_total{model_name=\"tiny\",finished_reason=\"error\"} 1\n"),
            std::string::npos)
      << text;
}

}  // namespace
}  // namespace kvpipe
