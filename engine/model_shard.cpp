#include "engine/model_shard.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <utility>

namespace kvpipe {

ModelShard::ModelShard(ModelWeights weights, int64_t first_cached_layer, TensorGroup* group)
    : weights_(std::move(weights)), first_cached_layer_(first_cached_layer), group_(group) {
  const ModelConfig& c = weights_.config;
  if (!weights_.split.whole() && (group_ == nullptr || group_->size() != weights_.split.size ||
                                  group_->rank() != weights_.split.rank))
    throw std::logic_error("a tensor rank's shard needs its tensor group");
  // In the compute dtype, as transformers casts cos and sin to the activations' dtype: a
  // float32 table would promote 16-bit queries and keys to float32.
  rope_ = make_rope_tables(c.max_position, rope_inv_freq(c), weights_.dtype, c.rope_scaling.attention_factor);
  if (!weights_.device.is_cpu()) rope_ = {rope_.cos.to(weights_.device), rope_.sin.to(weights_.device)};
  if (c.local_rope_theta > 0) {
    // Gemma 3's local layers: plain RoPE of their own base, the model's scaling not applied.
    ModelConfig local = c;
    local.rope_theta = c.local_rope_theta;
    local.rope_scaling = RopeScaling{};
    local_rope_ = make_rope_tables(c.max_position, rope_inv_freq(local), weights_.dtype);
    if (!weights_.device.is_cpu())
      local_rope_ = {local_rope_.cos.to(weights_.device), local_rope_.sin.to(weights_.device)};
  }
  attention_path_ = attention_path_from_env();
}

KvShape ModelShard::kv_shape(int64_t block_size, KvDtype dtype) const {
  KvShape s;
  s.num_layers = num_cached_layers();
  s.block_size = block_size;
  s.num_kv_heads = weights_.split.kv_heads;
  s.head_dim = weights_.config.head_dim;
  s.dtype = dtype;
  s.element_size = static_cast<int64_t>(c10::elementSize(kv_storage_scalar_type(dtype)));
  return s;
}

int64_t ModelShard::num_cached_layers() const {
  return std::max<int64_t>(0, weights_.layers.end - std::max(weights_.layers.begin, first_cached_layer_));
}

AttentionPath ModelShard::attention_path_for(const BlockPool& pool, const StepBatch& batch) const {
  return choose_attention_path(weights_.dtype, weights_.config.head_dim, !weights_.device.is_cpu(), pool, batch,
                               attention_path_, weights_.config.masked_or_capped_attention());
}

bool ModelShard::step_reads_keys(const BlockPool& pool, const StepBatch& batch) const {
  return num_cached_layers() > 0 && attention_reads_keys(attention_path_for(pool, batch));
}

at::Tensor ModelShard::reduced(at::Tensor partial) const {
  if (group_ != nullptr && group_->size() > 1) group_->all_reduce_sum(partial);
  return partial;
}

at::Tensor ModelShard::embed(const at::Tensor& token_ids) const {
  at::Tensor rows;
  const TensorSplit& s = weights_.split;
  if (s.whole()) {
    rows = weights_.embedding.gather_rows(token_ids, weights_.dtype);
  } else {
    // Each rank looks up the ids of its vocabulary rows (zeros for the others): the sum over
    // the group is every id's row, exactly.
    const at::Tensor local = token_ids.to(at::kLong) - s.vocab_begin;
    const at::Tensor mine = (local >= 0) & (local < s.vocab_rows);
    rows = weights_.embedding.gather_rows(local.clamp(0, s.vocab_rows - 1), weights_.dtype);
    rows = reduced(rows * mine.to(rows.device()).unsqueeze(1).to(rows.scalar_type()));
  }
  // Gemma: the scale rounded to the compute dtype first, as transformers multiplies by it.
  if (weights_.config.embedding_scale == 1.0) return rows;
  return rows * at::scalar_tensor(weights_.config.embedding_scale, rows.options());
}

double ModelShard::attention_scale() const {
  const ModelConfig& c = weights_.config;
  return c.attention_scale > 0 ? c.attention_scale : 1.0 / std::sqrt(static_cast<double>(c.head_dim));
}

AttentionWindow ModelShard::attention_window(const StepBatch& batch, int64_t layer) const {
  return {batch.window_sinks, batch.window_recent, weights_.config.layer_window(layer), weights_.config.attn_softcap};
}

std::array<at::Tensor, 3> ModelShard::project_qkv(const at::Tensor& x, int64_t local, const at::Tensor& positions) const {
  const ModelConfig& c = weights_.config;
  const LayerWeights& w = weights_.layer[local];
  const RopeTables& rope =
      local_rope_.cos.defined() && c.local_layer(weights_.layers.begin + local) ? local_rope_ : rope_;
  // This rank's heads (all of them on one rank).
  const int64_t heads = weights_.split.heads, kv_heads = weights_.split.kv_heads;
  const int64_t T = x.size(0), q_dim = heads * c.head_dim, kv_dim = kv_heads * c.head_dim;
  const at::Tensor qkv = w.qkv.matmul(x, w.qkv_bias);
  // q and k heads are adjacent in the fused projection: normalise and rotate them in one pass.
  const int64_t qk_heads = heads + kv_heads;
  at::Tensor qk = qkv.narrow(1, 0, q_dim + kv_dim).view({T, qk_heads, c.head_dim});
  if (w.qk_norm.defined()) qk = rms_norm(qk, w.qk_norm, c.rms_eps);
  qk = apply_rope_(qk, positions, rope);  // the projection's output is this step's own
  return {qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads),
          qkv.narrow(1, q_dim + kv_dim, kv_dim).reshape({T, kv_heads, c.head_dim})};
}

at::Tensor ModelShard::attention_block(const at::Tensor& x, int64_t local, const StepBatch& batch,
                                       const StepContext& ctx, BlockPool& pool) const {
  const ModelConfig& c = weights_.config;
  const LayerWeights& w = weights_.layer[local];
  const auto [q, k, v] = project_qkv(x, local, ctx.positions);
  const int64_t pool_layer = weights_.layers.begin + local - std::max(weights_.layers.begin, first_cached_layer_);
  pool.write(pool_layer, ctx.slots, k, v);

  const double scale = attention_scale();
  const AttentionPath path = choose_attention_path(q, pool, batch, ctx, attention_path_, c.masked_or_capped_attention());
  if (attention_reads_keys(path) && !ctx.key_indices)
    throw std::logic_error("attention path " + attention_path_name(path) +
                           " needs the step's key indices, which its context was built without");
  ++attention_calls_[static_cast<size_t>(path)];
  switch (path) {
    case AttentionPath::kPagedDecode: {
      const AttentionWindow window = attention_window(batch, weights_.layers.begin + local);
      return reduced(w.o.matmul(ctx.decode_only ? paged_decode(q, pool, pool_layer, ctx, scale, window)
                                                : paged_prefill(q, pool, pool_layer, ctx, scale, window)));
    }
    case AttentionPath::kVarlen:
      return reduced(w.o.matmul(varlen_causal_attention(q, pool.gather_keys(pool_layer, ctx.key_slots),
                                                        pool.gather_values(pool_layer, ctx.key_slots), ctx, scale)));
    case AttentionPath::kPerSequence:
      break;
  }
  const AttentionWindow window = attention_window(batch, weights_.layers.begin + local);
  std::vector<at::Tensor> outs;
  outs.reserve(batch.seqs.size());
  int64_t start = 0;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const int64_t n = batch.seqs[i].num_new;
    const at::Tensor& slots = ctx.seq_slots[i];
    // Gathered in the compute dtype whatever the pool stores (cache.dtype).
    outs.push_back(windowed_attention(q.narrow(0, start, n), pool.gather_keys(pool_layer, slots),
                                      pool.gather_values(pool_layer, slots), ctx.positions.narrow(0, start, n),
                                      ctx.seq_key_positions[i], window, scale));
    start += n;
  }
  const at::Tensor attn = outs.size() == 1 ? outs[0] : at::cat(outs);
  return reduced(w.o.matmul(attn));
}

at::Tensor ModelShard::recompute_attention_block(const at::Tensor& x, int64_t local, const StepBatch& batch,
                                                 const StepContext& ctx) const {
  const LayerWeights& w = weights_.layer[local];
  const auto [q, k, v] = project_qkv(x, local, ctx.full_positions);
  const double scale = attention_scale();
  const AttentionWindow window = attention_window(batch, weights_.layers.begin + local);
  std::vector<at::Tensor> outs;
  int64_t start = 0;
  for (const SeqStep& s : batch.seqs) {
    const int64_t total = s.context_len + s.num_new;
    const at::Tensor pos = ctx.full_positions.narrow(0, start, total);
    outs.push_back(windowed_attention(q.narrow(0, start, total), k.narrow(0, start, total),
                                      v.narrow(0, start, total), pos, pos, window, scale));
    start += total;
  }
  const at::Tensor attn = outs.size() == 1 ? outs[0] : at::cat(outs);
  return reduced(w.o.matmul(attn));
}

at::Tensor ModelShard::forward(at::Tensor hidden, const StepBatch& batch, const StepContext& ctx,
                               BlockPool& pool) const {
  const double eps = weights_.config.rms_eps;
  const int64_t count = weights_.layers.size();
  // Each residual add is fused with the norm that reads its result (the post-attention norm,
  // the next layer's input norm); `x` carries a norm computed ahead into the next layer.
  at::Tensor x;
  for (int64_t l = 0; l < count; ++l) {
    const LayerWeights& w = weights_.layer[l];
    const int64_t layer = weights_.layers.begin + l;
    const bool cached = layer >= first_cached_layer_;
    if (!x.defined()) x = rms_norm(hidden, w.input_norm, eps);
    at::Tensor attn = cached ? attention_block(x, l, batch, ctx, pool) : recompute_attention_block(x, l, batch, ctx);
    if (w.attn_out_norm.defined()) attn = rms_norm(attn, w.attn_out_norm, eps);
    ResidualAndNorm post = add_rms_norm(hidden, attn, w.post_norm, eps);
    hidden = std::move(post.sum);
    const at::Tensor gate_up = w.gate_up.matmul(post.normed);
    at::Tensor mlp = reduced(w.down.matmul(weights_.config.gelu_tanh ? geglu(gate_up) : swiglu(gate_up)));
    if (w.mlp_out_norm.defined()) mlp = rms_norm(mlp, w.mlp_out_norm, eps);
    x = at::Tensor();
    if (!cached && layer + 1 == first_cached_layer_) {
      // Past the last layer without K/V only the new tokens' rows are needed.
      hidden = (hidden + mlp).index_select(0, ctx.new_rows);
    } else if (l + 1 < count) {
      ResidualAndNorm next = add_rms_norm(hidden, mlp, weights_.layer[l + 1].input_norm, eps);
      hidden = std::move(next.sum);
      x = std::move(next.normed);
    } else {
      hidden = hidden + mlp;  // the stage's output: the next stage or the head norms it
    }
  }
  return hidden;
}

at::Tensor ModelShard::logits(const at::Tensor& hidden) const {
  at::Tensor out = weights_.lm_head.matmul(rms_norm(hidden, weights_.final_norm, weights_.config.rms_eps));
  const double cap = weights_.config.final_softcap;
  if (cap > 0) out = out.div(cap).tanh_().mul_(cap);
  out = out.to(at::kFloat);
  // Each rank's vocabulary slice, side by side on the leader in vocabulary order.
  if (!weights_.split.whole()) return group_->gather_columns(out);
  return out;
}

}  // namespace kvpipe
