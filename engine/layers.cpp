#include "engine/layers.h"

#include "engine/model/model_config.h"
#include "engine/model/weight_matrix.h"
#include "engine/kernels/cpu/blas_gemm.h"
#include "engine/kernels/cpu/fused_ops.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {

namespace {

// A float32 tensor on the CPU whose last dimension is contiguous: what the fused row kernels
// (engine/kernels/cpu/fused_ops.h) read.
bool cpu_float_rows(const at::Tensor& t) {
  return t.defined() && t.is_cpu() && t.scalar_type() == at::kFloat && t.dim() >= 1 && t.stride(-1) == 1;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (cpu_float_rows(x) && x.is_contiguous() && cpu_float_rows(weight) && weight.dim() == 1 &&
      weight.size(0) == x.size(-1) && x.numel() > 0) {
    const int64_t dim = x.size(-1), rows = x.numel() / dim;
    at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
    rms_norm_rows(x.data_ptr<float>(), dim, weight.contiguous().data_ptr<float>(), rows, dim, static_cast<float>(eps),
                  out.data_ptr<float>(), dim);
    return out;
  }
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor inv = at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true).add_(eps));
  return (xf * inv).to(x.scalar_type()) * weight;
}

ResidualAndNorm add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  if (cpu_float_rows(x) && cpu_float_rows(delta) && x.dim() == 2 && delta.sizes() == x.sizes() &&
      cpu_float_rows(weight) && weight.dim() == 1 && weight.size(0) == x.size(1) && x.numel() > 0) {
    const int64_t rows = x.size(0), dim = x.size(1);
    at::Tensor sum = at::empty({rows, dim}, x.options());
    at::Tensor normed = at::empty({rows, dim}, x.options());
    add_rms_norm_rows(x.data_ptr<float>(), x.stride(0), delta.data_ptr<float>(), delta.stride(0),
                      weight.contiguous().data_ptr<float>(), rows, dim, static_cast<float>(eps), sum.data_ptr<float>(),
                      normed.data_ptr<float>());
    return {sum, normed};
  }
  at::Tensor sum = x + delta;
  at::Tensor normed = rms_norm(sum, weight, eps);
  return {sum, normed};
}

RopeTables make_rope_tables(int64_t max_position, int64_t head_dim, double theta,
                            at::ScalarType dtype) {
  ModelConfig plain;
  plain.head_dim = head_dim;
  plain.rope_theta = theta;
  return make_rope_tables(max_position, rope_inv_freq(plain), dtype);
}

RopeTables make_rope_tables(int64_t max_position, const std::vector<double>& inv_freq, at::ScalarType dtype,
                            double attention_factor) {
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor inv = at::tensor(inv_freq, f64);
  const at::Tensor pos = at::arange(max_position, f64);
  const at::Tensor freqs = at::outer(pos, inv);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().mul_(attention_factor).to(dtype).contiguous(),
          emb.sin().mul_(attention_factor).to(dtype).contiguous()};
}

namespace {

// Whether x [T, heads, head_dim] takes the fused RoPE kernels: then `pos` holds the positions,
// contiguous, each checked against the tables.
bool fused_rope(const at::Tensor& x, const at::Tensor& positions, const RopeTables& rope, at::Tensor& pos) {
  const int64_t rotated = rope.cos.size(-1);
  if (!(cpu_float_rows(x) && x.dim() == 3 && rope.cos.is_contiguous() && rope.sin.is_contiguous() &&
        cpu_float_rows(rope.cos) && cpu_float_rows(rope.sin) && positions.is_cpu() &&
        positions.scalar_type() == at::kLong && positions.numel() == x.size(0) && rotated % 2 == 0 &&
        rotated <= x.size(-1)))
    return false;
  pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t max_position = rope.cos.size(0);
  for (int64_t i = 0; i < pos.numel(); ++i)
    if (p[i] < 0 || p[i] >= max_position)
      throw std::out_of_range("apply_rope: position " + std::to_string(p[i]) + " is outside the RoPE table of " +
                              std::to_string(max_position));
  return true;
}

}  // namespace

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& positions, const RopeTables& rope) {
  const int64_t rotated = rope.cos.size(-1), dim = x.size(-1);
  if (at::Tensor pos; fused_rope(x, positions, rope, pos)) {
    at::Tensor out = at::empty({x.size(0), x.size(1), dim}, x.options());
    rope_rows(x.data_ptr<float>(), x.size(0), x.size(1), dim, x.stride(0), x.stride(1), pos.data_ptr<int64_t>(),
              rope.cos.data_ptr<float>(), rope.sin.data_ptr<float>(), rotated, out.data_ptr<float>());
    return out;
  }
  const at::Tensor xr = rotated == dim ? x : x.narrow(-1, 0, rotated);
  const int64_t half = rotated / 2;
  const at::Tensor cos = rope.cos.index_select(0, positions).unsqueeze(1);
  const at::Tensor sin = rope.sin.index_select(0, positions).unsqueeze(1);
  const at::Tensor x1 = xr.narrow(-1, 0, half);
  const at::Tensor x2 = xr.narrow(-1, half, half);
  const at::Tensor out = xr * cos + at::cat({x2.neg(), x1}, -1) * sin;
  return rotated == dim ? out : at::cat({out, x.narrow(-1, rotated, dim - rotated)}, -1);
}

at::Tensor apply_rope_(const at::Tensor& x, const at::Tensor& positions, const RopeTables& rope) {
  if (at::Tensor pos; fused_rope(x, positions, rope, pos)) {
    rope_rows_in_place(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), x.stride(1), pos.data_ptr<int64_t>(),
                       rope.cos.data_ptr<float>(), rope.sin.data_ptr<float>(), rope.cos.size(-1));
    return x;
  }
  return apply_rope(x, positions, rope);
}

at::Tensor dense(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (x.is_cpu()) return WeightMatrix::from_tensor(weight).matmul(x, bias);
  return bias.defined() ? at::addmm(bias, x, weight.t()) : at::mm(x, weight.t());
}

namespace {

// gate_up [T, 2 * ff] on the fused kernel when it can take it (undefined otherwise).
at::Tensor fused_gated(const at::Tensor& gate_up, bool gelu_tanh) {
  if (!cpu_float_rows(gate_up) || gate_up.dim() != 2 || gate_up.size(1) % 2 != 0) return {};
  const int64_t rows = gate_up.size(0), ff = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, ff}, gate_up.options());
  gated_activation_rows(gate_up.data_ptr<float>(), rows, ff, gate_up.stride(0), gelu_tanh, out.data_ptr<float>());
  return out;
}

}  // namespace

at::Tensor swiglu(const at::Tensor& gate_up) {
  if (at::Tensor out = fused_gated(gate_up, false); out.defined()) return out;
  const int64_t ff = gate_up.size(-1) / 2;
  return at::silu(gate_up.narrow(-1, 0, ff)) * gate_up.narrow(-1, ff, ff);
}

at::Tensor geglu(const at::Tensor& gate_up) {
  if (at::Tensor out = fused_gated(gate_up, true); out.defined()) return out;
  const int64_t ff = gate_up.size(-1) / 2;
  return at::gelu(gate_up.narrow(-1, 0, ff), "tanh") * gate_up.narrow(-1, ff, ff);
}

namespace {

// One block of queries against keys [0, L): the whole computation, masks included.
at::Tensor attention_block(const at::Tensor& q, const at::Tensor& kt, const at::Tensor& vt,
                           const at::Tensor& q_positions, const at::Tensor& k_positions,
                           const AttentionWindow& window, double scale, int64_t kv_heads) {
  const int64_t n = q.size(0), heads = q.size(1), hd = q.size(2), L = kt.size(2);
  const int64_t group = heads / kv_heads;
  // [kv_heads, group * n, hd]: query heads sharing a kv head become rows of one product.
  const at::Tensor qg = q.reshape({n, kv_heads, group, hd}).permute({1, 2, 0, 3}).reshape({kv_heads, group * n, hd});
  at::Tensor scores = cpu_bmm(qg, kt).mul_(scale).view({kv_heads, group, n, L});
  if (window.softcap > 0) scores = scores.div_(window.softcap).tanh_().mul_(window.softcap);
  if (n > 1 || window.sliding > 0) {
    const at::Tensor qp = q_positions.unsqueeze(1), kp = k_positions.unsqueeze(0);
    at::Tensor hidden = kp > qp;
    if (window.recent > 0) hidden = hidden.logical_or((kp >= window.sinks).logical_and(kp <= qp - window.recent));
    if (window.sliding > 0) hidden = hidden.logical_or(kp <= qp - window.sliding);
    scores.masked_fill_(hidden, -std::numeric_limits<float>::infinity());
  }
  const at::Tensor probs = at::softmax(scores.to(at::kFloat), -1).to(q.scalar_type());
  const at::Tensor out = cpu_bmm(probs.view({kv_heads, group * n, L}), vt);
  return out.view({kv_heads, group, n, hd}).permute({2, 0, 1, 3}).reshape({n, heads * hd});
}

// Queries per block of a long prompt: each block skips the keys after its last query, which
// halves a causal prefill's attention work, and its scores stay cache-sized.
constexpr int64_t kQueryBlock = 256;

}  // namespace

at::Tensor windowed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& q_positions, const at::Tensor& k_positions,
                              const AttentionWindow& window, double scale) {
  const int64_t n = q.size(0), L = k.size(0), kv_heads = k.size(1);
  if (n <= kQueryBlock) {  // decode and short chunks: one block, on views of K and V
    return attention_block(q, k.permute({1, 2, 0}), v.permute({1, 0, 2}), q_positions, k_positions, window, scale,
                           kv_heads);
  }
  // Copied once so that every block's products read K and V contiguously.
  const at::Tensor kt = k.permute({1, 2, 0}).contiguous();  // [kv_heads, hd, L]
  const at::Tensor vt = v.permute({1, 0, 2}).contiguous();  // [kv_heads, L, hd]
  // Keys in position order (as a sequence's cache gathers them) let a block stop at the
  // first key past its last query; otherwise every block sees every key.
  const at::Tensor kp = k_positions.contiguous();
  const bool sorted = L < 2 || (kp.narrow(0, 1, L - 1) >= kp.narrow(0, 0, L - 1)).all().item<bool>();
  const at::Tensor qp_cpu = q_positions.to(at::kCPU).contiguous();
  const at::Tensor kp_cpu = kp.to(at::kCPU);
  std::vector<at::Tensor> outs;
  for (int64_t b = 0; b < n; b += kQueryBlock) {
    const int64_t m = std::min(kQueryBlock, n - b);
    const at::Tensor qp = q_positions.narrow(0, b, m);
    int64_t keys = L;
    if (sorted) {
      const int64_t last = qp_cpu.narrow(0, b, m).max().item<int64_t>();
      keys = (kp_cpu <= last).sum().item<int64_t>();
      keys = std::max<int64_t>(keys, 1);
    }
    outs.push_back(attention_block(q.narrow(0, b, m), kt.narrow(2, 0, keys), vt.narrow(1, 0, keys), qp,
                                   kp.narrow(0, 0, keys), window, scale, kv_heads));
  }
  return at::cat(outs, 0);
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  const int64_t n = q.size(0), L = k.size(0);
  const auto opts = at::TensorOptions().dtype(at::kLong).device(q.device());
  return windowed_attention(q, k, v, at::arange(L - n, L, opts), at::arange(L, opts), {}, scale);
}

}  // namespace kvpipe
