#include "engine/grammar/token_constraint.h"

#include "engine/grammar/regex_dfa.h"
#include "engine/text/tokenizer.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace kvpipe {

std::shared_ptr<const TokenVocabulary> TokenVocabulary::of(const Tokenizer& tokenizer, std::vector<int64_t> eos_ids) {
  auto v = std::make_shared<TokenVocabulary>();
  const int64_t n = tokenizer.vocab_size();
  v->bytes.resize(static_cast<size_t>(n));
  for (int64_t id = 0; id < n; ++id)
    if (!tokenizer.is_special(id)) v->bytes[id] = tokenizer.token_bytes(id);
  v->eos_ids = std::move(eos_ids);
  v->strips_leading_space = tokenizer.strips_leading_space();
  return v;
}

TokenConstraint::TokenConstraint(std::shared_ptr<const RegexDfa> dfa, std::shared_ptr<const TokenVocabulary> vocabulary)
    : dfa_(std::move(dfa)), vocabulary_(std::move(vocabulary)) {}

const std::string& TokenConstraint::token_text(int64_t id, bool first, std::string* scratch) const {
  const std::string& b = vocabulary_->bytes[id];
  if (!first || !vocabulary_->strips_leading_space || b.empty() || b[0] != ' ') return b;
  *scratch = b.substr(1);
  return *scratch;
}

int32_t TokenConstraint::state_after(const int64_t* output, int64_t n) const {
  int32_t state = dfa_->start();
  std::string scratch;
  const int64_t vocab = static_cast<int64_t>(vocabulary_->bytes.size());
  for (int64_t i = 0; i < n && state != RegexDfa::kDead; ++i) {
    if (output[i] < 0 || output[i] >= vocab) return RegexDfa::kDead;
    state = dfa_->walk(state, token_text(output[i], i == 0, &scratch));
  }
  return state;
}

const std::vector<uint64_t>& TokenConstraint::allowed(int32_t state, bool first) const {
  const int64_t key = static_cast<int64_t>(state) * 2 + (first ? 1 : 0);
  const auto it = cache_.find(key);
  if (it != cache_.end()) return it->second;
  const size_t vocab = vocabulary_->bytes.size();
  std::vector<uint64_t> bits((vocab + 63) / 64, 0);
  std::string scratch;
  for (size_t id = 0; id < vocab; ++id) {
    const std::string& text = token_text(static_cast<int64_t>(id), first, &scratch);
    if (text.empty()) continue;  // special tokens, and pieces that write nothing
    if (dfa_->walk(state, text) != RegexDfa::kDead) bits[id / 64] |= uint64_t{1} << (id % 64);
  }
  return cache_.emplace(key, std::move(bits)).first->second;
}

void TokenConstraint::mask(float* logits, int64_t vocab, const int64_t* output, int64_t n, int64_t tokens_left) const {
  constexpr float kBanned = -std::numeric_limits<float>::infinity();
  const int32_t state = state_after(output, n);
  if (state == RegexDfa::kDead) {
    for (int64_t id = 0; id < vocab; ++id) logits[id] = kBanned;
    return;
  }
  const std::vector<uint64_t>& bits = allowed(state, n == 0);
  // End-of-sequence keeps its own logit where the text is a whole match, and only there.
  std::vector<std::pair<int64_t, float>> ends;
  if (dfa_->accepting(state))
    for (int64_t id : vocabulary_->eos_ids)
      if (id >= 0 && id < vocab) ends.emplace_back(id, logits[id]);
  const int64_t known = std::min<int64_t>(vocab, static_cast<int64_t>(vocabulary_->bytes.size()));
  for (int64_t id = 0; id < known; ++id)
    if (!((bits[id / 64] >> (id % 64)) & 1)) logits[id] = kBanned;
  for (int64_t id = known; id < vocab; ++id) logits[id] = kBanned;  // padding rows of the head
  // Near the end of the budget: only tokens after which a match (and EOS) still fits. Where
  // none would (a budget too small from the start), the plain mask stands.
  const int64_t room = std::max<int64_t>(tokens_left - 2, 0);
  if (tokens_left >= 0 && dfa_->max_distance() > room) {
    std::vector<int64_t> keep;
    std::string scratch;
    for (int64_t id = 0; id < known; ++id) {
      if (!((bits[id / 64] >> (id % 64)) & 1)) continue;
      const int32_t next = dfa_->walk(state, token_text(id, n == 0, &scratch));
      if (next >= 0 && dfa_->distance(next) <= room) keep.push_back(id);
    }
    if (!keep.empty() || !ends.empty()) {
      std::vector<float> kept(keep.size());
      for (size_t i = 0; i < keep.size(); ++i) kept[i] = logits[keep[i]];
      for (int64_t id = 0; id < known; ++id) logits[id] = kBanned;
      for (size_t i = 0; i < keep.size(); ++i) logits[keep[i]] = kept[i];
    }
  }
  for (int64_t id : vocabulary_->eos_ids)
    if (id >= 0 && id < vocab) logits[id] = kBanned;
  for (const auto& [id, logit] : ends) logits[id] = logit;
}

size_t TokenConstraint::cache_bytes() const {
  size_t total = 0;
  for (const auto& [key, bits] : cache_) total += bits.size() * sizeof(uint64_t) + sizeof(key);
  return total;
}

}  // namespace kvpipe
