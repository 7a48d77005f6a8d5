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
// ConstraintStats (shared by the constraints of a ConstraintCache) records what masks and
// compiles cost and what the masks' caches hold, for `/metrics`.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
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
  // The tokens that write something, by their bytes (index() fills them); each constraint
  // spells them in its automaton's byte classes from here.
  std::vector<int32_t> sorted;
  std::string sorted_bytes;             // their bytes one after the other, in that order
  std::vector<uint32_t> sorted_offset;  // where each starts in sorted_bytes (and the end)

  void index();
  static std::shared_ptr<const TokenVocabulary> of(const Tokenizer& tokenizer, std::vector<int64_t> eos_ids);
};

// What constrained decoding costs: the time of each token's mask (state lookup or first
// walk of the vocabulary included) and of each compile, as histograms over fixed bounds, and
// the bytes and states the live constraints' caches of masks hold. Lock-free: the engine's
// thread records masks, request parsers compiles, and any thread reads.
class ConstraintStats {
 public:
  // Upper bounds of the histograms' buckets, in seconds (a last bucket takes the rest).
  static constexpr std::array<double, 12> kMaskBounds = {5e-6,   10e-6,  25e-6,  50e-6, 100e-6, 250e-6,
                                                          500e-6, 1e-3,   2.5e-3, 5e-3,  10e-3,  50e-3};
  static constexpr std::array<double, 12> kCompileBounds = {0.001, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                             0.25,  0.5,   1.0,  2.5,   5.0,  10.0};
  struct Histogram {
    std::vector<double> bounds;
    std::vector<int64_t> counts;  // per bucket (not cumulative), one more than bounds
    double sum = 0.0;
  };
  struct Snapshot {
    Histogram mask, compile;
    int64_t cache_bytes = 0, cached_states = 0;
  };

  void observe_mask(double seconds);
  void observe_compile(double seconds);
  void add_cached(int64_t bytes, int64_t states);  // negative when a constraint goes away
  Snapshot snapshot() const;

 private:
  struct Buckets {
    std::array<std::atomic<int64_t>, 13> counts{};
    std::atomic<int64_t> sum_ns{0};
  };
  static void observe(Buckets& b, const std::array<double, 12>& bounds, double seconds);
  static Histogram read(const Buckets& b, const std::array<double, 12>& bounds);

  Buckets mask_, compile_;
  std::atomic<int64_t> cache_bytes_{0}, cached_states_{0};
};

class TokenConstraint {
 public:
  // `stats`, when given, records this constraint's masks and cache.
  TokenConstraint(std::shared_ptr<const RegexDfa> dfa, std::shared_ptr<const TokenVocabulary> vocabulary,
                  std::shared_ptr<ConstraintStats> stats = nullptr);
  ~TokenConstraint();
  TokenConstraint(const TokenConstraint&) = delete;
  TokenConstraint& operator=(const TokenConstraint&) = delete;

  // Sets to -inf the logits of the tokens ruled out after `output` (its `n` tokens). With
  // `tokens_left` (this one included; -1: no limit), near the end of the budget only tokens
  // that leave room to finish are kept: those after which the fewest bytes to a match,
  // plus end-of-sequence, still fit in what is left (a byte per token at worst, as every
  // byte is a token of the vocabularies served), so that an answer ends as a whole match
  // rather than cut off by max_tokens.
  void mask(float* logits, int64_t vocab, const int64_t* output, int64_t n, int64_t tokens_left = -1) const;

  // The automaton's state after `output`, or RegexDfa::kDead where it left the language.
  int32_t state_after(const int64_t* output, int64_t n) const;

  // The automaton states (first token or later) whose masks the cache holds.
  size_t cached_states() const { return cache_.size(); }

 private:
  // The tokens allowed from a state, as the spellings (indices into spellings_) of the
  // tokens allowed or (`rejected`) of those ruled out, whichever holds fewer tokens; for the
  // first token of a SentencePiece output (`by_id`), as token ids the same way. Kept as
  // spellings, a state's first visit costs the walk alone, with no pass over the vocabulary.
  struct Allowed {
    std::vector<int32_t> items;
    bool by_id = false;
    bool rejected = false;
    int32_t max_end_distance = 0;  // the most bytes to a match after one of them
  };

  void mask_row(float* logits, int64_t vocab, const int64_t* output, int64_t n, int64_t tokens_left) const;
  const std::string& token_text(int64_t id, bool first, std::string* scratch) const;
  const Allowed& allowed(int32_t state, bool first) const;
  // The tokens that keep `state` alive and end where at most `room` bytes remain to a match
  // (-1: any), in no particular order.
  std::vector<int32_t> walk_vocabulary(int32_t state, bool first, int64_t room, int32_t* max_end_distance = nullptr) const;
  // The same as spellings, in ascending order (not for the first token of a SentencePiece
  // output, whose spellings differ).
  std::vector<int32_t> walk_spellings(int32_t state, int64_t room, int32_t* max_end_distance) const;

  // Spellings by how many of their first classes are in a group of classes that a state
  // sends all to one state (the characters of a string, say). From such a state a run of the
  // group goes down one chain of states, whichever classes it is made of, so the spellings
  // of the group alone are settled by their length and the others from where their run
  // ends: a state inside a string, where most of the vocabulary stays alive, costs a pass
  // over lengths and a walk of the few spellings that leave the group, not a walk of all.
  struct RunIndex {
    std::vector<int32_t> group;              // its classes
    std::vector<std::vector<int32_t>> only;  // [length] -> the spellings of the group alone
    std::vector<int32_t> mixed;              // the others
    std::vector<uint32_t> run;               // how many of each one's first classes are in the group
    std::vector<size_t> only_tokens;         // [length] -> the tokens of those spellings
  };
  // Spellings a walk keeps, as bits by spelling, with their tokens and the most bytes to a
  // match after one of them.
  struct SpellingSet {
    std::vector<uint64_t> bits;
    size_t tokens = 0;
    int32_t farthest = 0;
    // The spellings in it (or, `in` false, the others among `count`), ascending.
    std::vector<int32_t> list(bool in, size_t count) const;
  };
  // The index of the largest group of classes `state` sends to one live state, where most
  // spellings start in it (nullptr elsewhere: a walk leaves the others at once).
  const RunIndex* run_index(int32_t state) const;
  // walk_spellings through the run index of `state`; false (and nothing walked) where it has
  // none, or where the group's chain of states parts ways too soon for it to pay.
  bool walk_runs(int32_t state, int64_t room, SpellingSet* out) const;
  // Appends the tokens of spelling `k` to `out`.
  void append_tokens(int32_t k, std::vector<int32_t>* out) const {
    out->insert(out->end(), tokens_of_.begin() + spelling_tokens_[k], tokens_of_.begin() + spelling_tokens_[k + 1]);
  }

  // The tokens' texts spelled in the automaton's byte classes, each distinct spelling once
  // (sorted, with the classes each shares with the one before) and the tokens that spell it:
  // tokens of one spelling go the same way from every state, so a walk steps through each
  // spelling once. Schemas distinguish few bytes, and 49,152 tokens make a few hundred to
  // some thousands of spellings.
  void index_spellings();
  std::string spellings_;                   // the distinct spellings one after the other
  std::vector<uint32_t> spelling_offset_;   // where each starts in spellings_ (and the end)
  std::vector<int32_t> spelling_shared_;    // classes shared with the spelling before
  // The first spelling after each that shares fewer classes with its predecessor: the ones
  // between share that spelling's first classes, so a walk that left the language there
  // skips them in one step.
  std::vector<int32_t> spelling_jump_;
  std::vector<uint32_t> spelling_tokens_;   // where each spelling's tokens start in tokens_of_
  std::vector<int32_t> tokens_of_;
  std::vector<int32_t> unspelled_;  // the tokens that write nothing (special tokens)
  size_t longest_spelling_ = 0;
  std::vector<int32_t> starting_with_;  // [class] -> how many spellings start with it
  mutable std::unordered_map<std::string, RunIndex> run_indexes_;  // by group (a byte per class)

  std::shared_ptr<const RegexDfa> dfa_;
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  mutable std::unordered_map<int64_t, Allowed> cache_;  // (state, first) -> allowed tokens
  std::shared_ptr<ConstraintStats> stats_;
  mutable int64_t cache_bytes_ = 0;  // what cache_ holds, as stats_ counts it
};

// The constraints of the patterns recently asked for, so that requests with the same schema
// or regex share one automaton and one cache of masks (the first request pays for a state's
// mask, the next ones look it up). Thread-safe: request parsers on several threads get from
// it; the constraints it hands out are then used by the engine's thread alone.
class ConstraintCache {
 public:
  ConstraintCache(std::shared_ptr<const TokenVocabulary> vocabulary, size_t capacity = 64)
      : vocabulary_(std::move(vocabulary)), capacity_(capacity), stats_(std::make_shared<ConstraintStats>()) {}

  // The constraint of `pattern`, compiled on first use (std::invalid_argument as RegexDfa).
  std::shared_ptr<const TokenConstraint> get(const std::string& pattern, int32_t max_states);

  // What its constraints cost (those it handed out, also after it dropped them).
  std::shared_ptr<const ConstraintStats> stats() const { return stats_; }

 private:
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  size_t capacity_;
  std::shared_ptr<ConstraintStats> stats_;
  std::mutex mutex_;
  std::list<std::pair<std::string, std::shared_ptr<const TokenConstraint>>> recent_;  // most recent first
};

}  // namespace kvpipe
