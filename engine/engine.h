// Engine: the coordinator's step loop.
//
// Feeds the scheduler's batches to a StepExecutor (the whole model on this rank, or a
// pipeline of stages), hands every sampled token to a callback, and keeps per-request
// timings. It owns no weights and no cache memory: those belong to the executor's stages.
#pragma once

#include "engine/model_config.h"
#include "engine/model_shard.h"
#include "engine/scheduler.h"
#include "engine/step_batch.h"

#include <deque>
#include <functional>
#include <string>
#include <vector>

namespace kvpipe {

// Runs micro-batches: `submit` starts one, `wait` returns the oldest one's sampled tokens
// (outputs come back in submission order). Up to max_in_flight() may be outstanding.
class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  virtual size_t max_in_flight() const { return 1; }
  virtual void submit(const StepBatch& batch) = 0;
  virtual StepOutput wait() = 0;
};

// Samples every row of `logits` ([S, vocab], one per sampled sequence of `batch`).
StepOutput sample_batch(const StepBatch& batch, const at::Tensor& logits);

// The whole model on this rank.
class LocalExecutor : public StepExecutor {
 public:
  LocalExecutor(const ModelShard& shard, BlockPool& pool) : shard_(shard), pool_(pool) {}
  void submit(const StepBatch& batch) override;
  StepOutput wait() override;

 private:
  const ModelShard& shard_;
  BlockPool& pool_;
  std::deque<StepOutput> done_;
};

// Runs `batch` through `shard`: embeds the token ids when the shard is the first stage
// (otherwise takes `hidden`), and returns the hidden states, or the sampled tokens when the
// shard is the last stage.
struct StageResult {
  at::Tensor hidden;
  StepOutput output;
};
StageResult run_stage(const ModelShard& shard, BlockPool& pool, const StepBatch& batch,
                      const at::Tensor& hidden);

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
  std::string finish_reason;
  double ttft_ms = 0.0;
  double tpot_ms = 0.0;
};

struct EngineOptions {
  SchedulerOptions scheduler;
  bool keep_logits = false;
  // Polled before each step: once it returns true, run() schedules nothing new, collects the
  // micro-batches in flight and returns (a job stopped by SIGINT/SIGTERM).
  std::function<bool()> should_stop;
};

struct EngineStats {
  int64_t steps = 0;            // micro-batches run
  int64_t prefill_tokens = 0;   // tokens computed that were not sampled from
  int64_t decode_tokens = 0;    // tokens computed whose logits were sampled
  double step_ms_total = 0.0;   // end to end: submitted -> tokens back
  std::vector<double> step_ms;  // every micro-batch's end-to-end latency
};

class Engine {
 public:
  Engine(StepExecutor& executor, const ModelConfig& model, int64_t num_blocks,
         const EngineOptions& options);

  // std::invalid_argument naming the request for token ids outside the vocabulary, a
  // prompt longer than the context, or a request that can never fit in the pool.
  void add(const Request& request);

  // Steps until every request has finished, or until options.should_stop() says to stop.
  void run(const std::function<void(const TokenEvent&)>& on_token = {});

  std::vector<RequestResult> results() const;
  const EngineStats& stats() const { return stats_; }
  const Scheduler& scheduler() const { return scheduler_; }

 private:
  StepExecutor& executor_;
  ModelConfig model_;
  EngineOptions options_;
  Scheduler scheduler_;
  EngineStats stats_;
};

}  // namespace kvpipe
