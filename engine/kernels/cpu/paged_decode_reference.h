// paged_decode_reference: the CPU, float64 statement of paged decode attention
// (engine/kernels/cuda/paged_decode.h), and the argument contract both share.
//
// Owns the reference result the CUDA kernel is tested against. It runs the kernel's algorithm,
// not a shortcut: per (sequence, KV head, 512-token partition) an online softmax over the
// tokens read through the block table, then a merge of the partitions by their maxima and
// sums; every product and sum in double. Unlike the kernel it reads block tables and context
// lengths on the host, so it refuses bad ones with std::invalid_argument.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvpipe {

struct PagedDecodeDims {
  int64_t num_seqs = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t max_blocks = 0;  // columns of block_tables
};

enum class PagedDecodeDevice { kCpu, kCuda };

// The checks of paged_decode_attention's arguments that read no tensor data: shapes, dtypes,
// head_dim (64 or 128 where `device` is kCuda; any positive size on the CPU), block_size,
// scale, then devices and layouts last, so everything else is checked without a GPU. Throws
// std::invalid_argument with a one-line message naming the argument.
PagedDecodeDims check_paged_decode_inputs(const at::Tensor& query, const at::Tensor& key_cache,
                                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                                          const at::Tensor& context_lens, int64_t block_size, double scale,
                                          PagedDecodeDevice device);

// paged_decode_attention's arguments (see engine/kernels/cuda/paged_decode.h), on the CPU.
// Returns float64 [num_seqs, num_heads, head_dim]. Also refuses a context length outside
// [1, max_blocks * block_size] (naming context_lens) and a block id outside the pool (naming
// block_tables).
at::Tensor paged_decode_reference(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, int64_t block_size, double scale);

}  // namespace kvpipe
