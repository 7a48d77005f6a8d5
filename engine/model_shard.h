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
#pragma once

#include "cache/block_pool.h"
#include "engine/layers.h"
#include "engine/model_weights.h"
#include "engine/step_batch.h"

#include <ATen/Tensor.h>

namespace kvpipe {

class ModelShard {
 public:
  explicit ModelShard(ModelWeights weights, int64_t first_cached_layer = 0);

  const ModelConfig& config() const { return weights_.config; }
  const LayerRange& layers() const { return weights_.layers; }
  const ModelWeights& weights() const { return weights_; }
  bool has_embedding() const { return weights_.embedding.defined(); }
  bool has_head() const { return weights_.lm_head.defined(); }

  // Token ids (int64 [T]) -> hidden states [T, hidden].
  at::Tensor embed(const at::Tensor& token_ids) const;
  // Runs the shard's layers on `hidden` [T, hidden], storing each layer's new K/V in `pool`
  // (whose layer 0 is the shard's first layer).
  at::Tensor forward(at::Tensor hidden, const StepBatch& batch, const StepContext& ctx,
                     BlockPool& pool) const;
  // Final norm and LM head on hidden rows [S, hidden] -> float32 logits [S, vocab].
  at::Tensor logits(const at::Tensor& hidden) const;

  // The KV layout this shard needs for `block_size` (its cached layers only).
  KvShape kv_shape(int64_t block_size, KvDtype dtype = KvDtype::kFloat32) const;
  int64_t num_cached_layers() const;

 private:
  at::Tensor attention_block(const at::Tensor& x, int64_t local_layer, const StepBatch& batch,
                             const StepContext& ctx, BlockPool& pool) const;
  at::Tensor recompute_attention_block(const at::Tensor& x, int64_t local_layer, const StepBatch& batch,
                                       const StepContext& ctx) const;

  ModelWeights weights_;
  int64_t first_cached_layer_ = 0;
  RopeTables rope_;
};

}  // namespace kvpipe
