// paged_decode: attention of one new query token per sequence over that sequence's cached
// keys and values, read on the GPU straight from a BlockPool layer through block tables.
//
// Owns the CUDA kernels and their launch; guarantees the result of the float64 reference of the
// same algorithm (engine/kernels/cpu/paged_decode_reference.h) up to float32 accumulation and
// the rounding of the output to the query's dtype. Each (sequence, KV head, 512-token
// partition) is one thread block that reads its keys and values once for every query head
// sharing that KV head (grouped-query attention), keeps a running maximum and sum (online
// softmax), and leaves a partial result; a second kernel merges the partitions, as vLLM's
// paged_attention_v2. Work is queued on the current PyTorch CUDA stream of the query's device.
//
// This header includes no CUDA header, so CPU-only translation units may call the entry point;
// its argument checks that need no GPU (shapes, dtypes, head_dim, devices) run first and
// throw std::invalid_argument without one.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvpipe {

// Tokens of one partition: one thread block's share of a sequence's context.
constexpr int64_t kPagedDecodePartitionTokens = 512;

// query         [num_seqs, num_heads, head_dim]: the new token of each sequence.
// key_cache,
// value_cache   [num_blocks * block_size, num_kv_heads, head_dim], contiguous: one layer of a
//               BlockPool as BlockPool::keys(layer) / values(layer) return it; row
//               block * block_size + offset holds the token at `offset` of block `block`.
// block_tables  int32 [num_seqs, max_blocks]: token p of sequence s lives in block
//               block_tables[s][p / block_size] (entries past the context are not read).
// context_lens  int32 [num_seqs]: tokens each query attends to, itself included (>= 1).
// Query head h reads KV head h / (num_heads / num_kv_heads). Query, keys and values are all
// float32, float16 or bfloat16 (one dtype), on one CUDA device; head_dim is 64 or 128.
// Returns [num_seqs, num_heads, head_dim] in the query's dtype:
//   out[s][h] = sum_p softmax_p(scale * q[s][h] . k_p) v_p over the context of s.
// Block ids and context lengths are read on the device only (checking them on the host would
// cost a copy and a synchronisation every step): a sequence whose context is longer than its
// block table or that names a block outside the pool gets NaN in every output value.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, int64_t block_size, double scale);

}  // namespace kvpipe
