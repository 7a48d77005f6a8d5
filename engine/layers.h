// The math of a Llama-family decoder layer, as free functions on tensors.
//
// Each function follows the HF reference implementation (RMSNorm in the input dtype with
// float32 statistics, RoPE in the rotate-half convention, SwiGLU) and is checked against an
// independent float64 computation in the tests. `dense` on the CPU is WeightMatrix::matmul
// (engine/model/weight_matrix.h): kvpipe's kernels for decode's few rows, the faster of those and
// BLAS for prefill's many.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

namespace kvpipe {

// x [T, hidden] -> x / rms(x) * weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// The residual stream's next value and its norm: {x + delta, rms_norm(x + delta, weight, eps)},
// in one pass over the rows for float32 on the CPU (equal bit for bit to the two calls).
struct ResidualAndNorm {
  at::Tensor sum;
  at::Tensor normed;
};
ResidualAndNorm add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps);

// cos and sin tables [max_position, rotated dims] for RoPE in the rotate-half layout,
// computed in float64 (and multiplied by RoPE's attention factor, as transformers does for
// yarn) and stored as `dtype`.
struct RopeTables {
  at::Tensor cos;
  at::Tensor sin;
};
// Plain RoPE over all of head_dim with base `theta`.
RopeTables make_rope_tables(int64_t max_position, int64_t head_dim, double theta,
                            at::ScalarType dtype);
// The same for inverse frequencies given (rope_inv_freq: RoPE with the model's scaling).
RopeTables make_rope_tables(int64_t max_position, const std::vector<double>& inv_freq, at::ScalarType dtype,
                            double attention_factor = 1.0);

// x [T, heads, head_dim] rotated at `positions` (int64 [T]). Tables narrower than head_dim
// rotate its first dimensions and pass the others through (partial rotary embedding).
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& positions, const RopeTables& rope);
// The same rotation written into x where the fused kernels take it (float32 on the CPU, last
// dimension contiguous: a view of the fused q/k/v projection's output), returning x; a rotated
// copy otherwise. Bit for bit apply_rope's values.
at::Tensor apply_rope_(const at::Tensor& x, const at::Tensor& positions, const RopeTables& rope);

// x [T, in] @ weight[out, in]^T (+ bias).
at::Tensor dense(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

// gate_up [T, 2 * ff] -> silu(gate) * up, [T, ff].
at::Tensor swiglu(const at::Tensor& gate_up);
// gate_up [T, 2 * ff] -> gelu(gate) * up with gelu's tanh approximation (Gemma's GeGLU).
at::Tensor geglu(const at::Tensor& gate_up);

// Which earlier positions a query sees: all of them (recent == 0), or the first `sinks`
// and the last `recent` (itself included), as in attention sinks with a sliding window.
struct AttentionWindow {
  int64_t sinks = 0;
  int64_t recent = 0;
  // A layer's own sliding window (Gemma 2's local layers): query q sees key k only when
  // k > q - sliding, whatever the keys given, a single decode query's included; 0: none.
  int64_t sliding = 0;
  // Scores soft-capped as softcap * tanh(score / softcap) before the mask (Gemma 2); 0: not.
  double softcap = 0.0;
};

// Attention of one sequence's queries q [n, heads, head_dim] at `q_positions` (int64 [n])
// over keys and values [L, kv_heads, head_dim] at `k_positions` (int64 [L]); query i sees
// key j when k_j <= q_i and the window allows it. Query head h reads kv head
// h / (heads / kv_heads) (grouped-query attention). Returns [n, heads * head_dim]. Unless
// the window has `sliding`, a single query is taken to see every key it is given (the caller
// gathers only those).
at::Tensor windowed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& q_positions, const at::Tensor& k_positions,
                              const AttentionWindow& window, double scale);

// Causal attention of one sequence's new queries over its cached context.
// q [n, heads, head_dim]: the queries at positions context_len - n .. context_len - 1;
// k, v [context_len, kv_heads, head_dim]: every key/value up to the last query, in order.
// Query head h reads kv head h / (heads / kv_heads) (grouped-query attention).
// Returns [n, heads * head_dim].
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale);

}  // namespace kvpipe
