#include "engine/scheduler.h"

#include <algorithm>
#include <stdexcept>

namespace kvpipe {

Scheduler::Scheduler(const SchedulerOptions& options, int64_t num_blocks)
    : options_(options), allocator_(num_blocks) {}

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
  const int64_t need = blocks_for_tokens(longest, options_.block_size);
  if (need > allocator_.num_blocks())
    throw std::invalid_argument(who + ": needs " + std::to_string(need) + " KV blocks of " +
                                std::to_string(options_.block_size) + " tokens but the pool has " +
                                std::to_string(allocator_.num_blocks()) +
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

bool Scheduler::grow(Sequence& seq, int64_t tokens) {
  const int64_t need = blocks_for_tokens(tokens, options_.block_size) - static_cast<int64_t>(seq.blocks.size());
  if (need > allocator_.num_free()) return false;
  for (int64_t i = 0; i < need; ++i) seq.blocks.push_back(allocator_.allocate());
  return true;
}

void Scheduler::release(Sequence& seq) {
  for (int32_t b : seq.blocks) allocator_.release(b);
  seq.blocks.clear();
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
    pending_.front()->arrival_time = now;
    waiting_.push_back(pending_.front());
    pending_.erase(pending_.begin());
  }

  const int64_t arrived = static_cast<int64_t>(running_.size() + waiting_.size());
  const int64_t seats = std::min(options_.max_batch, std::max<int64_t>(1, (arrived + micro_batches - 1) / micro_batches));
  StepBatch batch;
  sequences.clear();
  int64_t budget = options_.max_tokens_per_step;
  auto take = [&](Sequence& s, int64_t n) {
    SeqStep st;
    st.request_id = s.request.id;
    st.context_len = s.num_computed;
    st.num_new = n;
    st.sample = s.num_computed + n == static_cast<int64_t>(s.tokens.size());
    st.output_index = s.num_output();
    st.sampling = s.request.sampling;
    st.block_table = s.blocks;
    batch.token_ids.insert(batch.token_ids.end(), s.tokens.begin() + s.num_computed,
                           s.tokens.begin() + s.num_computed + n);
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
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(s.tokens.size()) - s.num_computed, budget);
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
  while (!preempted && !waiting_.empty() && budget > 0 &&
         static_cast<int64_t>(batch.seqs.size()) < seats) {
    Sequence& s = *waiting_.front();
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(s.tokens.size()) - s.num_computed, budget);
    if (!grow(s, s.num_computed + n)) break;
    waiting_.pop_front();
    running_.push_back(&s);
    take(s, n);
  }
  return batch;
}

void Scheduler::update(const StepBatch& computed, const std::vector<Sequence*>& sequences,
                       const StepOutput& output, const std::vector<int64_t>& eos_ids) {
  const auto now = Clock::now();
  size_t sampled = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    Sequence& s = *sequences[i];
    const SeqStep& st = computed.seqs[i];
    s.in_flight = false;
    s.num_computed += st.num_new;
    if (!st.sample) continue;
    const int64_t token = output.tokens.at(sampled++);
    s.tokens.push_back(token);
    if (s.num_output() == 1) s.first_token_time = now;
    s.last_token_time = now;
    const bool eos = !s.request.ignore_eos &&
                     std::find(eos_ids.begin(), eos_ids.end(), token) != eos_ids.end();
    if (eos) s.finish_reason = "stop";
    else if (s.num_output() >= s.request.max_new_tokens ||
             static_cast<int64_t>(s.tokens.size()) >= options_.max_context)
      s.finish_reason = "length";
    if (s.finished()) {
      release(s);
      running_.erase(std::find(running_.begin(), running_.end(), &s));
    }
  }
}

}  // namespace kvpipe
