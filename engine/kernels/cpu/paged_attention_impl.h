// paged_attention_impl: what the CPU's paged attention kernels share (paged_attention.h,
// paged_prefill_attention.h): the positions a query at a given context length sees, and the
// row operations of the portable and AVX2 builds, among them the decode of one stored key or
// value row (float32, float16, bfloat16 or q8_0) to float32. Internal to engine/kernels/cpu.
#pragma once

#include "engine/kernels/cpu/half_convert.h"
#include "engine/kernels/cpu/paged_attention.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace kvpipe::paged_impl {

constexpr int64_t kQ8Group = 32;

// The positions a decode query sees, as at most two ranges in order: [a0, a1) (all of them, or
// the sinks) and [b0, b1) (the recent ones).
struct VisibleKeys {
  int64_t a0 = 0, a1 = 0, b0 = 0, b1 = 0;
  int64_t count() const { return (a1 - a0) + (b1 - b0); }
  int64_t position(int64_t i) const { return i < a1 - a0 ? a0 + i : b0 + (i - (a1 - a0)); }
  bool contains(int64_t k) const { return (a0 <= k && k < a1) || (b0 <= k && k < b1); }
  // Every position of [begin, end) is visible.
  bool covers(int64_t begin, int64_t end) const { return (a0 <= begin && end <= a1) || (b0 <= begin && end <= b1); }
};

inline VisibleKeys visible_keys(int64_t context_len, const PagedDecodeWindow& w) {
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

KVPIPE_PAGED_AVX2 inline float horizontal_sum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

struct Avx2Ops {
  KVPIPE_PAGED_AVX2 static float dot(const float* a, const float* b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float total = horizontal_sum(_mm256_add_ps(s0, s1));
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


}  // namespace kvpipe::paged_impl
