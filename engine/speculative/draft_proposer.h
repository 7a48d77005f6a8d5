// DraftProposer: where a decoding sequence's draft comes from when it is not prompt lookup
// (a draft model, engine/speculative/draft_model.h). The scheduler asks it for a draft as it
// schedules a sequence, and tells it when a request has ended so that what it kept for the
// request goes.
#pragma once

#include "engine/sampler.h"
#include "engine/step_batch.h"

#include <cstdint>
#include <vector>

namespace kvpipe {

struct DraftTokens {
  std::vector<int64_t> tokens;
  // With a sampled request (temperature > 0): the distribution each token was drawn from
  // (after the request's temperature, min_p, top-k and top-p), which rejection sampling reads
  // (engine/speculative/rejection_sampler.h). Empty for greedy requests: their drafts are
  // kept while they equal the model's argmax.
  std::vector<Candidates> probs;
};

class DraftProposer {
 public:
  virtual ~DraftProposer() = default;
  // Up to `k` tokens to follow `tokens` (the request's prompt and output so far; the first
  // drafted token has output index `output_index`). May return fewer, or none.
  virtual DraftTokens propose(int64_t request_id, const std::vector<int64_t>& tokens, int64_t k,
                              const SamplingParams& sampling, int64_t output_index) = 0;
  // The request has ended.
  virtual void forget(int64_t request_id) = 0;
};

}  // namespace kvpipe
