// BlockPool: one rank's paged KV cache storage.
//
// Holds K and V for the rank's layers in fixed-size blocks, allocated once at start-up as a
// single tensor and never resized: the step loop only writes into it and reads from it
// through slot indices (slot = block * block_size + offset). Which blocks a sequence owns is
// decided elsewhere (BlockAllocator on the coordinator), so every rank's pool, holding the
// same number of blocks, is addressed by the same block tables.
//
// The stored type (cache.dtype) is float32, float16, bfloat16 or q8_0: 8-bit values with one
// float16 scale per 32 values of a head (ggml's Q8_0 grouping, kept as two tensors so that
// LibTorch's vectorised ops encode and gather it). Writes take float K/V and encode them;
// gathers return the compute dtype, so attention never sees the stored type.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <string>

namespace kvpipe {

enum class KvDtype { kFloat32, kFloat16, kBFloat16, kQ8_0 };

// "float32" | "float16" | "bfloat16" | "q8_0"; std::invalid_argument naming `what` otherwise.
KvDtype parse_kv_dtype(const std::string& name, const std::string& what);
std::string kv_dtype_name(KvDtype dtype);
// Bytes one token's K (or V) of one KV head takes: head_dim values plus, for q8_0, a float16
// scale per 32 values (head_dim must then be a multiple of 32).
int64_t kv_row_bytes(KvDtype dtype, int64_t head_dim);
// The float dtype a KV dtype stores (q8_0: its 8-bit values are int8).
at::ScalarType kv_storage_scalar_type(KvDtype dtype);

struct KvShape {
  int64_t num_layers = 0;   // layers whose K/V this pool holds
  int64_t block_size = 16;  // tokens per block
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t element_size = 4;  // bytes per stored value of a float dtype
  KvDtype dtype = KvDtype::kFloat32;  // q8_0 rows are kv_row_bytes, whatever element_size says

  int64_t row_bytes() const { return dtype == KvDtype::kQ8_0 ? kv_row_bytes(dtype, head_dim) : head_dim * element_size; }
  int64_t bytes_per_block() const { return 2 * num_layers * block_size * num_kv_heads * row_bytes(); }
};

class BlockPool {
 public:
  // Float storage of `dtype` (shape.dtype is ignored).
  BlockPool(const KvShape& shape, int64_t num_blocks, at::ScalarType dtype, at::Device device);
  // Storage of shape.dtype, gathered as `compute_dtype`.
  BlockPool(const KvShape& shape, int64_t num_blocks, at::ScalarType compute_dtype, at::Device device,
            KvDtype stored);

  // Blocks that fit in `bytes` (0 when the pool holds no layers or the budget is too small).
  static int64_t blocks_for_budget(const KvShape& shape, int64_t bytes);

  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return shape_.block_size; }
  int64_t bytes() const { return num_blocks_ * shape_.bytes_per_block(); }
  const KvShape& shape() const { return shape_; }

  KvDtype dtype() const { return shape_.dtype; }

  // Views of layer `layer` (0-based within the pool) as [num_blocks * block_size, kv_heads,
  // head_dim]: row s is slot s. Float storage only (q8_0 has no float view).
  at::Tensor keys(int64_t layer) const;
  at::Tensor values(int64_t layer) const;

  // Layer `layer` of K (which 0) or V (which 1) as stored, [slots, kv_heads, head_dim] (int8
  // for q8_0), and q8_0's float16 scales [slots, kv_heads, head_dim / 32] (nullptr for the
  // float types): what kernels that read the pool in place take, every layer of every step,
  // so they are offsets into the one storage tensor rather than views of it.
  const void* stored_data(int which, int64_t layer) const;
  const uint16_t* stored_scales(int which, int64_t layer) const;
  at::Device device() const;

  // K and V of layer `layer` at `slots` (int64 [n]), decoded to the compute dtype:
  // [n, kv_heads, head_dim].
  at::Tensor gather_keys(int64_t layer, const at::Tensor& slots) const;
  at::Tensor gather_values(int64_t layer, const at::Tensor& slots) const;

  // Stores k and v ([n, kv_heads, head_dim]) of layer `layer` at `slots` (int64 [n]).
  void write(int64_t layer, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v);

  // Cache tensors allocated by every BlockPool of the process so far: constant after
  // start-up, which tests check.
  static int64_t tensors_allocated();

 private:
  KvShape shape_;
  int64_t num_blocks_ = 0;
  at::ScalarType compute_dtype_ = c10::ScalarType::Float;
  at::Tensor storage_;  // [2, layers, num_blocks * block_size, kv_heads, head_dim]
  at::Tensor scales_;   // q8_0: float16 [2, layers, slots, kv_heads, head_dim / 32]

  at::Tensor gather(int which, int64_t layer, const at::Tensor& slots) const;
  // write's direct path for float32 K/V and a pool on the CPU; false where it does not apply.
  bool write_on_cpu(int64_t layer, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v);
};

}  // namespace kvpipe
