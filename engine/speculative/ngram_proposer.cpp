#include "engine/speculative/ngram_proposer.h"

#include <algorithm>

namespace kvpipe {

std::vector<int64_t> propose_ngram(const std::vector<int64_t>& tokens, int64_t min_n, int64_t max_n, int64_t k) {
  const int64_t size = static_cast<int64_t>(tokens.size());
  if (k <= 0) return {};
  for (int64_t n = std::min(max_n, size - 1); n >= std::max<int64_t>(min_n, 1); --n) {
    const int64_t* suffix = tokens.data() + size - n;
    // The most recent occurrence that starts before the suffix does: recent text is the
    // likeliest to be copied next.
    for (int64_t i = size - n - 1; i >= 0; --i) {
      if (!std::equal(suffix, suffix + n, tokens.data() + i)) continue;
      const int64_t from = i + n, to = std::min(size, from + k);
      return std::vector<int64_t>(tokens.begin() + from, tokens.begin() + to);
    }
  }
  return {};
}

int64_t accepted_length(const std::vector<int64_t>& draft, const int64_t* sampled, int64_t num_sampled) {
  int64_t kept = 0;
  while (kept < num_sampled) {
    const bool matches = kept < static_cast<int64_t>(draft.size()) && sampled[kept] == draft[kept];
    ++kept;
    if (!matches) break;
  }
  return kept;
}

void SpeculationGate::record(int64_t drafted, int64_t accepted) {
  if (drafted <= 0) return;
  length_ = accepted == drafted ? drafted + 1 : std::max<int64_t>(1, accepted + 1);
  rate_ = 0.5 * rate_ + 0.5 * static_cast<double>(accepted) / static_cast<double>(drafted);
  // Below about one token in three the extra rows cost more than the kept tokens save.
  if (rate_ >= 0.3) {
    pause_ = 0;
    return;
  }
  pause_ = pause_ == 0 ? 4 : std::min<int64_t>(2 * pause_, 64);
  skip_ = pause_;
  rate_ = 0.5;
}

}  // namespace kvpipe
