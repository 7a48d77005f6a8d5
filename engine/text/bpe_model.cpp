#include "engine/text/bpe_model.h"

#include <queue>

namespace kvpipe::text {

BpeModel::BpeModel(const std::vector<std::string>& tokens,
                   const std::vector<std::pair<std::string, std::string>>& merges)
    : vocab_size_(static_cast<int64_t>(tokens.size())) {
  symbols_ = tokens;
  ids_.reserve(tokens.size() + merges.size());
  for (size_t i = 0; i < tokens.size(); ++i) ids_.emplace(tokens[i], static_cast<int32_t>(i));
  ranks_.reserve(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    const int32_t a = intern(merges[r].first), b = intern(merges[r].second);
    const int32_t c = intern(merges[r].first + merges[r].second);
    // A repeated pair keeps its first (lowest) rank.
    ranks_.emplace(key(a, b), Merge{static_cast<int32_t>(r), c});
  }
}

int32_t BpeModel::intern(const std::string& text) {
  const auto [it, inserted] = ids_.emplace(text, static_cast<int32_t>(symbols_.size()));
  if (inserted) symbols_.push_back(text);
  return it->second;
}

int64_t BpeModel::token_id(std::string_view text) const {
  const auto it = ids_.find(std::string(text));
  return it != ids_.end() && it->second < vocab_size_ ? it->second : -1;
}

int32_t BpeModel::symbol_id(std::string_view text) const {
  const auto it = ids_.find(std::string(text));
  return it == ids_.end() ? -1 : it->second;
}

void BpeModel::merge(std::vector<BpeSymbol>& symbols) const {
  const int n = static_cast<int>(symbols.size());
  if (n < 2) return;
  std::vector<int> prev(n), next(n);
  std::vector<char> alive(n, 1);
  for (int i = 0; i < n; ++i) prev[i] = i - 1, next[i] = i + 1 < n ? i + 1 : -1;

  struct Candidate {
    int32_t rank;
    int left, right;
    int32_t left_id, right_id, result;
    bool operator<(const Candidate& o) const {  // the queue's top is the lowest rank, leftmost
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate> queue;
  auto consider = [&](int l, int r) {
    if (l < 0 || r < 0) return;
    const int32_t a = symbols[l].id, b = symbols[r].id;
    if (a < 0 || b < 0) return;
    const auto it = ranks_.find(key(a, b));
    if (it == ranks_.end()) return;
    queue.push({it->second.rank, l, r, a, b, it->second.result});
  };
  for (int i = 0; i + 1 < n; ++i) consider(i, i + 1);

  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    // Stale when either side has merged since the pair was queued.
    if (!alive[c.left] || !alive[c.right] || next[c.left] != c.right || symbols[c.left].id != c.left_id ||
        symbols[c.right].id != c.right_id)
      continue;
    symbols[c.left].id = c.result;
    symbols[c.left].end = symbols[c.right].end;
    alive[c.right] = 0;
    next[c.left] = next[c.right];
    if (next[c.right] >= 0) prev[next[c.right]] = c.left;
    consider(prev[c.left], c.left);
    consider(c.left, next[c.left]);
  }
  size_t out = 0;
  for (int i = 0; i < n; ++i)
    if (alive[i]) symbols[out++] = symbols[i];
  symbols.resize(out);
}

}  // namespace kvpipe::text
