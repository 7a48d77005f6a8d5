// fused_ops_impl.h's x86 kernels. exp is Cephes' expf (a degree-5 polynomial on the remainder
// after taking out n ln 2) written out here: LibTorch's vectorised exp (Sleef) is not exposed to
// callers, and libm's expf is scalar. The AVX2 and AVX-512 bodies are one template over the
// vector width, so every lane does the same float operations whichever ISA runs.
#include "engine/kernels/cpu/fused_ops_impl.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstring>

namespace kvpipe::fused_impl {
namespace {

#define KVPIPE_FUSED_AVX2 __attribute__((target("avx2,fma")))
#define KVPIPE_FUSED_AVX512 __attribute__((target("avx2,fma,avx512f")))

// exp's argument is held in [kLow, kHigh]: 2^n then stays a normal float (n in [-126, 127]).
// Below kLow, 1 + exp(x) is 1 to float32 either way; above kHigh exp is infinite, as expf's
// overflow, so that g / (1 + exp(-g)) is 0 for every very negative g.
constexpr float kLow = -87.0f, kHigh = 88.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

struct Avx2 {
  using F = __m256;
  static constexpr int kLanes = 8;
  KVPIPE_FUSED_AVX2 static F load(const float* p) { return _mm256_loadu_ps(p); }
  KVPIPE_FUSED_AVX2 static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  KVPIPE_FUSED_AVX2 static F set(float v) { return _mm256_set1_ps(v); }
  KVPIPE_FUSED_AVX2 static F add(F a, F b) { return _mm256_add_ps(a, b); }
  KVPIPE_FUSED_AVX2 static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  KVPIPE_FUSED_AVX2 static F div(F a, F b) { return _mm256_div_ps(a, b); }
  KVPIPE_FUSED_AVX2 static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  KVPIPE_FUSED_AVX2 static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  KVPIPE_FUSED_AVX2 static F clamp(F x) { return _mm256_min_ps(_mm256_max_ps(x, set(kLow)), set(kHigh)); }
  KVPIPE_FUSED_AVX2 static F inf_above_high(F x, F e) {
    return _mm256_blendv_ps(e, set(__builtin_inff()), _mm256_cmp_ps(x, set(kHigh), _CMP_GT_OQ));
  }
  KVPIPE_FUSED_AVX2 static F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // 2^n for whole n in [-126, 127], from its exponent bits.
  KVPIPE_FUSED_AVX2 static F pow2(F n) {
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(bits);
  }
};

struct Avx512 {
  using F = __m512;
  static constexpr int kLanes = 16;
  KVPIPE_FUSED_AVX512 static F load(const float* p) { return _mm512_loadu_ps(p); }
  KVPIPE_FUSED_AVX512 static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  KVPIPE_FUSED_AVX512 static F set(float v) { return _mm512_set1_ps(v); }
  KVPIPE_FUSED_AVX512 static F add(F a, F b) { return _mm512_add_ps(a, b); }
  KVPIPE_FUSED_AVX512 static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  KVPIPE_FUSED_AVX512 static F div(F a, F b) { return _mm512_div_ps(a, b); }
  KVPIPE_FUSED_AVX512 static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  KVPIPE_FUSED_AVX512 static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  KVPIPE_FUSED_AVX512 static F clamp(F x) { return _mm512_min_ps(_mm512_max_ps(x, set(kLow)), set(kHigh)); }
  KVPIPE_FUSED_AVX512 static F inf_above_high(F x, F e) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, set(kHigh), _CMP_GT_OQ), e, set(__builtin_inff()));
  }
  KVPIPE_FUSED_AVX512 static F round(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  KVPIPE_FUSED_AVX512 static F pow2(F n) {
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_castsi512_ps(bits);
  }
};

#define KVPIPE_SILU_BODY(ATTR)                                                                            \
  template <typename V>                                                                                   \
  ATTR typename V::F exp_lanes(typename V::F in) {                                                        \
    const typename V::F x = V::clamp(in);                                                                 \
    const typename V::F n = V::round(V::mul(x, V::set(kLog2e)));                                          \
    typename V::F r = V::fnma(n, V::set(kLn2Hi), x);                                                      \
    r = V::fnma(n, V::set(kLn2Lo), r);                                                                    \
    typename V::F p = V::fma(V::set(kP0), r, V::set(kP1));                                                \
    p = V::fma(p, r, V::set(kP2));                                                                        \
    p = V::fma(p, r, V::set(kP3));                                                                        \
    p = V::fma(p, r, V::set(kP4));                                                                        \
    p = V::fma(p, r, V::set(kP5));                                                                        \
    const typename V::F e = V::add(V::fma(p, V::mul(r, r), r), V::set(1.0f));                             \
    return V::inf_above_high(in, V::mul(e, V::pow2(n)));                                                  \
  }                                                                                                       \
  template <typename V>                                                                                   \
  ATTR typename V::F silu_mul_lanes(typename V::F g, typename V::F u) {                                   \
    const typename V::F e = exp_lanes<V>(V::mul(g, V::set(-1.0f)));                                       \
    return V::mul(V::div(g, V::add(V::set(1.0f), e)), u);                                                 \
  }                                                                                                       \
  template <typename V>                                                                                   \
  ATTR void silu_mul_rows(const float* g, const float* u, float* o, int64_t n) {                          \
    int64_t i = 0;                                                                                        \
    for (; i + V::kLanes <= n; i += V::kLanes)                                                            \
      V::store(o + i, silu_mul_lanes<V>(V::load(g + i), V::load(u + i)));                                 \
    if (i == n) return;                                                                                   \
    /* The tail through the same lanes, so a value's result does not depend on where it sits. */         \
    float gt[V::kLanes] = {}, ut[V::kLanes] = {}, ot[V::kLanes];                                          \
    const size_t rest = static_cast<size_t>(n - i) * sizeof(float);                                       \
    std::memcpy(gt, g + i, rest);                                                                         \
    std::memcpy(ut, u + i, rest);                                                                         \
    V::store(ot, silu_mul_lanes<V>(V::load(gt), V::load(ut)));                                            \
    std::memcpy(o + i, ot, rest);                                                                         \
  }

namespace avx2 {
KVPIPE_SILU_BODY(KVPIPE_FUSED_AVX2)
}
// GCC 12 warns of the "undefined" pass-through operands inside its AVX-512 intrinsics once
// inlined (its bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace avx512 {
KVPIPE_SILU_BODY(KVPIPE_FUSED_AVX512)
}
#pragma GCC diagnostic pop

}  // namespace

void silu_mul_avx2(const float* g, const float* u, float* o, int64_t n) { avx2::silu_mul_rows<Avx2>(g, u, o, n); }
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
void silu_mul_avx512(const float* g, const float* u, float* o, int64_t n) {
  avx512::silu_mul_rows<Avx512>(g, u, o, n);
}
#pragma GCC diagnostic pop

}  // namespace kvpipe::fused_impl

#endif  // __x86_64__
