// Scheduler: continuous batching of requests over the coordinator's KV blocks.
//
// Decides, step by step, which sequences compute how many tokens: running sequences first
// (one token when decoding, the next chunk of their prompt otherwise), then waiting
// sequences in arrival order while the batch has seats (scheduler.max_batch), tokens
// (scheduler.max_tokens_per_step, long prompts are split into chunks) and free blocks. A
// request that can never fit in the pool is refused when it is added; one that does not fit
// now waits. When a running sequence needs a block and none is free, the most recently
// admitted sequence is preempted: its blocks are freed and it later resumes by recomputing
// its prompt and the tokens it already generated, so its output does not change.
//
// KV-cache policies live here too, since they decide which blocks a sequence holds:
// prefix reuse (a new request starts after the longest cached prefix, BlockManager), the
// window (blocks that fall wholly outside the first `sinks` and the last `recent` positions
// are freed as the sequence grows, leaving holes (-1) in its block table), and layer-level
// reuse (batches carry every token of each sequence, for the layers that keep no K/V).
#pragma once

#include "cache/block_manager.h"
#include "engine/logits_processor.h"
#include "engine/sampler.h"
#include "engine/speculative/ngram_proposer.h"
#include "engine/step_batch.h"

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

namespace kvpipe {

using Clock = std::chrono::steady_clock;

struct Request {
  int64_t id = 0;
  std::vector<int64_t> prompt;
  int64_t max_new_tokens = 16;
  int64_t arrival_step = 0;
  // When set, the time the request arrived, which may precede the step that first sees it
  // (requests fed while the engine runs); otherwise the time of that step.
  Clock::time_point arrival_time{};
  SamplingParams sampling;
  // Penalties, bias, banned words, min_tokens: applied on the coordinator (logits_processor.h).
  LogitsProcessing processing;
  bool ignore_eos = false;
  bool want_logits = false;         // the raw logits of every sampled token (log-probabilities)
};

struct Sequence {
  Request request;
  std::vector<int64_t> tokens;      // prompt, then generated tokens
  int64_t num_computed = 0;         // leading tokens whose K/V are in the cache
  std::vector<int32_t> blocks;      // block of each block_size tokens; -1 once freed by the window
  int64_t hashed_blocks = 0;        // leading full blocks offered to the prefix cache
  uint64_t last_hash = 0;           // chain hash of block hashed_blocks - 1
  std::string finish_reason;        // empty while running
  std::string error;                // why, when finish_reason is "error"
  std::string finish_requested;     // finish() asked while in flight: applied on its return
  int64_t preemptions = 0;
  int64_t cached_tokens = 0;        // prompt tokens found in the prefix cache when first admitted
  bool in_flight = false;           // part of a micro-batch whose tokens have not come back
  Clock::time_point arrival_time{}, first_token_time{}, last_token_time{};
  Clock::time_point scheduled_time{};  // first put into a micro-batch (end of its queue time)
  // Speculative decoding (engine/speculative/ngram_proposer.h): the draft its micro-batch in
  // flight verifies, and what its drafts have given so far.
  std::vector<int64_t> draft;
  // A draft model's distribution of each draft token, for a sampled request (empty otherwise:
  // a token is then kept while it equals the model's own draw).
  std::vector<Candidates> draft_probs;
  int64_t spec_drafts = 0;          // steps that verified a draft
  int64_t spec_draft_tokens = 0;    // draft tokens verified
  int64_t spec_accepted_tokens = 0; // draft tokens kept in the output
  SpeculationGate spec_gate;

  int64_t num_output() const { return static_cast<int64_t>(tokens.size() - request.prompt.size()); }
  bool finished() const { return !finish_reason.empty(); }
};

struct SchedulerOptions {
  int64_t block_size = 16;
  int64_t max_batch = 32;
  int64_t max_tokens_per_step = 2048;
  // While any sequence decodes, prompt chunks (and recomputation) of one micro-batch take at
  // most this many tokens, so that a long prompt does not stretch the running requests' next
  // token (Sarathi-style chunked prefill). 0: only max_tokens_per_step limits them.
  int64_t max_prefill_tokens_per_step = 0;
  int64_t max_context = 2048;       // the model's context length
  bool prefix_reuse = false;
  int64_t window_sinks = 0;
  int64_t window_recent = 0;        // 0: no window
  bool full_sequences = false;      // some layers keep no K/V: send every token each step
  // Decoding sequences verify drafts of up to num_tokens tokens per step, while at most
  // max_batch sequences run and blocks for the draft are free without preempting anyone.
  SpeculativeOptions speculative;
};

struct SchedulerStats {
  int64_t preemptions = 0;
  int64_t recomputed_tokens = 0;    // tokens computed again after preemption
  int64_t computed_tokens = 0;      // new tokens computed (prefix hits excluded)
  int64_t peak_blocks_used = 0;
  // Speculative decoding, with vLLM's meanings: drafts verified, their tokens, the tokens
  // kept, and per draft position (0 = the first draft token) how often it was kept.
  int64_t spec_drafts = 0;
  int64_t spec_draft_tokens = 0;
  int64_t spec_accepted_tokens = 0;
  std::vector<int64_t> spec_accepted_at;
};

class Scheduler {
 public:
  Scheduler(const SchedulerOptions& options, int64_t num_blocks);

  // Checks the request against the pool and the context (std::invalid_argument naming the
  // request when it can never run) and queues it for its arrival step.
  Sequence* add(const Request& request);

  // The next micro-batch; empty when nothing can run at `step` (every request finished,
  // in flight, or not yet arrived). Sequences of batches still in flight are skipped and
  // never preempted, so micro-batches in flight are disjoint and their blocks stay put.
  // `sequences` receives the scheduled sequences, in batch order.
  // `micro_batches` in flight share the arrived requests: each micro-batch takes at most
  // ceil(arrived / micro_batches) of them (and max_batch), so the stages get even work.
  StepBatch schedule(int64_t step, std::vector<Sequence*>& sequences, int64_t micro_batches = 1);

  // Appends the sampled tokens of a micro-batch that came back, finishing and freeing
  // sequences as they end. `computed` is the batch that ran. A kNonFiniteToken ends its
  // request with finish_reason "error" and no token appended. Of a verified draft's rows the
  // sequence keeps accepted_length() tokens.
  void update(const StepBatch& computed, const std::vector<Sequence*>& sequences,
              const StepOutput& output, const std::vector<int64_t>& eos_ids);

  // What each sequence of `computed` keeps of `output`'s sampled rows: accepted_length() of
  // them (one token where no draft was verified); empty for a sequence that sampled nothing.
  static std::vector<std::vector<int64_t>> kept_tokens(const StepBatch& computed,
                                                       const std::vector<Sequence*>& sequences,
                                                       const StepOutput& output);

  // The same with the tokens each sequence keeps already chosen (`kept[i]` for sequences[i]:
  // empty for a sequence that sampled nothing, else at most its sampled rows, a prefix of what
  // accepted_length() keeps; the caller may cut it short after a token whose callback asked
  // finish()). A draft's rejected positions are given back: the sequence holds the blocks of
  // its tokens, and the prefix cache sees only kept ones.
  void update(const StepBatch& computed, const std::vector<Sequence*>& sequences,
              const std::vector<std::vector<int64_t>>& kept, const std::vector<int64_t>& eos_ids);

  // Ends request `request_id` before its natural end (a stop string in its text, a client
  // that went away) with `reason` as its finish_reason, freeing its blocks. A request in a
  // micro-batch still in flight ends when that batch returns, keeping the token it brings.
  // False when no unfinished request has that id.
  bool finish(int64_t request_id, const std::string& reason);

  bool done() const { return pending_.empty() && waiting_.empty() && running_.empty(); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(pending_.size() + waiting_.size()); }
  // The most tokens (prompt + output) one request may hold: what add() accepts at most.
  int64_t max_request_tokens() const;
  // Forgets finished sequences (a long-running server would otherwise keep every one); their
  // results are gone from sequences() afterwards.
  void erase_finished();
  int64_t num_finished() const { return finished_; }
  const SchedulerStats& stats() const { return stats_; }
  const BlockManager& blocks() const { return blocks_; }
  const std::vector<std::unique_ptr<Sequence>>& sequences() const { return all_; }

 private:
  bool grow(Sequence& seq, int64_t tokens);  // blocks to hold `tokens` tokens; false if none
  void preempt(Sequence& seq);
  void release(Sequence& seq);
  void admit_prefix(Sequence& seq);   // starts a new sequence after its cached prefix
  void after_compute(Sequence& seq);  // offers full blocks to the cache, frees out-of-window ones
  int64_t max_blocks_held(int64_t tokens) const;
  int64_t chunk_of(const Sequence& seq, int64_t budget) const;  // tokens to compute next
  // The draft a decoding sequence verifies next within `budget` tokens (empty: none).
  std::vector<int64_t> draft_for(Sequence& seq, int64_t budget);
  void finish_now(Sequence& seq, const std::string& reason);

  SchedulerOptions options_;
  BlockManager blocks_;
  std::vector<std::unique_ptr<Sequence>> all_;
  std::vector<Sequence*> pending_;   // not yet arrived, by arrival step
  std::deque<Sequence*> waiting_;    // arrived, not admitted (preempted ones at the front)
  std::vector<Sequence*> running_;   // admitted, in admission order
  SchedulerStats stats_;
  int64_t finished_ = 0;
};

}  // namespace kvpipe
