// DraftModel: a small model with the target's vocabulary that drafts tokens for speculative
// decoding (speculative.method: draft), on the coordinator's rank.
//
// It owns its weights (every layer, on one device) and a KV pool of its own. For each request
// it keeps the blocks of what it has computed of the request's tokens, so a draft costs a
// forward pass over the tokens the request gained since its last draft (those the last draft
// wrote and the target kept are reused) and one decode step per further draft token. When its
// pool is full it drops what it kept for the request it drafted for least recently (that one
// catches up with one longer pass); a request that does not fit alone gets no draft.
//
// Greedy requests get the draft model's argmax; sampled ones a draw from its distribution
// after their own temperature, min_p, top-k and top-p, returned with the draft for the
// rejection rule.
#pragma once

#include "cache/block_pool.h"
#include "engine/model_shard.h"
#include "engine/speculative/draft_proposer.h"

#include <unordered_map>

namespace kvpipe {

class DraftModel : public DraftProposer {
 public:
  // `weights` hold every layer with the embedding and head. The pool has `num_blocks` blocks
  // of `block_size` tokens.
  DraftModel(ModelWeights weights, int64_t num_blocks, int64_t block_size);

  DraftTokens propose(int64_t request_id, const std::vector<int64_t>& tokens, int64_t k,
                      const SamplingParams& sampling, int64_t output_index) override;
  void forget(int64_t request_id) override;

  const ModelShard& shard() const { return shard_; }
  const BlockPool& pool() const { return pool_; }
  int64_t forward_passes() const { return forward_passes_; }
  int64_t tokens_computed() const { return tokens_computed_; }
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }

 private:
  struct State {
    std::vector<int32_t> blocks;
    int64_t computed = 0;          // leading tokens of the request whose K/V the pool holds
    std::vector<int64_t> written;  // draft tokens whose K/V follow those (kept ones are reused)
    uint64_t last_used = 0;
  };
  // Blocks for `tokens` tokens of `state`, dropping other requests' state as needed.
  bool reserve(int64_t request_id, State& state, int64_t tokens);
  void release(State& state);

  ModelShard shard_;
  BlockPool pool_;
  std::vector<int32_t> free_;
  std::unordered_map<int64_t, State> states_;
  uint64_t clock_ = 0;
  int64_t forward_passes_ = 0;
  int64_t tokens_computed_ = 0;
};

}  // namespace kvpipe
