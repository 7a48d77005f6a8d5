// LogitsProcessing: what a request asks of its logits before a token is drawn: a
// structured-output constraint, banned words, a minimum length, a bias per token, and
// repetition, frequency and presence penalties.
//
// They read the sequence's tokens so far, which only the coordinator holds, so a request
// that asks for any of them has its raw logits sent back and its token drawn again there
// (Engine::run); the other rows of the batch keep the token their last stage drew.
// Guarantees: the order and formulas are vLLM's (v1 sampler): the structured-output mask,
// then banned words, then min_tokens, then logit_bias, then the penalties (repetition over
// prompt and output, frequency and presence over the output), all before temperature,
// min_p, top-k and top-p; the result is
// a pure function of (raw logits, tokens so far), so preemption and recomputation, batch
// composition and the rank that samples change nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace kvpipe {

class TokenConstraint;

struct LogitsProcessing {
  // Added to the token's logit (OpenAI's logit_bias: -100 bans in practice, +100 forces).
  std::vector<std::pair<int64_t, float>> logit_bias;
  double presence_penalty = 0.0;    // subtracted once from each token the output holds
  double frequency_penalty = 0.0;   // subtracted once per occurrence in the output
  double repetition_penalty = 1.0;  // a token in prompt or output: positive logit / p, negative * p
  int64_t min_tokens = 0;           // the stop tokens are banned until the output has this many
  // Token sequences never produced: the last token of each is banned where the output
  // ends with the others (a one-token word is banned everywhere).
  std::vector<std::vector<int64_t>> bad_words;
  // Structured output: only tokens that keep the text a prefix of a match, end-of-sequence
  // only at a whole match (engine/grammar/token_constraint.h). Applied first, as vLLM
  // applies its grammar bitmask before the sampler.
  std::shared_ptr<const TokenConstraint> constraint;

  bool active() const {
    return constraint != nullptr || !logit_bias.empty() || presence_penalty != 0.0 || frequency_penalty != 0.0 ||
           repetition_penalty != 1.0 || min_tokens > 0 || !bad_words.empty();
  }
};

// Applies `p` in place to one row of `vocab` logits. `tokens` is the sequence so far, its
// first `prompt_len` the prompt; `stop_ids` are the tokens min_tokens holds back (EOS).
// Token ids outside the vocabulary are ignored (the request parsers refuse them).
// `max_output` (the request's max_new_tokens; -1: none) lets a constraint leave room to
// finish its match.
void apply_logits_processing(float* logits, int64_t vocab, const LogitsProcessing& p,
                             const std::vector<int64_t>& tokens, int64_t prompt_len,
                             const std::vector<int64_t>& stop_ids, int64_t max_output = -1);

}  // namespace kvpipe
