// Engine: the coordinator's step loop.
//
// Feeds the scheduler's batches to a StepExecutor (the whole model on this rank, or a
// pipeline of stages), hands every sampled token to a callback, and keeps per-request
// timings. It owns no weights and no cache memory: those belong to the executor's stages.
#pragma once

#include "engine/model/model_config.h"
#include "engine/model_shard.h"
#include "engine/scheduler.h"
#include "engine/step_batch.h"
#include "parallel/trace_recorder.h"

#include <chrono>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace kvpipe {

class DecodeGraphs;

// Runs micro-batches: `submit` starts one, `wait` returns the oldest one's sampled tokens
// (outputs come back in submission order). Up to max_in_flight() may be outstanding.
class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  virtual size_t max_in_flight() const { return 1; }
  virtual void submit(const StepBatch& batch) = 0;
  virtual StepOutput wait() = 0;
};

// Samples every row of `logits` ([S, vocab], one per sampled sequence of `batch`). Logits on a
// GPU stay there when every row is greedy and none is wanted back (only the ids cross);
// otherwise they come to the host, where the sampler runs.
StepOutput sample_batch(const StepBatch& batch, const at::Tensor& logits);

// Greedy sampling of every sampled row as tensor ops where the logits are (a GPU's path): the
// argmax, the lowest id among equal maxima as on the host, or kNonFiniteToken for a row
// sample_token would refuse; only the ids cross to the host.
StepOutput sample_greedy_rows(const StepBatch& batch, const at::Tensor& logits);

// The whole model on this rank. `trace` (optional) gets a compute span per micro-batch.
class LocalExecutor : public StepExecutor {
 public:
  LocalExecutor(const ModelShard& shard, BlockPool& pool, TraceRecorder* trace = nullptr,
                DecodeGraphs* graphs = nullptr)
      : shard_(shard), pool_(pool), trace_(trace), graphs_(graphs) {}
  void submit(const StepBatch& batch) override;
  StepOutput wait() override;

 private:
  const ModelShard& shard_;
  BlockPool& pool_;
  TraceRecorder* trace_;
  DecodeGraphs* graphs_;
  int64_t next_id_ = 0;
  std::deque<StepOutput> done_;
};

// Runs `batch` through `shard`: embeds the token ids when the shard is the first stage
// (otherwise takes `hidden`), and returns the hidden states, or the sampled tokens when the
// shard is the last stage.
struct StageResult {
  at::Tensor hidden;
  StepOutput output;
};
// With `graphs`, decode steps it handles replay its CUDA graphs (engine/decode_graphs.h).
StageResult run_stage(const ModelShard& shard, BlockPool& pool, const StepBatch& batch,
                      const at::Tensor& hidden, DecodeGraphs* graphs = nullptr);

struct TokenEvent {
  int64_t request_id = 0;
  int64_t index = 0;          // 0 for the first generated token
  int64_t token = 0;
  const float* logits = nullptr;  // raw logits of the step, when EngineOptions::keep_logits
  int64_t vocab = 0;
};

struct RequestResult {
  int64_t id = 0;
  std::vector<int64_t> prompt_ids;
  std::vector<int64_t> output_ids;
  std::string finish_reason;         // "length", "stop", "abort", or "error" (see error)
  std::string error;                 // why the request failed, when finish_reason is "error"
  double ttft_ms = 0.0;
  double tpot_ms = 0.0;
  int64_t spec_drafts = 0;           // speculative drafts verified, their tokens, those kept
  int64_t spec_draft_tokens = 0;
  int64_t spec_accepted_tokens = 0;
};

class Engine;

// Feeds requests while the engine runs (the synthetic load of `kvpipe bench`): closed loop
// (a new request whenever one finishes) or open loop (arrivals at given times).
class RequestSource {
 public:
  virtual ~RequestSource() = default;
  // Called before each scheduling round: adds to `engine` the requests due by `now`.
  virtual void poll(Engine& engine, Clock::time_point now) = 0;
  // Every request has been added.
  virtual bool exhausted() const = 0;
  // When the next request is due if no other event comes first; nullopt when none is due
  // by time (closed loop, or exhausted).
  virtual std::optional<Clock::time_point> next_arrival() const = 0;
  // Idles until `until` while nothing runs; a source fed from outside (a server) returns as
  // soon as something arrives.
  virtual void wait_until(Clock::time_point until) { std::this_thread::sleep_until(until); }
};

struct EngineOptions {
  SchedulerOptions scheduler;
  bool keep_logits = false;          // every request's logits (otherwise those with want_logits)
  // Called once for every request as it finishes (its finish_reason set, its blocks freed).
  std::function<void(const Sequence&)> on_finished;
  // Polled before each step: once it returns true, run() schedules nothing new, collects the
  // micro-batches in flight and returns (a job stopped by SIGINT/SIGTERM).
  std::function<bool()> should_stop;
  // Optional: requests added while running (not owned).
  RequestSource* source = nullptr;
  // Optional: gets an idle span whenever the engine sleeps until the next arrival.
  TraceRecorder* trace = nullptr;
};

// One micro-batch, as the coordinator saw it.
struct StepRecord {
  int64_t micro_batch = 0;            // submission index, as the executor numbers them
  Clock::time_point submitted{}, done{};  // done: its sampled tokens are on this host
  int64_t sequences = 0;
  int64_t prompt_tokens = 0;          // prompt chunks, and tokens recomputed after preemption
  int64_t decode_tokens = 0;          // one per sequence decoding its next token (and its draft's)
  int64_t blocks_used = 0;            // KV blocks in use once its tokens were appended

  // End-to-end latency: submitted -> tokens back.
  double ms() const { return std::chrono::duration<double, std::milli>(done - submitted).count(); }
};

struct EngineStats {
  std::vector<StepRecord> step_records;  // every micro-batch run, in completion order
  int64_t steps() const { return static_cast<int64_t>(step_records.size()); }
};

class Engine {
 public:
  Engine(StepExecutor& executor, const ModelConfig& model, int64_t num_blocks,
         const EngineOptions& options);

  // std::invalid_argument naming the request for token ids outside the vocabulary, a
  // prompt longer than the context, or a request that can never fit in the pool.
  void add(const Request& request);

  // Steps until every request has finished (and the source, if any, is exhausted), or until
  // options.should_stop() says to stop. May be called again with more requests.
  void run(const std::function<void(const TokenEvent&)>& on_token = {});

  // Ends a request early (Scheduler::finish); callable from the on_token callback.
  bool finish(int64_t request_id, const std::string& reason);

  // Forgets finished requests (Scheduler::erase_finished): results() no longer lists them.
  void erase_finished() { scheduler_.erase_finished(); }

  // Replaces EngineOptions::source for the next run() (null: none).
  void set_source(RequestSource* source) { options_.source = source; }

  // Requests added and not finished yet.
  int64_t unfinished() const {
    return static_cast<int64_t>(scheduler_.sequences().size()) - scheduler_.num_finished();
  }

  std::vector<RequestResult> results() const;
  const EngineStats& stats() const { return stats_; }
  const Scheduler& scheduler() const { return scheduler_; }

 private:
  StepExecutor& executor_;
  ModelConfig model_;
  EngineOptions options_;
  Scheduler scheduler_;
  EngineStats stats_;
  int64_t submitted_ = 0;
};

}  // namespace kvpipe
