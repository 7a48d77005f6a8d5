#include "engine/text/spm_model.h"

#include "engine/text/unicode_text.h"

#include <algorithm>
#include <map>
#include <queue>
#include <string>
#include <utility>

namespace kvpipe::text {

SpmModel::SpmModel(const std::unordered_map<std::string, int64_t>* token_ids, std::vector<float> scores,
                   std::vector<int64_t> byte_ids)
    : token_ids_(token_ids), scores_(std::move(scores)), byte_ids_(std::move(byte_ids)) {}

int64_t SpmModel::lookup(std::string_view text) const {
  const auto it = token_ids_->find(std::string(text));
  return it == token_ids_->end() ? -1 : it->second;
}

void SpmModel::encode(std::string_view text, std::vector<int64_t>& out) const {
  struct Symbol {
    int prev, next;
    size_t begin, n;
  };
  std::vector<Symbol> symbols;
  for (size_t offs = 0; offs < text.size();) {
    const size_t n = std::min(utf8_length(text[offs]), text.size() - offs);
    const int index = static_cast<int>(symbols.size());
    symbols.push_back({index - 1, offs + n == text.size() ? -1 : index + 1, offs, n});
    offs += n;
  }

  struct Bigram {
    int left, right;
    float score;
    size_t size;
    bool operator<(const Bigram& o) const {  // top: highest score, then leftmost
      return score < o.score || (score == o.score && left > o.left);
    }
  };
  std::priority_queue<Bigram> queue;
  // Last writer wins, as in llama.cpp: re-splitting follows the most recent pair of a text.
  std::map<std::string, std::pair<int, int>> rev_merge;
  auto try_add = [&](int left, int right) {
    if (left == -1 || right == -1) return;
    const std::string piece(text.substr(symbols[left].begin, symbols[left].n + symbols[right].n));
    const int64_t id = lookup(piece);
    if (id < 0 || id >= static_cast<int64_t>(scores_.size())) return;
    queue.push({left, right, scores_[id], piece.size()});
    rev_merge[piece] = {left, right};
  };
  for (int i = 1; i < static_cast<int>(symbols.size()); ++i) try_add(i - 1, i);

  while (!queue.empty()) {
    const Bigram b = queue.top();
    queue.pop();
    Symbol& l = symbols[b.left];
    Symbol& r = symbols[b.right];
    if (l.n == 0 || r.n == 0 || l.n + r.n != b.size) continue;
    l.n += r.n;
    r.n = 0;
    l.next = r.next;
    if (r.next >= 0) symbols[r.next].prev = b.left;
    try_add(l.prev, b.left);
    try_add(b.left, l.next);
  }

  // Re-split a symbol that is no vocabulary entry along the merges that made it.
  auto resegment = [&](auto&& self, const Symbol& s) -> void {
    const std::string_view piece = text.substr(s.begin, s.n);
    const int64_t id = lookup(piece);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
    const auto p = rev_merge.find(std::string(piece));
    if (p == rev_merge.end()) {
      for (size_t j = 0; j < s.n; ++j) {
        const int64_t byte = byte_ids_[static_cast<uint8_t>(text[s.begin + j])];
        if (byte >= 0) out.push_back(byte);
      }
      return;
    }
    self(self, symbols[p->second.first]);
    self(self, symbols[p->second.second]);
  };
  if (symbols.empty()) return;
  for (int i = 0; i != -1; i = symbols[i].next) resegment(resegment, symbols[i]);
}

}  // namespace kvpipe::text
