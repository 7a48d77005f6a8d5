// Byte-pair merging by rank, the core both llama.cpp's llm_tokenizer_bpe and Hugging Face's
// BPE model share: a word starts as a list of symbols, and the adjacent pair with the lowest
// merge rank (leftmost first among equals) is merged until no listed pair remains. A priority
// queue over a linked list of symbols keeps it O(n log n) in the word's length.
//
// Guarantees: symbols are interned strings (vocabulary entries keep their ids; merge parts and
// results outside the vocabulary get ids from vocab_size() up), so merging compares integers;
// the model is immutable after construction and merge() keeps its state on the caller's
// stack, so one model serves many threads.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvpipe::text {

struct BpeSymbol {
  int32_t id = -1;     // interned symbol, -1: takes part in no merge
  uint32_t begin = 0;  // byte range in the word
  uint32_t end = 0;
};

class BpeModel {
 public:
  BpeModel() = default;
  // `tokens`: id -> text (duplicates keep the first id); merges in rank order.
  BpeModel(const std::vector<std::string>& tokens,
           const std::vector<std::pair<std::string, std::string>>& merges);

  int64_t vocab_size() const { return vocab_size_; }
  // The vocabulary id of `text`, -1 when absent.
  int64_t token_id(std::string_view text) const;
  // The interned id of `text` (vocabulary or merge part), -1 when unknown.
  int32_t symbol_id(std::string_view text) const;
  const std::string& symbol_text(int32_t id) const { return symbols_[id]; }
  size_t merge_count() const { return ranks_.size(); }

  // Merges `symbols` in place; the survivors stay in order.
  void merge(std::vector<BpeSymbol>& symbols) const;

 private:
  struct Merge {
    int32_t rank;
    int32_t result;
  };
  static uint64_t key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  int32_t intern(const std::string& text);

  int64_t vocab_size_ = 0;
  std::vector<std::string> symbols_;
  std::unordered_map<std::string, int32_t> ids_;
  std::unordered_map<uint64_t, Merge> ranks_;
};

}  // namespace kvpipe::text
