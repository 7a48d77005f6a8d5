// Attention backends: which implementation computes a layer's attention over the paged KV
// cache for a step, by device, dtype and the step's shape, and the two batched ones.
//
// Three paths give the same result (up to rounding): the per-sequence one of engine/layers.h
// (every device and dtype, windows and sinks included: the CPU's path), FlashAttention-2
// varlen over the step's keys gathered through their slots (CUDA, 16-bit, no window: prefill
// and mixed steps), and the paged decode kernel reading the pool in place through block
// tables (CUDA, one new token per sequence, no window: decode steps). On the CPU the batched
// paths run their references (a per-sequence loop over the same packed indices, and the
// float64 paged decode reference), so their indexing is tested where no GPU is.
//
// On the CPU every step reads the pool in place through block tables (the `paged` path, every
// stored type and window): decode steps on kvpipe's paged decode kernel
// (engine/kernels/cpu/paged_attention.h), prefill and mixed steps on its tiled prefill kernel
// (engine/kernels/cpu/paged_prefill_attention.h). The per-sequence path and the varlen one are
// references there.
#pragma once

#include "cache/block_pool.h"
#include "engine/layers.h"
#include "engine/step_batch.h"

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace kvpipe {

enum class AttentionPath { kPerSequence, kVarlen, kPagedDecode };

// "per_sequence" | "varlen" | "paged"; std::invalid_argument naming `what` otherwise.
AttentionPath parse_attention_path(const std::string& name, const std::string& what);
std::string attention_path_name(AttentionPath path);

// KVPIPE_ATTENTION, when set: the path every step should take where it can (benchmarks
// compare them; tests force the batched paths on the CPU). Read once per process.
std::optional<AttentionPath> attention_path_from_env();

// Whether the paged kernels take a step. On a GPU: one new token per sequence, no window,
// float storage of the query's dtype and a head size the decode kernel was built for (64 or
// 128). On the CPU: every step with float32 queries (its decode and prefill kernels read every
// stored type, windows included).
bool paged_decode_fits(at::ScalarType q_dtype, int64_t head_dim, bool on_gpu, const BlockPool& pool,
                       const StepBatch& batch, const StepContext& ctx);
bool paged_decode_fits(at::ScalarType q_dtype, int64_t head_dim, bool on_gpu, const BlockPool& pool,
                       const StepBatch& batch);

// The path for one layer of a step: `preferred` when given and the step allows it, otherwise
// the fastest that does. q is [T, heads, head_dim] on the compute device. With
// `masked_or_capped` (a model whose attention is soft-capped or has sliding-window layers:
// ModelConfig::masked_or_capped_attention) only the per-sequence path and the CPU's paged
// kernel compute it: the GPU's batched kernels know neither.
AttentionPath choose_attention_path(const at::Tensor& q, const BlockPool& pool, const StepBatch& batch,
                                    const StepContext& ctx, std::optional<AttentionPath> preferred,
                                    bool masked_or_capped = false);
// The same choice before any tensor of the step exists (its context is built for the path).
AttentionPath choose_attention_path(at::ScalarType q_dtype, int64_t head_dim, bool on_gpu, const BlockPool& pool,
                                    const StepBatch& batch, std::optional<AttentionPath> preferred,
                                    bool masked_or_capped = false);

// Whether `path` reads the step's per-key indices (StepContext::key_indices): the per-sequence
// and varlen paths gather keys through them; the paged decode path reads block tables.
bool attention_reads_keys(AttentionPath path);

// Each sequence's new queries (q [T, heads, head_dim]) over layer `layer` of `pool` through the
// step's per-sequence block tables, context lengths and query offsets (cu_seqlens_q), on the
// CPU's tiled prefill kernel, seeing what `window` lets each position see. Returns [T, heads *
// head_dim]. CPU only.
at::Tensor paged_prefill(const at::Tensor& q, const BlockPool& pool, int64_t layer, const StepContext& ctx,
                         double scale, const AttentionWindow& window = {});

// Causal attention of each sequence's new queries (rows cu_seqlens_q[i] .. of q [T, heads,
// head_dim]) over its keys and values (rows cu_seqlens_k[i] .. of k, v [K, kv_heads,
// head_dim], in position order, the last new token's last): FlashAttention-2 varlen with the
// causal mask aligned to the bottom right. Returns [T, heads * head_dim].
at::Tensor varlen_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const StepContext& ctx, double scale);

// One new query per sequence (q [S, heads, head_dim]) over layer `layer` of `pool` through
// the step's block tables and context lengths, seeing what `window` lets it see (on a GPU the
// window must be empty: paged_decode_fits). Returns [S, heads * head_dim].
at::Tensor paged_decode(const at::Tensor& q, const BlockPool& pool, int64_t layer, const StepContext& ctx,
                        double scale, const AttentionWindow& window = {});

}  // namespace kvpipe
