// Rejection sampling of drafted tokens (Leviathan et al., Chen et al.): what a sampled
// request keeps of a draft whose proposal distribution q is not one-hot (a draft model's).
//
// A draft token x drawn from q is kept with probability min(1, p(x) / q(x)), p being the
// target model's distribution at that position after the request's temperature, min_p,
// top-k and top-p; when it is not, the token is drawn from max(p - q, 0) renormalised. The
// kept token is then distributed exactly as p, whatever q is. Both draws are seeded by the
// request's seed and stream and the output index (each with a salt of its own, apart from the
// draw of the token without a draft), so that a seeded request repeats exactly.
#pragma once

#include "engine/sampler.h"

#include <cstdint>

namespace kvpipe {

// A uniform draw in [0, 1) for `params`' seed and stream (`request_id` when the stream is
// -1), at `output_index`, for the purpose `salt` names.
double seeded_uniform(const SamplingParams& params, int64_t request_id, int64_t output_index, uint64_t salt);

// A token drawn from `q` with seeded_uniform(..., kDraftSalt): what a draft model proposes.
constexpr uint64_t kDraftSalt = 0x64726166745f7131ULL;  // "draft_q1"
int64_t draw_from(const Candidates& q, double u);

struct VerifiedToken {
  int64_t token = 0;
  bool accepted = false;  // the draft token itself
};

// The token kept at a draft position: `draft` (drawn from `q`) or a draw from the residual,
// `p` being the target's distribution there.
VerifiedToken verify_draft_token(const Candidates& p, const Candidates& q, int64_t draft,
                                 const SamplingParams& params, int64_t request_id, int64_t output_index);

}  // namespace kvpipe
