// JobRunner: one rank's part of a job, shared by `generate` and `bench`.
//
// Sets the rank up from a validated job and its plan (device check, thread pinning and
// count, the communicator before any weight loads, this rank's shard and KV pool), then rank 0
// runs the caller's coordinator over an executor (the whole model, or stage 0 of the
// pipeline) while every other rank serves its stage until rank 0 shuts the pipeline down.
// Afterwards every rank's busy/wait/comm times, and the trace when one is recorded, are
// gathered on rank 0.
// On more than one rank a watchdog (parallel/watchdog.h, parallel.timeout) runs from the
// communicator's creation to the end of the job, so a rank that goes silent ends the job.
#pragma once

#include "engine/engine.h"
#include "engine/speculative/draft_proposer.h"
#include "launch/job_config.h"
#include "launch/job_plan.h"
#include "parallel/pipeline_channel.h"
#include "parallel/trace_recorder.h"
#include "parallel/world.h"

#include <functional>
#include <string>
#include <vector>

namespace kvpipe {

// What rank 0's coordinator works with.
struct CoordinatorContext {
  const JobConfig& job;
  const JobPlan& plan;
  const ModelShard& shard;  // stage 0 (the whole model on one rank)
  StepExecutor& executor;
  const World& world;
  const DecodeGraphs* graphs = nullptr;  // rank 0's, when runtime.cuda_graphs made them
  DraftProposer* draft_model = nullptr;  // speculative.method draft: the draft model
};

// What rank `shard`'s steps ran on: attention calls of its cached layers by path, and the
// CUDA graphs captured and replayed (-1 when the rank has none). The bench report (and, at
// --log-level debug, every rank's log at the job's end) say it, so that a measurement shows
// which path it measured.
struct EngineCounters {
  int64_t attention_calls[3] = {0, 0, 0};  // indexed by AttentionPath
  int64_t graphs_captured = -1;
  int64_t graph_replays = -1;
};
EngineCounters engine_counters(const ModelShard& shard, const DecodeGraphs* graphs);

struct JobOutcome {
  std::string backend;                         // "local", "mpi" or "nccl"
  std::vector<RankTimes> times;                // rank 0 only, one per rank (pipelines only)
  std::vector<std::vector<TraceSpan>> traces;  // rank 0 only, one per rank, when traced
};

// With `trace` set, every rank starts it (collectively, just before the run) and records
// its spans into it; the spans come back in JobOutcome::traces on rank 0.
// `plan` is plan_job(job, world.size()).
JobOutcome run_job(const JobConfig& job, const JobPlan& plan, World& world, TraceRecorder* trace,
                   const std::function<void(CoordinatorContext&)>& coordinator);

// Engine options of the job: scheduler limits, cache policies, the context length, and the
// speculative section (with `draft_model`, the coordinator's draft model when it has one).
EngineOptions engine_options(const JobConfig& job, const JobPlan& plan, DraftProposer* draft_model = nullptr);

}  // namespace kvpipe
