#include "engine/model_shard.h"

#include <ATen/ATen.h>

#include <cmath>

namespace kvpipe {

ModelShard::ModelShard(ModelWeights weights) : weights_(std::move(weights)) {
  const ModelConfig& c = weights_.config;
  rope_ = make_rope_tables(c.max_position, c.head_dim, c.rope_theta, at::kFloat);
}

KvShape ModelShard::kv_shape(int64_t block_size) const {
  KvShape s;
  s.num_layers = weights_.layers.size();
  s.block_size = block_size;
  s.num_kv_heads = weights_.config.num_kv_heads;
  s.head_dim = weights_.config.head_dim;
  s.element_size = 4;
  if (!weights_.layer.empty()) s.element_size = weights_.layer[0].qkv.element_size();
  return s;
}

at::Tensor ModelShard::embed(const at::Tensor& token_ids) const {
  return weights_.embedding.index_select(0, token_ids);
}

at::Tensor ModelShard::attention_block(const at::Tensor& x, int64_t local, const StepBatch& batch,
                                       const StepContext& ctx, BlockPool& pool) const {
  const ModelConfig& c = weights_.config;
  const LayerWeights& w = weights_.layer[local];
  const int64_t T = x.size(0), q_dim = c.num_heads * c.head_dim,
                kv_dim = c.num_kv_heads * c.head_dim;
  const at::Tensor qkv = dense(x, w.qkv, w.qkv_bias);
  // q and k heads are adjacent in the fused projection: rotate them in one pass.
  const int64_t qk_heads = c.num_heads + c.num_kv_heads;
  const at::Tensor qk = apply_rope(qkv.narrow(1, 0, q_dim + kv_dim).view({T, qk_heads, c.head_dim}),
                                   ctx.positions, rope_);
  const at::Tensor q = qk.narrow(1, 0, c.num_heads);
  const at::Tensor k = qk.narrow(1, c.num_heads, c.num_kv_heads);
  const at::Tensor v = qkv.narrow(1, q_dim + kv_dim, kv_dim).reshape({T, c.num_kv_heads, c.head_dim});
  pool.write(local, ctx.slots, k, v);

  const at::Tensor keys = pool.keys(local), values = pool.values(local);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  std::vector<at::Tensor> outs;
  outs.reserve(batch.seqs.size());
  int64_t start = 0;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const int64_t n = batch.seqs[i].num_new;
    const at::Tensor& slots = ctx.seq_slots[i];
    outs.push_back(causal_attention(q.narrow(0, start, n), keys.index_select(0, slots),
                                    values.index_select(0, slots), scale));
    start += n;
  }
  const at::Tensor attn = outs.size() == 1 ? outs[0] : at::cat(outs);
  return dense(attn, w.o);
}

at::Tensor ModelShard::forward(at::Tensor hidden, const StepBatch& batch, const StepContext& ctx,
                               BlockPool& pool) const {
  const double eps = weights_.config.rms_eps;
  for (int64_t l = 0; l < weights_.layers.size(); ++l) {
    const LayerWeights& w = weights_.layer[l];
    hidden = hidden + attention_block(rms_norm(hidden, w.input_norm, eps), l, batch, ctx, pool);
    hidden = hidden + dense(swiglu(dense(rms_norm(hidden, w.post_norm, eps), w.gate_up)), w.down);
  }
  return hidden;
}

at::Tensor ModelShard::logits(const at::Tensor& hidden) const {
  return dense(rms_norm(hidden, weights_.final_norm, weights_.config.rms_eps), weights_.lm_head)
      .to(at::kFloat);
}

}  // namespace kvpipe
