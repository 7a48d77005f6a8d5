// ModelShard: the forward pass of one pipeline stage over the paged KV cache.
//
// A shard owns the weights of a contiguous layer range and, when it is the first or last
// stage, the embedding or the final norm and LM head. It reads and writes K/V only through
// the StepContext's slot indices into the stage's BlockPool, so the same code serves a
// one-rank run (one shard with every layer) and each stage of a pipeline.
//
// Layer-level reuse: layers before `first_cached_layer` keep no K/V and run over every
// token of each sequence at every step (the batch then carries full sequences); the rows of
// the new tokens alone go on into the first cached layer. The pool holds only the shard's
// cached layers.
//
// The shard computes where its weights live (ModelWeights::device): the StepContext and the
// pool must be on that device too.
//
// Tensor parallelism: with weights of one tensor rank's slice (ModelWeights::split) and the
// stage's TensorGroup, the shard computes its heads and MLP units, all-reduces the output and
// down projections' partial sums (twice per layer), looks up the embedding rows of its
// vocabulary slice and all-reduces them, and gathers the LM head's slices on the group's
// leader. Every rank of the group must run the same calls on the same batch. Its pool holds
// K/V of its own KV heads.
#pragma once

#include "cache/block_pool.h"
#include "engine/attention_backend.h"
#include "engine/layers.h"
#include "engine/model/model_weights.h"
#include "engine/step_batch.h"
#include "parallel/tensor_group.h"

#include <ATen/Tensor.h>

#include <array>
#include <optional>

namespace kvpipe {

class ModelShard {
 public:
  // `group` (not owned) is required when the weights are a tensor rank's slice.
  explicit ModelShard(ModelWeights weights, int64_t first_cached_layer = 0, TensorGroup* group = nullptr);

  const ModelConfig& config() const { return weights_.config; }
  const LayerRange& layers() const { return weights_.layers; }
  const ModelWeights& weights() const { return weights_; }
  const TensorSplit& split() const { return weights_.split; }
  TensorGroup* tensor_group() const { return group_; }
  at::Device device() const { return weights_.device; }
  bool has_embedding() const { return weights_.embedding.defined(); }
  bool has_head() const { return weights_.lm_head.defined(); }

  // Token ids (int64 [T]) -> hidden states [T, hidden].
  at::Tensor embed(const at::Tensor& token_ids) const;
  // Runs the shard's layers on `hidden` [T, hidden], storing each layer's new K/V in `pool`
  // (whose layer 0 is the shard's first layer).
  at::Tensor forward(at::Tensor hidden, const StepBatch& batch, const StepContext& ctx,
                     BlockPool& pool) const;
  // Final norm and LM head on hidden rows [S, hidden] -> float32 logits [S, vocab]; with tensor
  // ranks, the whole vocabulary's on the group's leader and undefined on the other ranks.
  at::Tensor logits(const at::Tensor& hidden) const;

  // The KV layout this shard needs for `block_size` (its cached layers only).
  KvShape kv_shape(int64_t block_size, KvDtype dtype = KvDtype::kFloat32) const;
  int64_t num_cached_layers() const;

  // The attention path every step should take where it can (engine/attention_backend.h);
  // unset: the fastest each step allows. Starts as KVPIPE_ATTENTION says.
  void set_attention_path(std::optional<AttentionPath> path) { attention_path_ = path; }
  std::optional<AttentionPath> attention_path() const { return attention_path_; }
  // Cached layers' attention computed by `path` so far (tests check which path steps took).
  int64_t attention_calls(AttentionPath path) const { return attention_calls_[static_cast<size_t>(path)]; }
  // The path this shard's cached layers take for `batch` (every layer takes the same), and
  // whether it needs the step's per-key indices (make_step_context's `key_indices`).
  AttentionPath attention_path_for(const BlockPool& pool, const StepBatch& batch) const;
  bool step_reads_keys(const BlockPool& pool, const StepBatch& batch) const;

 private:
  // x [T, hidden] -> q [T, heads, head_dim] and k, v [T, kv_heads, head_dim] of the shard's
  // layer `local_layer`, q and k normalised where the model says so and rotated at `positions`.
  std::array<at::Tensor, 3> project_qkv(const at::Tensor& x, int64_t local_layer, const at::Tensor& positions) const;
  double attention_scale() const;
  // The keys model layer `layer` sees in `batch` (the job's window and the layer's own) and
  // its scores' soft cap.
  AttentionWindow attention_window(const StepBatch& batch, int64_t layer) const;
  at::Tensor attention_block(const at::Tensor& x, int64_t local_layer, const StepBatch& batch,
                             const StepContext& ctx, BlockPool& pool) const;
  at::Tensor recompute_attention_block(const at::Tensor& x, int64_t local_layer, const StepBatch& batch,
                                       const StepContext& ctx) const;

  // Sums a row-parallel product's partial outputs over the tensor group (no-op on one rank).
  at::Tensor reduced(at::Tensor partial) const;

  ModelWeights weights_;
  int64_t first_cached_layer_ = 0;
  TensorGroup* group_ = nullptr;
  RopeTables rope_;
  RopeTables local_rope_;  // Gemma 3's local layers; undefined for other models
  std::optional<AttentionPath> attention_path_;
  mutable std::array<int64_t, 3> attention_calls_{};
};

}  // namespace kvpipe
