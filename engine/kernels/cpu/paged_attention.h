// paged_attention: decode attention on the CPU over the paged KV pool, read in place.
//
// Owns the CPU's decode attention: one new query per sequence against the keys and values its
// block table points at, in the pool's stored type (float32, float16, bfloat16 or q8_0 with its
// float16 scales), without gathering them into a tensor first. Work is split over the rank's
// thread pool by (sequence, KV head, partition of 256 visible keys); each item runs an online
// softmax for the query heads that share its KV head, and a merge by the partitions' maxima
// and sums combines them. Every product and sum is float32. The window of attention sinks
// plus recent keys, a layer's own sliding window and Gemma 2's score soft-cap are applied as
// engine/layers.h defines them, so the kernel serves every decode step the per-sequence path
// would. Its specification is the float64 paged decode reference
// (engine/kernels/cpu/paged_decode_reference.h), which the tests hold it to.
//
// Scratch memory is per thread and reused from step to step; it grows only with the largest
// (sequences x KV heads x partitions) seen, never per key.
#pragma once

#include "cache/block_pool.h"

#include <cstdint>

namespace kvpipe {

// One layer of the pool as stored: row `slot * kv_heads + h` of keys/values is head h's
// head_dim values at that slot (q8_0: int8 values with one float16 scale per 32 of them in
// key_scales/value_scales, laid out the same way with head_dim / 32 per row).
struct PagedKvLayer {
  KvDtype dtype = KvDtype::kFloat32;
  const void* keys = nullptr;
  const void* values = nullptr;
  const uint16_t* key_scales = nullptr;
  const uint16_t* value_scales = nullptr;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t block_size = 0;
  int64_t num_blocks = 0;
};

// Which keys the query at position p (= context length - 1) sees: k <= p, and with `recent`
// only k < sinks or k > p - recent, and with `sliding` only k > p - sliding.
struct PagedDecodeWindow {
  int64_t sinks = 0;
  int64_t recent = 0;
  int64_t sliding = 0;
  double softcap = 0.0;  // scores become softcap * tanh(score / softcap) when positive
};

// Layer `layer` of `pool` as stored (CPU storage only).
PagedKvLayer paged_kv_layer(const BlockPool& pool, int64_t layer);

// out[s, h, :] = softmax(q[s, h] . K / ...) V over the keys sequence s sees. q and out are
// float32 [num_seqs, num_heads, head_dim], contiguous; block_tables int32 [num_seqs,
// max_blocks] row-major (-1 for blocks a window freed); context_lens int32 [num_seqs].
// num_heads must be a multiple of kv.kv_heads. A context length outside [1, max_blocks *
// block_size], or a visible position whose block is outside the pool, is refused with
// std::invalid_argument naming context_lens or block_tables.
void paged_decode_attention_cpu(const float* q, int64_t num_seqs, int64_t num_heads, const PagedKvLayer& kv,
                                const int32_t* block_tables, int64_t max_blocks, const int32_t* context_lens,
                                const PagedDecodeWindow& window, float scale, float* out);

// Whether the vector (AVX2 + FMA + F16C) version runs: the same decision as the dot kernels'
// (KVPIPE_CPU_KERNELS=portable turns it off).
const char* paged_attention_isa();

}  // namespace kvpipe
