// Speculative decoding by prompt lookup: the proposer, the acceptance rule, and whole
// generations with drafts verified against the same generations without them.
#include "engine/engine.h"
#include "engine/model/model_weights.h"
#include "engine/model_shard.h"
#include "engine/speculative/ngram_proposer.h"
#include "tests/support/engine_run.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

using kvpipe::testing::Generated;
using kvpipe::testing::make_request;

TEST(NgramProposer, ProposesWhatFollowsTheMostRecentLongestMatch) {
  // The last three tokens (7 8 9) occur twice before; the later occurrence is followed by 4 4.
  const std::vector<int64_t> tokens = {7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 4, 5, 6, 8, 9, 7, 8, 9};
  EXPECT_EQ(propose_ngram(tokens, 1, 3, 2), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(propose_ngram(tokens, 1, 3, 5), (std::vector<int64_t>{4, 4, 5, 6, 8}));
  // With n at most 2 the suffix 8 9 last occurred at 13-14, followed by 7 8 9.
  EXPECT_EQ(propose_ngram(tokens, 1, 2, 4), (std::vector<int64_t>{7, 8, 9}));
  // A draft never runs past the end of the sequence, and n below min is not tried.
  EXPECT_EQ(propose_ngram({5, 6, 5}, 1, 4, 4), (std::vector<int64_t>{6, 5}));
  EXPECT_TRUE(propose_ngram({5, 6, 5}, 2, 4, 4).empty());
  EXPECT_TRUE(propose_ngram({1, 2, 3, 4}, 1, 4, 4).empty());
  EXPECT_TRUE(propose_ngram({1}, 1, 4, 4).empty());
  EXPECT_TRUE(propose_ngram(tokens, 1, 3, 0).empty());
}

TEST(NgramProposer, AcceptedLengthKeepsMatchesAndTheModelsNextToken) {
  const std::vector<int64_t> draft = {4, 5, 6};
  const int64_t all[] = {4, 5, 6, 9};
  const int64_t second_wrong[] = {4, 7, 6, 9};
  const int64_t first_wrong[] = {3, 5, 6, 9};
  EXPECT_EQ(accepted_length(draft, all, 4), 4);
  EXPECT_EQ(accepted_length(draft, second_wrong, 4), 2);
  EXPECT_EQ(accepted_length(draft, first_wrong, 4), 1);
  EXPECT_EQ(accepted_length({}, all, 1), 1);
  const int64_t failed[] = {4, kNonFiniteToken, 6, 9};
  EXPECT_EQ(accepted_length(draft, failed, 4), 2);  // the failed row ends the run
}

TEST(NgramProposer, GatePausesAfterRejectedDraftsAndDoublesThePause) {
  SpeculationGate gate;
  EXPECT_TRUE(gate.open());
  gate.record(4, 4);
  EXPECT_TRUE(gate.open());
  gate.record(4, 0);  // rate 0.5
  EXPECT_TRUE(gate.open());
  gate.record(4, 0);  // rate 0.25: pause 4 steps
  int64_t closed = 0;
  while (!gate.open()) gate.step_without_draft(), ++closed;
  EXPECT_EQ(closed, 4);
  gate.record(4, 0);  // still bad: pause 8
  closed = 0;
  while (!gate.open()) gate.step_without_draft(), ++closed;
  EXPECT_EQ(closed, 8);
  gate.record(4, 3);  // good again: open, and the next pause starts short
  EXPECT_TRUE(gate.open());
  gate.record(4, 0);
  gate.record(4, 0);
  closed = 0;
  while (!gate.open()) gate.step_without_draft(), ++closed;
  EXPECT_EQ(closed, 4);
}

TEST(NgramProposer, DraftLengthGrowsWhileKeptWholeAndShrinksPastTheLastKeptToken) {
  SpeculationGate gate;
  EXPECT_EQ(gate.length(8), 2);
  EXPECT_EQ(gate.length(1), 1);
  gate.record(2, 2);
  EXPECT_EQ(gate.length(8), 3);
  gate.record(3, 3);
  EXPECT_EQ(gate.length(8), 4);
  EXPECT_EQ(gate.length(3), 3);
  gate.record(4, 1);  // kept one: the next draft is two long
  EXPECT_EQ(gate.length(8), 2);
  gate.record(2, 0);
  EXPECT_EQ(gate.length(8), 1);
}

ModelConfig tiny_config() {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = 61;
  c.hidden_size = 64;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.intermediate_size = 96;
  c.max_position = 256;
  c.rope_theta = 10000.0;
  c.rms_eps = 1e-5;
  c.eos_token_ids = {2};
  return c;
}

WeightSelection whole(const ModelConfig& c) { return {{0, c.num_layers}, true, true, {}}; }

// Prompts that repeat themselves, so that lookup finds drafts from the first step on.
std::vector<int64_t> repeating_prompt(int64_t len, int64_t period, int64_t salt, int64_t vocab) {
  std::vector<int64_t> p(len);
  for (int64_t i = 0; i < len; ++i) p[i] = ((i % period) * 7 + salt * 13 + 3) % vocab;
  return p;
}

SchedulerOptions with_ngram(SchedulerOptions o, int64_t k) {
  o.speculative.ngram = true;
  o.speculative.num_tokens = k;
  o.speculative.ngram_min = 1;
  o.speculative.ngram_max = 3;
  return o;
}

void expect_same_generations(const Generated& spec, const Generated& plain, double logit_tolerance = 1e-4) {
  ASSERT_EQ(spec.tokens.size(), plain.tokens.size());
  for (const auto& [id, tokens] : plain.tokens) {
    ASSERT_EQ(spec.tokens.at(id), tokens) << "request " << id;
    for (size_t s = 0; s < tokens.size(); ++s)
      EXPECT_LE((spec.logits.at(id)[s] - plain.logits.at(id)[s]).abs().max().item<double>(), logit_tolerance)
          << "request " << id << " token " << s;
  }
}

std::vector<Request> requests_in_flight(const ModelConfig& cfg, const SamplingParams& sampling) {
  std::vector<Request> requests;
  const int64_t shapes[][4] = {{24, 5, 40, 0}, {9, 3, 33, 0}, {40, 8, 25, 2}, {17, 4, 3, 3}, {30, 6, 45, 6}};
  for (int64_t i = 0; i < 5; ++i) {
    Request r = make_request(i, repeating_prompt(shapes[i][0], shapes[i][1], i, cfg.vocab_size), shapes[i][2],
                             shapes[i][3]);
    r.sampling = sampling;
    requests.push_back(r);
  }
  return requests;
}

class SpeculativeEngine : public ::testing::TestWithParam<int64_t> {};

TEST_P(SpeculativeEngine, GreedyOutputsEqualThoseWithoutDrafts) {
  const int64_t k = GetParam();
  const ModelConfig cfg = tiny_config();
  const ModelShard shard(random_weights(cfg, whole(cfg), 3, 0.1, at::kFloat));
  SchedulerOptions o;
  o.block_size = 8;
  o.max_batch = 4;
  o.max_tokens_per_step = 32;  // long prompts come in chunks beside the drafts
  const std::vector<Request> requests = requests_in_flight(cfg, {});
  const Generated plain = kvpipe::testing::run_engine(shard, o, 64, requests);
  const Generated spec = kvpipe::testing::run_engine(shard, with_ngram(o, k), 64, requests);
  expect_same_generations(spec, plain);
  EXPECT_EQ(plain.scheduler.spec_drafts, 0);
  EXPECT_GT(spec.scheduler.spec_drafts, 0);
  EXPECT_GT(spec.scheduler.spec_accepted_tokens, 0);
  EXPECT_LE(spec.scheduler.spec_accepted_tokens, spec.scheduler.spec_draft_tokens);
  ASSERT_FALSE(spec.scheduler.spec_accepted_at.empty());
  EXPECT_LE(static_cast<int64_t>(spec.scheduler.spec_accepted_at.size()), k);
  // A later position is kept only after the earlier ones were.
  for (size_t p = 1; p < spec.scheduler.spec_accepted_at.size(); ++p)
    EXPECT_LE(spec.scheduler.spec_accepted_at[p], spec.scheduler.spec_accepted_at[p - 1]);
}

INSTANTIATE_TEST_SUITE_P(DraftLengths, SpeculativeEngine, ::testing::Values(1, 4, 8));

// Alone, a request's verified rows are decode queries of the paged kernel, each over the keys
// up to its own position: its logits are those of the steps without drafts, bit for bit (so
// a model whose activations are rounded to 8 bits, where any difference can flip a rounding,
// gives the same samples too).
TEST(SpeculativeEngineAlone, VerifiedRowsGiveTheDecodeStepsLogitsBitForBit) {
  const ModelConfig cfg = tiny_config();
  const ModelShard shard(random_weights(cfg, whole(cfg), 3, 0.1, at::kFloat));
  SchedulerOptions o;
  o.block_size = 8;
  for (int64_t k : {1, 3, 6}) {
    const std::vector<Request> one = {make_request(0, repeating_prompt(19, 4, 1, cfg.vocab_size), 40)};
    const Generated plain = kvpipe::testing::run_engine(shard, o, 64, one);
    const Generated spec = kvpipe::testing::run_engine(shard, with_ngram(o, k), 64, one);
    EXPECT_GT(spec.scheduler.spec_accepted_tokens, 0) << k;
    expect_same_generations(spec, plain, /*logit_tolerance=*/0.0);
  }
}

TEST(SpeculativeEngineSampling, SeededSamplesEqualThoseWithoutDrafts) {
  const ModelConfig cfg = tiny_config();
  // Sharper weights: sampled tokens repeat often enough for drafts to be kept.
  const ModelShard shard(random_weights(cfg, whole(cfg), 5, 0.3, at::kFloat));
  SchedulerOptions o;
  o.block_size = 8;
  int64_t accepted = 0;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    SamplingParams sampling;
    sampling.temperature = 0.7;
    sampling.top_k = 20;
    sampling.seed = seed;
    const std::vector<Request> requests = requests_in_flight(cfg, sampling);
    const Generated plain = kvpipe::testing::run_engine(shard, o, 64, requests);
    const Generated spec = kvpipe::testing::run_engine(shard, with_ngram(o, 4), 64, requests);
    expect_same_generations(spec, plain);
    accepted += spec.scheduler.spec_accepted_tokens;
  }
  EXPECT_GT(accepted, 0);
}

TEST(SpeculativeEngineCache, PreemptionPrefixReuseAndBlockAccountingStayExact) {
  const ModelConfig cfg = tiny_config();
  const ModelShard shard(random_weights(cfg, whole(cfg), 7, 0.1, at::kFloat));
  SchedulerOptions o;
  o.block_size = 4;
  o.prefix_reuse = true;
  std::vector<Request> requests;
  const std::vector<int64_t> shared = repeating_prompt(20, 5, 1, cfg.vocab_size);
  for (int64_t i = 0; i < 6; ++i) {
    std::vector<int64_t> prompt = shared;
    prompt.push_back(10 + i);
    requests.push_back(make_request(i, prompt, 30, i < 3 ? 0 : 20));
  }
  const Generated ample = kvpipe::testing::run_engine(shard, o, 128, requests);
  const Generated tight = kvpipe::testing::run_engine(shard, with_ngram(o, 4), 20, requests);
  const Generated spec = kvpipe::testing::run_engine(shard, with_ngram(o, 4), 128, requests);
  EXPECT_GT(tight.preemptions, 0);
  EXPECT_GT(spec.prefix.hit_tokens, 0);
  expect_same_generations(tight, ample);
  expect_same_generations(spec, ample);
  EXPECT_GT(spec.scheduler.spec_accepted_tokens, 0);
}

TEST(SpeculativeEngineCache, WindowAndLayerLevelReuseKeepTheirOutputs) {
  const ModelConfig cfg = tiny_config();
  const ModelWeights w = random_weights(cfg, whole(cfg), 9, 0.1, at::kFloat);
  SchedulerOptions o;
  o.block_size = 4;
  o.window_sinks = 4;
  o.window_recent = 12;
  o.full_sequences = true;
  const ModelShard shard(w, /*first_cached_layer=*/1);
  const std::vector<Request> requests = {make_request(0, repeating_prompt(30, 6, 2, cfg.vocab_size), 60),
                                         make_request(1, repeating_prompt(11, 4, 3, cfg.vocab_size), 50)};
  const Generated plain = kvpipe::testing::run_engine(shard, o, 40, requests);
  const Generated spec = kvpipe::testing::run_engine(shard, with_ngram(o, 4), 40, requests);
  expect_same_generations(spec, plain);
  EXPECT_GT(spec.scheduler.spec_accepted_tokens, 0);
}

// Runs one engine with speculation and returns its results, calling `on_token` for each token.
std::vector<RequestResult> run_with(const ModelShard& shard, const ModelConfig& cfg, SchedulerOptions o,
                                    const std::vector<Request>& requests,
                                    const std::function<void(Engine&, const TokenEvent&)>& on_token = {}) {
  BlockPool pool(shard.kv_shape(o.block_size), 64, at::kFloat, at::kCPU);
  LocalExecutor executor(shard, pool);
  EngineOptions eo;
  eo.scheduler = o;
  eo.scheduler.max_context = cfg.max_position;
  Engine engine(executor, cfg, 64, eo);
  for (const Request& r : requests) engine.add(r);
  engine.run([&](const TokenEvent& ev) {
    if (on_token) on_token(engine, ev);
  });
  EXPECT_EQ(engine.scheduler().blocks().num_used(), 0);
  return engine.results();
}

TEST(SpeculativeEngineEdges, MaxTokensEosAndFinishInsideAnAcceptedRun) {
  const ModelConfig cfg = tiny_config();
  const ModelShard shard(random_weights(cfg, whole(cfg), 3, 0.1, at::kFloat));
  SchedulerOptions o;
  o.block_size = 8;
  const SchedulerOptions spec = with_ngram(o, 8);
  const Request r = make_request(0, repeating_prompt(24, 5, 0, cfg.vocab_size), 40);
  const std::vector<int64_t> full = run_with(shard, cfg, o, {r}).at(0).output_ids;
  ASSERT_EQ(full.size(), 40u);

  // K larger than what is left of max_new_tokens: never a token more than asked.
  for (int64_t max_new : {1, 2, 3, 7}) {
    Request shorter = r;
    shorter.max_new_tokens = max_new;
    const RequestResult res = run_with(shard, cfg, spec, {shorter}).at(0);
    EXPECT_EQ(res.finish_reason, "length");
    EXPECT_EQ(res.output_ids, std::vector<int64_t>(full.begin(), full.begin() + max_new)) << max_new;
  }

  // The end-of-sequence token inside a run of kept drafts ends the output right there.
  const int64_t eos_at = 20;
  ModelConfig with_eos = cfg;
  with_eos.eos_token_ids = {full[eos_at]};
  Request stops = r;
  stops.ignore_eos = false;
  const size_t first = std::find(full.begin(), full.end(), full[eos_at]) - full.begin();
  const RequestResult stopped = run_with(shard, with_eos, spec, {stops}).at(0);
  EXPECT_EQ(stopped.finish_reason, "stop");
  EXPECT_EQ(stopped.output_ids, std::vector<int64_t>(full.begin(), full.begin() + first + 1));

  // finish() from the callback (a stop string) inside a kept run: later tokens are neither
  // announced nor kept.
  std::vector<int64_t> announced;
  const RequestResult cut = run_with(shard, cfg, spec, {r}, [&](Engine& engine, const TokenEvent& ev) {
                              announced.push_back(ev.token);
                              if (ev.index == 25) {
                                EXPECT_TRUE(engine.finish(0, "stop"));
                              }
                            }).at(0);
  EXPECT_EQ(cut.finish_reason, "stop");
  EXPECT_EQ(cut.output_ids, std::vector<int64_t>(full.begin(), full.begin() + 26));
  EXPECT_EQ(announced, cut.output_ids);
}

TEST(SpeculativeEngineEdges, EndOfContextAndBusyBatchesDraftNothingTheyCannotHold) {
  ModelConfig cfg = tiny_config();
  cfg.max_position = 40;
  const ModelShard shard(random_weights(cfg, whole(cfg), 3, 0.1, at::kFloat));
  SchedulerOptions o;
  o.block_size = 8;
  const Request r = make_request(0, repeating_prompt(30, 5, 0, cfg.vocab_size), 30);
  const RequestResult plain = run_with(shard, cfg, o, {r}).at(0);
  const RequestResult spec = run_with(shard, cfg, with_ngram(o, 8), {r}).at(0);
  EXPECT_EQ(spec.finish_reason, "length");
  EXPECT_EQ(spec.output_ids, plain.output_ids);
  EXPECT_EQ(spec.output_ids.size(), 10u);  // the context of 40 ends it

  // More running sequences than speculative.max_batch: nobody drafts.
  SchedulerOptions busy = with_ngram(o, 4);
  busy.speculative.max_batch = 1;
  std::vector<Request> two = {make_request(0, repeating_prompt(20, 5, 0, cfg.vocab_size), 15),
                              make_request(1, repeating_prompt(20, 5, 1, cfg.vocab_size), 15)};
  const Generated g = kvpipe::testing::run_engine(shard, busy, 64, two);
  EXPECT_EQ(g.scheduler.spec_drafts, 0);
}

}  // namespace
}  // namespace kvpipe
