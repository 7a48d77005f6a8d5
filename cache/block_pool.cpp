#include "cache/block_pool.h"

#include <ATen/ATen.h>

#include <atomic>
#include <stdexcept>

namespace kvpipe {
namespace {
std::atomic<int64_t> g_tensors_allocated{0};
}

BlockPool::BlockPool(const KvShape& shape, int64_t num_blocks, at::ScalarType dtype,
                     at::Device device)
    : shape_(shape), num_blocks_(num_blocks) {
  if (shape.block_size <= 0) throw std::invalid_argument("cache.block_size must be positive");
  if (num_blocks < 0) throw std::invalid_argument("KV pool: negative block count");
  storage_ = at::zeros({2, shape.num_layers, num_blocks * shape.block_size, shape.num_kv_heads,
                        shape.head_dim},
                       at::TensorOptions().dtype(dtype).device(device));
  ++g_tensors_allocated;
}

int64_t BlockPool::blocks_for_budget(const KvShape& shape, int64_t bytes) {
  const int64_t per_block = shape.bytes_per_block();
  if (per_block <= 0 || bytes <= 0) return 0;
  return bytes / per_block;
}

at::Tensor BlockPool::keys(int64_t layer) const { return storage_[0][layer]; }
at::Tensor BlockPool::values(int64_t layer) const { return storage_[1][layer]; }

void BlockPool::write(int64_t layer, const at::Tensor& slots, const at::Tensor& k,
                      const at::Tensor& v) {
  storage_[0][layer].index_copy_(0, slots, k);
  storage_[1][layer].index_copy_(0, slots, v);
}

int64_t BlockPool::tensors_allocated() { return g_tensors_allocated.load(); }

}  // namespace kvpipe
