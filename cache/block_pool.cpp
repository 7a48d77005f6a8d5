#include "cache/block_pool.h"

#include <ATen/ATen.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace kvpipe {
namespace {
std::atomic<int64_t> g_tensors_allocated{0};

constexpr uintptr_t kHugePage = uintptr_t{2} << 20;

// The pool's zeroed tensor. On the CPU its 2 MiB pages are asked to be huge before anything
// touches them (MADV_HUGEPAGE; THP "madvise", Debian's default, gives huge pages only where
// asked), so that the zeroing faults in huge pages and attention, which walks a sequence's
// blocks all over the pool at every step, misses the TLB once per 2 MiB instead of per 4 KiB.
// Where the kernel refuses, the pages stay small: nothing else changes.
at::Tensor zeroed_pool_tensor(at::IntArrayRef shape, const at::TensorOptions& options) {
  if (!options.device().is_cpu()) return at::zeros(shape, options);
  at::Tensor t = at::empty(shape, options);
  const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t begin = (lo + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (lo + t.nbytes()) & ~(kHugePage - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  return t.zero_();
}
constexpr int64_t kQ8Group = 32;
}

KvDtype parse_kv_dtype(const std::string& name, const std::string& what) {
  if (name == "float32") return KvDtype::kFloat32;
  if (name == "float16") return KvDtype::kFloat16;
  if (name == "bfloat16") return KvDtype::kBFloat16;
  if (name == "q8_0") return KvDtype::kQ8_0;
  throw std::invalid_argument(what + ": unknown KV dtype '" + name + "' (float32, float16, bfloat16, q8_0)");
}

std::string kv_dtype_name(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kFloat32: return "float32";
    case KvDtype::kFloat16: return "float16";
    case KvDtype::kBFloat16: return "bfloat16";
    case KvDtype::kQ8_0: return "q8_0";
  }
  return "?";
}

at::ScalarType kv_storage_scalar_type(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kFloat32: return at::kFloat;
    case KvDtype::kFloat16: return at::kHalf;
    case KvDtype::kBFloat16: return at::kBFloat16;
    case KvDtype::kQ8_0: return at::kChar;
  }
  return at::kFloat;
}

int64_t kv_row_bytes(KvDtype dtype, int64_t head_dim) {
  if (dtype == KvDtype::kQ8_0) return head_dim + head_dim / kQ8Group * 2;
  return head_dim * static_cast<int64_t>(c10::elementSize(kv_storage_scalar_type(dtype)));
}

BlockPool::BlockPool(const KvShape& shape, int64_t num_blocks, at::ScalarType dtype,
                     at::Device device)
    : BlockPool(shape, num_blocks, dtype, device,
                dtype == at::kHalf       ? KvDtype::kFloat16
                : dtype == at::kBFloat16 ? KvDtype::kBFloat16
                                         : KvDtype::kFloat32) {}

BlockPool::BlockPool(const KvShape& shape, int64_t num_blocks, at::ScalarType compute_dtype, at::Device device,
                     KvDtype stored)
    : shape_(shape), num_blocks_(num_blocks), compute_dtype_(compute_dtype) {
  if (shape.block_size <= 0) throw std::invalid_argument("cache.block_size must be positive");
  if (num_blocks < 0) throw std::invalid_argument("KV pool: negative block count");
  shape_.dtype = stored;
  if (stored != KvDtype::kQ8_0)
    shape_.element_size = static_cast<int64_t>(c10::elementSize(kv_storage_scalar_type(stored)));
  if (stored == KvDtype::kQ8_0 && shape.head_dim % kQ8Group != 0)
    throw std::invalid_argument("cache.dtype q8_0: head_dim " + std::to_string(shape.head_dim) +
                                " is not a multiple of 32");
  const auto options = at::TensorOptions().dtype(kv_storage_scalar_type(stored)).device(device);
  const int64_t slots = num_blocks * shape.block_size;
  storage_ = zeroed_pool_tensor({2, shape.num_layers, slots, shape.num_kv_heads, shape.head_dim}, options);
  if (stored == KvDtype::kQ8_0)
    scales_ = zeroed_pool_tensor({2, shape.num_layers, slots, shape.num_kv_heads, shape.head_dim / kQ8Group},
                                 options.dtype(at::kHalf));
  ++g_tensors_allocated;
}

int64_t BlockPool::blocks_for_budget(const KvShape& shape, int64_t bytes) {
  const int64_t per_block = shape.bytes_per_block();
  if (per_block <= 0 || bytes <= 0) return 0;
  return bytes / per_block;
}

at::Tensor BlockPool::keys(int64_t layer) const {
  if (shape_.dtype == KvDtype::kQ8_0) throw std::logic_error("KV pool: q8_0 storage has no float view");
  return storage_[0][layer];
}
at::Tensor BlockPool::values(int64_t layer) const {
  if (shape_.dtype == KvDtype::kQ8_0) throw std::logic_error("KV pool: q8_0 storage has no float view");
  return storage_[1][layer];
}

const void* BlockPool::stored_data(int which, int64_t layer) const {
  const int64_t layer_values = num_blocks_ * shape_.block_size * shape_.num_kv_heads * shape_.head_dim;
  return static_cast<const char*>(storage_.data_ptr()) +
         (which * shape_.num_layers + layer) * layer_values * static_cast<int64_t>(storage_.element_size());
}

const uint16_t* BlockPool::stored_scales(int which, int64_t layer) const {
  if (!scales_.defined()) return nullptr;
  const int64_t layer_groups = num_blocks_ * shape_.block_size * shape_.num_kv_heads * (shape_.head_dim / kQ8Group);
  return static_cast<const uint16_t*>(scales_.data_ptr()) + (which * shape_.num_layers + layer) * layer_groups;
}

at::Device BlockPool::device() const { return storage_.device(); }

at::Tensor BlockPool::gather(int which, int64_t layer, const at::Tensor& slots) const {
  const at::Tensor rows = storage_[which][layer].index_select(0, slots);
  if (shape_.dtype != KvDtype::kQ8_0) return rows.scalar_type() == compute_dtype_ ? rows : rows.to(compute_dtype_);
  const at::Tensor d = scales_[which][layer].index_select(0, slots).to(at::kFloat);  // [n, heads, groups]
  const int64_t n = rows.size(0), heads = rows.size(1), groups = rows.size(2) / kQ8Group;
  const at::Tensor values = rows.to(at::kFloat).view({n, heads, groups, kQ8Group}) * d.unsqueeze(-1);
  return values.view({n, heads, groups * kQ8Group}).to(compute_dtype_);
}

at::Tensor BlockPool::gather_keys(int64_t layer, const at::Tensor& slots) const { return gather(0, layer, slots); }
at::Tensor BlockPool::gather_values(int64_t layer, const at::Tensor& slots) const { return gather(1, layer, slots); }

namespace {

// Rounds as at::Tensor::to does (c10's conversions, to nearest even), so that the direct
// write below stores what index_copy_ of the converted tensor stored.
template <typename Stored>
void store_rows(const float* x, int64_t row_stride, int64_t head_stride, const int64_t* slots, int64_t n,
                int64_t heads, int64_t dim, Stored* layer_base) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < heads; ++h) {
      const float* src = x + i * row_stride + h * head_stride;
      Stored* dst = layer_base + (slots[i] * heads + h) * dim;
      for (int64_t j = 0; j < dim; ++j) dst[j] = static_cast<Stored>(src[j]);
    }
}

// Q8_0 per 32 values, as the tensor path below: scale = max |x| / 127 rounded to float16,
// values = round-half-even(x / scale) clamped to [-127, 127] (0 where the scale is 0).
void store_q8_0_rows(const float* x, int64_t row_stride, int64_t head_stride, const int64_t* slots, int64_t n,
                     int64_t heads, int64_t dim, int8_t* layer_base, c10::Half* scale_base) {
  const int64_t groups = dim / kQ8Group;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < heads; ++h) {
      const float* src = x + i * row_stride + h * head_stride;
      int8_t* dst = layer_base + (slots[i] * heads + h) * dim;
      c10::Half* scales = scale_base + (slots[i] * heads + h) * groups;
      for (int64_t g = 0; g < groups; ++g) {
        const float* v = src + g * kQ8Group;
        float amax = 0.0f;
        for (int64_t j = 0; j < kQ8Group; ++j) amax = std::max(amax, std::fabs(v[j]));
        const c10::Half d(amax / 127.0f);
        scales[g] = d;
        const float df = static_cast<float>(d);
        const float inv = df > 0 ? 1.0f / df : 0.0f;
        for (int64_t j = 0; j < kQ8Group; ++j)
          dst[g * kQ8Group + j] =
              static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(v[j] * inv))));
      }
    }
}

}  // namespace

bool BlockPool::write_on_cpu(int64_t layer, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v) {
  // Decode writes one row per sequence and layer: the tensor path's views, conversions and
  // index_copy_ dispatches cost more than the copy itself.
  if (!storage_.is_cpu() || !slots.is_cpu() || slots.scalar_type() != at::kLong || slots.dim() != 1 ||
      !slots.is_contiguous())
    return false;
  const int64_t n = slots.size(0), heads = shape_.num_kv_heads, dim = shape_.head_dim;
  for (const at::Tensor* x : {&k, &v})
    if (!x->is_cpu() || x->scalar_type() != at::kFloat || x->dim() != 3 || x->size(0) != n || x->size(1) != heads ||
        x->size(2) != dim || x->stride(2) != 1)
      return false;
  if (layer < 0 || layer >= shape_.num_layers) throw std::out_of_range("KV pool: layer " + std::to_string(layer));
  const int64_t total = num_blocks_ * shape_.block_size;
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    if (slot[i] < 0 || slot[i] >= total)
      throw std::out_of_range("KV pool: slot " + std::to_string(slot[i]) + " outside " + std::to_string(total));
  const int64_t layer_values = total * heads * dim;
  const at::Tensor* inputs[2] = {&k, &v};
  for (int which = 0; which < 2; ++which) {
    const at::Tensor& x = *inputs[which];
    const float* src = x.data_ptr<float>();
    const int64_t offset = (which * shape_.num_layers + layer) * layer_values;
    switch (shape_.dtype) {
      case KvDtype::kFloat32:
        store_rows(src, x.stride(0), x.stride(1), slot, n, heads, dim, storage_.data_ptr<float>() + offset);
        break;
      case KvDtype::kFloat16:
        store_rows(src, x.stride(0), x.stride(1), slot, n, heads, dim, storage_.data_ptr<c10::Half>() + offset);
        break;
      case KvDtype::kBFloat16:
        store_rows(src, x.stride(0), x.stride(1), slot, n, heads, dim, storage_.data_ptr<c10::BFloat16>() + offset);
        break;
      case KvDtype::kQ8_0:
        store_q8_0_rows(src, x.stride(0), x.stride(1), slot, n, heads, dim, storage_.data_ptr<int8_t>() + offset,
                        scales_.data_ptr<c10::Half>() + offset / kQ8Group);
        break;
    }
  }
  return true;
}

void BlockPool::write(int64_t layer, const at::Tensor& slots, const at::Tensor& k,
                      const at::Tensor& v) {
  if (write_on_cpu(layer, slots, k, v)) return;
  const at::Tensor* inputs[2] = {&k, &v};
  for (int which = 0; which < 2; ++which) {
    const at::Tensor& x = *inputs[which];
    if (shape_.dtype != KvDtype::kQ8_0) {
      storage_[which][layer].index_copy_(0, slots, x.to(storage_.scalar_type()));
      continue;
    }
    // Q8_0 per 32 values: scale = max |x| / 127 (rounded to float16), values = round(x / scale).
    const int64_t n = x.size(0), heads = x.size(1), groups = x.size(2) / kQ8Group;
    const at::Tensor g = x.to(at::kFloat).reshape({n, heads, groups, kQ8Group});
    const at::Tensor d = (g.abs().amax(-1) / 127.0f).to(at::kHalf);
    const at::Tensor df = d.to(at::kFloat).unsqueeze(-1);
    const at::Tensor inv = at::where(df > 0, df.reciprocal(), at::zeros_like(df));
    const at::Tensor q = (g * inv).round().clamp(-127, 127).to(at::kChar).view({n, heads, groups * kQ8Group});
    storage_[which][layer].index_copy_(0, slots, q);
    scales_[which][layer].index_copy_(0, slots, d);
  }
}

int64_t BlockPool::tensors_allocated() { return g_tensors_allocated.load(); }

}  // namespace kvpipe
