#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

namespace kvpipe {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

Candidates sampling_candidates(const float* logits, int64_t vocab, const SamplingParams& p) {
  Candidates c;
  if (p.temperature <= 0.0) {
    c.tokens.push_back(std::max_element(logits, logits + vocab) - logits);
    c.probs.push_back(1.0);
    return c;
  }
  std::vector<int64_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  // Stable: among equal logits the lower id ranks first, so the kept set is well defined.
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
  if (p.top_k > 0 && p.top_k < vocab) order.resize(p.top_k);

  const double max_logit = logits[order[0]];
  std::vector<double> probs(order.size());
  double sum = 0.0;
  for (size_t i = 0; i < order.size(); ++i) {
    probs[i] = std::exp((logits[order[i]] - max_logit) / p.temperature);
    sum += probs[i];
  }
  for (double& x : probs) x /= sum;

  // min_p keeps a prefix of the sorted tokens, as top-k does, so the two commute; top-p then
  // reads the mass of what is left (vLLM's order: temperature, min_p, top-k/top-p).
  if (p.min_p > 0.0) {
    const double floor = p.min_p * probs[0];
    size_t keep = 1;
    while (keep < probs.size() && probs[keep] >= floor) ++keep;
    order.resize(keep);
    probs.resize(keep);
    const double left = std::accumulate(probs.begin(), probs.end(), 0.0);
    for (double& x : probs) x /= left;
  }

  // Keep the smallest prefix whose mass reaches top_p (at least one token).
  size_t keep = order.size();
  if (p.top_p < 1.0) {
    double cum = 0.0;
    for (size_t i = 0; i < order.size(); ++i) {
      cum += probs[i];
      if (cum >= p.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  order.resize(keep);
  probs.resize(keep);
  const double kept = std::accumulate(probs.begin(), probs.end(), 0.0);
  for (double& x : probs) x /= kept;
  c.tokens = std::move(order);
  c.probs = std::move(probs);
  return c;
}

bool logits_usable(const float* logits, int64_t vocab) {
  // On the bits, so that the loop vectorises (float compares with NaN would not reduce):
  // NaN and +inf are the magnitudes at or above +inf's pattern (sign clear, or NaN of either
  // sign); -inf is 0xff800000 and counts only when every entry is -inf.
  constexpr uint32_t kPosInf = 0x7f800000u, kNegInf = 0xff800000u;
  uint32_t bad = 0, all_neg_inf = 1;
  for (int64_t i = 0; i < vocab; ++i) {
    uint32_t b;
    std::memcpy(&b, logits + i, sizeof(b));
    bad |= static_cast<uint32_t>(b != kNegInf && (b & 0x7fffffffu) >= kPosInf);
    all_neg_inf &= static_cast<uint32_t>(b == kNegInf);
  }
  return vocab > 0 && bad == 0 && all_neg_inf == 0;
}

int64_t sample_token(const float* logits, int64_t vocab, const SamplingParams& p,
                     int64_t request_id, int64_t output_index) {
  if (!logits_usable(logits, vocab)) return kNonFiniteToken;
  const Candidates c = sampling_candidates(logits, vocab, p);
  if (c.tokens.size() == 1) return c.tokens[0];
  const uint64_t seed =
      splitmix64(splitmix64(splitmix64(p.seed) ^ static_cast<uint64_t>(p.stream >= 0 ? p.stream : request_id)) ^
                 static_cast<uint64_t>(output_index));
  std::mt19937_64 rng(seed);
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
  double cum = 0.0;
  for (size_t i = 0; i < c.tokens.size(); ++i) {
    cum += c.probs[i];
    if (u < cum) return c.tokens[i];
  }
  return c.tokens.back();
}

}  // namespace kvpipe
