// The 256-value super-block types' AVX2 + FMA half (quant_impl.h): dot kernels for Q2_K, Q3_K,
// Q4_K, Q5_K, Q6_K and IQ4_XS against Q8_K activations, and a vector Q8_K quantiser. The file
// is built for baseline x86-64; the functions carry target attributes and quant_types.cpp
// calls them only where the processor has AVX2, FMA and F16C.
//
// The integer scheme is llama.cpp's: unsigned weight quants times signed activation bytes with
// maddubs (16-bit pair sums), the sub-block scales applied with madd (32-bit), one float
// multiply per super-block and input; the Q2_K/Q4_K/Q5_K mins and the Q3_K/Q6_K offsets (4 and
// 32) come from the activation block sums (bsums) instead of touching every value. IQ4_XS's
// grid values are signed: their magnitudes go into maddubs and their signs onto the
// activation bytes, as for ggml's Q8_0. Each kernel is
// instantiated for 1..kMaxKernelInputs inputs: a weight chunk is unpacked once and multiplied
// into every input while it sits in registers, so a group of inputs streams the weights once.
// Q4_K and Q5_K have a second build with AVX-512 VNNI's vpdpwssd for the scale products,
// handed out where that probe passes, with the same results bit for bit.
#include "engine/kernels/cpu/quant_impl.h"

#if defined(__x86_64__)

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#define KVPIPE_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVPIPE_K_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))

namespace kvpipe::quant_impl {

void k_quantize_activation_row_avx2(const float* x, void* dst, int64_t cols);

namespace {

constexpr int64_t kSuperBlock = 256;
constexpr int64_t kQ8KBytes = 292;
constexpr int64_t kQ8KQs = 4;
constexpr int64_t kQ8KBsums = 4 + kSuperBlock;

inline int load_i32(const uint8_t* p) {
  int v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

KVPIPE_AVX2 inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

KVPIPE_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A shuffle that repeats 16-bit element `e` of each 128-bit lane over that lane.
KVPIPE_AVX2 inline __m256i repeat_word(int e) {
  return _mm256_set1_epi16(static_cast<short>(((2 * e + 1) << 8) | (2 * e)));
}

// The shuffle that gives, in 16-bit words, scale 2k of an eight-scale group in the low lane
// and scale 2k + 1 in the high lane: for vectors of 32 values that span two 16-value
// sub-blocks.
KVPIPE_AVX2 inline __m256i lane_scales(int k) {
  return _mm256_setr_m128i(_mm256_castsi256_si128(repeat_word(2 * k)), _mm256_castsi256_si128(repeat_word(2 * k + 1)));
}

// Pins an accumulator's value at this point of the computation: without it the compiler
// reassociates the unrolled chunks' sums into one late tree, keeps every product live and
// spills them.
KVPIPE_AVX2 inline void settle(__m256i& v) { asm("" : "+x"(v)); }

// sumi[n] += scales . (q x the 32 activation bytes of input n at a + n * x_stride), for N inputs.
template <int N>
KVPIPE_AVX2 inline void add_scaled_products(__m256i* sumi, __m256i scales, __m256i q, const uint8_t* a,
                                            int64_t x_stride) {
#pragma GCC unroll 4
  for (int n = 0; n < N; ++n) {
    sumi[n] = _mm256_add_epi32(sumi[n], _mm256_madd_epi16(scales, _mm256_maddubs_epi16(q, load256(a + n * x_stride))));
    settle(sumi[n]);
  }
}

// acc[n] += d_x(n) * (d * sumi[n]): a super-block's integer sums under the weight's scale d and
// each input's (the float at the start of its Q8_K block).
template <int N>
KVPIPE_AVX2 inline void add_block_sums(__m256* acc, const __m256i* sumi, float d, const uint8_t* xb,
                                       int64_t x_stride) {
  const __m256 vd = _mm256_set1_ps(d);
#pragma GCC unroll 4
  for (int n = 0; n < N; ++n) {
    const __m256 xd = _mm256_broadcast_ss(reinterpret_cast<const float*>(xb + n * x_stride));
    acc[n] = _mm256_fmadd_ps(xd, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(sumi[n])), acc[n]);
  }
}

// Weights ahead of the current block the kernels ask for: the hardware prefetcher follows one
// row well, but a few cache lines of head start hide the latency when rows start anew.
constexpr int64_t kPrefetchBytes = 1024;

// Asks for the kLines cache lines kPrefetchBytes ahead of a block at wb.
template <int kLines>
KVPIPE_AVX2 inline void prefetch_ahead(const uint8_t* wb) {
#pragma GCC unroll 4
  for (int i = 0; i < kLines; ++i) _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + 64 * i), _MM_HINT_T0);
}

// sumi + s_lo . (q_lo x the 32 activation bytes at a) + s_hi . (q_hi x the 32 at a + 32):
// maddubs's 16-bit pair sums under the sub-block scales, AVX2's madd then two adds; AVX-512
// VNNI's vpdpwssd multiplies, pairs and adds in one. The same integers either way (the
// scaled pair sums stay far inside 32 bits), so the kernels' floats agree bit for bit.
KVPIPE_AVX2 inline __m256i add_scaled_pairs_avx2(__m256i sumi, __m256i s_lo, __m256i q_lo, __m256i s_hi, __m256i q_hi,
                                                const uint8_t* a) {
  const __m256i p_lo = _mm256_madd_epi16(s_lo, _mm256_maddubs_epi16(q_lo, load256(a)));
  const __m256i p_hi = _mm256_madd_epi16(s_hi, _mm256_maddubs_epi16(q_hi, load256(a + 32)));
  return _mm256_add_epi32(sumi, _mm256_add_epi32(p_lo, p_hi));
}

KVPIPE_K_VNNI inline __m256i add_scaled_pairs_vnni(__m256i sumi, __m256i s_lo, __m256i q_lo, __m256i s_hi, __m256i q_hi,
                                                  const uint8_t* a) {
  sumi = _mm256_dpwssd_epi32(sumi, s_lo, _mm256_maddubs_epi16(q_lo, load256(a)));
  return _mm256_dpwssd_epi32(sumi, s_hi, _mm256_maddubs_epi16(q_hi, load256(a + 32)));
}

// Q4_K (kFive false) and Q5_K (kFive true) rows against N activation rows. One body, compiled
// twice: with AVX2's scale products and with AVX-512 VNNI's.
#define KVPIPE_DOT_Q45K(NAME, ATTR, ADD_SCALED)                                                                       \
template <int N, bool kFive>                                                                                          \
ATTR void NAME(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, float* y,                      \
                 int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {                                     \
  constexpr int64_t kBlockBytes = kFive ? 176 : 144;                                                                  \
  constexpr int64_t kQs = kFive ? 48 : 16;                                                                            \
  const int64_t blocks = cols / kSuperBlock;                                                                          \
  const __m256i low4 = _mm256_set1_epi8(0x0f);                                                                        \
  const __m256i bit4 = _mm256_set1_epi8(0x10);                                                                        \
  /* Bytes 8..15 of the unpacked scales are the mins; each covers two 16-value bsums. */                              \
  const __m128i mins_pairs = _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);               \
  for (int64_t r = row_begin; r < row_end; ++r) {                                                                     \
    const uint8_t* row = w + r * w_stride;                                                                            \
    __m256 acc[N];                                                                                                    \
    _Pragma("GCC unroll 8")                                                                                           \
    for (int n = 0; n < N; ++n) acc[n] = _mm256_setzero_ps();                                                         \
    for (int64_t b = 0; b < blocks; ++b) {                                                                            \
      const uint8_t* wb = row + b * kBlockBytes;                                                                      \
      prefetch_ahead<3>(wb);                                                                                          \
      const uint8_t* xb = x + b * kQ8KBytes;                                                                          \
                                                                                                                      \
      /* get_scale_min_k4 for all eight sub-blocks at once, as 32-bit words [A, C, B, D]: A and B                     \
         the low 6 bits of bytes 0-3 (scales 0-3) and 4-7 (mins 0-3); C and D the nibbles of                          \
         bytes 8-11 (scales 4-7 low, mins 4-7 high) under the top two bits of bytes 0-3 and 4-7.                      \
         The 16-byte load reaches 4 bytes past the scales, still inside the block. */                                 \
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 4));                                  \
      const __m128i low6 = _mm_and_si128(raw, _mm_set1_epi8(0x3f));                                                   \
      const __m128i top2 = _mm_and_si128(_mm_srli_epi32(raw, 2), _mm_set1_epi8(0x30));                                \
      const __m128i nibbles = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(raw, 0xaa), _mm_setr_epi32(0, 4, 0, 4)), \
                                            _mm_set1_epi8(0x0f));                                                     \
      const __m128i packed = _mm_unpacklo_epi32(low6, _mm_or_si128(nibbles, top2));                                   \
      const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(packed));                                  \
      const __m256i mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(packed, mins_pairs));                                \
                                                                                                                      \
      __m256i sumi[N];                                                                                                \
      _Pragma("GCC unroll 8")                                                                                         \
      for (int n = 0; n < N; ++n) sumi[n] = _mm256_setzero_si256();                                                   \
      /* Q5_K's fifth bits: bit s of qh[l] for sub-block s, walked down two sub-blocks a chunk. */                    \
      __m256i high = kFive ? load256(wb + 16) : _mm256_setzero_si256();                                               \
      _Pragma("GCC unroll 8")                                                                                         \
      for (int j = 0; j < 4; ++j) {                                                                                   \
        const __m256i bits = load256(wb + kQs + 32 * j);                                                              \
        __m256i q_lo = _mm256_and_si256(bits, low4);                                                                  \
        __m256i q_hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);                                            \
        if (kFive) {                                                                                                  \
          q_lo = _mm256_or_si256(q_lo, _mm256_and_si256(_mm256_slli_epi16(high, 4), bit4));                           \
          q_hi = _mm256_or_si256(q_hi, _mm256_and_si256(_mm256_slli_epi16(high, 3), bit4));                           \
          high = _mm256_srli_epi16(high, 2);                                                                          \
        }                                                                                                             \
        const __m256i s_lo = _mm256_shuffle_epi8(scales, repeat_word(2 * j));                                         \
        const __m256i s_hi = _mm256_shuffle_epi8(scales, repeat_word(2 * j + 1));                                     \
        _Pragma("GCC unroll 8")                                                                                       \
        for (int n = 0; n < N; ++n) {                                                                                 \
          const uint8_t* a = xb + n * x_stride + kQ8KQs + 64 * j;                                                     \
          sumi[n] = ADD_SCALED(sumi[n], s_lo, q_lo, s_hi, q_hi, a);                                                   \
          settle(sumi[n]);                                                                                            \
        }                                                                                                             \
      }                                                                                                               \
                                                                                                                      \
      /* [d, dmin] of the block, then each input's d * sumi - dmin * (mins . bsums) times its own d. */               \
      const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(load_i32(wb)));                                            \
      const __m256 vd = _mm256_broadcastss_ps(d_dmin);                                                                \
      const __m256 vdmin = _mm256_broadcastss_ps(_mm_movehdup_ps(d_dmin));                                            \
      _Pragma("GCC unroll 8")                                                                                         \
      for (int n = 0; n < N; ++n) {                                                                                   \
        const uint8_t* xn = xb + n * x_stride;                                                                        \
        const __m256i m = _mm256_madd_epi16(mins, load256(xn + kQ8KBsums));                                           \
        const __m256 block =                                                                                          \
            _mm256_fnmadd_ps(vdmin, _mm256_cvtepi32_ps(m), _mm256_mul_ps(vd, _mm256_cvtepi32_ps(sumi[n])));           \
        acc[n] = _mm256_fmadd_ps(_mm256_broadcast_ss(reinterpret_cast<const float*>(xn)), block, acc[n]);             \
      }                                                                                                               \
    }                                                                                                                 \
    _Pragma("GCC unroll 8")                                                                                           \
    for (int n = 0; n < N; ++n) y[n * ldy + r] = hsum(acc[n]);                                                        \
  }                                                                                                                   \
}

KVPIPE_DOT_Q45K(dot_q45k, KVPIPE_AVX2, add_scaled_pairs_avx2)
KVPIPE_DOT_Q45K(dot_q45k_vnni, KVPIPE_K_VNNI, add_scaled_pairs_vnni)

// Vector k (values 32k..32k+31) of a Q6_K half: the low nibbles of ql0 (k = 0) or ql1 (k = 1),
// then their high nibbles (k = 2, 3), under bit pair k of qh. k is a constant after unrolling.
KVPIPE_AVX2 inline __m256i six_bit_values(__m256i ql0, __m256i ql1, __m256i qh, int k) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i ql = (k % 2 == 0) ? ql0 : ql1;
  const __m256i nibble = _mm256_and_si256(k < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
  // Bits 2k, 2k+1 of each qh byte to bits 4, 5.
  const __m256i pair = _mm256_and_si256(qh, _mm256_set1_epi8(static_cast<char>(3 << (2 * k))));
  __m256i top;
  if (k == 0)
    top = _mm256_slli_epi16(pair, 4);
  else if (k == 1)
    top = _mm256_slli_epi16(pair, 2);
  else if (k == 2)
    top = pair;
  else
    top = _mm256_srli_epi16(pair, 2);
  return _mm256_or_si256(nibble, top);
}

// Q6_K rows against N activation rows.
template <int N>
KVPIPE_AVX2 void dot_q6k(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, float* y,
                         int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  constexpr int64_t kBlockBytes = 210;
  const int64_t blocks = cols / kSuperBlock;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w + r * w_stride;
    __m256 acc[N];
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) acc[n] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = row + b * kBlockBytes;
      prefetch_ahead<4>(wb);
      const uint8_t* xb = x + b * kQ8KBytes;

      // The 16 signed scales as 16-bit words: [sc0..sc7 | sc8..sc15].
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 192)));

      // sum sc * (q - 32) * a = sum sc * q * a - 32 * sum_s sc_s * bsum_s: start from the offset.
      __m256i sumi[N];
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n)
        sumi[n] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                   _mm256_slli_epi32(_mm256_madd_epi16(sc16, load256(xb + n * x_stride + kQ8KBsums)), 5));

      // Each half's eight scales in both 128-bit lanes.
      const __m256i half_scales[2] = {_mm256_permute4x64_epi64(sc16, 0x44), _mm256_permute4x64_epi64(sc16, 0xee)};
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i ql0 = load256(wb + 64 * h);
        const __m256i ql1 = load256(wb + 64 * h + 32);
        const __m256i qh = load256(wb + 128 + 32 * h);
        const __m256i sc = half_scales[h];
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          // Values 0..15 of this vector take scale 2k of the half, values 16..31 scale 2k + 1.
          const __m256i q = six_bit_values(ql0, ql1, qh, k);
          const __m256i s = _mm256_shuffle_epi8(sc, lane_scales(k));
          add_scaled_products<N>(sumi, s, q, xb + kQ8KQs + 128 * h + 32 * k, x_stride);
        }
      }

      add_block_sums<N>(acc, sumi, _cvtsh_ss(static_cast<unsigned short>(wb[208] | (wb[209] << 8))), xb, x_stride);
    }
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) y[n * ldy + r] = hsum(acc[n]);
  }
}

// Q2_K (kThree false) and Q3_K (kThree true) rows against N activation rows. Both keep value
// 128h + 32k + l in bits 2k, 2k+1 of qs[32h + l], sixteen sub-blocks of 16; Q3_K adds a third
// bit from hmask (bit 4h + k of hmask[l]), taken here as unsigned 0..7 with its offset of 4
// subtracted through the bsums, as Q6_K's 32.
template <int N, bool kThree>
KVPIPE_AVX2 void dot_q23k(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, float* y,
                          int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  constexpr int64_t kBlockBytes = kThree ? 110 : 84;
  constexpr int64_t kQs = kThree ? 32 : 16;
  const int64_t blocks = cols / kSuperBlock;
  const __m256i low2 = _mm256_set1_epi8(3);
  const __m256i one = _mm256_set1_epi8(1);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w + r * w_stride;
    __m256 acc[N];
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) acc[n] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = row + b * kBlockBytes;
      prefetch_ahead<2>(wb);
      const uint8_t* xb = x + b * kQ8KBytes;

      // The sixteen scales as 16-bit words [s0..s7 | s8..s15], and what the bsums multiply:
      // Q2_K's mins (high nibbles), Q3_K's scales (times -4 below).
      __m256i sc16, by_bsums;
      if (kThree) {
        // Q3_K's 6-bit scales (quant_k.cpp's unpack_q3k_scales), four at a time in 32-bit words.
        uint32_t aux[4];
        std::memcpy(aux, wb + 96, 12);
        const uint32_t top = aux[2];
        aux[2] = ((aux[0] >> 4) & 0x0f0f0f0f) | (((top >> 4) & 0x03030303) << 4);
        aux[3] = ((aux[1] >> 4) & 0x0f0f0f0f) | (((top >> 6) & 0x03030303) << 4);
        aux[0] = (aux[0] & 0x0f0f0f0f) | (((top >> 0) & 0x03030303) << 4);
        aux[1] = (aux[1] & 0x0f0f0f0f) | (((top >> 2) & 0x03030303) << 4);
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(aux));
        sc16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(raw), _mm256_set1_epi16(32));
        by_bsums = sc16;
      } else {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb));
        sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0f)));
        by_bsums = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f)));
      }

      __m256i sumi[N], summ[N];
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) {
        summ[n] = _mm256_madd_epi16(by_bsums, load256(xb + n * x_stride + kQ8KBsums));
        sumi[n] = kThree ? _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(summ[n], 2))
                         : _mm256_setzero_si256();
      }

      const __m256i half_scales[2] = {_mm256_permute4x64_epi64(sc16, 0x44), _mm256_permute4x64_epi64(sc16, 0xee)};
      const __m256i hmask = kThree ? load256(wb) : _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i bits = load256(wb + kQs + 32 * h);
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          __m256i q = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * k), low2);
          if (kThree)
            q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hmask, 4 * h + k), one), 2));
          const __m256i s = _mm256_shuffle_epi8(half_scales[h], lane_scales(k));
          add_scaled_products<N>(sumi, s, q, xb + kQ8KQs + 128 * h + 32 * k, x_stride);
        }
      }

      if (kThree) {
        add_block_sums<N>(acc, sumi, _cvtsh_ss(static_cast<unsigned short>(wb[108] | (wb[109] << 8))), xb, x_stride);
      } else {
        const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(load_i32(wb + 80)));
        const __m256 vd = _mm256_broadcastss_ps(d_dmin);
        const __m256 vdmin = _mm256_broadcastss_ps(_mm_movehdup_ps(d_dmin));
#pragma GCC unroll 4
        for (int n = 0; n < N; ++n) {
          const __m256 block = _mm256_fnmadd_ps(vdmin, _mm256_cvtepi32_ps(summ[n]),
                                                _mm256_mul_ps(vd, _mm256_cvtepi32_ps(sumi[n])));
          acc[n] = _mm256_fmadd_ps(_mm256_broadcast_ss(reinterpret_cast<const float*>(xb + n * x_stride)), block,
                                   acc[n]);
        }
      }
    }
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) y[n * ldy + r] = hsum(acc[n]);
  }
}

// IQ4_XS rows against N activation rows: eight sub-blocks of 32, each's 16 bytes of nibbles
// spread to 32 bytes (low nibbles, then high) and looked up in the grid with one shuffle.
template <int N>
KVPIPE_AVX2 void dot_iq4xs(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, float* y,
                           int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  constexpr int64_t kBlockBytes = 136;
  const int64_t blocks = cols / kSuperBlock;
  const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues)));
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w + r * w_stride;
    __m256 acc[N];
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) acc[n] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = row + b * kBlockBytes;
      prefetch_ahead<3>(wb);
      const uint8_t* xb = x + b * kQ8KBytes;
      uint16_t high;
      std::memcpy(&high, wb + 2, sizeof high);
      int16_t sc[8];
      for (int ib = 0; ib < 8; ++ib)
        sc[ib] = static_cast<int16_t>((((wb[4 + ib / 2] >> (4 * (ib % 2))) & 0xf) | (((high >> (2 * ib)) & 3) << 4)) - 32);

      __m256i sumi[N];
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) sumi[n] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int ib = 0; ib < 8; ++ib) {
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 8 + 16 * ib));
        const __m256i nibbles =
            _mm256_and_si256(_mm256_setr_m128i(packed, _mm_srli_epi16(packed, 4)), low4);
        const __m256i v = _mm256_shuffle_epi8(grid, nibbles);
        const __m256i mag = _mm256_sign_epi8(v, v);
        const __m256i s = _mm256_set1_epi16(sc[ib]);
#pragma GCC unroll 4
        for (int n = 0; n < N; ++n) {
          const __m256i a = _mm256_sign_epi8(load256(xb + n * x_stride + kQ8KQs + 32 * ib), v);
          sumi[n] = _mm256_add_epi32(sumi[n], _mm256_madd_epi16(s, _mm256_maddubs_epi16(mag, a)));
          settle(sumi[n]);
        }
      }

      add_block_sums<N>(acc, sumi, _cvtsh_ss(static_cast<unsigned short>(wb[0] | (wb[1] << 8))), xb, x_stride);
    }
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) y[n * ldy + r] = hsum(acc[n]);
  }
}

template <int N>
KVPIPE_AVX2 void dot_q2k_n(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, float* y,
                           int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  dot_q23k<N, false>(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
}

template <int N>
KVPIPE_AVX2 void dot_q3k_n(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, float* y,
                           int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  dot_q23k<N, true>(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
}

template <int N>
KVPIPE_AVX2 void dot_q4k_n(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, float* y,
                           int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  dot_q45k<N, false>(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
}

template <int N>
KVPIPE_AVX2 void dot_q5k_n(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, float* y,
                           int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  dot_q45k<N, true>(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
}

template <int N>
KVPIPE_K_VNNI void dot_q4k_vnni(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, float* y,
                               int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  dot_q45k_vnni<N, false>(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
}

template <int N>
KVPIPE_K_VNNI void dot_q5k_vnni(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, float* y,
                               int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  dot_q45k_vnni<N, true>(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
}

// Batches past kMaxKernelInputs with VNNI: 8 inputs a pass over each row's blocks, so that each
// block's unpacking (nibbles, fifth bits, scales and mins) serves 8 inputs rather than 4;
// AVX-512's 32 registers hold the 8 inputs' sums and accumulators beside the unpacked values.
// Every input's operations are dot_q45k_vnni's for any input count, so the results are the dot
// kernel's bit for bit (a sequence gets the same numbers alone and in a batch).
template <bool kFive>
KVPIPE_K_VNNI void batch_q45k_vnni(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride,
                                   int64_t inputs, float* y, int64_t ldy, int64_t row_begin, int64_t row_end,
                                   int64_t cols) {
  // Rows a pass covers before the next 8 inputs take them: about 128 KiB, still in L2.
  const int64_t slice = std::clamp<int64_t>((128 << 10) / std::max<int64_t>(w_stride, 1), 4, 64);
  for (int64_t r = row_begin; r < row_end; r += slice) {
    const int64_t r_end = std::min(row_end, r + slice);
    int64_t j = 0;
    for (; j + 8 <= inputs; j += 8)
      dot_q45k_vnni<8, kFive>(w, w_stride, x + j * x_stride, x_stride, y + j * ldy, ldy, r, r_end, cols);
    if (inputs - j >= 4) {
      dot_q45k_vnni<4, kFive>(w, w_stride, x + j * x_stride, x_stride, y + j * ldy, ldy, r, r_end, cols);
      j += 4;
    }
    const uint8_t* xj = x + j * x_stride;
    float* yj = y + j * ldy;
    switch (inputs - j) {
      case 3: dot_q45k_vnni<3, kFive>(w, w_stride, xj, x_stride, yj, ldy, r, r_end, cols); break;
      case 2: dot_q45k_vnni<2, kFive>(w, w_stride, xj, x_stride, yj, ldy, r, r_end, cols); break;
      case 1: dot_q45k_vnni<1, kFive>(w, w_stride, xj, x_stride, yj, ldy, r, r_end, cols); break;
      default: break;
    }
  }
}

using FixedKernel = void (*)(const uint8_t*, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t, int64_t,
                             int64_t);

// One DotKernel per type: picks the instantiation for the call's number of inputs.
template <FixedKernel K1, FixedKernel K2, FixedKernel K3, FixedKernel K4>
void dispatch_inputs(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, int inputs, float* y,
                     int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  static_assert(kMaxKernelInputs == 4, "one instantiation per input count");
  switch (inputs) {
    case 1: return K1(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
    case 2: return K2(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
    case 3: return K3(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
    case 4: return K4(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
    default: return;
  }
}

}  // namespace

DotKernel k_avx2_kernel(QuantType type) {
  switch (type) {
    case QuantType::Q4_K: return dispatch_inputs<dot_q4k_n<1>, dot_q4k_n<2>, dot_q4k_n<3>, dot_q4k_n<4>>;
    case QuantType::Q5_K: return dispatch_inputs<dot_q5k_n<1>, dot_q5k_n<2>, dot_q5k_n<3>, dot_q5k_n<4>>;
    case QuantType::Q6_K: return dispatch_inputs<dot_q6k<1>, dot_q6k<2>, dot_q6k<3>, dot_q6k<4>>;
    case QuantType::Q2_K: return dispatch_inputs<dot_q2k_n<1>, dot_q2k_n<2>, dot_q2k_n<3>, dot_q2k_n<4>>;
    case QuantType::Q3_K: return dispatch_inputs<dot_q3k_n<1>, dot_q3k_n<2>, dot_q3k_n<3>, dot_q3k_n<4>>;
    case QuantType::IQ4_XS: return dispatch_inputs<dot_iq4xs<1>, dot_iq4xs<2>, dot_iq4xs<3>, dot_iq4xs<4>>;
    default: return nullptr;
  }
}

DotKernel k_vnni_kernel(QuantType type) {
  switch (type) {
    case QuantType::Q4_K: return dispatch_inputs<dot_q4k_vnni<1>, dot_q4k_vnni<2>, dot_q4k_vnni<3>, dot_q4k_vnni<4>>;
    case QuantType::Q5_K: return dispatch_inputs<dot_q5k_vnni<1>, dot_q5k_vnni<2>, dot_q5k_vnni<3>, dot_q5k_vnni<4>>;
    default: return nullptr;
  }
}

BatchKernel k_vnni_batch_kernel(QuantType type) {
  switch (type) {
    case QuantType::Q4_K: return batch_q45k_vnni<false>;
    case QuantType::Q5_K: return batch_q45k_vnni<true>;
    default: return nullptr;
  }
}

// ggml's quantize_row_q8_K_ref, eight values at a time. Every step rounds as the scalar loop
// does: the same float products, and cvtps rounds to nearest even as nearest_int's
// 1.5 * 2^23 trick does (the quants stay far inside the range where the two agree).
KVPIPE_AVX2 void k_quantize_activation_row_avx2(const float* x, void* dst, int64_t cols) {
  auto* out = static_cast<uint8_t*>(dst);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < cols / kSuperBlock; ++b, x += kSuperBlock) {
    uint8_t* yb = out + b * kQ8KBytes;
    // max_ps(v, m) keeps m when v is NaN: NaNs drop out of the maximum as they do in ggml's loop.
    __m256 vmax = _mm256_setzero_ps();
    for (int j = 0; j < kSuperBlock; j += 8)
      vmax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), abs_mask), vmax);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    if (amax == 0) {
      std::memset(yb, 0, kQ8KBytes);
      continue;
    }
    // The signed value ggml keeps: the first one whose magnitude is the maximum.
    const __m256 vamax = _mm256_set1_ps(amax);
    float max = 0;
    for (int j = 0; j < kSuperBlock; j += 8) {
      const int hit = _mm256_movemask_ps(
          _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), abs_mask), vamax, _CMP_EQ_OQ));
      if (hit != 0) {
        max = x[j + __builtin_ctz(static_cast<unsigned>(hit))];
        break;
      }
    }
    const float iscale = -127.f / max;
    const __m256 vscale = _mm256_set1_ps(iscale);
    const __m256i top = _mm256_set1_epi32(127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i pair_sums[16];
    for (int k = 0; k < 8; ++k) {
      __m256i q[4];
      for (int i = 0; i < 4; ++i)
        q[i] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 32 * k + 8 * i), vscale)), top);
      pair_sums[2 * k] = _mm256_add_epi32(q[0], q[1]);
      pair_sums[2 * k + 1] = _mm256_add_epi32(q[2], q[3]);
      // packs works within 128-bit lanes; the permute puts the 32 bytes back in order.
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(yb + kQ8KQs + 32 * k), bytes);
    }
    // Sixteen horizontal sums, four at a time: hadd twice, then the two lanes.
    alignas(16) int32_t sums[16];
    for (int g = 0; g < 4; ++g) {
      const __m256i h01 = _mm256_hadd_epi32(pair_sums[4 * g], pair_sums[4 * g + 1]);
      const __m256i h23 = _mm256_hadd_epi32(pair_sums[4 * g + 2], pair_sums[4 * g + 3]);
      const __m256i h = _mm256_hadd_epi32(h01, h23);
      _mm_store_si128(reinterpret_cast<__m128i*>(sums + 4 * g),
                      _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
    }
    const __m128i bsums_lo = _mm_packs_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sums)),
                                             _mm_load_si128(reinterpret_cast<const __m128i*>(sums + 4)));
    const __m128i bsums_hi = _mm_packs_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sums + 8)),
                                             _mm_load_si128(reinterpret_cast<const __m128i*>(sums + 12)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(yb + kQ8KBsums), bsums_lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(yb + kQ8KBsums + 16), bsums_hi);
    const float d = 1 / iscale;
    std::memcpy(yb, &d, sizeof d);
  }
}

}  // namespace kvpipe::quant_impl

#else

namespace kvpipe::quant_impl {
DotKernel k_avx2_kernel(QuantType) { return nullptr; }
DotKernel k_vnni_kernel(QuantType) { return nullptr; }
BatchKernel k_vnni_batch_kernel(QuantType) { return nullptr; }
}  // namespace kvpipe::quant_impl

#endif
