// SentencePiece-style merging by score, as llama.cpp's llm_tokenizer_spm does it: the text
// (spaces already escaped to U+2581) starts as one symbol per UTF-8 character, the adjacent
// pair whose concatenation is the highest-scoring vocabulary entry merges first, and a final
// symbol that is no entry is re-split along the merges that built it, down to byte tokens.
//
// Guarantees: ids equal llama.cpp's for the same vocabulary and scores, ties included (the
// leftmost pair wins); the model is immutable after construction and safe across threads.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvpipe::text {

class SpmModel {
 public:
  SpmModel() = default;
  // `byte_ids[b]`: the id of the byte token for byte b (<0xXX>, else the 1-byte text), -1 if none.
  SpmModel(const std::unordered_map<std::string, int64_t>* token_ids, std::vector<float> scores,
           std::vector<int64_t> byte_ids);

  void encode(std::string_view text, std::vector<int64_t>& out) const;

 private:
  int64_t lookup(std::string_view text) const;

  const std::unordered_map<std::string, int64_t>* token_ids_ = nullptr;  // owned by the tokenizer
  std::vector<float> scores_;
  std::vector<int64_t> byte_ids_;
};

}  // namespace kvpipe::text
