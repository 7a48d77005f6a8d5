#include "engine/speculative/draft_model.h"

#include "engine/engine.h"
#include "engine/speculative/rejection_sampler.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>

namespace kvpipe {

namespace {

// Catching up on a long prompt goes in chunks of this many tokens, so that the draft model's
// activations stay small beside the target's.
constexpr int64_t kDraftChunkTokens = 512;

}  // namespace

DraftModel::DraftModel(ModelWeights weights, int64_t num_blocks, int64_t block_size)
    : shard_(std::move(weights)),
      pool_(shard_.kv_shape(block_size), num_blocks, shard_.weights().dtype, shard_.device()) {
  free_.resize(static_cast<size_t>(num_blocks));
  // Lowest ids handed out first.
  std::iota(free_.rbegin(), free_.rend(), 0);
}

void DraftModel::release(State& state) {
  for (const int32_t b : state.blocks) free_.push_back(b);
  state.blocks.clear();
  state.computed = 0;
  state.written.clear();
}

void DraftModel::forget(int64_t request_id) {
  const auto it = states_.find(request_id);
  if (it == states_.end()) return;
  release(it->second);
  states_.erase(it);
}

bool DraftModel::reserve(int64_t request_id, State& state, int64_t tokens) {
  const size_t needed = static_cast<size_t>((tokens + pool_.block_size() - 1) / pool_.block_size());
  if (needed > static_cast<size_t>(pool_.num_blocks())) return false;
  while (state.blocks.size() < needed) {
    if (free_.empty()) {
      auto victim = states_.end();
      for (auto it = states_.begin(); it != states_.end(); ++it)
        if (it->first != request_id && !it->second.blocks.empty() &&
            (victim == states_.end() || it->second.last_used < victim->second.last_used))
          victim = it;
      if (victim == states_.end()) return false;
      release(victim->second);
      continue;
    }
    state.blocks.push_back(free_.back());
    free_.pop_back();
  }
  return true;
}

DraftTokens DraftModel::propose(int64_t request_id, const std::vector<int64_t>& tokens, int64_t k,
                                const SamplingParams& sampling, int64_t output_index) {
  DraftTokens draft;
  const int64_t n = static_cast<int64_t>(tokens.size());
  // Draft token j sits at position n + j; the last one's K/V is never written.
  k = std::min(k, shard_.config().max_position - n + 1);
  if (k <= 0 || n == 0) return draft;
  State& state = states_[request_id];
  state.last_used = ++clock_;
  // What the last draft wrote stays valid as far as the request kept it.
  int64_t kept = 0;
  while (kept < static_cast<int64_t>(state.written.size()) && state.computed + kept < n &&
         tokens[state.computed + kept] == state.written[kept])
    ++kept;
  state.computed += kept;
  state.written.clear();
  // The last token is fed again at least: its logits give the first draft token.
  state.computed = std::min(state.computed, n - 1);
  if (!reserve(request_id, state, n + k - 1)) {
    release(state);
    return draft;
  }

  const bool sampled = sampling.temperature > 0.0;
  std::vector<int64_t> fed(tokens.begin() + state.computed, tokens.end());
  int64_t position = state.computed;
  for (int64_t j = 0; j < k; ++j) {
    StepOutput out;
    size_t at = 0;
    while (at < fed.size()) {
      const int64_t chunk = std::min<int64_t>(kDraftChunkTokens, static_cast<int64_t>(fed.size() - at));
      StepBatch batch;
      SeqStep step;
      step.request_id = request_id;
      step.context_len = position;
      step.num_new = chunk;
      step.sample = at + static_cast<size_t>(chunk) == fed.size();
      step.block_table = state.blocks;  // greedy sampling params: the argmax, or the logits
      batch.token_ids.assign(fed.begin() + static_cast<std::ptrdiff_t>(at), fed.begin() + static_cast<std::ptrdiff_t>(at) + chunk);
      batch.want_logits = step.sample && sampled;
      batch.seqs.push_back(std::move(step));
      out = run_stage(shard_, pool_, batch, {}).output;
      ++forward_passes_;
      tokens_computed_ += chunk;
      position += chunk;
      at += static_cast<size_t>(chunk);
    }
    if (out.tokens.empty() || out.tokens[0] == kNonFiniteToken) break;
    int64_t token = out.tokens[0];
    if (sampled) {
      const Candidates q = sampling_candidates(out.logits.data_ptr<float>(), out.logits.size(1), sampling);
      token = draw_from(q, seeded_uniform(sampling, request_id, output_index + j, kDraftSalt));
      draft.probs.push_back(q);
    }
    draft.tokens.push_back(token);
    fed.assign(1, token);
  }
  // Positions before n hold the request's tokens; those after, the draft's tokens but the last.
  state.computed = n;
  if (!draft.tokens.empty()) state.written.assign(draft.tokens.begin(), draft.tokens.end() - 1);
  return draft;
}

}  // namespace kvpipe
