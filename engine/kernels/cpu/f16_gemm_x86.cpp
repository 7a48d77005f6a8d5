// f16_gemm's AVX-512 tiles, float16 and bfloat16 (f16_gemm_impl.h), compiled with their own
// target attributes so the binary runs on any x86-64 and calls them only where the probe passed.
#include "engine/kernels/cpu/f16_gemm_impl.h"

#if defined(__x86_64__)
#include <immintrin.h>

namespace kvpipe::f16_gemm_impl {
namespace {

#define KVPIPE_F16_ATTR __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq")))

// GCC 12 warns of the "undefined" pass-through operand inside _mm512_cvtph_ps once inlined (its
// bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// 16 rows' value c in float32: float16 through vcvtph2ps, bfloat16 by a 16-bit shift (both exact).
template <bool kBf16>
KVPIPE_F16_ATTR inline __m512 widen(const uint16_t* values) {
  const __m256i bits = _mm256_load_si256(reinterpret_cast<const __m256i*>(values));
  if constexpr (kBf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  return _mm512_cvtph_ps(bits);
}

// kInputs inputs of a tile times one group: an accumulator of 16 rows per input, each widened
// value of the 16 rows shared by the inputs, the inputs' values broadcast from their
// interleaved tile (one stream of activations, not one per input).
template <bool kBf16, int kInputs>
KVPIPE_F16_ATTR void tile_inputs(const uint16_t* group, int64_t cols, const float* xt, float* y, int64_t ldy,
                                 __mmask16 rows) {
  __m512 acc[kInputs];
  for (int j = 0; j < kInputs; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < cols; ++c) {
    const __m512 w = widen<kBf16>(group + kGroupRows * c);
    const float* xc = xt + kTileInputs * c;
    for (int j = 0; j < kInputs; ++j) acc[j] = _mm512_fmadd_ps(w, _mm512_set1_ps(xc[j]), acc[j]);
  }
  for (int j = 0; j < kInputs; ++j) _mm512_mask_storeu_ps(y + j * ldy, rows, acc[j]);
}

#pragma GCC diagnostic pop

template <bool kBf16>
KVPIPE_F16_ATTR void tile(const uint16_t* group, int64_t cols, const float* xt, int count, float* y, int64_t ldy,
                          int valid) {
  static_assert(kTileInputs == 12, "the switch below covers tiles of up to 12 inputs");
  const __mmask16 rows = static_cast<__mmask16>((1u << valid) - 1u);
  switch (count) {
    case 12: return tile_inputs<kBf16, 12>(group, cols, xt, y, ldy, rows);
    case 11: return tile_inputs<kBf16, 11>(group, cols, xt, y, ldy, rows);
    case 10: return tile_inputs<kBf16, 10>(group, cols, xt, y, ldy, rows);
    case 9: return tile_inputs<kBf16, 9>(group, cols, xt, y, ldy, rows);
    case 8: return tile_inputs<kBf16, 8>(group, cols, xt, y, ldy, rows);
    case 7: return tile_inputs<kBf16, 7>(group, cols, xt, y, ldy, rows);
    case 6: return tile_inputs<kBf16, 6>(group, cols, xt, y, ldy, rows);
    case 5: return tile_inputs<kBf16, 5>(group, cols, xt, y, ldy, rows);
    case 4: return tile_inputs<kBf16, 4>(group, cols, xt, y, ldy, rows);
    case 3: return tile_inputs<kBf16, 3>(group, cols, xt, y, ldy, rows);
    case 2: return tile_inputs<kBf16, 2>(group, cols, xt, y, ldy, rows);
    case 1: return tile_inputs<kBf16, 1>(group, cols, xt, y, ldy, rows);
    default: return;
  }
}

}  // namespace

KVPIPE_F16_ATTR void tile_avx512(const uint16_t* group, int64_t cols, const float* xt, int count, float* y,
                                 int64_t ldy, int valid) {
  tile<false>(group, cols, xt, count, y, ldy, valid);
}

KVPIPE_F16_ATTR void tile_avx512_bf16(const uint16_t* group, int64_t cols, const float* xt, int count, float* y,
                                      int64_t ldy, int valid) {
  tile<true>(group, cols, xt, count, y, ldy, valid);
}

}  // namespace kvpipe::f16_gemm_impl

#endif  // __x86_64__
