// bf16_gemm's AVX512-BF16 tile (bf16_gemm_impl.h), compiled with its own target attributes so
// the binary runs on any x86-64 and calls it only where the probe passed.
#include "engine/kernels/cpu/bf16_gemm_impl.h"

#if defined(__x86_64__)
#include <immintrin.h>

namespace kvpipe::bf16_gemm_impl {
namespace {

#define KVPIPE_BF16_ATTR __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512dq,avx512bf16")))

// kInputs inputs from j0 times one group: an accumulator of 16 rows per input, each 64-byte
// load of the group's next pair shared by the inputs, the input's pair broadcast from memory.
// kInputs = 8 keeps eight independent accumulations in flight, past vdpbf16ps's latency.
template <int kInputs>
KVPIPE_BF16_ATTR void tile_inputs(const uint32_t* group, const uint32_t* xb, int64_t pairs, int64_t j0, float* y,
                                  int64_t ldy, __mmask16 rows) {
  __m512 acc[kInputs];
  const uint32_t* xr[kInputs];
  for (int j = 0; j < kInputs; ++j) {
    acc[j] = _mm512_setzero_ps();
    xr[j] = xb + (j0 + j) * pairs;
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh w = reinterpret_cast<__m512bh>(_mm512_load_si512(group + kGroupRows * p));
    for (int j = 0; j < kInputs; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], w, reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(xr[j][p]))));
  }
  for (int j = 0; j < kInputs; ++j) _mm512_mask_storeu_ps(y + (j0 + j) * ldy, rows, acc[j]);
}

}  // namespace

KVPIPE_BF16_ATTR void tile_avx512bf16(const uint32_t* group, const uint32_t* xb, int64_t pairs, int64_t j0,
                                      int64_t count, float* y, int64_t ldy, int valid) {
  const __mmask16 rows = static_cast<__mmask16>((1u << valid) - 1u);
  int64_t j = j0;
  const int64_t end = j0 + count;
  for (; j + 8 <= end; j += 8) tile_inputs<8>(group, xb, pairs, j, y, ldy, rows);
  switch (end - j) {
    case 7: return tile_inputs<7>(group, xb, pairs, j, y, ldy, rows);
    case 6: return tile_inputs<6>(group, xb, pairs, j, y, ldy, rows);
    case 5: return tile_inputs<5>(group, xb, pairs, j, y, ldy, rows);
    case 4: return tile_inputs<4>(group, xb, pairs, j, y, ldy, rows);
    case 3: return tile_inputs<3>(group, xb, pairs, j, y, ldy, rows);
    case 2: return tile_inputs<2>(group, xb, pairs, j, y, ldy, rows);
    case 1: return tile_inputs<1>(group, xb, pairs, j, y, ldy, rows);
    default: return;
  }
}

}  // namespace kvpipe::bf16_gemm_impl

#endif
