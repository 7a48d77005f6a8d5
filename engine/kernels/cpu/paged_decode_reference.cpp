#include "engine/kernels/cpu/paged_decode_reference.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/kernels/cuda/paged_decode.h"

namespace kvpipe {
namespace {

[[noreturn]] void refuse(const std::string& message) {
  throw std::invalid_argument("paged decode attention: " + message);
}

std::string shape_text(const at::Tensor& t) {
  std::string text = "[";
  for (int64_t d = 0; d < t.dim(); ++d) text += (d ? ", " : "") + std::to_string(t.size(d));
  return text + "]";
}

bool is_float_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

}  // namespace

PagedDecodeDims check_paged_decode_inputs(const at::Tensor& query, const at::Tensor& key_cache,
                                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                                          const at::Tensor& context_lens, int64_t block_size, double scale,
                                          PagedDecodeDevice device) {
  const struct {
    const at::Tensor& tensor;
    const char* name;
  } all[] = {{query, "query"},
             {key_cache, "key_cache"},
             {value_cache, "value_cache"},
             {block_tables, "block_tables"},
             {context_lens, "context_lens"}};
  for (const auto& arg : all)
    if (!arg.tensor.defined()) refuse(std::string(arg.name) + " is undefined");

  if (query.dim() != 3)
    refuse("query must be [num_seqs, num_heads, head_dim], got " + shape_text(query));
  PagedDecodeDims dims;
  dims.num_seqs = query.size(0);
  dims.num_heads = query.size(1);
  dims.head_dim = query.size(2);
  if (device == PagedDecodeDevice::kCuda ? dims.head_dim != 64 && dims.head_dim != 128 : dims.head_dim < 1)
    refuse("head_dim " + std::to_string(dims.head_dim) + " of query is not supported (64 or 128)");
  if (dims.num_heads < 1) refuse("query has no heads");
  for (const auto* cache : {&all[1], &all[2]}) {
    if (cache->tensor.dim() != 3 || cache->tensor.size(2) != dims.head_dim)
      refuse(std::string(cache->name) + " must be [num_blocks * block_size, num_kv_heads, " +
             std::to_string(dims.head_dim) + "], got " + shape_text(cache->tensor));
  }
  if (!value_cache.sizes().equals(key_cache.sizes()))
    refuse("value_cache " + shape_text(value_cache) + " does not match key_cache " + shape_text(key_cache));
  dims.num_kv_heads = key_cache.size(1);
  if (dims.num_kv_heads < 1 || dims.num_heads % dims.num_kv_heads != 0)
    refuse("query's " + std::to_string(dims.num_heads) + " heads are not a multiple of key_cache's " +
           std::to_string(dims.num_kv_heads) + " KV heads");
  if (!is_float_dtype(query.scalar_type()))
    refuse(std::string("query dtype ") + c10::toString(query.scalar_type()) +
           " is not supported (Float, Half or BFloat16)");
  for (const auto* cache : {&all[1], &all[2]})
    if (cache->tensor.scalar_type() != query.scalar_type())
      refuse(std::string(cache->name) + " dtype " + c10::toString(cache->tensor.scalar_type()) +
             " differs from query's " + c10::toString(query.scalar_type()));
  if (block_tables.scalar_type() != at::kInt)
    refuse(std::string("block_tables must be int32, got ") + c10::toString(block_tables.scalar_type()));
  if (block_tables.dim() != 2 || block_tables.size(0) != dims.num_seqs)
    refuse("block_tables must be [" + std::to_string(dims.num_seqs) + ", max_blocks], got " +
           shape_text(block_tables));
  if (context_lens.scalar_type() != at::kInt)
    refuse(std::string("context_lens must be int32, got ") + c10::toString(context_lens.scalar_type()));
  if (context_lens.dim() != 1 || context_lens.size(0) != dims.num_seqs)
    refuse("context_lens must be [" + std::to_string(dims.num_seqs) + "], got " + shape_text(context_lens));
  if (block_size < 1) refuse("block_size " + std::to_string(block_size) + " must be positive");
  if (key_cache.size(0) % block_size != 0)
    refuse("key_cache's " + std::to_string(key_cache.size(0)) + " rows are not whole blocks of " +
           std::to_string(block_size));
  // Slots and block ids are int32 on the device side of the kernel's address arithmetic.
  if (key_cache.size(0) > std::numeric_limits<int32_t>::max())
    refuse("key_cache has more rows than int32 block tables address");
  if (!std::isfinite(scale)) refuse("scale " + std::to_string(scale) + " is not finite");
  dims.block_size = block_size;
  dims.num_blocks = key_cache.size(0) / block_size;
  dims.max_blocks = block_tables.size(1);

  const bool want_cuda = device == PagedDecodeDevice::kCuda;
  for (const auto& arg : all) {
    if (arg.tensor.is_cuda() != want_cuda)
      refuse(std::string(arg.name) + " must be a " + (want_cuda ? "CUDA" : "CPU") + " tensor, got " +
             arg.tensor.device().str());
    if (want_cuda && arg.tensor.device() != query.device())
      refuse(std::string(arg.name) + " is on " + arg.tensor.device().str() + ", query on " + query.device().str());
  }
  for (const auto* cache : {&all[1], &all[2]})
    if (!cache->tensor.is_contiguous())
      refuse(std::string(cache->name) + " must be contiguous (a BlockPool layer's keys or values)");
  return dims;
}

at::Tensor paged_decode_reference(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, int64_t block_size, double scale) {
  const PagedDecodeDims dims = check_paged_decode_inputs(query, key_cache, value_cache, block_tables,
                                                         context_lens, block_size, scale, PagedDecodeDevice::kCpu);
  const at::Tensor q = query.to(at::kDouble).contiguous();
  const at::Tensor k = key_cache.to(at::kDouble).contiguous();
  const at::Tensor v = value_cache.to(at::kDouble).contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  const double* q_data = q.data_ptr<double>();
  const double* k_data = k.data_ptr<double>();
  const double* v_data = v.data_ptr<double>();
  const int32_t* table_data = tables.data_ptr<int32_t>();
  const int32_t* len_data = lens.data_ptr<int32_t>();

  const int64_t D = dims.head_dim, kv_heads = dims.num_kv_heads, group = dims.num_heads / kv_heads;
  const int64_t capacity = dims.max_blocks * block_size;
  for (int64_t s = 0; s < dims.num_seqs; ++s) {
    const int64_t len = len_data[s];
    if (len < 1 || len > capacity)
      refuse("context_lens[" + std::to_string(s) + "] = " + std::to_string(len) + " is outside [1, " +
             std::to_string(capacity) + "] (block_tables' " + std::to_string(dims.max_blocks) + " blocks of " +
             std::to_string(block_size) + ")");
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
      const int64_t block = table_data[s * dims.max_blocks + b];
      if (block < 0 || block >= dims.num_blocks)
        refuse("block_tables[" + std::to_string(s) + "][" + std::to_string(b) + "] = " + std::to_string(block) +
               " is not a block of the pool (" + std::to_string(dims.num_blocks) + " blocks)");
    }
  }

  at::Tensor out = at::zeros({dims.num_seqs, dims.num_heads, D}, at::kDouble);
  double* out_data = out.data_ptr<double>();
  // One partition's result per query head of the group, as the first kernel leaves it: the
  // running maximum of the scaled scores, the sum of exp(score - maximum), and the value
  // average weighted by those exponentials (already divided by the sum).
  struct Partial {
    double max_score = -std::numeric_limits<double>::infinity();
    double exp_sum = 0.0;
    std::vector<double> average;
  };
  std::vector<double> scores(group);
  for (int64_t s = 0; s < dims.num_seqs; ++s) {
    const int64_t len = len_data[s];
    const int64_t num_partitions = (len + kPagedDecodePartitionTokens - 1) / kPagedDecodePartitionTokens;
    for (int64_t kv = 0; kv < kv_heads; ++kv) {
      std::vector<std::vector<Partial>> partials(group, std::vector<Partial>(num_partitions));
      for (int64_t part = 0; part < num_partitions; ++part) {
        std::vector<Partial*> state(group);
        std::vector<std::vector<double>> accum(group, std::vector<double>(D, 0.0));
        for (int64_t g = 0; g < group; ++g) state[g] = &partials[g][part];
        const int64_t begin = part * kPagedDecodePartitionTokens;
        const int64_t end = std::min(len, begin + kPagedDecodePartitionTokens);
        for (int64_t p = begin; p < end; ++p) {
          const int64_t slot = static_cast<int64_t>(table_data[s * dims.max_blocks + p / block_size]) * block_size +
                               p % block_size;
          const double* k_row = k_data + (slot * kv_heads + kv) * D;
          const double* v_row = v_data + (slot * kv_heads + kv) * D;
          for (int64_t g = 0; g < group; ++g) {
            const double* q_row = q_data + (s * dims.num_heads + kv * group + g) * D;
            double dot = 0.0;
            for (int64_t d = 0; d < D; ++d) dot += q_row[d] * k_row[d];
            const double score = scale * dot;
            Partial& st = *state[g];
            const double new_max = std::max(st.max_score, score);
            // Rescale what was summed under the old maximum (exp(-inf) = 0 on the first token).
            const double correction = std::exp(st.max_score - new_max);
            const double weight = std::exp(score - new_max);
            st.exp_sum = st.exp_sum * correction + weight;
            for (int64_t d = 0; d < D; ++d) accum[g][d] = accum[g][d] * correction + weight * v_row[d];
            st.max_score = new_max;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          state[g]->average.resize(D);
          for (int64_t d = 0; d < D; ++d) state[g]->average[d] = accum[g][d] / state[g]->exp_sum;
        }
      }
      // Merge: each partition's average counts with its share of the global exponential sum.
      for (int64_t g = 0; g < group; ++g) {
        double global_max = -std::numeric_limits<double>::infinity();
        for (const Partial& pt : partials[g]) global_max = std::max(global_max, pt.max_score);
        double total = 0.0;
        std::vector<double> weights(num_partitions);
        for (int64_t part = 0; part < num_partitions; ++part) {
          weights[part] = partials[g][part].exp_sum * std::exp(partials[g][part].max_score - global_max);
          total += weights[part];
        }
        double* o = out_data + (s * dims.num_heads + kv * group + g) * D;
        for (int64_t part = 0; part < num_partitions; ++part)
          for (int64_t d = 0; d < D; ++d) o[d] += weights[part] / total * partials[g][part].average[d];
      }
    }
  }
  return out;
}

}  // namespace kvpipe
