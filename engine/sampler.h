// Sampler: greedy, temperature, min_p, top-k and top-p sampling of one token from logits.
//
// Sampling is a pure function of (logits, params, request id, output index): the random
// draw is seeded from those, not from a stream shared by the batch. A request therefore
// gets the same tokens whichever requests it is batched with, whether it was preempted and
// recomputed, and on whichever rank samples it.
#pragma once

#include "engine/step_batch.h"

#include <cstdint>
#include <vector>

namespace kvpipe {

// SplitMix64's finaliser: a well-mixed 64-bit hash, for seeds derived from several values.
uint64_t splitmix64(uint64_t x);

// Tokens that stay candidates after temperature, min_p, top-k and top-p, most probable first,
// with their renormalised probabilities. Greedy (temperature 0) keeps the argmax alone
// (the lowest id among equal maxima).
struct Candidates {
  std::vector<int64_t> tokens;
  std::vector<double> probs;
};
Candidates sampling_candidates(const float* logits, int64_t vocab, const SamplingParams& params);

// False when the row holds a NaN or +inf, or nothing above -inf: no token can be drawn from
// it (-inf alone is a masked token, not a fault). Costs one pass of integer compares.
bool logits_usable(const float* logits, int64_t vocab);

// The token drawn from `logits`, or kNonFiniteToken when !logits_usable(logits, vocab): a
// NaN from broken weights must fail the request, never pass for token 0.
int64_t sample_token(const float* logits, int64_t vocab, const SamplingParams& params,
                     int64_t request_id, int64_t output_index);

}  // namespace kvpipe
