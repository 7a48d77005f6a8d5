// What the CPU paged attention kernels' tests share: a pool of random keys and values, block
// tables that scatter each sequence over it, and which keys a position sees under a window (as
// engine/layers.h defines it, restated here so the tests do not take it from the kernels).
#pragma once

#include "cache/block_pool.h"
#include "engine/kernels/cpu/paged_attention.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

namespace kvpipe::testing {

// Two layers (the tests read the second, whose storage starts at an offset) of random K/V in
// `dtype`. Keys of std 3: peaked softmaxes, so that running maxima move and merges matter.
inline std::unique_ptr<BlockPool> random_kv_pool(int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                                 int64_t num_blocks, KvDtype dtype, uint32_t seed) {
  KvShape shape;
  shape.num_layers = 2, shape.block_size = block_size, shape.num_kv_heads = kv_heads, shape.head_dim = head_dim;
  auto pool = std::make_unique<BlockPool>(shape, num_blocks, at::kFloat, at::Device(at::kCPU), dtype);
  at::manual_seed(seed);
  const int64_t slots = num_blocks * block_size;
  for (int64_t layer = 0; layer < 2; ++layer)
    pool->write(layer, at::arange(slots, at::kLong), 3.0 * at::randn({slots, kv_heads, head_dim}),
                at::rand({slots, kv_heads, head_dim}) * 2.0 - 1.0);
  return pool;
}

// Row-major [lens.size(), max_blocks] tables: each sequence's blocks drawn in a shuffled order
// from the pool's num_blocks, -1 past its last.
inline std::vector<int32_t> scattered_block_tables(const std::vector<int32_t>& lens, int64_t block_size,
                                                   int64_t max_blocks, int64_t num_blocks, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> tables(lens.size() * static_cast<size_t>(max_blocks), -1);
  std::vector<int32_t> order(static_cast<size_t>(num_blocks));
  for (size_t s = 0; s < lens.size(); ++s) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const int64_t used = (lens[s] + block_size - 1) / block_size;
    std::copy(order.begin(), order.begin() + used, tables.begin() + static_cast<int64_t>(s) * max_blocks);
  }
  return tables;
}

// Whether the query at position p sees the key at position k.
inline bool window_sees(int64_t k, int64_t p, const PagedDecodeWindow& w) {
  if (k > p) return false;
  if (w.recent > 0 && k >= w.sinks && k <= p - w.recent) return false;
  return w.sliding <= 0 || k > p - w.sliding;
}

}  // namespace kvpipe::testing
