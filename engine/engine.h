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

#include <functional>
#include <string>
#include <vector>

namespace kvpipe {

// Runs one step's batch and returns the sampled tokens.
class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  virtual StepOutput execute(const StepBatch& batch) = 0;
};

// Samples every row of `logits` ([S, vocab], one per sampled sequence of `batch`).
StepOutput sample_batch(const StepBatch& batch, const at::Tensor& logits);

// The whole model on this rank.
class LocalExecutor : public StepExecutor {
 public:
  LocalExecutor(const ModelShard& shard, BlockPool& pool) : shard_(shard), pool_(pool) {}
  StepOutput execute(const StepBatch& batch) override;

 private:
  const ModelShard& shard_;
  BlockPool& pool_;
};

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
};

struct EngineStats {
  int64_t steps = 0;
  int64_t prefill_tokens = 0;   // tokens computed that were not sampled from
  int64_t decode_tokens = 0;    // tokens computed whose logits were sampled
  double step_ms_total = 0.0;
};

class Engine {
 public:
  Engine(StepExecutor& executor, const ModelConfig& model, int64_t num_blocks,
         const EngineOptions& options);

  // std::invalid_argument naming the request for token ids outside the vocabulary, a
  // prompt longer than the context, or a request that can never fit in the pool.
  void add(const Request& request);

  // Steps until every request has finished.
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
