// int8_gemm's x86 tile kernels (int8_gemm_impl.h): one template over the byte product, AVX2's
// vpmaddubsw + vpmaddwd or AVX-512 VNNI's vpdpbusd, each compiled with its own target
// attributes so the binary runs on any x86-64 and calls them only where they run.
#include "engine/kernels/cpu/int8_gemm_impl.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstring>

namespace kvpipe::int8_gemm_impl {
namespace {

#define KVPIPE_INT8_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVPIPE_INT8_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))

struct DotAvx2 {
  // Pairs of byte products summed into 16 bits, then pairs of those into 32: exact while
  // both pair sums stay below 2^15, which the unsigned bytes below 128 guarantee.
  KVPIPE_INT8_AVX2 static __m256i dot(__m256i acc, __m256i u, __m256i a) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
  }
};

struct DotVnni {
  KVPIPE_INT8_VNNI static __m256i dot(__m256i acc, __m256i u, __m256i a) { return _mm256_dpbusd_epi32(acc, u, a); }
};

inline int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// kInputs inputs from j0 times the group: per run, every input's 8 row sums in one register
// (two for split runs, one per half), each of the 8 loads of four values shared by the
// inputs. The epilogue's float operations are tile_portable's, in its order.
#define KVPIPE_INT8_TILE(NAME, ATTR, DOT)                                                                          \
  template <int kInputs, bool kSplit>                                                                             \
  ATTR void NAME(const PackedRun* group, const Panel& p, int64_t j0, float* y, int64_t ldy, int valid) {          \
    constexpr int kHalves = kSplit ? 2 : 1;                                                                       \
    __m256 acc[kInputs];                                                                                          \
    const uint8_t* xr[kInputs];                                                                                   \
    const float* da[kInputs];                                                                                     \
    const float* sa[kInputs];                                                                                     \
    for (int j = 0; j < kInputs; ++j) {                                                                           \
      acc[j] = _mm256_setzero_ps();                                                                               \
      xr[j] = p.x + (j0 + j) * p.x_stride;                                                                        \
      da[j] = p.da + (j0 + j) * p.runs;                                                                           \
      sa[j] = p.s + (j0 + j) * p.runs * kHalves;                                                                  \
    }                                                                                                             \
    for (int64_t b = 0; b < p.runs; ++b) {                                                                        \
      const PackedRun& run = group[b];                                                                            \
      const int64_t off = p.qs_offset[b];                                                                         \
      __m256i isum[kHalves][kInputs];                                                                             \
      for (int h = 0; h < kHalves; ++h)                                                                           \
        for (int j = 0; j < kInputs; ++j) isum[h][j] = _mm256_setzero_si256();                                    \
      _Pragma("GCC unroll 8") for (int k = 0; k < 8; ++k) {                                                       \
        const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(run.q + 32 * k));                    \
        const int h = kSplit && k >= 4 ? 1 : 0;                                                                   \
        for (int j = 0; j < kInputs; ++j)                                                                         \
          isum[h][j] = DOT::dot(isum[h][j], w, _mm256_set1_epi32(load_i32(xr[j] + off + 4 * k)));                 \
      }                                                                                                           \
      for (int h = 0; h < kHalves; ++h) {                                                                         \
        const __m256 dv = _mm256_load_ps(run.d[h]), mv = _mm256_load_ps(run.m[h]);                                \
        for (int j = 0; j < kInputs; ++j) {                                                                       \
          const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(da[j][b]));                                       \
          acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h][j]), scale, acc[j]);                                \
          acc[j] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sa[j][b * kHalves + h]), acc[j]);                           \
        }                                                                                                         \
      }                                                                                                           \
    }                                                                                                             \
    for (int j = 0; j < kInputs; ++j) {                                                                           \
      float* out = y + (j0 + j) * ldy;                                                                            \
      if (valid == kGroupRows) {                                                                                  \
        _mm256_storeu_ps(out, acc[j]);                                                                            \
      } else {                                                                                                    \
        alignas(32) float tmp[kGroupRows];                                                                        \
        _mm256_store_ps(tmp, acc[j]);                                                                             \
        std::memcpy(out, tmp, sizeof(float) * static_cast<size_t>(valid));                                        \
      }                                                                                                           \
    }                                                                                                             \
  }

KVPIPE_INT8_TILE(inputs_avx2, KVPIPE_INT8_AVX2, DotAvx2)
KVPIPE_INT8_TILE(inputs_vnni, KVPIPE_INT8_VNNI, DotVnni)

// AVX2 has 16 vector registers: 4 inputs keep their sums and accumulators in them; AVX-512's
// 32 hold 8.
template <bool kSplit>
KVPIPE_INT8_AVX2 void tile_avx2_impl(const PackedRun* group, const Panel& p, int64_t n, float* y, int64_t ldy,
                                     int valid) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) inputs_avx2<4, kSplit>(group, p, j, y, ldy, valid);
  switch (n - j) {
    case 3: inputs_avx2<3, kSplit>(group, p, j, y, ldy, valid); break;
    case 2: inputs_avx2<2, kSplit>(group, p, j, y, ldy, valid); break;
    case 1: inputs_avx2<1, kSplit>(group, p, j, y, ldy, valid); break;
    default: break;
  }
}

template <bool kSplit>
KVPIPE_INT8_VNNI void tile_vnni_impl(const PackedRun* group, const Panel& p, int64_t n, float* y, int64_t ldy,
                                     int valid) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) inputs_vnni<8, kSplit>(group, p, j, y, ldy, valid);
  if (n - j >= 4) {
    inputs_vnni<4, kSplit>(group, p, j, y, ldy, valid);
    j += 4;
  }
  switch (n - j) {
    case 3: inputs_vnni<3, kSplit>(group, p, j, y, ldy, valid); break;
    case 2: inputs_vnni<2, kSplit>(group, p, j, y, ldy, valid); break;
    case 1: inputs_vnni<1, kSplit>(group, p, j, y, ldy, valid); break;
    default: break;
  }
}

// Two groups (16 rows, one to each 32-bit lane of a 512-bit vector) against kInputs inputs:
// every vpdpbusd, broadcast and float operation serves twice the rows of inputs_vnni, whose
// prompts were bound by issuing instructions rather than by the multiplies. Each lane does
// inputs_vnni's operations in its order, so a row's result is the same bit for bit.
// GCC 12 warns that the widening casts' undefined upper halves "may be used uninitialized"
// once inlined (its bug 105593, fixed in GCC 13); the inserts overwrite them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <int kInputs, bool kSplit>
KVPIPE_INT8_VNNI void pair_inputs_vnni(const PackedRun* g0, const PackedRun* g1, const Panel& p, int64_t j0, float* y,
                                       int64_t ldy, int valid) {
  constexpr int kHalves = kSplit ? 2 : 1;
  __m512 acc[kInputs];
  const uint8_t* xr[kInputs];
  const float* da[kInputs];
  const float* sa[kInputs];
  for (int j = 0; j < kInputs; ++j) {
    acc[j] = _mm512_setzero_ps();
    xr[j] = p.x + (j0 + j) * p.x_stride;
    da[j] = p.da + (j0 + j) * p.runs;
    sa[j] = p.s + (j0 + j) * p.runs * kHalves;
  }
  for (int64_t b = 0; b < p.runs; ++b) {
    const PackedRun& r0 = g0[b];
    const PackedRun& r1 = g1[b];
    const int64_t off = p.qs_offset[b];
    __m512i isum[kHalves][kInputs];
    for (int h = 0; h < kHalves; ++h)
      for (int j = 0; j < kInputs; ++j) isum[h][j] = _mm512_setzero_si512();
    _Pragma("GCC unroll 8") for (int k = 0; k < 8; ++k) {
      const __m512i w = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(r0.q + 32 * k))),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(r1.q + 32 * k)), 1);
      const int h = kSplit && k >= 4 ? 1 : 0;
      for (int j = 0; j < kInputs; ++j)
        isum[h][j] = _mm512_dpbusd_epi32(isum[h][j], w, _mm512_set1_epi32(load_i32(xr[j] + off + 4 * k)));
    }
    for (int h = 0; h < kHalves; ++h) {
      const __m512 dv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(r0.d[h])), _mm256_load_ps(r1.d[h]), 1);
      const __m512 mv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(r0.m[h])), _mm256_load_ps(r1.m[h]), 1);
      for (int j = 0; j < kInputs; ++j) {
        const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(da[j][b]));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[h][j]), scale, acc[j]);
        acc[j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sa[j][b * kHalves + h]), acc[j]);
      }
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
  for (int j = 0; j < kInputs; ++j) _mm512_mask_storeu_ps(y + (j0 + j) * ldy, keep, acc[j]);
}
#pragma GCC diagnostic pop

template <bool kSplit>
KVPIPE_INT8_VNNI void tile_pair_vnni_impl(const PackedRun* g0, const PackedRun* g1, const Panel& p, int64_t n,
                                          float* y, int64_t ldy, int valid) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) pair_inputs_vnni<8, kSplit>(g0, g1, p, j, y, ldy, valid);
  if (n - j >= 4) {
    pair_inputs_vnni<4, kSplit>(g0, g1, p, j, y, ldy, valid);
    j += 4;
  }
  switch (n - j) {
    case 3: pair_inputs_vnni<3, kSplit>(g0, g1, p, j, y, ldy, valid); break;
    case 2: pair_inputs_vnni<2, kSplit>(g0, g1, p, j, y, ldy, valid); break;
    case 1: pair_inputs_vnni<1, kSplit>(g0, g1, p, j, y, ldy, valid); break;
    default: break;
  }
}

}  // namespace

void tile_avx2(const PackedRun* group, const Panel& p, bool split, int64_t n, float* y, int64_t ldy, int valid) {
  if (split) return tile_avx2_impl<true>(group, p, n, y, ldy, valid);
  tile_avx2_impl<false>(group, p, n, y, ldy, valid);
}

void tile_avx512vnni(const PackedRun* group, const Panel& p, bool split, int64_t n, float* y, int64_t ldy,
                     int valid) {
  if (split) return tile_vnni_impl<true>(group, p, n, y, ldy, valid);
  tile_vnni_impl<false>(group, p, n, y, ldy, valid);
}

void tile_pair_avx512vnni(const PackedRun* g0, const PackedRun* g1, const Panel& p, bool split, int64_t n, float* y,
                          int64_t ldy, int valid) {
  if (split) return tile_pair_vnni_impl<true>(g0, g1, p, n, y, ldy, valid);
  tile_pair_vnni_impl<false>(g0, g1, p, n, y, ldy, valid);
}

}  // namespace kvpipe::int8_gemm_impl

#endif  // __x86_64__
