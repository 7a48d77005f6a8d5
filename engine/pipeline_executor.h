// The pipeline: rank 0 runs the first stage and coordinates, every other rank runs a stage or
// a tensor rank's part of one.
//
// The job is a grid of stages by tensor ranks (parallel/process_grid.h). Stage leaders (tensor
// rank 0 of each stage) form the pipeline: PipelineExecutor (rank 0) runs stage 0 of a
// micro-batch and passes [step header + hidden states] to stage 1's leader; each later
// leader receives from the previous one, runs its layers and passes on, the last stage
// sampling and returning the token ids (and the logits when asked) to rank 0. Links are FIFO
// and every stage handles micro-batches in order, so outputs come back in submission order.
// Up to `micro_batches` micro-batches of disjoint requests are in flight, so that in steady
// state no stage waits for another. Inside a stage, the leader broadcasts each message it
// runs to its tensor group, whose other ranks compute their heads and units of the same
// step beside it (the shard's all-reduces join them) and send nothing down the pipeline.
#pragma once

#include "engine/engine.h"
#include "parallel/pipeline_channel.h"
#include "parallel/process_grid.h"
#include "parallel/tensor_group.h"

#include <deque>

namespace kvpipe {

class PipelineExecutor : public StepExecutor {
 public:
  // `group`: rank 0's tensor group, when the grid has tensor ranks (not owned).
  PipelineExecutor(const ModelShard& shard, BlockPool& pool, PipelineChannel& channel, const ProcessGrid& grid,
                   size_t micro_batches, DecodeGraphs* graphs = nullptr, TensorGroup* group = nullptr);
  size_t max_in_flight() const override { return micro_batches_; }
  void submit(const StepBatch& batch) override;
  StepOutput wait() override;
  // Tells every rank to stop once the micro-batches in flight are done.
  void shutdown();

 private:
  const ModelShard& shard_;
  BlockPool& pool_;
  PipelineChannel& channel_;
  ProcessGrid grid_;
  size_t micro_batches_;
  DecodeGraphs* graphs_;
  TensorGroup* group_;
  int64_t next_id_ = 0;
  std::deque<StepOutput> done_;  // a one-stage grid's outputs (its leader samples)
};

// Runs rank `rank`'s part of the grid until rank 0 shuts the job down: a later stage's leader
// (over `channel`), or a tensor rank that follows its leader (over `group`).
void run_stage_worker(const ModelShard& shard, BlockPool& pool, PipelineChannel& channel, const ProcessGrid& grid,
                      int rank, DecodeGraphs* graphs = nullptr, TensorGroup* group = nullptr);

}  // namespace kvpipe
