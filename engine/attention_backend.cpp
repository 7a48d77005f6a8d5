#include "engine/attention_backend.h"

#include "engine/kernels/cpu/paged_attention.h"
#include "engine/kernels/cpu/paged_prefill_attention.h"
#include "engine/kernels/cuda/paged_decode.h"
#include "engine/layers.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <stdexcept>
#include <vector>

namespace kvpipe {

AttentionPath parse_attention_path(const std::string& name, const std::string& what) {
  if (name == "per_sequence") return AttentionPath::kPerSequence;
  if (name == "varlen") return AttentionPath::kVarlen;
  if (name == "paged") return AttentionPath::kPagedDecode;
  throw std::invalid_argument(what + ": unknown attention path '" + name + "' (per_sequence, varlen, paged)");
}

std::string attention_path_name(AttentionPath path) {
  switch (path) {
    case AttentionPath::kPerSequence: return "per_sequence";
    case AttentionPath::kVarlen: return "varlen";
    case AttentionPath::kPagedDecode: return "paged";
  }
  return "?";
}

std::optional<AttentionPath> attention_path_from_env() {
  static const std::optional<AttentionPath> path = []() -> std::optional<AttentionPath> {
    const char* value = std::getenv("KVPIPE_ATTENTION");
    if (value == nullptr || *value == '\0') return std::nullopt;
    return parse_attention_path(value, "KVPIPE_ATTENTION");
  }();
  return path;
}

bool paged_decode_fits(at::ScalarType q_dtype, int64_t head_dim, bool on_gpu, const BlockPool& pool,
                       const StepBatch& batch) {
  if (!on_gpu) return q_dtype == at::kFloat;  // decode steps on the decode kernel, others on the prefill one
  if (!is_decode_only(batch)) return false;
  if (batch.window_recent > 0 || pool.dtype() == KvDtype::kQ8_0) return false;
  if (kv_storage_scalar_type(pool.dtype()) != q_dtype) return false;
  return head_dim == 64 || head_dim == 128;
}

bool paged_decode_fits(at::ScalarType q_dtype, int64_t head_dim, bool on_gpu, const BlockPool& pool,
                       const StepBatch& batch, const StepContext& ctx) {
  return (ctx.decode_only || !on_gpu) && paged_decode_fits(q_dtype, head_dim, on_gpu, pool, batch);
}

bool attention_reads_keys(AttentionPath path) { return path != AttentionPath::kPagedDecode; }

namespace {

bool is_16bit(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

bool varlen_fits(at::ScalarType q_dtype, int64_t head_dim, bool on_gpu, const StepBatch& batch) {
  if (batch.window_recent > 0) return false;
  // FlashAttention-2: 16-bit, head sizes up to 256 in multiples of 8.
  return !on_gpu || (is_16bit(q_dtype) && head_dim % 8 == 0 && head_dim <= 256);
}

AttentionPath choose_path(bool on_gpu, bool paged, bool varlen, std::optional<AttentionPath> preferred) {
  if (preferred) {
    if (*preferred == AttentionPath::kPagedDecode && paged) return *preferred;
    if (*preferred == AttentionPath::kVarlen && varlen) return *preferred;
    if (*preferred == AttentionPath::kPerSequence) return *preferred;
  }
  // The CPU's steps take its paged kernels (its varlen path is a reference); a GPU's decode
  // steps take its paged kernel and the others FlashAttention varlen where it applies.
  if (paged) return AttentionPath::kPagedDecode;
  if (!on_gpu) return AttentionPath::kPerSequence;
  if (varlen) return AttentionPath::kVarlen;
  return AttentionPath::kPerSequence;
}

}  // namespace

AttentionPath choose_attention_path(const at::Tensor& q, const BlockPool& pool, const StepBatch& batch,
                                    const StepContext& ctx, std::optional<AttentionPath> preferred,
                                    bool masked_or_capped) {
  const bool on_gpu = !q.is_cpu();
  return choose_path(on_gpu,
                     (!on_gpu || !masked_or_capped) &&
                         paged_decode_fits(q.scalar_type(), q.size(-1), on_gpu, pool, batch, ctx),
                     !masked_or_capped && varlen_fits(q.scalar_type(), q.size(-1), on_gpu, batch), preferred);
}

AttentionPath choose_attention_path(at::ScalarType q_dtype, int64_t head_dim, bool on_gpu, const BlockPool& pool,
                                    const StepBatch& batch, std::optional<AttentionPath> preferred,
                                    bool masked_or_capped) {
  return choose_path(on_gpu, (!on_gpu || !masked_or_capped) && paged_decode_fits(q_dtype, head_dim, on_gpu, pool, batch),
                     !masked_or_capped && varlen_fits(q_dtype, head_dim, on_gpu, batch), preferred);
}

at::Tensor varlen_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const StepContext& ctx, double scale) {
  const int64_t T = q.size(0), heads = q.size(1), hd = q.size(2);
  if (q.is_cuda()) {
    // Grouped-query heads are native; the causal mask is aligned to the bottom right, so each
    // sequence's new queries see their cached context and each other in order.
    const auto out = at::_flash_attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), ctx.cu_seqlens_q,
                                                  ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
                                                  /*dropout_p=*/0.0, /*is_causal=*/true,
                                                  /*return_debug_mask=*/false, scale);
    return std::get<0>(out).reshape({T, heads * hd});
  }
  // The reference: one causal attention per sequence over the same packed rows.
  const at::Tensor cu_q = ctx.cu_seqlens_q.to(at::kCPU), cu_k = ctx.cu_seqlens_k.to(at::kCPU);
  const int32_t* qs = cu_q.data_ptr<int32_t>();
  const int32_t* ks = cu_k.data_ptr<int32_t>();
  std::vector<at::Tensor> outs;
  for (int64_t i = 0; i + 1 < cu_q.numel(); ++i) {
    const int64_t n = qs[i + 1] - qs[i], L = ks[i + 1] - ks[i];
    outs.push_back(causal_attention(q.narrow(0, qs[i], n), k.narrow(0, ks[i], L), v.narrow(0, ks[i], L), scale));
  }
  return outs.empty() ? at::empty({0, heads * hd}, q.options()) : at::cat(outs);
}

at::Tensor paged_decode(const at::Tensor& q, const BlockPool& pool, int64_t layer, const StepContext& ctx,
                        double scale, const AttentionWindow& window) {
  const int64_t S = q.size(0), heads = q.size(1), hd = q.size(2);
  if (q.is_cuda()) {
    if (window.recent > 0 || window.sliding > 0 || window.softcap > 0)
      throw std::logic_error("paged decode: the CUDA kernel has no window or soft-cap");
    return paged_decode_attention(q.contiguous(), pool.keys(layer), pool.values(layer), ctx.block_tables,
                                  ctx.context_lens, pool.block_size(), scale)
        .reshape({S, heads * hd});
  }
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const at::Tensor tables = ctx.block_tables.to(at::kInt).contiguous(), lens = ctx.context_lens.to(at::kInt).contiguous();
  if (tables.dim() != 2 || tables.size(0) != S || lens.numel() != S)
    throw std::logic_error("paged decode: block tables or context lengths do not match the step's queries");
  at::Tensor out = at::empty({S, heads, hd}, qf.options());
  paged_decode_attention_cpu(qf.data_ptr<float>(), S, heads, paged_kv_layer(pool, layer), tables.data_ptr<int32_t>(),
                             tables.size(1), lens.data_ptr<int32_t>(),
                             {window.sinks, window.recent, window.sliding, window.softcap}, static_cast<float>(scale),
                             out.data_ptr<float>());
  return out.to(q.scalar_type()).reshape({S, heads * hd});
}

at::Tensor paged_prefill(const at::Tensor& q, const BlockPool& pool, int64_t layer, const StepContext& ctx,
                         double scale, const AttentionWindow& window) {
  const int64_t T = q.size(0), heads = q.size(1), hd = q.size(2);
  if (q.is_cuda()) throw std::logic_error("paged prefill: there is no CUDA kernel; prefill there is varlen");
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const at::Tensor tables = ctx.block_tables.to(at::kInt).contiguous(), lens = ctx.context_lens.to(at::kInt).contiguous();
  const at::Tensor cu_q = ctx.cu_seqlens_q.to(at::kInt).contiguous();
  const int64_t S = cu_q.numel() - 1;
  if (ctx.decode_only || tables.dim() != 2 || tables.size(0) != S || lens.numel() != S ||
      cu_q.data_ptr<int32_t>()[S] != T)
    throw std::logic_error("paged prefill: block tables, context lengths or query offsets do not match the step");
  at::Tensor out = at::empty({T, heads, hd}, qf.options());
  paged_prefill_attention_cpu(qf.data_ptr<float>(), heads, paged_kv_layer(pool, layer), tables.data_ptr<int32_t>(),
                              tables.size(1), lens.data_ptr<int32_t>(), cu_q.data_ptr<int32_t>(), S,
                              {window.sinks, window.recent, window.sliding, window.softcap}, static_cast<float>(scale),
                              out.data_ptr<float>());
  return out.to(q.scalar_type()).reshape({T, heads * hd});
}

}  // namespace kvpipe
