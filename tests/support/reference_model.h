// A reference forward pass for tests: the whole sequence at once with a dense mask, no
// cache, no block tables, no chunking, written with plain ATen ops apart from the layer
// functions that have float64 tests of their own.
#pragma once

#include "engine/layers.h"
#include "engine/model/model_weights.h"

#include <ATen/ATen.h>

#include <cmath>
#include <vector>

namespace kvpipe::testing {

// Logits [T, vocab] of every position of `tokens`; with a window, position p attends to
// positions j <= p with j < sinks or j > p - recent.
inline at::Tensor full_recompute_logits(const ModelWeights& w, const std::vector<int64_t>& tokens,
                                        int64_t sinks = 0, int64_t recent = 0) {
  const ModelConfig& c = w.config;
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int64_t group = c.num_heads / c.num_kv_heads;
  const at::Tensor pos = at::arange(T, at::kLong);
  const RopeTables rope = make_rope_tables(c.max_position, c.head_dim, c.rope_theta, at::kFloat);
  at::Tensor h = w.embedding.dequantize().index_select(0, at::tensor(tokens, at::kLong));
  at::Tensor mask = at::ones({T, T}, at::kBool).triu(1);
  if (recent > 0) {
    const at::Tensor q = pos.unsqueeze(1), k = pos.unsqueeze(0);
    mask = mask.logical_or((k >= sinks).logical_and(k <= q - recent));
  }
  for (const LayerWeights& l : w.layer) {
    const at::Tensor x = rms_norm(h, l.input_norm, c.rms_eps);
    at::Tensor qkv = at::matmul(x, l.qkv.dequantize().t());
    if (l.qkv_bias.defined()) qkv = qkv + l.qkv_bias;
    const int64_t qd = c.num_heads * c.head_dim, kd = c.num_kv_heads * c.head_dim;
    at::Tensor q = apply_rope(qkv.narrow(1, 0, qd).reshape({T, c.num_heads, c.head_dim}), pos, rope);
    at::Tensor k = apply_rope(qkv.narrow(1, qd, kd).reshape({T, c.num_kv_heads, c.head_dim}), pos, rope);
    at::Tensor v = qkv.narrow(1, qd + kd, kd).reshape({T, c.num_kv_heads, c.head_dim});
    k = k.repeat_interleave(group, 1);
    v = v.repeat_interleave(group, 1);
    at::Tensor scores = at::einsum("qhd,khd->hqk", {q, k}) / std::sqrt(static_cast<double>(c.head_dim));
    scores = scores.masked_fill(mask, -INFINITY).softmax(-1);
    const at::Tensor attn = at::einsum("hqk,khd->qhd", {scores, v}).reshape({T, qd});
    h = h + at::matmul(attn, l.o.dequantize().t());
    const at::Tensor y = at::matmul(rms_norm(h, l.post_norm, c.rms_eps), l.gate_up.dequantize().t());
    h = h + at::matmul(swiglu(y), l.down.dequantize().t());
  }
  return at::matmul(rms_norm(h, w.final_norm, c.rms_eps), w.lm_head.dequantize().t());
}

}  // namespace kvpipe::testing
