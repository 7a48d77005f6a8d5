// Speculative decoding: what a decoding sequence proposes to verify in one step, and how the
// model's own tokens decide what of it is kept.
//
// Drafts come from prompt lookup (n-gram matching over the sequence's own prompt and output,
// as vLLM's `ngram` method and llama.cpp's lookup decoding do): the continuation of the most
// recent earlier occurrence of the sequence's last n tokens, for the longest n in [min, max]
// that occurs. Verification keeps a draft token only where it equals the token the model
// itself draws at that position (the same draw, seeded by request and output index, as
// without speculation), so the output is token for token what the model alone gives, greedy
// or sampled. For drafts of one token with certainty (q one-hot, as n-gram drafts are) this
// is exactly the standard rejection rule: a token x is kept with probability p(x), and
// otherwise the model's draw is distributed as p with x removed and renormalised.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvpipe {

class DraftProposer;

struct SpeculativeOptions {
  bool ngram = false;         // prompt-lookup drafts (method: ngram); off otherwise
  // Drafts from a draft model (method: draft) instead (not owned): engine/speculative/draft_model.h.
  DraftProposer* draft_model = nullptr;
  int64_t num_tokens = 4;     // K: the most draft tokens verified per step
  int64_t ngram_min = 1;
  int64_t ngram_max = 4;
  // Above this many running sequences nothing is drafted: a busy batch gains little from
  // verification and pays its extra tokens.
  int64_t max_batch = 8;
  bool enabled() const { return (ngram || draft_model != nullptr) && num_tokens > 0; }
};

// Up to `k` tokens that follow the most recent earlier occurrence of the last n tokens of
// `tokens`, for the largest n in [min_n, max_n] with an occurrence; empty when none occurs.
std::vector<int64_t> propose_ngram(const std::vector<int64_t>& tokens, int64_t min_n, int64_t max_n, int64_t k);

// How many of `sampled` (the model's tokens at the rows of a verified draft: row r follows
// the draft's first r tokens) a sequence keeps: the model's tokens while each equals the
// draft token it was drawn in place of, and the first that differs (or the one after the
// whole draft). Always at least 1 when `sampled` is not empty.
int64_t accepted_length(const std::vector<int64_t>& draft, const int64_t* sampled, int64_t num_sampled);

// When and how much a sequence drafts. On a CPU every verified row costs compute (about a
// quarter of a decode step on a small model), so the draft's length follows what the model
// kept: one more after a draft kept whole, one past the last kept token otherwise. Proposals
// are skipped for a while after steps whose drafts the model mostly rejected, so that text
// without repeats costs (almost) nothing, with the pause doubling while acceptance stays low.
class SpeculationGate {
 public:
  bool open() const { return skip_ == 0; }
  // The draft length to propose now, at most `most`.
  int64_t length(int64_t most) const { return std::min(most, length_); }
  // A decoding step passed without drafting.
  void step_without_draft() {
    if (skip_ > 0) --skip_;
  }
  // A draft of `drafted` tokens came back with `accepted` of them kept.
  void record(int64_t drafted, int64_t accepted);

 private:
  double rate_ = 1.0;   // exponential average of accepted / drafted
  int64_t length_ = 2;  // the next draft's length
  int64_t pause_ = 0;   // the length of the next pause
  int64_t skip_ = 0;    // decoding steps left to pass without drafting
};

}  // namespace kvpipe
