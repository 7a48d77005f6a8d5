// BlockPool: one rank's paged KV cache storage.
//
// Holds K and V for the rank's layers in fixed-size blocks, allocated once at start-up as a
// single tensor and never resized: the step loop only writes into it and reads from it
// through slot indices (slot = block * block_size + offset). Which blocks a sequence owns is
// decided elsewhere (BlockAllocator on the coordinator), so every rank's pool, holding the
// same number of blocks, is addressed by the same block tables.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>

namespace kvpipe {

struct KvShape {
  int64_t num_layers = 0;   // layers whose K/V this pool holds
  int64_t block_size = 16;  // tokens per block
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t element_size = 4;  // bytes per stored value

  int64_t bytes_per_block() const {
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size;
  }
};

class BlockPool {
 public:
  BlockPool(const KvShape& shape, int64_t num_blocks, at::ScalarType dtype, at::Device device);

  // Blocks that fit in `bytes` (0 when the pool holds no layers or the budget is too small).
  static int64_t blocks_for_budget(const KvShape& shape, int64_t bytes);

  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return shape_.block_size; }
  int64_t bytes() const { return num_blocks_ * shape_.bytes_per_block(); }
  const KvShape& shape() const { return shape_; }

  // Views of layer `layer` (0-based within the pool) as [num_blocks * block_size, kv_heads,
  // head_dim]: row s is slot s.
  at::Tensor keys(int64_t layer) const;
  at::Tensor values(int64_t layer) const;

  // Stores k and v ([n, kv_heads, head_dim]) of layer `layer` at `slots` (int64 [n]).
  void write(int64_t layer, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v);

  // Cache tensors allocated by every BlockPool of the process so far: constant after
  // start-up, which tests check.
  static int64_t tensors_allocated();

 private:
  KvShape shape_;
  int64_t num_blocks_ = 0;
  at::Tensor storage_;  // [2, layers, num_blocks * block_size, kv_heads, head_dim]
};

}  // namespace kvpipe
