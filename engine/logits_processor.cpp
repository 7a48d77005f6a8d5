#include "engine/logits_processor.h"

#include "engine/grammar/token_constraint.h"

#include <algorithm>
#include <limits>
#include <unordered_map>

namespace kvpipe {

void apply_logits_processing(float* logits, int64_t vocab, const LogitsProcessing& p,
                             const std::vector<int64_t>& tokens, int64_t prompt_len,
                             const std::vector<int64_t>& stop_ids, int64_t max_output) {
  constexpr float kBanned = -std::numeric_limits<float>::infinity();
  const auto in_vocab = [vocab](int64_t id) { return id >= 0 && id < vocab; };
  prompt_len = std::clamp<int64_t>(prompt_len, 0, static_cast<int64_t>(tokens.size()));
  const int64_t output_len = static_cast<int64_t>(tokens.size()) - prompt_len;
  if (p.constraint)
    p.constraint->mask(logits, vocab, tokens.data() + prompt_len, output_len,
                       max_output < 0 ? -1 : std::max<int64_t>(max_output - output_len, 0));

  for (const std::vector<int64_t>& word : p.bad_words) {
    if (word.empty() || !in_vocab(word.back())) continue;
    const int64_t before = static_cast<int64_t>(word.size()) - 1;
    if (before > output_len) continue;
    if (std::equal(word.begin(), word.end() - 1, tokens.end() - before)) logits[word.back()] = kBanned;
  }
  if (output_len < p.min_tokens)
    for (int64_t id : stop_ids)
      if (in_vocab(id)) logits[id] = kBanned;
  for (const auto& [id, bias] : p.logit_bias)
    if (in_vocab(id)) logits[id] += bias;

  if (p.repetition_penalty == 1.0 && p.frequency_penalty == 0.0 && p.presence_penalty == 0.0) return;
  // Occurrences in the output; prompt tokens enter with 0 (they count for repetition only).
  std::unordered_map<int64_t, int64_t> output_counts;
  output_counts.reserve(tokens.size());
  for (int64_t i = 0; i < static_cast<int64_t>(tokens.size()); ++i) {
    const int64_t id = tokens[i];
    if (!in_vocab(id)) continue;
    int64_t& n = output_counts[id];
    if (i >= prompt_len) ++n;
  }
  for (const auto& [id, count] : output_counts) {
    double x = logits[id];
    if (p.repetition_penalty != 1.0) x = x > 0.0 ? x / p.repetition_penalty : x * p.repetition_penalty;
    x -= p.frequency_penalty * static_cast<double>(count) + p.presence_penalty * (count > 0 ? 1.0 : 0.0);
    logits[id] = static_cast<float>(x);
  }
}

}  // namespace kvpipe
