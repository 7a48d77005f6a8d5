// Speculative decoding with a draft model: the rejection rule against the exact target
// distribution, and whole generations (greedy and sampled) against those without drafts.
#include "engine/engine.h"
#include "engine/model/model_weights.h"
#include "engine/model_shard.h"
#include "engine/speculative/draft_model.h"
#include "engine/speculative/rejection_sampler.h"
#include "tests/support/engine_run.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <vector>

namespace kvpipe {
namespace {

using kvpipe::testing::Generated;
using kvpipe::testing::make_request;

// Pearson's statistic of `counts` against `probs` (n draws).
double chi_square(const std::vector<double>& counts, const std::vector<double>& probs, double n) {
  double x = 0.0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double e = probs[i] * n;
    if (e > 0.0) x += (counts[i] - e) * (counts[i] - e) / e;
    else EXPECT_EQ(counts[i], 0.0) << "token " << i << " has probability 0";
  }
  return x;
}

// Upper 0.1% points of the chi-square distribution, by degrees of freedom.
double chi_square_critical(int df) {
  static const double table[] = {0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59};
  return table[df];
}

TEST(RejectionSampler, KeptTokensAreDistributedAsTheTargetWhateverTheDraft) {
  // q puts most mass where p has little, holds token 5 that p never gives, and misses token 4.
  Candidates p{{0, 1, 2, 3, 4}, {0.40, 0.25, 0.15, 0.12, 0.08}};
  Candidates q{{3, 2, 5, 0, 1}, {0.45, 0.25, 0.15, 0.10, 0.05}};
  const int64_t n = 60000;
  std::vector<double> counts(6, 0.0);
  int64_t accepted = 0;
  for (int64_t i = 0; i < n; ++i) {
    SamplingParams params;
    params.temperature = 1.0;
    params.seed = 17;
    const int64_t x = draw_from(q, seeded_uniform(params, i, 3, kDraftSalt));
    const VerifiedToken v = verify_draft_token(p, q, x, params, i, 3);
    if (v.accepted) {
      EXPECT_EQ(v.token, x);
      ++accepted;
    } else {
      EXPECT_NE(v.token, x);
    }
    counts.at(static_cast<size_t>(v.token)) += 1.0;
    // Seeded: the same request and index verify the same way.
    const VerifiedToken again = verify_draft_token(p, q, x, params, i, 3);
    EXPECT_EQ(again.token, v.token);
  }
  const std::vector<double> target = {0.40, 0.25, 0.15, 0.12, 0.08, 0.0};
  EXPECT_LT(chi_square(counts, target, double(n)), chi_square_critical(4));
  // A draft token is kept with probability sum_x min(p(x), q(x)) = 0.10 + 0.05 + 0.15 + 0.12.
  EXPECT_NEAR(double(accepted) / double(n), 0.42, 0.01);
}

ModelConfig small_config(int64_t vocab, int64_t hidden, int64_t layers) {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = vocab;
  c.hidden_size = hidden;
  c.num_layers = layers;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = hidden / 4;
  c.intermediate_size = hidden + hidden / 2;
  c.max_position = 256;
  c.rope_theta = 10000.0;
  c.rms_eps = 1e-5;
  c.eos_token_ids = {2};
  return c;
}

WeightSelection whole(const ModelConfig& c) { return {{0, c.num_layers}, true, true, {}}; }

std::vector<Request> mixed_requests(int64_t vocab, const SamplingParams& sampling) {
  std::vector<Request> requests;
  // Prompt length, output length, arrival step: long prompts come in chunks beside decodes.
  const int64_t shapes[][3] = {{24, 30, 0}, {9, 25, 0}, {40, 20, 2}, {17, 3, 3}, {30, 35, 6}};
  for (int64_t i = 0; i < 5; ++i) {
    std::vector<int64_t> prompt(shapes[i][0]);
    for (int64_t t = 0; t < shapes[i][0]; ++t) prompt[t] = (t * 37 + i * 11 + 1) % vocab;
    Request r = make_request(i, prompt, shapes[i][1], shapes[i][2]);
    r.sampling = sampling;
    requests.push_back(r);
  }
  return requests;
}

SchedulerOptions with_draft(SchedulerOptions o, DraftProposer* draft, int64_t k) {
  o.speculative.draft_model = draft;
  o.speculative.num_tokens = k;
  return o;
}

void expect_same_tokens(const Generated& spec, const Generated& plain) {
  ASSERT_EQ(spec.tokens.size(), plain.tokens.size());
  for (const auto& [id, tokens] : plain.tokens) EXPECT_EQ(spec.tokens.at(id), tokens) << "request " << id;
}

SchedulerOptions scheduler_options() {
  SchedulerOptions o;
  o.block_size = 8;
  o.max_batch = 4;
  o.max_tokens_per_step = 32;
  return o;
}

// The target as its own draft proposes what the target computes: every draft token is kept.
TEST(DraftModelEngine, TheTargetAsItsOwnDraftKeepsEveryToken) {
  const ModelConfig cfg = small_config(61, 64, 3);
  const ModelShard shard(random_weights(cfg, whole(cfg), 3, 0.1, at::kFloat));
  DraftModel draft(random_weights(cfg, whole(cfg), 3, 0.1, at::kFloat), 64, 8);
  const std::vector<Request> requests = mixed_requests(cfg.vocab_size, {});
  const Generated plain = kvpipe::testing::run_engine(shard, scheduler_options(), 64, requests);
  const Generated spec = kvpipe::testing::run_engine(shard, with_draft(scheduler_options(), &draft, 4), 64, requests);
  expect_same_tokens(spec, plain);
  EXPECT_GT(spec.scheduler.spec_drafts, 10);
  EXPECT_EQ(spec.scheduler.spec_accepted_tokens, spec.scheduler.spec_draft_tokens);
  // Kept whole, drafts grow to K.
  EXPECT_EQ(spec.scheduler.spec_accepted_at.size(), 4u);
  // Every request ended: the draft model gave back every block it held.
  EXPECT_EQ(draft.free_blocks(), draft.pool().num_blocks());
}

// A draft model of another shape and other weights: drafts are mostly wrong, the output is
// the same, also with the target's sequences preempted and the draft's own pool too small
// for every request at once.
TEST(DraftModelEngine, ARandomDraftChangesNoTokenUnderPreemptionAndAFullDraftPool) {
  const ModelConfig cfg = small_config(61, 64, 3);
  const ModelShard shard(random_weights(cfg, whole(cfg), 3, 0.1, at::kFloat));
  DraftModel draft(random_weights(small_config(61, 32, 2), whole(small_config(61, 32, 2)), 11, 0.1, at::kFloat), 12, 8);
  const std::vector<Request> requests = mixed_requests(cfg.vocab_size, {});
  const Generated plain = kvpipe::testing::run_engine(shard, scheduler_options(), 64, requests);
  for (const int64_t blocks : {int64_t{64}, int64_t{16}}) {
    SCOPED_TRACE(std::to_string(blocks) + " target blocks");
    const Generated spec =
        kvpipe::testing::run_engine(shard, with_draft(scheduler_options(), &draft, 3), blocks, requests);
    expect_same_tokens(spec, plain);
    EXPECT_GT(spec.scheduler.spec_drafts, 0);
    EXPECT_LT(spec.scheduler.spec_accepted_tokens, spec.scheduler.spec_draft_tokens);
    if (blocks == 16) {
      EXPECT_GT(spec.preemptions, 0);
    }
    EXPECT_EQ(draft.free_blocks(), draft.pool().num_blocks());
  }
}

// The end-of-sequence token proposed by the draft and kept ends the output there.
TEST(DraftModelEngine, AKeptEndOfSequenceTokenEndsTheOutput) {
  ModelConfig cfg = small_config(61, 64, 3);
  const ModelShard free_running(random_weights(cfg, whole(cfg), 3, 0.1, at::kFloat));
  Request r = make_request(0, {5, 9, 14, 3, 27, 8}, 40);
  const std::vector<int64_t> full =
      kvpipe::testing::run_engine(free_running, scheduler_options(), 64, {r}).tokens.at(0);
  ASSERT_EQ(full.size(), 40u);
  // Where the end of sequence falls inside a draft depends on the draft lengths: over several
  // end-of-sequence tokens, every output stops at the first one, and some draft has tokens
  // after it, counted as drafted, not kept (vLLM's counters).
  bool drafted_past_the_end = false;
  for (size_t at = 6; at < 20; ++at) {
    if (full[0] == full[at]) continue;  // the output's first token is never checked for the end
    cfg.eos_token_ids = {full[at]};
    const size_t first = std::find(full.begin() + 1, full.end(), full[at]) - full.begin();
    const ModelShard shard(random_weights(cfg, whole(cfg), 3, 0.1, at::kFloat));
    DraftModel draft(random_weights(cfg, whole(cfg), 3, 0.1, at::kFloat), 16, 8);
    r.ignore_eos = false;
    const Generated spec = kvpipe::testing::run_engine(shard, with_draft(scheduler_options(), &draft, 8), 64, {r});
    EXPECT_EQ(spec.tokens.at(0), std::vector<int64_t>(full.begin(), full.begin() + first + 1)) << "end at " << at;
    EXPECT_GT(spec.scheduler.spec_drafts, 0);
    drafted_past_the_end |= spec.scheduler.spec_accepted_tokens < spec.scheduler.spec_draft_tokens;
  }
  EXPECT_TRUE(drafted_past_the_end);
}

// Sampling: on a vocabulary of 6 tokens, the tokens verified against a draft whose q differs
// strongly from p follow the distribution of the tokens sampled without drafts (two-sample
// chi-square at 0.1%), and seeded runs repeat exactly.
TEST(DraftModelEngine, SampledTokensFollowTheModelsDistributionWithAStronglyDifferentDraft) {
  const ModelConfig cfg = small_config(6, 32, 2);
  const ModelShard shard(random_weights(cfg, whole(cfg), 5, 0.4, at::kFloat));
  DraftModel draft(random_weights(cfg, whole(cfg), 23, 0.8, at::kFloat), 256, 8);
  SamplingParams sampling;
  sampling.temperature = 1.0;
  sampling.seed = 9;
  std::vector<Request> requests;
  for (int64_t i = 0; i < 1200; ++i) {
    Request r = make_request(i, {1, 4, 0, 3, 2}, 3);
    r.sampling = sampling;
    requests.push_back(r);
  }
  SchedulerOptions o;
  o.block_size = 8;
  o.max_batch = 64;
  SchedulerOptions spec_options = with_draft(o, &draft, 2);
  spec_options.speculative.max_batch = 64;
  const Generated plain = kvpipe::testing::run_engine(shard, o, 1024, requests);
  const Generated spec = kvpipe::testing::run_engine(shard, spec_options, 1024, requests);
  const Generated again = kvpipe::testing::run_engine(shard, spec_options, 1024, requests);
  expect_same_tokens(again, spec);
  // Drafts were verified, and both outcomes of the rule happened often.
  const double rate = double(spec.scheduler.spec_accepted_tokens) / double(spec.scheduler.spec_draft_tokens);
  EXPECT_GT(spec.scheduler.spec_drafts, 1000);
  EXPECT_GT(rate, 0.1);
  EXPECT_LT(rate, 0.9);

  for (size_t position : {size_t{1}, size_t{2}}) {
    SCOPED_TRACE("output token " + std::to_string(position));
    std::vector<double> a(6, 0.0), b(6, 0.0);
    for (const auto& [id, tokens] : plain.tokens) a.at(static_cast<size_t>(tokens.at(position))) += 1.0;
    for (const auto& [id, tokens] : spec.tokens) b.at(static_cast<size_t>(tokens.at(position))) += 1.0;
    double x = 0.0;
    int cells = 0;
    for (size_t t = 0; t < 6; ++t) {
      if (a[t] + b[t] == 0.0) continue;
      x += (a[t] - b[t]) * (a[t] - b[t]) / (a[t] + b[t]);  // equal sample sizes
      ++cells;
    }
    EXPECT_LT(x, chi_square_critical(cells - 1));
  }
}

}  // namespace
}  // namespace kvpipe
