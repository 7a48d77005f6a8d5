// The pipeline: rank 0 runs the first stage and coordinates, every other rank runs a stage.
//
// PipelineExecutor (rank 0) runs stage 0 of a micro-batch and passes [step header + hidden
// states] to rank 1; StageWorker (ranks 1..S-1) receives from the previous rank, runs its
// layers and passes on, the last stage sampling and returning the token ids (and the
// logits when asked) to rank 0. Links are FIFO and every stage handles micro-batches in
// order, so outputs come back in submission order. Up to `micro_batches` micro-batches of
// disjoint requests are in flight, so that in steady state no stage waits for another.
#pragma once

#include "engine/engine.h"
#include "parallel/pipeline_channel.h"

namespace kvpipe {

class PipelineExecutor : public StepExecutor {
 public:
  PipelineExecutor(const ModelShard& shard, BlockPool& pool, PipelineChannel& channel, int world_size,
                   size_t micro_batches, DecodeGraphs* graphs = nullptr);
  size_t max_in_flight() const override { return micro_batches_; }
  void submit(const StepBatch& batch) override;
  StepOutput wait() override;
  // Tells every stage to stop once the micro-batches in flight are done.
  void shutdown();

 private:
  const ModelShard& shard_;
  BlockPool& pool_;
  PipelineChannel& channel_;
  int last_rank_;
  size_t micro_batches_;
  DecodeGraphs* graphs_;
  int64_t next_id_ = 0;
};

// Runs a non-coordinator stage until rank 0 shuts the pipeline down.
void run_stage_worker(const ModelShard& shard, BlockPool& pool, PipelineChannel& channel, int rank,
                      int world_size, DecodeGraphs* graphs = nullptr);

}  // namespace kvpipe
