#include "engine/kernels/cpu/paged_attention.h"

#include "engine/kernels/cpu/half_convert.h"
#include "engine/kernels/cpu/quant_impl.h"
#include "engine/kernels/cpu/thread_pool.h"

#include <ATen/ATen.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

// Visible keys a work item takes: long contexts split over threads even at batch 1.
constexpr int64_t kPartition = 256;
// Keys whose scores are formed before the running maximum is updated: one rescale of the
// accumulators per chunk rather than per key.
constexpr int64_t kChunk = 32;
constexpr int64_t kQ8Group = 32;

// The positions a decode query sees, as at most two ranges in order: [a0, a1) (all of them, or
// the sinks) and [b0, b1) (the recent ones).
struct VisibleKeys {
  int64_t a0 = 0, a1 = 0, b0 = 0, b1 = 0;
  int64_t count() const { return (a1 - a0) + (b1 - b0); }
  int64_t position(int64_t i) const { return i < a1 - a0 ? a0 + i : b0 + (i - (a1 - a0)); }
};

VisibleKeys visible_keys(int64_t context_len, const PagedDecodeWindow& w) {
  const int64_t p = context_len - 1;
  const int64_t lo = w.sliding > 0 ? std::max<int64_t>(0, p - w.sliding + 1) : 0;
  if (w.recent <= 0) return {lo, context_len, context_len, context_len};
  const int64_t sinks_end = std::min(w.sinks, context_len);
  return {lo, std::max(lo, sinks_end), std::max({sinks_end, p - w.recent + 1, lo}), context_len};
}

// Row operations of the portable build.
struct PortableOps {
  static float dot(const float* a, const float* b, int64_t n) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
    float total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; i < n; ++i) total += a[i] * b[i];
    return total;
  }
  static void axpy(float* y, float a, const float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
  }
  static void scale(float* y, float a, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] *= a;
  }
  static void half_row(const uint16_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = quant_impl::fp16_to_fp32(src[i]);
  }
  static void bf16_row(const uint16_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = quant_impl::bf16_to_fp32(src[i]);
  }
  static void q8_row(const int8_t* src, const uint16_t* scales, float* dst, int64_t n) {
    for (int64_t g = 0; g < n / kQ8Group; ++g) {
      const float d = quant_impl::fp16_to_fp32(scales[g]);
      for (int64_t i = g * kQ8Group; i < (g + 1) * kQ8Group; ++i) dst[i] = static_cast<float>(src[i]) * d;
    }
  }
  // scores[g * ld + j] = scale * q_g . k_j for the group's query heads and the chunk's keys.
  static void chunk_scores(const float* q, int64_t group, int64_t hd, const float* const* k, int64_t n, float scale,
                           float* scores, int64_t ld) {
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j = 0; j < n; ++j) scores[g * ld + j] = dot(q + g * hd, k[j], hd) * scale;
  }
  // acc_g += sum_j p[g * ld + j] v_j, key by key.
  static void chunk_accumulate(float* acc, int64_t group, int64_t hd, const float* const* v, int64_t n,
                               const float* p, int64_t ld) {
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j = 0; j < n; ++j) axpy(acc + g * hd, p[g * ld + j], v[j], hd);
  }
};

#if defined(__x86_64__)
#define KVPIPE_PAGED_AVX2 __attribute__((target("avx2,fma,f16c")))

struct Avx2Ops {
  KVPIPE_PAGED_AVX2 static float dot(const float* a, const float* b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s0 = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float total = _mm_cvtss_f32(h);
    for (; i < n; ++i) total += a[i] * b[i];
    return total;
  }
  KVPIPE_PAGED_AVX2 static void axpy(float* y, float a, const float* x, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += a * x[i];
  }
  KVPIPE_PAGED_AVX2 static void scale(float* y, float a, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] *= a;
  }
  KVPIPE_PAGED_AVX2 static void half_row(const uint16_t* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    for (; i < n; ++i) dst[i] = quant_impl::fp16_to_fp32(src[i]);
  }
  KVPIPE_PAGED_AVX2 static void bf16_row(const uint16_t* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
    for (; i < n; ++i) dst[i] = quant_impl::bf16_to_fp32(src[i]);
  }
  KVPIPE_PAGED_AVX2 static void q8_row(const int8_t* src, const uint16_t* scales, float* dst, int64_t n) {
    for (int64_t g = 0; g < n / kQ8Group; ++g) {
      const __m256 d = _mm256_set1_ps(quant_impl::fp16_to_fp32(scales[g]));
      for (int64_t i = g * kQ8Group; i < (g + 1) * kQ8Group; i += 8) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d));
      }
    }
  }
  // Four keys' dot products at once, each summed exactly as dot() sums it (two accumulators
  // over alternate 8-value slices, added, then reduced in dot()'s order), so the scores stay
  // bit for bit those of one key at a time; the four reductions share their shuffles and the
  // eight FMA chains are independent. For head sizes that are multiples of 16.
  KVPIPE_PAGED_AVX2 static __m256 dot4(const float* q, const float* const* k, int64_t hd) {
    __m256 e[4], o[4];
    for (int t = 0; t < 4; ++t) e[t] = _mm256_setzero_ps(), o[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < hd; i += 16) {
      const __m256 q0 = _mm256_loadu_ps(q + i), q1 = _mm256_loadu_ps(q + i + 8);
      for (int t = 0; t < 4; ++t) {
        e[t] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k[t] + i), e[t]);
        o[t] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k[t] + i + 8), o[t]);
      }
    }
    for (int t = 0; t < 4; ++t) e[t] = _mm256_add_ps(e[t], o[t]);
    // Lanes i + (i + 4) of each key: [u0 | u1] and [u2 | u3].
    const __m256 u01 =
        _mm256_add_ps(_mm256_permute2f128_ps(e[0], e[1], 0x20), _mm256_permute2f128_ps(e[0], e[1], 0x31));
    const __m256 u23 =
        _mm256_add_ps(_mm256_permute2f128_ps(e[2], e[3], 0x20), _mm256_permute2f128_ps(e[2], e[3], 0x31));
    // (u_0 + u_2) and (u_1 + u_3) of each key, then their sum: key 0 in lane 0, 2 in 1, 1 in 4,
    // 3 in 5.
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(r, r, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(r, r, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  KVPIPE_PAGED_AVX2 static void chunk_scores(const float* q, int64_t group, int64_t hd, const float* const* k,
                                             int64_t n, float scale, float* scores, int64_t ld) {
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * hd;
      int64_t j = 0;
      if (hd % 16 == 0)
        for (; j + 4 <= n; j += 4) {
          alignas(32) float d[8];
          _mm256_store_ps(d, dot4(qg, k + j, hd));
          float* out = scores + g * ld + j;
          out[0] = d[0] * scale, out[1] = d[4] * scale, out[2] = d[1] * scale, out[3] = d[5] * scale;
        }
      for (; j < n; ++j) scores[g * ld + j] = dot(qg, k[j], hd) * scale;
    }
  }
  // The accumulators stay in registers over the chunk's keys, 32 values at a time; each value
  // still takes its keys in order (one FMA per key), as axpy key by key does.
  KVPIPE_PAGED_AVX2 static void chunk_accumulate(float* acc, int64_t group, int64_t hd, const float* const* v,
                                                 int64_t n, const float* p, int64_t ld) {
    for (int64_t g = 0; g < group; ++g) {
      float* a = acc + g * hd;
      const float* pg = p + g * ld;
      int64_t i = 0;
      for (; i + 32 <= hd; i += 32) {
        __m256 c0 = _mm256_loadu_ps(a + i), c1 = _mm256_loadu_ps(a + i + 8);
        __m256 c2 = _mm256_loadu_ps(a + i + 16), c3 = _mm256_loadu_ps(a + i + 24);
        for (int64_t j = 0; j < n; ++j) {
          const __m256 pj = _mm256_set1_ps(pg[j]);
          const float* vj = v[j] + i;
          c0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj), c0);
          c1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8), c1);
          c2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 16), c2);
          c3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 24), c3);
        }
        _mm256_storeu_ps(a + i, c0);
        _mm256_storeu_ps(a + i + 8, c1);
        _mm256_storeu_ps(a + i + 16, c2);
        _mm256_storeu_ps(a + i + 24, c3);
      }
      for (; i + 8 <= hd; i += 8) {
        __m256 c = _mm256_loadu_ps(a + i);
        for (int64_t j = 0; j < n; ++j) c = _mm256_fmadd_ps(_mm256_set1_ps(pg[j]), _mm256_loadu_ps(v[j] + i), c);
        _mm256_storeu_ps(a + i, c);
      }
      for (; i < hd; ++i)
        for (int64_t j = 0; j < n; ++j) a[i] += pg[j] * v[j][i];
    }
  }
};
#endif

// Row `row` (slot * kv_heads + head) of keys or values as float32: the pool's own memory for
// float32 storage, `tmp` otherwise.
template <class Ops>
const float* load_row(const PagedKvLayer& kv, const void* base, const uint16_t* scales, int64_t row, float* tmp) {
  const int64_t hd = kv.head_dim;
  switch (kv.dtype) {
    case KvDtype::kFloat32: return static_cast<const float*>(base) + row * hd;
    case KvDtype::kFloat16: Ops::half_row(static_cast<const uint16_t*>(base) + row * hd, tmp, hd); return tmp;
    case KvDtype::kBFloat16: Ops::bf16_row(static_cast<const uint16_t*>(base) + row * hd, tmp, hd); return tmp;
    case KvDtype::kQ8_0:
      Ops::q8_row(static_cast<const int8_t*>(base) + row * hd, scales + row * (hd / kQ8Group), tmp, hd);
      return tmp;
  }
  return tmp;
}

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
