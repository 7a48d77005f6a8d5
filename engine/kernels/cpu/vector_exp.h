// vector_exp: exp over the float32 lanes of an AVX2 or AVX-512 register, for the CPU kernels that
// need it in their inner loops (attention's softmax, SiLU). LibTorch's vectorised exp (Sleef) is
// not exposed to callers and libm's expf is scalar, so this is Cephes' expf written out:
// x = n ln 2 + f, a degree-6 polynomial in f, times 2^n; about 1 ulp.
//
// Guarantees: exactly 0 below -87 (a masked score, -inf, gives 0) and for NaN; +inf above 88
// (as expf overflows); the AVX2 and AVX-512 versions do the same operations in each lane, so
// they agree bit for bit. Internal to engine/kernels/cpu; callers compile with the matching
// target attributes.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

namespace kvpipe::vector_exp {

inline constexpr float kLow = -87.0f, kHigh = 88.0f;
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
inline constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                       kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kLow), _CMP_GE_OQ);
  const __m256 overflow = _mm256_cmp_ps(x, _mm256_set1_ps(kHigh), _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kLow)), _mm256_set1_ps(kHigh));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), f);
  __m256 y = _mm256_set1_ps(kP0);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(kP1));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(kP2));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(kP3));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(kP4));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(kP5));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
  // x in [kLow, kHigh] keeps n in [-126, 127], where 2^n is a normal float: its exponent bits.
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(pow2)), keep);
  return _mm256_blendv_ps(e, _mm256_set1_ps(__builtin_inff()), overflow);
}

__attribute__((target("avx2,fma,avx512f"))) inline __m512 exp_avx512(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kLow), _CMP_GE_OQ);
  const __mmask16 overflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kHigh), _CMP_GT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kLow)), _mm512_set1_ps(kHigh));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), f);
  __m512 y = _mm512_set1_ps(kP0);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kP1));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kP2));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kP3));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kP4));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kP5));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.0f)));
  const __m512i pow2 = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 e = _mm512_maskz_mov_ps(keep, _mm512_mul_ps(y, _mm512_castsi512_ps(pow2)));
  return _mm512_mask_blend_ps(overflow, e, _mm512_set1_ps(__builtin_inff()));
}

}  // namespace kvpipe::vector_exp

#endif  // __x86_64__
