// fused_ops_impl.h's x86 kernels: SiLU through vector_exp.h's exp, whose AVX2 and AVX-512
// versions do the same operations in each lane, as do the two bodies here.
#include "engine/kernels/cpu/fused_ops_impl.h"

#if defined(__x86_64__)
#include "engine/kernels/cpu/vector_exp.h"

#include <immintrin.h>

#include <cstring>

namespace kvpipe::fused_impl {
namespace {

#define KVPIPE_FUSED_AVX2 __attribute__((target("avx2,fma")))
#define KVPIPE_FUSED_AVX512 __attribute__((target("avx2,fma,avx512f")))

KVPIPE_FUSED_AVX2 inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = vector_exp::exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

// GCC 12 warns of the "undefined" pass-through operands inside its AVX-512 intrinsics once
// inlined (its bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
KVPIPE_FUSED_AVX512 inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 e = vector_exp::exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}
#pragma GCC diagnostic pop

}  // namespace

// A row's tail goes through the same lanes (zero-padded), so a value's result does not depend
// on where in the row it sits.
KVPIPE_FUSED_AVX2 void silu_mul_avx2(const float* g, const float* u, float* o, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
  if (i == n) return;
  float gt[8] = {}, ut[8] = {}, ot[8];
  const size_t rest = static_cast<size_t>(n - i) * sizeof(float);
  std::memcpy(gt, g + i, rest);
  std::memcpy(ut, u + i, rest);
  _mm256_storeu_ps(ot, silu_mul8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
  std::memcpy(o + i, ot, rest);
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
KVPIPE_FUSED_AVX512 void silu_mul_avx512(const float* g, const float* u, float* o, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(o + i, silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
  if (i == n) return;
  const __mmask16 rest = static_cast<__mmask16>((1u << (n - i)) - 1u);
  _mm512_mask_storeu_ps(o + i, rest, silu_mul16(_mm512_maskz_loadu_ps(rest, g + i), _mm512_maskz_loadu_ps(rest, u + i)));
}
#pragma GCC diagnostic pop

}  // namespace kvpipe::fused_impl

#endif  // __x86_64__
