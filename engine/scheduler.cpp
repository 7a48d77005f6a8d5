#include "engine/scheduler.h"

#include "engine/speculative/draft_proposer.h"

#include <algorithm>
#include <stdexcept>

namespace kvpipe {

Scheduler::Scheduler(const SchedulerOptions& options, int64_t num_blocks)
    : options_(options), blocks_(num_blocks, options.block_size, options.prefix_reuse) {}

int64_t Scheduler::max_blocks_held(int64_t tokens) const {
  const int64_t bs = options_.block_size;
  const int64_t all = blocks_for_tokens(tokens, bs);
  if (options_.window_recent <= 0) return all;
  // Sinks, the window, and the chunk being computed (its queries reach back `recent`); one
  // more block on each side for positions that do not start a block.
  const int64_t chunk = std::min({options_.max_tokens_per_step, options_.window_recent, tokens});
  const int64_t windowed = blocks_for_tokens(options_.window_sinks, bs) +
                           blocks_for_tokens(options_.window_recent + chunk, bs) + 2;
  return std::min(all, windowed);
}

int64_t Scheduler::max_request_tokens() const {
  // add() accepts a request when its longest sequence (prompt + outputs - 1) fits.
  int64_t lo = 1, hi = options_.max_context;
  if (max_blocks_held(lo) > blocks_.num_blocks()) return 0;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (max_blocks_held(mid) <= blocks_.num_blocks()) lo = mid;
    else hi = mid - 1;
  }
  return std::min(lo + 1, options_.max_context);
}

void Scheduler::erase_finished() {
  all_.erase(std::remove_if(all_.begin(), all_.end(),
                            [](const std::unique_ptr<Sequence>& s) { return s->finished() && !s->in_flight; }),
             all_.end());
}

Sequence* Scheduler::add(const Request& r) {
  const std::string who = "request " + std::to_string(r.id);
  const int64_t prompt = static_cast<int64_t>(r.prompt.size());
  if (prompt == 0) throw std::invalid_argument(who + ": empty prompt");
  if (r.max_new_tokens < 1) throw std::invalid_argument(who + ": max_new_tokens must be at least 1");
  if (prompt >= options_.max_context)
    throw std::invalid_argument(who + ": prompt of " + std::to_string(prompt) +
                                " tokens does not fit the model's context of " +
                                std::to_string(options_.max_context) + " tokens");
  // The last sampled token is never fed back, so a finished sequence holds one token less
  // than it outputs.
  const int64_t longest = std::min(prompt + r.max_new_tokens - 1, options_.max_context);
  const int64_t need = max_blocks_held(longest);
  if (need > blocks_.num_blocks())
    throw std::invalid_argument(who + ": needs " + std::to_string(need) + " KV blocks of " +
                                std::to_string(options_.block_size) + " tokens but the pool has " +
                                std::to_string(blocks_.num_blocks()) +
                                " (raise cache.memory or lower max_new_tokens)");
  auto seq = std::make_unique<Sequence>();
  seq->request = r;
  seq->tokens = r.prompt;
  Sequence* p = seq.get();
  all_.push_back(std::move(seq));
  // Stable by arrival step, so requests of the same step keep their order.
  auto at = std::upper_bound(pending_.begin(), pending_.end(), r.arrival_step,
                             [](int64_t s, const Sequence* q) { return s < q->request.arrival_step; });
  pending_.insert(at, p);
  return p;
}

int64_t Scheduler::chunk_of(const Sequence& seq, int64_t budget) const {
  int64_t n = std::min<int64_t>(static_cast<int64_t>(seq.tokens.size()) - seq.num_computed, budget);
  // Under a window a chunk's queries reach `recent` back from its first token: chunks of at
  // most `recent` tokens keep the blocks a sequence holds bounded whatever its length.
  if (options_.window_recent > 0) n = std::min(n, options_.window_recent);
  return n;
}

bool Scheduler::grow(Sequence& seq, int64_t tokens) {
  const int64_t need = blocks_for_tokens(tokens, options_.block_size) - static_cast<int64_t>(seq.blocks.size());
  if (need > blocks_.num_available()) return false;
  for (int64_t i = 0; i < need; ++i) seq.blocks.push_back(blocks_.allocate());
  stats_.peak_blocks_used = std::max(stats_.peak_blocks_used, blocks_.num_used());
  return true;
}

void Scheduler::release(Sequence& seq) {
  for (int32_t b : seq.blocks)
    if (b >= 0) blocks_.release(b);
  seq.blocks.clear();
  seq.hashed_blocks = 0;
  seq.last_hash = 0;
}

void Scheduler::admit_prefix(Sequence& seq) {
  if (!seq.blocks.empty() || seq.num_computed != 0) return;
  // At least the last token is computed, since its logits are what the step is for.
  const int64_t len = static_cast<int64_t>(seq.tokens.size());
  const std::vector<int32_t> hit = blocks_.match_prefix(seq.tokens, (len - 1) / options_.block_size, len);
  for (int32_t b : hit) {
    seq.last_hash = BlockManager::chain_hash(seq.last_hash, seq.tokens.data() + seq.blocks.size() * options_.block_size,
                                             options_.block_size);
    seq.blocks.push_back(b);
  }
  seq.hashed_blocks = static_cast<int64_t>(hit.size());
  seq.num_computed = static_cast<int64_t>(hit.size()) * options_.block_size;
  if (seq.preemptions == 0) seq.cached_tokens = seq.num_computed;
}

void Scheduler::after_compute(Sequence& seq) {
  const int64_t bs = options_.block_size;
  while ((seq.hashed_blocks + 1) * bs <= seq.num_computed) {
    const int64_t k = seq.hashed_blocks;
    const int64_t* t = seq.tokens.data() + k * bs;
    seq.last_hash = BlockManager::chain_hash(seq.last_hash, t, bs);
    if (seq.blocks[k] >= 0) blocks_.insert(seq.last_hash, seq.blocks[k], t);
    ++seq.hashed_blocks;
  }
  if (options_.window_recent <= 0) return;
  // The next query sits at num_computed and sees back to num_computed - recent + 1; a block
  // of no sink and wholly before that is never read again.
  const int64_t lowest = seq.num_computed - options_.window_recent + 1;
  for (int64_t k = blocks_for_tokens(options_.window_sinks, bs);
       k < static_cast<int64_t>(seq.blocks.size()) && (k + 1) * bs <= lowest; ++k) {
    if (seq.blocks[k] < 0) continue;
    blocks_.release(seq.blocks[k]);
    seq.blocks[k] = -1;
  }
}

std::vector<int64_t> Scheduler::draft_for(Sequence& seq, int64_t budget) {
  const SpeculativeOptions& o = options_.speculative;
  if (!o.enabled() || num_running() > o.max_batch) return {};
  const int64_t len = static_cast<int64_t>(seq.tokens.size());
  if (seq.num_output() == 0 || len - seq.num_computed != 1) return {};
  // Never more tokens than max_new_tokens or the context allow, counting the model's own
  // token after the draft.
  int64_t k = std::min({o.num_tokens, seq.request.max_new_tokens - seq.num_output() - 1,
                        options_.max_context - len - 1, budget - 1});
  if (options_.window_recent > 0) k = std::min(k, options_.window_recent - 1);
  if (k <= 0) return {};
  if (!seq.spec_gate.open()) {
    seq.spec_gate.step_without_draft();
    return {};
  }
  std::vector<int64_t> draft;
  seq.draft_probs.clear();
  // Blocks for the draft only where they are free: it must never preempt anyone. A draft
  // model's pass is paid only once they are.
  if (o.draft_model != nullptr) {
    if (!grow(seq, len + seq.spec_gate.length(k))) return {};
    DraftTokens d = o.draft_model->propose(seq.request.id, seq.tokens, seq.spec_gate.length(k),
                                           seq.request.sampling, seq.num_output());
    draft = std::move(d.tokens);
    seq.draft_probs = std::move(d.probs);
  } else {
    draft = propose_ngram(seq.tokens, o.ngram_min, o.ngram_max, seq.spec_gate.length(k));
  }
  if (!draft.empty() && !grow(seq, len + static_cast<int64_t>(draft.size()))) draft.clear();
  if (draft.empty()) seq.draft_probs.clear();
  return draft;
}

void Scheduler::preempt(Sequence& seq) {
  release(seq);
  stats_.recomputed_tokens += seq.num_computed;
  seq.num_computed = 0;
  ++seq.preemptions;
  ++stats_.preemptions;
  running_.erase(std::find(running_.begin(), running_.end(), &seq));
  waiting_.push_front(&seq);
}

StepBatch Scheduler::schedule(int64_t step, std::vector<Sequence*>& sequences, int64_t micro_batches) {
  const auto now = Clock::now();
  while (!pending_.empty() && pending_.front()->request.arrival_step <= step) {
    const Clock::time_point given = pending_.front()->request.arrival_time;
    pending_.front()->arrival_time = given == Clock::time_point{} ? now : given;
    waiting_.push_back(pending_.front());
    pending_.erase(pending_.begin());
  }

  const int64_t arrived = static_cast<int64_t>(running_.size() + waiting_.size());
  const int64_t seats = std::min(options_.max_batch, std::max<int64_t>(1, (arrived + micro_batches - 1) / micro_batches));
  StepBatch batch;
  batch.full_sequences = options_.full_sequences;
  batch.window_sinks = options_.window_sinks;
  batch.window_recent = options_.window_recent;
  sequences.clear();
  int64_t budget = options_.max_tokens_per_step;
  // Prompt tokens allowed beside running decodes (those in flight count: their next token
  // waits for this micro-batch too in a pipeline).
  int64_t prefill_budget = budget;
  const auto decoding = [](const Sequence* s) {
    return s->num_output() > 0 && static_cast<int64_t>(s->tokens.size()) - s->num_computed == 1;
  };
  if (options_.max_prefill_tokens_per_step > 0 && std::any_of(running_.begin(), running_.end(), decoding))
    prefill_budget = options_.max_prefill_tokens_per_step;
  auto is_prefill = [](const Sequence& s) { return static_cast<int64_t>(s.tokens.size()) - s.num_computed > 1; };
  auto take = [&](Sequence& s, int64_t n) {
    if (is_prefill(s)) prefill_budget -= n;
    if (s.scheduled_time == Clock::time_point{}) s.scheduled_time = now;
    SeqStep st;
    st.request_id = s.request.id;
    const int64_t drafted = static_cast<int64_t>(s.draft.size());
    st.context_len = s.num_computed;
    st.num_new = n;
    st.sample = s.num_computed + n - drafted == static_cast<int64_t>(s.tokens.size());
    st.num_sampled = 1 + drafted;
    st.output_index = s.num_output();
    st.sampling = s.request.sampling;
    st.block_table = s.blocks;
    batch.token_ids.insert(batch.token_ids.end(),
                           s.tokens.begin() + (options_.full_sequences ? 0 : s.num_computed),
                           s.tokens.begin() + s.num_computed + n - drafted);
    batch.token_ids.insert(batch.token_ids.end(), s.draft.begin(), s.draft.end());
    batch.seqs.push_back(std::move(st));
    sequences.push_back(&s);
    s.in_flight = true;
    budget -= n;
  };
  // The most recently admitted sequence that is not in flight.
  auto victim = [&]() -> Sequence* {
    for (auto it = running_.rbegin(); it != running_.rend(); ++it)
      if (!(*it)->in_flight) return *it;
    return nullptr;
  };

  bool preempted = false;
  std::vector<Sequence*> candidates;
  for (Sequence* s : running_)
    if (!s->in_flight) candidates.push_back(s);
  for (Sequence* cand : candidates) {
    if (budget <= 0 || static_cast<int64_t>(batch.seqs.size()) >= seats) break;
    Sequence& s = *cand;
    if (std::find(running_.begin(), running_.end(), &s) == running_.end()) continue;  // preempted above
    const bool prefill = is_prefill(s);
    if (prefill && prefill_budget <= 0) continue;
    int64_t n = chunk_of(s, prefill ? std::min(budget, prefill_budget) : budget);
    s.draft = prefill ? std::vector<int64_t>{} : draft_for(s, budget);
    n += static_cast<int64_t>(s.draft.size());
    bool stalled = false;
    while (!grow(s, s.num_computed + n)) {
      Sequence* v = victim();
      if (v == nullptr) {  // everything else is in flight: wait for it to come back
        stalled = true;
        break;
      }
      preempt(*v);
      preempted = true;
      if (v == &s) {
        stalled = true;
        break;
      }
    }
    if (stalled) continue;
    take(s, n);
  }

  // New admissions only when nothing had to be preempted: admitting would just thrash.
  while (!preempted && !waiting_.empty() && budget > 0 && prefill_budget > 0 &&
         static_cast<int64_t>(batch.seqs.size()) < seats) {
    Sequence& s = *waiting_.front();
    s.draft.clear();
    s.draft_probs.clear();
    admit_prefix(s);
    const int64_t n = chunk_of(s, is_prefill(s) ? std::min(budget, prefill_budget) : budget);
    if (!grow(s, s.num_computed + n)) {
      release(s);  // give the prefix back: it may wait a long time
      s.num_computed = 0;
      break;
    }
    waiting_.pop_front();
    running_.push_back(&s);
    take(s, n);
  }
  return batch;
}

void Scheduler::update(const StepBatch& computed, const std::vector<Sequence*>& sequences,
                       const StepOutput& output, const std::vector<int64_t>& eos_ids) {
  update(computed, sequences, kept_tokens(computed, sequences, output), eos_ids);
}

std::vector<std::vector<int64_t>> Scheduler::kept_tokens(const StepBatch& computed,
                                                         const std::vector<Sequence*>& sequences,
                                                         const StepOutput& output) {
  std::vector<std::vector<int64_t>> kept(sequences.size());
  size_t row = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const SeqStep& st = computed.seqs[i];
    if (!st.sample) continue;
    if (row + st.num_sampled > output.tokens.size())
      throw std::logic_error("a micro-batch came back with fewer sampled rows than it computed");
    const int64_t* rows = output.tokens.data() + row;
    row += st.num_sampled;
    kept[i].assign(rows, rows + accepted_length(sequences[i]->draft, rows, st.num_sampled));
  }
  return kept;
}

void Scheduler::finish_now(Sequence& s, const std::string& reason) {
  s.finish_reason = reason;
  if (options_.speculative.draft_model != nullptr) options_.speculative.draft_model->forget(s.request.id);
  ++finished_;
  release(s);
  running_.erase(std::find(running_.begin(), running_.end(), &s));
}

void Scheduler::update(const StepBatch& computed, const std::vector<Sequence*>& sequences,
                       const std::vector<std::vector<int64_t>>& kept, const std::vector<int64_t>& eos_ids) {
  const auto now = Clock::now();
  for (size_t i = 0; i < sequences.size(); ++i) {
    Sequence& s = *sequences[i];
    const SeqStep& st = computed.seqs[i];
    s.in_flight = false;
    stats_.computed_tokens += st.num_new;
    if (!st.sample) {
      s.num_computed += st.num_new;
      after_compute(s);
      if (!s.finish_requested.empty()) finish_now(s, s.finish_requested);
      continue;
    }
    const std::vector<int64_t>& tokens = kept.at(i);
    if (tokens.empty() || static_cast<int64_t>(tokens.size()) > st.num_sampled)
      throw std::logic_error("request " + std::to_string(s.request.id) + " keeps " +
                             std::to_string(tokens.size()) + " of " + std::to_string(st.num_sampled) +
                             " sampled tokens");
    const std::vector<int64_t> draft = std::move(s.draft);
    s.draft.clear();
    s.draft_probs.clear();
    // Positions before the sampled rows, and those of the rows whose tokens are kept (row r
    // was computed from the draft's first r tokens): their K/V is what the model alone writes.
    const int64_t computed_now = st.context_len + st.num_new - st.num_sampled + static_cast<int64_t>(tokens.size());
    if (!draft.empty()) {
      int64_t accepted = 0;
      while (accepted < static_cast<int64_t>(std::min(draft.size(), tokens.size())) &&
             tokens[accepted] == draft[accepted])
        ++accepted;
      ++s.spec_drafts;
      ++stats_.spec_drafts;
      s.spec_draft_tokens += static_cast<int64_t>(draft.size());
      stats_.spec_draft_tokens += static_cast<int64_t>(draft.size());
      s.spec_accepted_tokens += accepted;
      stats_.spec_accepted_tokens += accepted;
      if (stats_.spec_accepted_at.size() < draft.size()) stats_.spec_accepted_at.resize(draft.size(), 0);
      for (int64_t r = 0; r < accepted; ++r) ++stats_.spec_accepted_at[r];
      s.spec_gate.record(static_cast<int64_t>(draft.size()), accepted);
    }
    for (size_t r = 0; r < tokens.size() && !s.finished(); ++r) {
      const int64_t token = tokens[r];
      if (token == kNonFiniteToken) {
        s.error = "non-finite logits at step " + std::to_string(st.output_index + static_cast<int64_t>(r));
        finish_now(s, "error");
        break;
      }
      s.tokens.push_back(token);
      if (s.num_output() == 1) s.first_token_time = now;
      s.last_token_time = now;
      const bool eos = !s.request.ignore_eos &&
                       std::find(eos_ids.begin(), eos_ids.end(), token) != eos_ids.end();
      const bool last = r + 1 == tokens.size();
      if (last && !s.finish_requested.empty()) finish_now(s, s.finish_requested);
      else if (eos) finish_now(s, "stop");
      else if (s.num_output() >= s.request.max_new_tokens ||
               static_cast<int64_t>(s.tokens.size()) >= options_.max_context)
        finish_now(s, "length");
    }
    if (s.finished()) continue;
    s.num_computed = computed_now;
    after_compute(s);
    // A rejected draft's blocks beyond the sequence's tokens go back to the pool.
    const size_t holds = static_cast<size_t>(blocks_for_tokens(static_cast<int64_t>(s.tokens.size()), options_.block_size));
    while (s.blocks.size() > holds) {
      if (s.blocks.back() >= 0) blocks_.release(s.blocks.back());
      s.blocks.pop_back();
    }
  }
}

bool Scheduler::finish(int64_t request_id, const std::string& reason) {
  auto it = std::find_if(all_.begin(), all_.end(), [&](const std::unique_ptr<Sequence>& q) {
    return q->request.id == request_id && !q->finished();
  });
  if (it == all_.end()) return false;
  Sequence& s = **it;
  if (s.in_flight) {
    s.finish_requested = reason;
    return true;
  }
  s.finish_reason = reason;
  if (options_.speculative.draft_model != nullptr) options_.speculative.draft_model->forget(s.request.id);
  ++finished_;
  release(s);
  for (auto* list : {&pending_, &running_}) {
    auto at = std::find(list->begin(), list->end(), &s);
    if (at != list->end()) list->erase(at);
  }
  auto at = std::find(waiting_.begin(), waiting_.end(), &s);
  if (at != waiting_.end()) waiting_.erase(at);
  return true;
}

}  // namespace kvpipe
