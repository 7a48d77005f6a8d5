// paged_decode.cu: the CUDA kernels behind paged_decode_attention (contract in
// engine/kernels/cuda/paged_decode.h, float64 statement in
// engine/kernels/cpu/paged_decode_reference.h).
//
// First kernel, one thread block per (sequence, KV head, partition of 512 tokens): tiles of 32
// tokens are gathered through the block table into shared memory (as float), once for the
// whole group of query heads that share the KV head; each warp then owns some of those query
// heads, one token per lane for the scores, and folds the tile into its running maximum, sum
// and weighted value sum (online softmax). It leaves, per query head and partition, the
// maximum, the sum and the normalised value average. Second kernel, one thread per output
// value: rescales the partitions to their common maximum and combines them.
#include "engine/kernels/cuda/paged_decode.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "engine/kernels/cpu/paged_decode_reference.h"

namespace kvpipe {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;
// One token per lane when a warp scores a tile.
constexpr int kTileTokens = kWarpSize;
constexpr int kPartitionTokens = static_cast<int>(kPagedDecodePartitionTokens);
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

__device__ __forceinline__ bool context_fits(int context_len, int capacity) {
  return context_len >= 1 && context_len <= capacity;
}

// Floats of dynamic shared memory the partition kernel needs for `group` query heads.
constexpr int64_t partition_shared_floats(int64_t group, int64_t head_dim) {
  return 2 * group * head_dim              // scaled queries, value accumulators
         + 2 * group                       // running maxima and sums
         + kTileTokens * (head_dim + 1)    // key tile, rows padded against bank conflicts
         + kTileTokens * head_dim;         // value tile
}

// partial_out [num_seqs, num_heads, max_partitions, D]; partial_max, partial_sum
// [num_seqs, num_heads, max_partitions].
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    paged_decode_partition_kernel(const T* __restrict__ query, const T* __restrict__ key_cache,
                                  const T* __restrict__ value_cache, const int32_t* __restrict__ block_tables,
                                  const int32_t* __restrict__ context_lens, float* __restrict__ partial_out,
                                  float* __restrict__ partial_max, float* __restrict__ partial_sum, int num_heads,
                                  int num_kv_heads, int num_blocks, int block_size, int max_blocks,
                                  int max_partitions, float scale) {
  const int seq = blockIdx.x, kv_head = blockIdx.y, part = blockIdx.z;
  const int context_len = context_lens[seq];
  const int begin = part * kPartitionTokens;
  // Invalid contexts are reported as NaN by the merge kernel.
  if (!context_fits(context_len, max_blocks * block_size) || begin >= context_len) return;
  const int end = min(context_len, begin + kPartitionTokens);
  const int group = num_heads / num_kv_heads;
  const int first_head = kv_head * group;

  extern __shared__ float shared[];
  float* query_s = shared;
  float* accum_s = query_s + group * D;
  float* max_s = accum_s + group * D;
  float* sum_s = max_s + group;
  float* key_s = sum_s + group;
  float* value_s = key_s + kTileTokens * (D + 1);
  __shared__ int64_t slot_s[kTileTokens];
  __shared__ int bad_block;

  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  // The group's query heads are adjacent rows of the query.
  const T* group_query = query + (static_cast<int64_t>(seq) * num_heads + first_head) * D;
  for (int i = tid; i < group * D; i += kThreads) {
    query_s[i] = scale * to_float(group_query[i]);
    accum_s[i] = 0.0f;
  }
  for (int g = tid; g < group; g += kThreads) {
    max_s[g] = -INFINITY;
    sum_s[g] = 0.0f;
  }
  if (tid == 0) bad_block = 0;
  const int32_t* table = block_tables + static_cast<int64_t>(seq) * max_blocks;

  for (int tile = begin; tile < end; tile += kTileTokens) {
    const int tokens = min(kTileTokens, end - tile);
    __syncthreads();  // the previous tile is consumed (and the state above initialised)
    if (tid < tokens) {
      const int position = tile + tid;
      const int block = table[position / block_size];
      if (block < 0 || block >= num_blocks) {
        bad_block = 1;
        slot_s[tid] = -1;
      } else {
        slot_s[tid] = static_cast<int64_t>(block) * block_size + position % block_size;
      }
    }
    __syncthreads();
    // Consecutive threads read consecutive values of a row: coalesced within each token.
    for (int i = tid; i < tokens * D; i += kThreads) {
      const int token = i / D, d = i % D;
      const int64_t slot = slot_s[token];
      float key = 0.0f, value = 0.0f;
      if (slot >= 0) {
        const int64_t offset = (slot * num_kv_heads + kv_head) * D + d;
        key = to_float(key_cache[offset]);
        value = to_float(value_cache[offset]);
      }
      key_s[token * (D + 1) + d] = key;
      value_s[token * D + d] = value;
    }
    __syncthreads();

    for (int g = warp; g < group; g += kWarps) {
      const float* q = query_s + g * D;
      float score = -INFINITY;
      if (lane < tokens) {
        const float* k = key_s + lane * (D + 1);
        float dot = 0.0f;
#pragma unroll 16
        for (int d = 0; d < D; ++d) dot += q[d] * k[d];
        score = dot;
      }
      const float old_max = max_s[g];
      const float new_max = fmaxf(old_max, warp_max(score));
      const float weight = lane < tokens ? expf(score - new_max) : 0.0f;
      const float weight_sum = warp_sum(weight);
      // What was summed under the old maximum shrinks to the new one (exp(-inf) = 0 at first).
      const float correction = expf(old_max - new_max);
      float* accum = accum_s + g * D;
#pragma unroll
      for (int i = 0; i < D / kWarpSize; ++i) {
        const int d = lane + i * kWarpSize;
        float a = accum[d] * correction;
        for (int token = 0; token < tokens; ++token)
          a += __shfl_sync(kFullMask, weight, token) * value_s[token * D + d];
        accum[d] = a;
      }
      __syncwarp();
      if (lane == 0) {
        max_s[g] = new_max;
        sum_s[g] = sum_s[g] * correction + weight_sum;
      }
      __syncwarp();
    }
  }
  __syncthreads();

  for (int g = warp; g < group; g += kWarps) {
    const int64_t row = (static_cast<int64_t>(seq) * num_heads + first_head + g) * max_partitions + part;
    const float inverse_sum = 1.0f / sum_s[g];
    for (int d = lane; d < D; d += kWarpSize) partial_out[row * D + d] = accum_s[g * D + d] * inverse_sum;
    if (lane == 0) {
      partial_max[row] = max_s[g];
      // A NaN sum makes the merge's total, so every output value of the head, NaN.
      partial_sum[row] = bad_block ? NAN : sum_s[g];
    }
  }
}

// One thread block per (sequence, query head), one thread per value of the head.
template <typename T, int D>
__global__ void __launch_bounds__(D)
    paged_decode_merge_kernel(const float* __restrict__ partial_out, const float* __restrict__ partial_max,
                              const float* __restrict__ partial_sum, const int32_t* __restrict__ context_lens,
                              T* __restrict__ out, int num_heads, int max_partitions, int capacity) {
  const int seq = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
  const int context_len = context_lens[seq];
  T* o = out + (static_cast<int64_t>(seq) * num_heads + head) * D + d;
  if (!context_fits(context_len, capacity)) {
    *o = from_float<T>(NAN);
    return;
  }
  const int partitions = (context_len + kPartitionTokens - 1) / kPartitionTokens;
  const int64_t first_row = (static_cast<int64_t>(seq) * num_heads + head) * max_partitions;
  float global_max = -INFINITY;
  for (int p = 0; p < partitions; ++p) global_max = fmaxf(global_max, partial_max[first_row + p]);
  float total = 0.0f, value = 0.0f;
  for (int p = 0; p < partitions; ++p) {
    const float weight = partial_sum[first_row + p] * expf(partial_max[first_row + p] - global_max);
    total += weight;
    value += weight * partial_out[(first_row + p) * D + d];
  }
  *o = from_float<T>(value / total);
}

template <typename T, int D>
void launch_paged_decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
                         const PagedDecodeDims& dims, int64_t max_partitions, double scale) {
  const int64_t group = dims.num_heads / dims.num_kv_heads;
  const int64_t shared_bytes = partition_shared_floats(group, D) * static_cast<int64_t>(sizeof(float));
  const auto kernel = &paged_decode_partition_kernel<T, D>;
  const cudaDeviceProp* properties = at::cuda::getCurrentDeviceProperties();
  if (shared_bytes > static_cast<int64_t>(properties->sharedMemPerBlockOptin))
    throw std::invalid_argument("paged decode attention: query's " + std::to_string(group) +
                                " heads per KV head need " + std::to_string(shared_bytes) +
                                " bytes of shared memory, more than the device's " +
                                std::to_string(properties->sharedMemPerBlockOptin));
  if (shared_bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(shared_bytes)));

  const auto float_options = query.options().dtype(at::kFloat);
  const at::Tensor partial_out = at::empty({dims.num_seqs, dims.num_heads, max_partitions, D}, float_options);
  const at::Tensor partial_max = at::empty({dims.num_seqs, dims.num_heads, max_partitions}, float_options);
  const at::Tensor partial_sum = at::empty({dims.num_seqs, dims.num_heads, max_partitions}, float_options);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int capacity = static_cast<int>(dims.max_blocks * dims.block_size);

  const dim3 partition_grid(static_cast<unsigned>(dims.num_seqs), static_cast<unsigned>(dims.num_kv_heads),
                            static_cast<unsigned>(max_partitions));
  paged_decode_partition_kernel<T, D><<<partition_grid, kThreads, shared_bytes, stream>>>(
      reinterpret_cast<const T*>(query.data_ptr()), reinterpret_cast<const T*>(key_cache.data_ptr()),
      reinterpret_cast<const T*>(value_cache.data_ptr()), block_tables.data_ptr<int32_t>(),
      context_lens.data_ptr<int32_t>(), partial_out.data_ptr<float>(), partial_max.data_ptr<float>(),
      partial_sum.data_ptr<float>(), static_cast<int>(dims.num_heads), static_cast<int>(dims.num_kv_heads),
      static_cast<int>(dims.num_blocks), static_cast<int>(dims.block_size), static_cast<int>(dims.max_blocks),
      static_cast<int>(max_partitions), static_cast<float>(scale));
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const dim3 merge_grid(static_cast<unsigned>(dims.num_seqs), static_cast<unsigned>(dims.num_heads));
  paged_decode_merge_kernel<T, D><<<merge_grid, D, 0, stream>>>(
      partial_out.data_ptr<float>(), partial_max.data_ptr<float>(), partial_sum.data_ptr<float>(),
      context_lens.data_ptr<int32_t>(), reinterpret_cast<T*>(out.data_ptr()), static_cast<int>(dims.num_heads),
      static_cast<int>(max_partitions), capacity);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void dispatch_head_dim(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
                       const PagedDecodeDims& dims, int64_t max_partitions, double scale) {
  // check_paged_decode_inputs admits 64 and 128 only.
  if (dims.head_dim == 64)
    launch_paged_decode<T, 64>(query, key_cache, value_cache, block_tables, context_lens, out, dims,
                               max_partitions, scale);
  else
    launch_paged_decode<T, 128>(query, key_cache, value_cache, block_tables, context_lens, out, dims,
                                max_partitions, scale);
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, int64_t block_size, double scale) {
  const PagedDecodeDims dims = check_paged_decode_inputs(query, key_cache, value_cache, block_tables,
                                                         context_lens, block_size, scale, PagedDecodeDevice::kCuda);
  // Token positions, slots' block part and grid dimensions are 32-bit on the device.
  const int64_t capacity = dims.max_blocks * dims.block_size;
  if (capacity > std::numeric_limits<int32_t>::max())
    throw std::invalid_argument("paged decode attention: block_tables address " + std::to_string(capacity) +
                                " tokens per sequence, more than int32 positions hold");
  const int64_t max_partitions =
      std::max<int64_t>(1, (capacity + kPagedDecodePartitionTokens - 1) / kPagedDecodePartitionTokens);
  if (max_partitions > 65535 || dims.num_kv_heads > 65535 || dims.num_heads > 65535)
    throw std::invalid_argument("paged decode attention: block_tables or query exceed the kernel's grid (" +
                                std::to_string(max_partitions) + " partitions, " +
                                std::to_string(dims.num_heads) + " heads)");

  const c10::cuda::CUDAGuard device_guard(query.device());
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  at::Tensor out = at::empty_like(q);
  if (dims.num_seqs == 0) return out;
  switch (query.scalar_type()) {
    case at::kFloat:
      dispatch_head_dim<float>(q, key_cache, value_cache, tables, lens, out, dims, max_partitions, scale);
      break;
    case at::kHalf:
      dispatch_head_dim<__half>(q, key_cache, value_cache, tables, lens, out, dims, max_partitions, scale);
      break;
    case at::kBFloat16:
      dispatch_head_dim<__nv_bfloat16>(q, key_cache, value_cache, tables, lens, out, dims, max_partitions, scale);
      break;
    default:
      throw std::logic_error("paged decode attention: dtype admitted by the checks but not dispatched");
  }
  return out;
}

}  // namespace kvpipe
