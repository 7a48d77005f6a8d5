// f16_gemm's AVX-512 tile (f16_gemm_impl.h), compiled with its own target attributes so the
// binary runs on any x86-64 and calls it only where the probe passed.
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

// kInputs inputs of a tile times one group: an accumulator of 16 rows per input, each widened
// value of the 16 rows shared by the inputs, the inputs' values broadcast from their
// interleaved tile (one stream of activations, not one per input).
template <int kInputs>
KVPIPE_F16_ATTR void tile_inputs(const uint16_t* group, int64_t cols, const float* xt, float* y, int64_t ldy,
                                 __mmask16 rows) {
  __m512 acc[kInputs];
  for (int j = 0; j < kInputs; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < cols; ++c) {
    const __m512 w = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(group + kGroupRows * c)));
    const float* xc = xt + kTileInputs * c;
    for (int j = 0; j < kInputs; ++j) acc[j] = _mm512_fmadd_ps(w, _mm512_set1_ps(xc[j]), acc[j]);
  }
  for (int j = 0; j < kInputs; ++j) _mm512_mask_storeu_ps(y + j * ldy, rows, acc[j]);
}

#pragma GCC diagnostic pop

}  // namespace

KVPIPE_F16_ATTR void tile_avx512(const uint16_t* group, int64_t cols, const float* xt, int count, float* y,
                                 int64_t ldy, int valid) {
  static_assert(kTileInputs == 12, "the switch below covers tiles of up to 12 inputs");
  const __mmask16 rows = static_cast<__mmask16>((1u << valid) - 1u);
  switch (count) {
    case 12: return tile_inputs<12>(group, cols, xt, y, ldy, rows);
    case 11: return tile_inputs<11>(group, cols, xt, y, ldy, rows);
    case 10: return tile_inputs<10>(group, cols, xt, y, ldy, rows);
    case 9: return tile_inputs<9>(group, cols, xt, y, ldy, rows);
    case 8: return tile_inputs<8>(group, cols, xt, y, ldy, rows);
    case 7: return tile_inputs<7>(group, cols, xt, y, ldy, rows);
    case 6: return tile_inputs<6>(group, cols, xt, y, ldy, rows);
    case 5: return tile_inputs<5>(group, cols, xt, y, ldy, rows);
    case 4: return tile_inputs<4>(group, cols, xt, y, ldy, rows);
    case 3: return tile_inputs<3>(group, cols, xt, y, ldy, rows);
    case 2: return tile_inputs<2>(group, cols, xt, y, ldy, rows);
    case 1: return tile_inputs<1>(group, cols, xt, y, ldy, rows);
    default: return;
  }
}

}  // namespace kvpipe::f16_gemm_impl

#endif  // __x86_64__
