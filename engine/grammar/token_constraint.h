// TokenConstraint: which tokens an output may take next so that its text stays the start of
// a match of a regular expression (RegexDfa), and end-of-sequence exactly where the text is
// a whole match: the mask that structured outputs (`choice`, `regex`) apply before sampling.
//
// Owns the vocabulary's bytes (shared by every constraint of a model) and, per constraint, a
// cache of the allowed tokens of each automaton state it has visited (xgrammar's design for
// the regular case: every token's fate depends on the state alone, so after the first visit a
// step costs a lookup and one pass over the row). Guarantees: special tokens never match
// text; a SentencePiece tokenizer's first output token is matched without the leading space
// its decoding drops; the output's state is recomputed from its tokens, so preemption and
// recomputation need no saved state. Used by one thread at a time (the engine's).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvpipe {

class RegexDfa;
class Tokenizer;

struct TokenVocabulary {
  std::vector<std::string> bytes;  // what each token writes into the text ("" for special tokens)
  std::vector<int64_t> eos_ids;    // end-of-sequence: allowed where the text is a whole match
  bool strips_leading_space = false;

  static std::shared_ptr<const TokenVocabulary> of(const Tokenizer& tokenizer, std::vector<int64_t> eos_ids);
};

class TokenConstraint {
 public:
  TokenConstraint(std::shared_ptr<const RegexDfa> dfa, std::shared_ptr<const TokenVocabulary> vocabulary);

  // Sets to -inf the logits of the tokens ruled out after `output` (its `n` tokens). With
  // `tokens_left` (this one included; -1: no limit), near the end of the budget only tokens
  // that leave room to finish are kept: those after which the fewest bytes to a match,
  // plus end-of-sequence, still fit in what is left (a byte per token at worst, as every
  // byte is a token of the vocabularies served), so that an answer ends as a whole match
  // rather than cut off by max_tokens.
  void mask(float* logits, int64_t vocab, const int64_t* output, int64_t n, int64_t tokens_left = -1) const;

  // The automaton's state after `output`, or RegexDfa::kDead where it left the language.
  int32_t state_after(const int64_t* output, int64_t n) const;

  // Tokens the cache holds masks for, and its bytes.
  size_t cached_states() const { return cache_.size(); }
  size_t cache_bytes() const;

 private:
  const std::string& token_text(int64_t id, bool first, std::string* scratch) const;
  const std::vector<uint64_t>& allowed(int32_t state, bool first) const;

  std::shared_ptr<const RegexDfa> dfa_;
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  mutable std::unordered_map<int64_t, std::vector<uint64_t>> cache_;  // (state, first) -> bit per token
};

}  // namespace kvpipe
