// DecodeGraphs: a stage's decode step on a GPU replayed from CUDA graphs.
//
// A decode step launches a few dozen small kernels per layer; at batch 1 on a fast GPU their
// launches, not the weights' bytes, set the step time. DecodeGraphs captures the stage's
// whole decode step (embedding on the first stage, every layer with the paged decode kernel,
// final norm and LM head on the last) once per padded batch size (1, 2, 4, 8, then multiples
// of 8 up to max_batch) and replays it: the step's indices are copied into static tensors,
// and rows past the real batch are padding that writes its K/V into a scratch block the
// scheduler never hands out (`scratch_block`, the pool's last block) and attends only to it.
// Sampling, NCCL and everything on the host stay outside the graph. Graphs are captured on
// first use of their size on a side stream and share one memory pool, the instance's own: a
// pool outlives no instance, so a later DecodeGraphs in the same process (another dtype, another
// job in a test) captures into a fresh one.
//
// Only steps the paged decode path takes (one new token per sequence, no window, no
// layer-level reuse, float storage of the compute dtype, head size 64 or 128) run as graphs;
// `handles` says which. Built in every build; constructing one needs a CUDA device.
#pragma once

#include "cache/block_pool.h"
#include "engine/model_shard.h"
#include "engine/step_batch.h"

#include <ATen/Tensor.h>
#include <c10/core/Allocator.h>

#include <cstdint>
#include <map>
#include <memory>

namespace kvpipe {

// The padded batch size a decode step of `sequences` replays: 1, 2, 4, 8, then the next
// multiple of 8, capped at max_batch; 0 when no graph takes it.
int64_t decode_graph_bucket(int64_t sequences, int64_t max_batch);

class DecodeGraphs {
 public:
  // `pool` must hold `scratch_block` beyond the blocks the scheduler uses.
  DecodeGraphs(const ModelShard& shard, BlockPool& pool, int64_t max_batch, int64_t scratch_block);
  ~DecodeGraphs();
  DecodeGraphs(const DecodeGraphs&) = delete;
  DecodeGraphs& operator=(const DecodeGraphs&) = delete;

  bool handles(const StepBatch& batch, const StepContext& ctx) const;

  // Runs the step of `ctx` (whose batch handles() accepts) from its graph: returns the stage's
  // hidden states [S, hidden], or on the last stage the logits [S, vocab] of every sequence
  // (all sample). `hidden` is the stage's input on stages after the first.
  at::Tensor run(const StepContext& ctx, const at::Tensor& hidden);

  // Graphs captured so far (one per padded batch size used).
  int64_t graphs_captured() const { return static_cast<int64_t>(graphs_.size()); }
  // Steps run from a graph so far (a captured graph's first step included).
  int64_t replays() const { return replays_; }

 private:
  struct Graph;
  Graph& graph_for(int64_t bucket);

  const ModelShard& shard_;
  BlockPool& pool_;
  int64_t max_batch_;
  int64_t scratch_block_;
  int64_t table_width_;  // block table columns: enough for the model's whole context
  c10::MempoolId_t graph_pool_;  // the allocator pool every graph of this instance captures into
  int64_t replays_ = 0;
  std::map<int64_t, std::unique_ptr<Graph>> graphs_;
};

}  // namespace kvpipe
