#include "engine/kernels/cpu/paged_attention.h"

#include "engine/kernels/cpu/paged_attention_impl.h"
#include "engine/kernels/cpu/quant_impl.h"
#include "engine/kernels/cpu/thread_pool.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

using namespace paged_impl;

// Visible keys a work item takes: long contexts split over threads even at batch 1.
constexpr int64_t kPartition = 256;
// Keys whose scores are formed before the running maximum is updated: one rescale of the
// accumulators per chunk rather than per key.
constexpr int64_t kChunk = 32;

struct ItemScratch {
  std::vector<float> scores;       // [group, kChunk]
  std::vector<int64_t> rows;       // [kChunk]
  std::vector<const float*> keys;  // [kChunk]: each key row as float32
  std::vector<const float*> values;
  std::vector<float> converted;    // [kChunk, head_dim]: rows of 16- and 8-bit pools
};

// One (sequence, KV head, partition) item: the group's running maximum m, sum l and
// unnormalised output acc over visible keys [begin, end).
template <class Ops>
void attend_partition(const float* q, int64_t group, const PagedKvLayer& kv, int64_t kv_head, const int32_t* table,
                      int64_t max_blocks, const VisibleKeys& visible, int64_t begin, int64_t end,
                      const PagedDecodeWindow& window, float scale, float* m, float* l, float* acc,
                      ItemScratch& scratch) {
  const int64_t hd = kv.head_dim, bs = kv.block_size;
  scratch.scores.resize(static_cast<size_t>(group * kChunk));
  scratch.rows.resize(kChunk);
  scratch.keys.resize(kChunk);
  scratch.values.resize(kChunk);
  scratch.converted.resize(static_cast<size_t>(kChunk * hd));
  float* scores = scratch.scores.data();
  int64_t* rows = scratch.rows.data();
  const float** keys = scratch.keys.data();
  const float** values = scratch.values.data();
  float* tmp = scratch.converted.data();
  const float softcap = static_cast<float>(window.softcap);
  for (int64_t g = 0; g < group; ++g) m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0.0f;
  std::fill(acc, acc + group * hd, 0.0f);
  for (int64_t c = begin; c < end; c += kChunk) {
    const int64_t n = std::min(kChunk, end - c);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t p = visible.position(c + j);
      const int64_t b = p / bs;
      const int32_t block = b < max_blocks ? table[b] : -1;
      if (block < 0 || block >= kv.num_blocks)
        throw std::invalid_argument("paged decode attention: block_tables entry " + std::to_string(block) +
                                    " for position " + std::to_string(p) + " is outside the pool's " +
                                    std::to_string(kv.num_blocks) + " blocks");
      rows[j] = (static_cast<int64_t>(block) * bs + p % bs) * kv.kv_heads + kv_head;
      keys[j] = load_row<Ops>(kv, kv.keys, kv.key_scales, rows[j], tmp + j * hd);
    }
    Ops::chunk_scores(q, group, hd, keys, n, scale, scores, kChunk);
    if (softcap > 0)
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < n; ++j) scores[g * kChunk + j] = softcap * std::tanh(scores[g * kChunk + j] / softcap);
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * kChunk;
      const float chunk_max = *std::max_element(s, s + n);
      const float m_new = std::max(m[g], chunk_max);
      if (m_new > m[g] && l[g] > 0) {
        const float f = std::exp(m[g] - m_new);
        l[g] *= f;
        Ops::scale(acc + g * hd, f, hd);
      }
      m[g] = m_new;
      for (int64_t j = 0; j < n; ++j) l[g] += s[j] = std::exp(s[j] - m_new);
    }
    for (int64_t j = 0; j < n; ++j) values[j] = load_row<Ops>(kv, kv.values, kv.value_scales, rows[j], tmp + j * hd);
    Ops::chunk_accumulate(acc, group, hd, values, n, scores, kChunk);
  }
}

template <class Ops>
void run(const float* q, int64_t num_seqs, int64_t num_heads, const PagedKvLayer& kv, const int32_t* block_tables,
         int64_t max_blocks, const int32_t* context_lens, const PagedDecodeWindow& window, float scale, float* out) {
  const int64_t hd = kv.head_dim, kvh = kv.kv_heads, group = num_heads / kvh;
  // Reused from call to call; the pool's threads reach it through `seen` (a lambda naming a
  // thread_local would see each thread's own).
  thread_local std::vector<VisibleKeys> visible;
  visible.resize(static_cast<size_t>(num_seqs));
  const VisibleKeys* seen = visible.data();
  int64_t parts = 1;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = context_lens[s];
    if (len < 1 || len > max_blocks * kv.block_size)
      throw std::invalid_argument("paged decode attention: context_lens[" + std::to_string(s) + "] = " +
                                  std::to_string(len) + " is outside [1, " +
                                  std::to_string(max_blocks * kv.block_size) + "]");
    visible[s] = visible_keys(len, window);
    parts = std::max(parts, (visible[s].count() + kPartition - 1) / kPartition);
  }
  // Per item: m and l for each query head of the group, then its accumulators. Reused by the
  // next call (the pool's threads reach it through the pointer).
  const int64_t item_floats = group * (hd + 2);
  const int64_t items = num_seqs * kvh * parts;
  thread_local std::vector<float> partials;
  if (static_cast<int64_t>(partials.size()) < items * item_floats) partials.resize(static_cast<size_t>(items * item_floats));
  float* part = partials.data();
  parallel_rows(items, 1, [&](int64_t first, int64_t last) {
    thread_local ItemScratch scratch;
    for (int64_t item = first; item < last; ++item) {
      const int64_t s = item / (kvh * parts), h = item / parts % kvh, p = item % parts;
      float* m = part + item * item_floats;
      const int64_t begin = p * kPartition, end = std::min(seen[s].count(), begin + kPartition);
      if (begin >= end) {
        for (int64_t g = 0; g < group; ++g) m[g] = -std::numeric_limits<float>::infinity(), m[group + g] = 0.0f;
        continue;
      }
      attend_partition<Ops>(q + (s * num_heads + h * group) * hd, group, kv, h, block_tables + s * max_blocks,
                            max_blocks, seen[s], begin, end, window, scale, m, m + group, m + 2 * group,
                            scratch);
    }
  });
  // Merge the partitions of each query head by their maxima and sums.
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t h = 0; h < kvh; ++h)
      for (int64_t g = 0; g < group; ++g) {
        const float* base = part + (s * kvh + h) * parts * item_floats;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < parts; ++p) top = std::max(top, base[p * item_floats + g]);
        float* o = out + (s * num_heads + h * group + g) * hd;
        std::fill(o, o + hd, 0.0f);
        float sum = 0.0f;
        for (int64_t p = 0; p < parts; ++p) {
          const float* item = base + p * item_floats;
          if (item[group + g] <= 0.0f) continue;
          const float f = std::exp(item[g] - top);
          sum += item[group + g] * f;
          Ops::axpy(o, f, item + 2 * group + g * hd, hd);
        }
        Ops::scale(o, 1.0f / sum, hd);
      }
}

}  // namespace

PagedKvLayer paged_kv_layer(const BlockPool& pool, int64_t layer) {
  PagedKvLayer kv;
  const KvShape& shape = pool.shape();
  kv.dtype = pool.dtype();
  if (!pool.device().is_cpu()) throw std::logic_error("paged_kv_layer: the pool is not on the CPU");
  kv.keys = pool.stored_data(0, layer);
  kv.values = pool.stored_data(1, layer);
  kv.key_scales = pool.stored_scales(0, layer);
  kv.value_scales = pool.stored_scales(1, layer);
  kv.kv_heads = shape.num_kv_heads;
  kv.head_dim = shape.head_dim;
  kv.block_size = shape.block_size;
  kv.num_blocks = pool.num_blocks();
  return kv;
}

void paged_decode_attention_cpu(const float* q, int64_t num_seqs, int64_t num_heads, const PagedKvLayer& kv,
                                const int32_t* block_tables, int64_t max_blocks, const int32_t* context_lens,
                                const PagedDecodeWindow& window, float scale, float* out) {
  if (num_seqs <= 0) return;
  if (kv.kv_heads < 1 || num_heads % kv.kv_heads != 0)
    throw std::invalid_argument("paged decode attention: " + std::to_string(num_heads) +
                                " query heads are not a multiple of " + std::to_string(kv.kv_heads) + " KV heads");
  if (kv.dtype == KvDtype::kQ8_0 && kv.head_dim % kQ8Group != 0)
    throw std::invalid_argument("paged decode attention: q8_0 rows of " + std::to_string(kv.head_dim) +
                                " values are not whole 32-value groups");
#if defined(__x86_64__)
  if (quant_impl::use_avx2())
    return run<Avx2Ops>(q, num_seqs, num_heads, kv, block_tables, max_blocks, context_lens, window, scale, out);
#endif
  run<PortableOps>(q, num_seqs, num_heads, kv, block_tables, max_blocks, context_lens, window, scale, out);
}

const char* paged_attention_isa() {
#if defined(__x86_64__)
  if (quant_impl::use_avx2()) return "avx2";
#endif
  return "portable";
}

}  // namespace kvpipe
