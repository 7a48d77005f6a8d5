#include "engine/grammar/token_constraint.h"

#include "engine/grammar/regex_dfa.h"
#include "engine/text/tokenizer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string_view>
#include <utility>

namespace kvpipe {
namespace {

// Sorts `items` (indices of distinct `texts` alike in their first `depth` bytes) by their
// texts, most significant byte first: a constraint's spellings are tens of thousands of
// short strings over a few dozen classes, where each comparison of a comparison sort would
// read their shared prefixes again.
void sort_texts(const std::vector<std::string_view>& texts, int32_t* items, size_t n, size_t depth, size_t alphabet,
                int32_t* scratch) {
  if (n < 48) {
    std::sort(items, items + n,
              [&](int32_t a, int32_t b) { return texts[a].substr(depth) < texts[b].substr(depth); });
    return;
  }
  auto key = [&](int32_t x) {
    const std::string_view t = texts[x];
    return depth < t.size() ? 1 + static_cast<size_t>(static_cast<uint8_t>(t[depth])) : 0;
  };
  std::vector<size_t> start(alphabet + 2, 0);
  for (size_t i = 0; i < n; ++i) ++start[key(items[i]) + 1];
  for (size_t b = 0; b <= alphabet; ++b) start[b + 1] += start[b];
  std::vector<size_t> fill(start.begin(), start.end() - 1);
  for (size_t i = 0; i < n; ++i) scratch[fill[key(items[i])]++] = items[i];
  std::copy(scratch, scratch + n, items);
  // Bucket 0 holds the one text that ends here (they are distinct), already in place.
  for (size_t b = 1; b <= alphabet; ++b)
    if (start[b + 1] - start[b] > 1)
      sort_texts(texts, items + start[b], start[b + 1] - start[b], depth + 1, alphabet, scratch);
}

}  // namespace

void TokenVocabulary::index() {
  sorted.clear();
  for (size_t id = 0; id < bytes.size(); ++id)
    if (!bytes[id].empty()) sorted.push_back(static_cast<int32_t>(id));
  std::sort(sorted.begin(), sorted.end(), [&](int32_t a, int32_t b) { return bytes[a] < bytes[b]; });
  sorted_bytes.clear();
  sorted_offset.assign(1, 0);
  for (int32_t id : sorted) {
    sorted_bytes += bytes[id];
    sorted_offset.push_back(static_cast<uint32_t>(sorted_bytes.size()));
  }
}

std::shared_ptr<const TokenVocabulary> TokenVocabulary::of(const Tokenizer& tokenizer, std::vector<int64_t> eos_ids) {
  auto v = std::make_shared<TokenVocabulary>();
  const int64_t n = tokenizer.vocab_size();
  v->bytes.resize(static_cast<size_t>(n));
  for (int64_t id = 0; id < n; ++id)
    if (!tokenizer.is_special(id)) v->bytes[id] = tokenizer.token_bytes(id);
  v->eos_ids = std::move(eos_ids);
  v->strips_leading_space = tokenizer.strips_leading_space();
  v->index();
  return v;
}

void ConstraintStats::observe(Buckets& b, const std::array<double, 12>& bounds, double seconds) {
  size_t i = 0;
  while (i < bounds.size() && seconds > bounds[i]) ++i;
  b.counts[i].fetch_add(1, std::memory_order_relaxed);
  b.sum_ns.fetch_add(static_cast<int64_t>(std::llround(seconds * 1e9)), std::memory_order_relaxed);
}

ConstraintStats::Histogram ConstraintStats::read(const Buckets& b, const std::array<double, 12>& bounds) {
  Histogram h;
  h.bounds.assign(bounds.begin(), bounds.end());
  for (const auto& c : b.counts) h.counts.push_back(c.load(std::memory_order_relaxed));
  h.sum = static_cast<double>(b.sum_ns.load(std::memory_order_relaxed)) * 1e-9;
  return h;
}

void ConstraintStats::observe_mask(double seconds) { observe(mask_, kMaskBounds, seconds); }
void ConstraintStats::observe_compile(double seconds) { observe(compile_, kCompileBounds, seconds); }

void ConstraintStats::add_cached(int64_t bytes, int64_t states) {
  cache_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  cached_states_.fetch_add(states, std::memory_order_relaxed);
}

ConstraintStats::Snapshot ConstraintStats::snapshot() const {
  Snapshot s;
  s.mask = read(mask_, kMaskBounds);
  s.compile = read(compile_, kCompileBounds);
  s.cache_bytes = cache_bytes_.load(std::memory_order_relaxed);
  s.cached_states = cached_states_.load(std::memory_order_relaxed);
  return s;
}

TokenConstraint::TokenConstraint(std::shared_ptr<const RegexDfa> dfa, std::shared_ptr<const TokenVocabulary> vocabulary,
                                 std::shared_ptr<ConstraintStats> stats)
    : dfa_(std::move(dfa)), vocabulary_(std::move(vocabulary)), stats_(std::move(stats)) {
  if (vocabulary_->sorted.empty() && !vocabulary_->bytes.empty())
    throw std::logic_error("TokenConstraint: the vocabulary is not indexed (TokenVocabulary::index)");
  index_spellings();
}

void TokenConstraint::index_spellings() {
  const TokenVocabulary& v = *vocabulary_;
  // Every token's spelling, in the vocabulary's sorted order, in one buffer.
  std::string all(v.sorted_bytes.size(), '\0');
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<char>(dfa_->byte_class(static_cast<uint8_t>(v.sorted_bytes[i])));
  const size_t n = v.sorted.size();
  // Distinct spellings by an open-addressing table of FNV-1a hashes: this runs for every
  // constraint compiled, and a node-based map costs several times more.
  size_t slots = 1;
  while (slots < 2 * n + 2) slots <<= 1;
  std::vector<int32_t> table(slots, -1);
  std::vector<std::string_view> distinct;
  std::vector<int32_t> spelling(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string_view text(all.data() + v.sorted_offset[i], v.sorted_offset[i + 1] - v.sorted_offset[i]);
    uint64_t h = 1469598103934665603ull;
    for (char c : text) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
    size_t slot = static_cast<size_t>(h) & (slots - 1);
    while (table[slot] >= 0 && distinct[table[slot]] != text) slot = (slot + 1) & (slots - 1);
    if (table[slot] < 0) {
      table[slot] = static_cast<int32_t>(distinct.size());
      distinct.push_back(text);
    }
    spelling[i] = table[slot];
  }
  std::vector<int32_t> order(distinct.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = static_cast<int32_t>(k);
  std::vector<int32_t> scratch(order.size());
  sort_texts(distinct, order.data(), order.size(), 0, static_cast<size_t>(dfa_->num_classes()), scratch.data());
  std::vector<int32_t> rank(distinct.size());
  for (size_t k = 0; k < order.size(); ++k) rank[order[k]] = static_cast<int32_t>(k);
  spellings_.clear();
  spelling_offset_.assign(1, 0);
  spelling_shared_.assign(order.size(), 0);
  for (size_t k = 0; k < order.size(); ++k) {
    const std::string_view text = distinct[order[k]];
    if (k > 0) {
      const std::string_view before = distinct[order[k - 1]];
      size_t m = 0;
      while (m < before.size() && m < text.size() && before[m] == text[m]) ++m;
      spelling_shared_[k] = static_cast<int32_t>(m);
    }
    spellings_.append(text.data(), text.size());
    spelling_offset_.push_back(static_cast<uint32_t>(spellings_.size()));
  }
  // The tokens of each spelling, by counting.
  spelling_tokens_.assign(order.size() + 1, 0);
  for (size_t i = 0; i < n; ++i) ++spelling_tokens_[rank[spelling[i]] + 1];
  for (size_t k = 0; k < order.size(); ++k) spelling_tokens_[k + 1] += spelling_tokens_[k];
  tokens_of_.assign(n, 0);
  std::vector<uint32_t> fill(spelling_tokens_.begin(), spelling_tokens_.end() - 1);
  for (size_t i = 0; i < n; ++i) tokens_of_[fill[rank[spelling[i]]]++] = v.sorted[i];
  const int32_t count = static_cast<int32_t>(spelling_shared_.size());
  spelling_jump_.assign(spelling_shared_.size(), count);
  std::vector<int32_t> later;  // the next spellings with ever fewer shared classes
  for (int32_t k = count - 1; k >= 0; --k) {
    while (!later.empty() && spelling_shared_[later.back()] >= spelling_shared_[k]) later.pop_back();
    if (!later.empty()) spelling_jump_[k] = later.back();
    later.push_back(k);
  }
  unspelled_.clear();
  for (size_t id = 0; id < v.bytes.size(); ++id)
    if (v.bytes[id].empty()) unspelled_.push_back(static_cast<int32_t>(id));
  longest_spelling_ = 0;
  starting_with_.assign(static_cast<size_t>(dfa_->num_classes()), 0);
  for (size_t k = 0; k + 1 < spelling_offset_.size(); ++k) {
    longest_spelling_ = std::max<size_t>(longest_spelling_, spelling_offset_[k + 1] - spelling_offset_[k]);
    ++starting_with_[static_cast<uint8_t>(spellings_[spelling_offset_[k]])];
  }
  run_indexes_.clear();
}

TokenConstraint::~TokenConstraint() {
  if (stats_) stats_->add_cached(-cache_bytes_, -static_cast<int64_t>(cache_.size()));
}

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

std::vector<int32_t> TokenConstraint::walk_vocabulary(int32_t state, bool first, int64_t room,
                                                      int32_t* max_end_distance) const {
  std::vector<int32_t> out;
  int32_t farthest = 0;
  const TokenVocabulary& v = *vocabulary_;
  if (first && v.strips_leading_space) {
    // The first token of a SentencePiece output loses its leading space: the sorted order
    // (of the stored bytes) does not hold for what it writes, so each token is walked alone.
    std::string scratch;
    for (int32_t id : v.sorted) {
      const std::string& text = token_text(id, true, &scratch);
      if (text.empty()) continue;
      const int32_t end = dfa_->walk(state, text);
      if (end >= 0 && (room < 0 || dfa_->distance(end) <= room)) {
        out.push_back(id);
        farthest = std::max(farthest, dfa_->distance(end));
      }
    }
    if (max_end_distance) *max_end_distance = farthest;
    return out;
  }
  for (int32_t k : walk_spellings(state, room, &farthest)) append_tokens(k, &out);
  if (max_end_distance) *max_end_distance = farthest;
  return out;
}

const TokenConstraint::RunIndex* TokenConstraint::run_index(int32_t state) const {
  const size_t classes = static_cast<size_t>(dfa_->num_classes());
  const int32_t* row = dfa_->transitions() + static_cast<size_t>(state) * classes;
  std::vector<int32_t> targets(row, row + classes);
  std::sort(targets.begin(), targets.end());
  int32_t target = RegexDfa::kDead;
  size_t most = 0;
  for (size_t i = 0; i < targets.size();) {
    size_t j = i;
    while (j < targets.size() && targets[j] == targets[i]) ++j;
    if (targets[i] != RegexDfa::kDead && j - i > most) {
      most = j - i;
      target = targets[i];
    }
    i = j;
  }
  if (most < 2) return nullptr;
  std::string key(classes, '\0');
  size_t starting = 0;
  for (size_t c = 0; c < classes; ++c)
    if (row[c] == target) {
      key[c] = 1;
      starting += static_cast<size_t>(starting_with_[c]);
    }
  const size_t count = spelling_shared_.size();
  if (count == 0 || 2 * starting < count) return nullptr;
  const auto found = run_indexes_.find(key);
  if (found != run_indexes_.end()) return &found->second;
  RunIndex index;
  for (size_t c = 0; c < classes; ++c)
    if (key[c]) index.group.push_back(static_cast<int32_t>(c));
  index.only.resize(longest_spelling_ + 1);
  // Each spelling's run from the one before: where that one left the group inside the
  // classes the two share, so does this one; otherwise its run goes on from what they share.
  size_t before = 0;
  for (size_t k = 0; k < count; ++k) {
    const char* c = spellings_.data() + spelling_offset_[k];
    const size_t len = spelling_offset_[k + 1] - spelling_offset_[k];
    const size_t shared = static_cast<size_t>(spelling_shared_[k]);
    size_t run = before;
    if (k == 0 || before >= shared) {
      run = k == 0 ? 0 : shared;
      while (run < len && key[static_cast<uint8_t>(c[run])]) ++run;
    }
    if (run == len) {
      index.only[len].push_back(static_cast<int32_t>(k));
    } else {
      index.mixed.push_back(static_cast<int32_t>(k));
      index.run.push_back(static_cast<uint32_t>(run));
    }
    before = run;
  }
  index.only_tokens.assign(index.only.size(), 0);
  for (size_t len = 0; len < index.only.size(); ++len) {
    index.only[len].shrink_to_fit();
    for (int32_t k : index.only[len]) index.only_tokens[len] += spelling_tokens_[k + 1] - spelling_tokens_[k];
  }
  if (stats_) {
    const int64_t bytes = static_cast<int64_t>(count * sizeof(int32_t) + index.mixed.size() * sizeof(uint32_t) +
                                               index.only.size() * sizeof(std::vector<int32_t>) + key.size());
    cache_bytes_ += bytes;
    stats_->add_cached(bytes, 0);
  }
  return &run_indexes_.emplace(std::move(key), std::move(index)).first->second;
}

bool TokenConstraint::walk_runs(int32_t state, int64_t room, SpellingSet* out) const {
  const RunIndex* found = run_index(state);
  if (found == nullptr) return false;
  const RunIndex& index = *found;
  const int32_t* table = dfa_->transitions();
  const int32_t* distance = dfa_->distances();
  const size_t classes = static_cast<size_t>(dfa_->num_classes());
  // chain[d]: the state after any d classes of the group, known up to `known` (where the
  // group's classes part ways, or the chain dies, or the longest spelling ends).
  std::vector<int32_t> chain(longest_spelling_ + 1, RegexDfa::kDead);
  chain[0] = state;
  size_t known = 0;
  while (known < longest_spelling_) {
    const size_t base = static_cast<size_t>(chain[known]) * classes;
    const int32_t next = table[base + static_cast<size_t>(index.group[0])];
    bool same = true;
    for (int32_t c : index.group)
      if (table[base + static_cast<size_t>(c)] != next) {
        same = false;
        break;
      }
    if (!same) break;
    chain[++known] = next;
    if (next == RegexDfa::kDead) break;
  }
  // A chain that parts ways at once leaves the walk of nearly every spelling to do alone.
  if (known < 2 && known < longest_spelling_ && chain[known] != RegexDfa::kDead) return false;
  const size_t count = spelling_shared_.size();
  std::vector<uint64_t>& bits = out->bits;
  bits.assign((count + 63) / 64, 0);
  int32_t farthest = 0;
  size_t tokens = 0;
  const char* flat = spellings_.data();
  // The rest of spelling k from its class `from`, where it is in state `at`.
  auto finish = [&](int32_t k, size_t from, int32_t at) {
    const char* c = flat + spelling_offset_[k];
    const size_t len = spelling_offset_[k + 1] - spelling_offset_[k];
    for (size_t j = from; j < len && at != RegexDfa::kDead; ++j)
      at = table[static_cast<size_t>(at) * classes + static_cast<uint8_t>(c[j])];
    if (at == RegexDfa::kDead || (room >= 0 && distance[at] > room)) return;
    bits[static_cast<size_t>(k) >> 6] |= uint64_t{1} << (k & 63);
    tokens += spelling_tokens_[k + 1] - spelling_tokens_[k];
    farthest = std::max(farthest, distance[at]);
  };
  for (size_t len = 1; len < index.only.size(); ++len) {
    const std::vector<int32_t>& list = index.only[len];
    if (list.empty()) continue;
    if (len <= known) {
      const int32_t end = chain[len];
      if (end == RegexDfa::kDead || (room >= 0 && distance[end] > room)) continue;
      farthest = std::max(farthest, distance[end]);
      tokens += index.only_tokens[len];
      for (int32_t k : list) bits[static_cast<size_t>(k) >> 6] |= uint64_t{1} << (k & 63);
    } else if (chain[known] != RegexDfa::kDead) {
      for (int32_t k : list) finish(k, known, chain[known]);
    }
  }
  for (size_t i = 0; i < index.mixed.size(); ++i) {
    const size_t from = std::min<size_t>(index.run[i], known);
    if (chain[from] != RegexDfa::kDead) finish(index.mixed[i], from, chain[from]);
  }
  out->tokens = tokens;
  out->farthest = farthest;
  return true;
}

std::vector<int32_t> TokenConstraint::SpellingSet::list(bool in, size_t count) const {
  std::vector<int32_t> out;
  for (size_t w = 0; w < bits.size(); ++w) {
    uint64_t x = in ? bits[w] : ~bits[w];
    if (!in && w + 1 == bits.size() && count % 64 != 0) x &= (uint64_t{1} << (count % 64)) - 1;
    for (; x != 0; x &= x - 1) out.push_back(static_cast<int32_t>(w * 64 + static_cast<size_t>(__builtin_ctzll(x))));
  }
  return out;
}

std::vector<int32_t> TokenConstraint::walk_spellings(int32_t state, int64_t room, int32_t* max_end_distance) const {
  std::vector<int32_t> out;
  if (SpellingSet set; walk_runs(state, room, &set)) {
    *max_end_distance = set.farthest;
    return set.list(true, spelling_shared_.size());
  }
  int32_t farthest = 0;
  // states[j] is the state after the first j classes of the previous spelling, valid up to
  // `alive` classes (where it left the language, or its length).
  std::vector<int32_t> states(longest_spelling_ + 1);
  states[0] = state;
  size_t alive = 0;
  const char* flat = spellings_.data();
  const uint32_t* offset = spelling_offset_.data();
  const int32_t* shared_with = spelling_shared_.data();
  const int32_t* jump = spelling_jump_.data();
  int32_t* at = states.data();
  // Held here: stores into `states` could otherwise alias the automaton's own arrays.
  const int32_t* table = dfa_->transitions();
  const int32_t* distance = dfa_->distances();
  const size_t classes = static_cast<size_t>(dfa_->num_classes());
  const size_t count = spelling_shared_.size();
  for (size_t k = 0; k < count; ++k) {
    size_t shared = static_cast<size_t>(shared_with[k]);
    // Those that start with the prefix that left the language, a group at a time.
    while (shared > alive) {
      k = static_cast<size_t>(jump[k]);
      if (k >= count) break;
      shared = static_cast<size_t>(shared_with[k]);
    }
    if (k >= count) break;
    const char* c = flat + offset[k];
    const size_t len = offset[k + 1] - offset[k];
    size_t j = shared;
    for (; j < len; ++j) {
      const int32_t next = table[static_cast<size_t>(at[j]) * classes + static_cast<uint8_t>(c[j])];
      if (next < 0) break;
      at[j + 1] = next;
    }
    alive = j;
    if (j == len) {
      const int32_t d = distance[at[j]];
      if (room < 0 || d <= room) {
        out.push_back(static_cast<int32_t>(k));
        farthest = std::max(farthest, d);
      }
    }
  }
  *max_end_distance = farthest;
  return out;
}

const TokenConstraint::Allowed& TokenConstraint::allowed(int32_t state, bool first) const {
  const int64_t key = static_cast<int64_t>(state) * 2 + (first ? 1 : 0);
  const auto it = cache_.find(key);
  if (it != cache_.end()) return it->second;
  Allowed a;
  const size_t vocab = vocabulary_->bytes.size();
  if (first && vocabulary_->strips_leading_space) {
    a.by_id = true;
    a.items = walk_vocabulary(state, first, -1, &a.max_end_distance);
    // Into id order through a map of the vocabulary: one pass, where a sort of thousands of
    // ids would cost more than the walk.
    std::vector<char> in(vocab, 0);
    for (int32_t id : a.items) in[id] = 1;
    a.rejected = a.items.size() > vocab / 2;
    a.items.clear();
    for (size_t id = 0; id < vocab; ++id)
      if ((in[id] != 0) != a.rejected) a.items.push_back(static_cast<int32_t>(id));
  } else if (SpellingSet set; walk_runs(state, -1, &set)) {
    // Straight from the walk's set of spellings, in whichever form holds fewer.
    a.max_end_distance = set.farthest;
    a.rejected = set.tokens > vocab / 2;
    a.items = set.list(!a.rejected, spelling_shared_.size());
  } else {
    a.items = walk_spellings(state, -1, &a.max_end_distance);
    size_t tokens = 0;
    for (int32_t k : a.items) tokens += spelling_tokens_[k + 1] - spelling_tokens_[k];
    if (tokens > vocab / 2) {
      // The other spellings, by a merge with the ascending allowed ones.
      std::vector<int32_t> others;
      others.reserve(spelling_shared_.size() - a.items.size());
      size_t i = 0;
      for (int32_t k = 0; k < static_cast<int32_t>(spelling_shared_.size()); ++k) {
        if (i < a.items.size() && a.items[i] == k)
          ++i;
        else
          others.push_back(k);
      }
      a.items = std::move(others);
      a.rejected = true;
    }
  }
  a.items.shrink_to_fit();
  if (stats_) {
    // The items, plus what a node of the map costs beside them.
    const int64_t bytes =
        static_cast<int64_t>(a.items.capacity() * sizeof(int32_t) + sizeof(Allowed) + 4 * sizeof(void*));
    cache_bytes_ += bytes;
    stats_->add_cached(bytes, 1);
  }
  return cache_.emplace(key, std::move(a)).first->second;
}

void TokenConstraint::mask(float* logits, int64_t vocab, const int64_t* output, int64_t n, int64_t tokens_left) const {
  if (!stats_) {
    mask_row(logits, vocab, output, n, tokens_left);
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  mask_row(logits, vocab, output, n, tokens_left);
  stats_->observe_mask(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

void TokenConstraint::mask_row(float* logits, int64_t vocab, const int64_t* output, int64_t n,
                               int64_t tokens_left) const {
  constexpr float kBanned = -std::numeric_limits<float>::infinity();
  const int32_t state = state_after(output, n);
  if (state == RegexDfa::kDead) {
    std::fill(logits, logits + vocab, kBanned);
    return;
  }
  const bool first = n == 0;
  const int64_t known = std::min<int64_t>(vocab, static_cast<int64_t>(vocabulary_->bytes.size()));
  // End-of-sequence keeps its own logit where the text is a whole match, and only there.
  std::vector<std::pair<int64_t, float>> ends;
  if (dfa_->accepting(state))
    for (int64_t id : vocabulary_->eos_ids)
      if (id >= 0 && id < vocab) ends.emplace_back(id, logits[id]);
  // Keeps only `ids` of the row.
  auto keep_only = [&](const std::vector<int32_t>& ids) {
    std::vector<float> kept(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) kept[i] = ids[i] < vocab ? logits[ids[i]] : kBanned;
    std::fill(logits, logits + vocab, kBanned);
    for (size_t i = 0; i < ids.size(); ++i)
      if (ids[i] < vocab) logits[ids[i]] = kept[i];
  };
  // Near the end of the budget: only tokens after which a match (and EOS) still fits. Where
  // none would (a budget too small from the start), the plain mask stands.
  const int64_t room = std::max<int64_t>(tokens_left - 2, 0);
  const Allowed& a = allowed(state, first);
  const bool binding = tokens_left >= 0 && a.max_end_distance > room;
  std::vector<int32_t> finishing;
  if (binding) {
    // Many spellings go faster by a walk of them all (which shares their prefixes) than alone.
    if (a.rejected || (!a.by_id && a.items.size() > 64)) {
      finishing = walk_vocabulary(state, first, room);
    } else if (a.by_id) {
      std::string scratch;
      for (int32_t id : a.items)
        if (dfa_->distance(dfa_->walk(state, token_text(id, first, &scratch))) <= room) finishing.push_back(id);
    } else {
      for (int32_t k : a.items) {
        int32_t end = state;
        for (uint32_t j = spelling_offset_[k]; j < spelling_offset_[k + 1] && end >= 0; ++j)
          end = dfa_->next_class(end, static_cast<uint8_t>(spellings_[j]));
        if (end >= 0 && dfa_->distance(end) <= room) append_tokens(k, &finishing);
      }
    }
  }
  if (binding && (!finishing.empty() || !ends.empty())) {
    keep_only(finishing);
  } else if (a.rejected) {
    auto ban = [&](int32_t id) {
      if (id < vocab) logits[id] = kBanned;
    };
    if (a.by_id) {
      for (int32_t id : a.items) ban(id);
    } else {
      for (int32_t k : a.items)
        for (uint32_t t = spelling_tokens_[k]; t < spelling_tokens_[k + 1]; ++t) ban(tokens_of_[t]);
      for (int32_t id : unspelled_) ban(id);
    }
    for (int64_t id = known; id < vocab; ++id) logits[id] = kBanned;  // padding rows of the head
  } else if (a.by_id) {
    keep_only(a.items);
  } else {
    // The allowed spellings' tokens straight from tokens_of_, with no list of ids built.
    std::vector<float> kept;
    for (int32_t k : a.items)
      for (uint32_t t = spelling_tokens_[k]; t < spelling_tokens_[k + 1]; ++t)
        kept.push_back(tokens_of_[t] < vocab ? logits[tokens_of_[t]] : kBanned);
    std::fill(logits, logits + vocab, kBanned);
    size_t i = 0;
    for (int32_t k : a.items)
      for (uint32_t t = spelling_tokens_[k]; t < spelling_tokens_[k + 1]; ++t, ++i)
        if (tokens_of_[t] < vocab) logits[tokens_of_[t]] = kept[i];
  }
  for (int64_t id : vocabulary_->eos_ids)
    if (id >= 0 && id < vocab) logits[id] = kBanned;
  for (const auto& [id, logit] : ends) logits[id] = logit;
}

std::shared_ptr<const TokenConstraint> ConstraintCache::get(const std::string& pattern, int32_t max_states) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = recent_.begin(); it != recent_.end(); ++it)
      if (it->first == pattern) {
        recent_.splice(recent_.begin(), recent_, it);
        return recent_.front().second;
      }
  }
  // Compiled outside the lock: a large schema takes a while, and other requests go on.
  const auto start = std::chrono::steady_clock::now();
  auto made = std::make_shared<const TokenConstraint>(std::make_shared<const RegexDfa>(pattern, max_states), vocabulary_,
                                                      stats_);
  stats_->observe_compile(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  std::lock_guard<std::mutex> lock(mutex_);
  recent_.emplace_front(pattern, made);
  if (recent_.size() > capacity_) recent_.pop_back();
  return made;
}

}  // namespace kvpipe
