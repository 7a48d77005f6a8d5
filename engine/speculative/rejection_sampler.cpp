#include "engine/speculative/rejection_sampler.h"

#include <algorithm>
#include <random>
#include <unordered_map>

namespace kvpipe {

namespace {

constexpr uint64_t kAcceptSalt = 0x6163636570745f75ULL;    // "accept_u"
constexpr uint64_t kResidualSalt = 0x7265736964755f72ULL;  // "residu_r"

double probability_of(const Candidates& c, int64_t token) {
  for (size_t i = 0; i < c.tokens.size(); ++i)
    if (c.tokens[i] == token) return c.probs[i];
  return 0.0;
}

}  // namespace

double seeded_uniform(const SamplingParams& p, int64_t request_id, int64_t output_index, uint64_t salt) {
  const uint64_t stream = static_cast<uint64_t>(p.stream >= 0 ? p.stream : request_id);
  const uint64_t seed =
      splitmix64(splitmix64(splitmix64(splitmix64(p.seed) ^ stream) ^ static_cast<uint64_t>(output_index)) ^ salt);
  std::mt19937_64 rng(seed);
  return std::uniform_real_distribution<double>(0.0, 1.0)(rng);
}

int64_t draw_from(const Candidates& q, double u) {
  double cum = 0.0;
  for (size_t i = 0; i < q.tokens.size(); ++i) {
    cum += q.probs[i];
    if (u < cum) return q.tokens[i];
  }
  return q.tokens.back();
}

VerifiedToken verify_draft_token(const Candidates& p, const Candidates& q, int64_t draft,
                                 const SamplingParams& params, int64_t request_id, int64_t output_index) {
  const double px = probability_of(p, draft);
  const double qx = probability_of(q, draft);
  // Kept when u < p(x) / q(x), written without the division (q(x) > 0: x was drawn from q).
  if (seeded_uniform(params, request_id, output_index, kAcceptSalt) * qx < px) return {draft, true};
  std::unordered_map<int64_t, double> q_of;
  for (size_t i = 0; i < q.tokens.size(); ++i) q_of[q.tokens[i]] = q.probs[i];
  Candidates residual;
  double mass = 0.0;
  for (size_t i = 0; i < p.tokens.size(); ++i) {
    const auto it = q_of.find(p.tokens[i]);
    const double left = p.probs[i] - (it == q_of.end() ? 0.0 : it->second);
    if (left <= 0.0) continue;
    residual.tokens.push_back(p.tokens[i]);
    residual.probs.push_back(left);
    mass += left;
  }
  // A rejection means p(x) < q(x), so some other token has p > q; should rounding leave
  // nothing, p without x is the residual's limit. Either way the residual never holds x, so
  // the kept run ends at a rejection.
  if (residual.tokens.empty() || mass <= 0.0) {
    residual = Candidates{};
    mass = 0.0;
    for (size_t i = 0; i < p.tokens.size(); ++i)
      if (p.tokens[i] != draft) residual.tokens.push_back(p.tokens[i]), residual.probs.push_back(p.probs[i]), mass += p.probs[i];
    if (residual.tokens.empty()) return {draft, true};  // p is x alone: p(x) = 1 >= q(x)
  }
  for (double& x : residual.probs) x /= mass;
  return {draw_from(residual, seeded_uniform(params, request_id, output_index, kResidualSalt)), false};
}

}  // namespace kvpipe
