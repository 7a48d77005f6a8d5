// interleaved_blocks' x86 group kernels (interleaved_blocks_impl.h): one template over the
// byte product, AVX2's vpmaddubsw or AVX-512 VNNI's vpdpbusd, each compiled with its own
// target attributes so the binary runs on any x86-64 and calls them only where they run.
#include "engine/kernels/cpu/interleaved_blocks_impl.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstring>

namespace kvpipe::interleaved_impl {
namespace {

#define KVPIPE_INTERLEAVED_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVPIPE_INTERLEAVED_VNNI \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))

inline int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// How far ahead of the block being computed the kernels ask for weights (as the row kernels,
// quant_legacy_avx2.cpp: on weights streamed from memory the hardware prefetcher alone left
// the loop 15-25% slower).
constexpr int64_t kPrefetchBytes = 2048;

// ---- Q4_0 and Q8_0: blocks of 32 values ----------------------------------------------------
// Per block of a group and input: the 8 rows' integer sums (the block's 8 weight vectors loaded
// once for every input of a tile), less the activations' offset term, then one float term.

// The 8 nibble vectors of one Q4_0 block of a group: lo[k] holds values 4k .. 4k + 3 of each
// row (one row per 32-bit lane), hi[k] values 16 + 4k .. 16 + 4k + 3.
struct Nibbles {
  __m256i lo[4], hi[4];
};

KVPIPE_INTERLEAVED_AVX2 inline Nibbles unpack(const uint8_t* q) {
  const __m256i mask = _mm256_set1_epi8(0x0f);
  Nibbles v;
  for (int k = 0; k < 4; ++k) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * k));
    v.lo[k] = _mm256_and_si256(bytes, mask);
    v.hi[k] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
  }
  return v;
}

// The 8 byte vectors of one Q8_0 block of a group: q[k] holds values 4k .. 4k + 3 of each row.
struct Bytes {
  __m256i q[8];
};

struct SumsAvx2 {
  using Weights = Nibbles;
  KVPIPE_INTERLEAVED_AVX2 static Weights load(const uint8_t* q) { return unpack(q); }
  // Each pair of nibble-times-byte products is at most 2 * 15 * 127 = 3810, so the eight
  // vectors' pair sums add up in 16 bits (at most 30480) before one widening to 32.
  KVPIPE_INTERLEAVED_AVX2 static __m256i block(const Nibbles& v, const uint8_t* xq, int32_t offset) {
    __m256i s = _mm256_maddubs_epi16(v.lo[0], _mm256_set1_epi32(load_i32(xq)));
    for (int k = 1; k < 4; ++k)
      s = _mm256_add_epi16(s, _mm256_maddubs_epi16(v.lo[k], _mm256_set1_epi32(load_i32(xq + 4 * k))));
    for (int k = 0; k < 4; ++k)
      s = _mm256_add_epi16(s, _mm256_maddubs_epi16(v.hi[k], _mm256_set1_epi32(load_i32(xq + 16 + 4 * k))));
    return _mm256_sub_epi32(_mm256_madd_epi16(s, _mm256_set1_epi16(1)), _mm256_set1_epi32(offset));
  }
};

struct SumsVnni {
  using Weights = Nibbles;
  KVPIPE_INTERLEAVED_VNNI static Weights load(const uint8_t* q) { return unpack(q); }
  // Two chains of four, so one input's sums wait on half as many vpdpbusd latencies.
  KVPIPE_INTERLEAVED_VNNI static __m256i block(const Nibbles& v, const uint8_t* xq, int32_t offset) {
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      lo = _mm256_dpbusd_epi32(lo, v.lo[k], _mm256_set1_epi32(load_i32(xq + 4 * k)));
      hi = _mm256_dpbusd_epi32(hi, v.hi[k], _mm256_set1_epi32(load_i32(xq + 16 + 4 * k)));
    }
    return _mm256_sub_epi32(_mm256_add_epi32(lo, hi), _mm256_set1_epi32(offset));
  }
};

struct Q8SumsAvx2 {
  using Weights = Bytes;  // the signed bytes as stored
  KVPIPE_INTERLEAVED_AVX2 static Weights load(const uint8_t* q) {
    Bytes v;
    for (int k = 0; k < 8; ++k) v.q[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * k));
    return v;
  }
  // |w| times x with w's sign (activations are within +-127, so negating one never overflows);
  // a pair of products reaches 2 * 128 * 127 = 32512, so each vpmaddubsw widens on its own.
  KVPIPE_INTERLEAVED_AVX2 static __m256i block(const Bytes& v, const uint8_t* xq, int32_t) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
      const __m256i x = _mm256_set1_epi32(load_i32(xq + 4 * k));
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(v.q[k]), _mm256_sign_epi8(x, v.q[k]));
      s = _mm256_add_epi32(s, _mm256_madd_epi16(pairs, ones));
    }
    return s;
  }
};

struct Q8SumsVnni {
  using Weights = Bytes;  // each byte plus 128, unsigned, as vpdpbusd reads it
  KVPIPE_INTERLEAVED_VNNI static Weights load(const uint8_t* q) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    Bytes v;
    for (int k = 0; k < 8; ++k)
      v.q[k] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * k)), flip);
    return v;
  }
  KVPIPE_INTERLEAVED_VNNI static __m256i block(const Bytes& v, const uint8_t* xq, int32_t offset) {
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      lo = _mm256_dpbusd_epi32(lo, v.q[k], _mm256_set1_epi32(load_i32(xq + 4 * k)));
      hi = _mm256_dpbusd_epi32(hi, v.q[4 + k], _mm256_set1_epi32(load_i32(xq + 16 + 4 * k)));
    }
    return _mm256_sub_epi32(_mm256_add_epi32(lo, hi), _mm256_set1_epi32(offset));
  }
};

// kInputs inputs from j0 times kGroups groups of BLOCK_BYTES-byte blocks (wg[i], results at
// y[i]): more than one group only for a lone input, whose groups then stream from as many
// places in memory at once (a core keeps more reads in flight over two streams than over
// one). The float operations are the portable kernels', in their order, for each group alone.
#define KVPIPE_INTERLEAVED_TILE(NAME, ATTR, SUMS, BLOCK_BYTES)                                                    \
  template <int kInputs, int kGroups = 1>                                                                         \
  struct NAME { ATTR static void run(const uint8_t* const* wg, const Activations& a, int64_t j0, float* const* y, \
                                     int64_t ldy) {                                                               \
    __m256 acc[kGroups][kInputs];                                                                                 \
    const uint8_t* xr[kInputs];                                                                                   \
    const float* da[kInputs];                                                                                     \
    const int32_t* off[kInputs];                                                                                  \
    for (int j = 0; j < kInputs; ++j) {                                                                           \
      for (int i = 0; i < kGroups; ++i) acc[i][j] = _mm256_setzero_ps();                                          \
      xr[j] = a.x + (j0 + j) * a.x_stride + 2;                                                                    \
      da[j] = a.da + (j0 + j) * a.blocks;                                                                         \
      off[j] = a.offset + (j0 + j) * a.blocks;                                                                    \
    }                                                                                                             \
    for (int64_t b = 0; b < a.blocks; ++b) {                                                                      \
      _Pragma("GCC unroll 2") for (int i = 0; i < kGroups; ++i) {                                                 \
        const uint8_t* wb = wg[i] + b * BLOCK_BYTES;                                                              \
        if (j0 == 0) /* later tiles find the group in cache */                                                    \
          for (int64_t line = 0; line < BLOCK_BYTES; line += 64)                                                  \
            _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + line), _MM_HINT_T0);                 \
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb)));                 \
        const typename SUMS::Weights v = SUMS::load(wb + 2 * kGroupRows);                                         \
        _Pragma("GCC unroll 8") for (int j = 0; j < kInputs; ++j) {                                               \
          const __m256i sum = SUMS::block(v, xr[j] + b * kQ8_0ActivationBytes, off[j][b]);                        \
          const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(da[j][b]));                                       \
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[i][j]);                                 \
        }                                                                                                         \
      }                                                                                                           \
    }                                                                                                             \
    for (int i = 0; i < kGroups; ++i)                                                                             \
      for (int j = 0; j < kInputs; ++j) _mm256_storeu_ps(y[i] + (j0 + j) * ldy, acc[i][j]);                       \
  } };

KVPIPE_INTERLEAVED_TILE(q4_0_inputs_avx2, KVPIPE_INTERLEAVED_AVX2, SumsAvx2, kQ4_0GroupBlockBytes)
KVPIPE_INTERLEAVED_TILE(q4_0_inputs_vnni, KVPIPE_INTERLEAVED_VNNI, SumsVnni, kQ4_0GroupBlockBytes)
KVPIPE_INTERLEAVED_TILE(q8_0_inputs_avx2, KVPIPE_INTERLEAVED_AVX2, Q8SumsAvx2, kQ8_0GroupBlockBytes)
KVPIPE_INTERLEAVED_TILE(q8_0_inputs_vnni, KVPIPE_INTERLEAVED_VNNI, Q8SumsVnni, kQ8_0GroupBlockBytes)

// ---- Pairs of groups in 512-bit vectors (Q4_0, Q8_0; AVX-512 VNNI) ---------------------------
// Two adjacent groups, 16 rows, one to each 32-bit lane of a 512-bit vector: every vpdpbusd,
// broadcast and float operation serves twice the rows of the 256-bit tiles above. A prompt's
// tiles there issued about three instructions per vpdpbusd and were bound by issuing them, not
// by the multiplies (a 512-bit vpdpbusd does the work of two 256-bit ones). Each lane does the
// 256-bit tile's operations in its order, so a row's result is the same bit for bit.

// GCC 12 warns that the widening casts' undefined upper halves "may be used uninitialized" once
// inlined (its bug 105593, fixed in GCC 13); the inserts overwrite them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

KVPIPE_INTERLEAVED_VNNI inline __m512i load_pair(const uint8_t* p0, const uint8_t* p1) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1)), 1);
}

// The lines kPrefetchBytes past the current block of each group of a pair (the first tile of
// inputs streams the weights; later tiles find them in cache).
template <int64_t kBlockBytes>
inline void prefetch_pair(const uint8_t* wb0, const uint8_t* wb1) {
  for (int64_t line = 0; line < kBlockBytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(wb0 + kPrefetchBytes + line), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb1 + kPrefetchBytes + line), _MM_HINT_T0);
  }
}

// The 16 rows' fp16 scales at the start of each group's block, widened.
KVPIPE_INTERLEAVED_VNNI inline __m512 scales_pair(const uint8_t* p0, const uint8_t* p1) {
  const __m128i s0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0));
  const __m128i s1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(s0), s1, 1));
}

// A block of 16 rows as vpdpbusd reads it: q[k] holds values 4k .. 4k + 3 of every row for k < 4,
// q[4 + k] values 16 + 4k .. 16 + 4k + 3.
struct PairBytes {
  __m512i q[8];
};

// The 16 rows' integer sums against one input's block, less its offset term: two chains of four,
// as SumsVnni and Q8SumsVnni form them.
KVPIPE_INTERLEAVED_VNNI inline __m512i pair_block_sums(const PairBytes& v, const uint8_t* xq, int32_t offset) {
  __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
  for (int k = 0; k < 4; ++k) {
    lo = _mm512_dpbusd_epi32(lo, v.q[k], _mm512_set1_epi32(load_i32(xq + 4 * k)));
    hi = _mm512_dpbusd_epi32(hi, v.q[4 + k], _mm512_set1_epi32(load_i32(xq + 16 + 4 * k)));
  }
  return _mm512_sub_epi32(_mm512_add_epi32(lo, hi), _mm512_set1_epi32(offset));
}

struct Q4_0Pair {
  static constexpr int64_t kBlockBytes = kQ4_0GroupBlockBytes;
  // The low nibbles are values 0 .. 15, the high ones 16 .. 31.
  KVPIPE_INTERLEAVED_VNNI static PairBytes load(const uint8_t* q0, const uint8_t* q1) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    PairBytes v;
    for (int k = 0; k < 4; ++k) {
      const __m512i bytes = load_pair(q0 + 32 * k, q1 + 32 * k);
      v.q[k] = _mm512_and_si512(bytes, mask);
      v.q[4 + k] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask);
    }
    return v;
  }
};

struct Q8_0Pair {
  static constexpr int64_t kBlockBytes = kQ8_0GroupBlockBytes;
  // Each byte plus 128, as in Q8SumsVnni.
  KVPIPE_INTERLEAVED_VNNI static PairBytes load(const uint8_t* q0, const uint8_t* q1) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    PairBytes v;
    for (int k = 0; k < 8; ++k) v.q[k] = _mm512_xor_si512(load_pair(q0 + 32 * k, q1 + 32 * k), flip);
    return v;
  }
};

// kInputs inputs from j0 times the groups at w0 and w0 + group_bytes; results at y (the second
// group's rows follow the first's).
template <typename Pair, int kInputs>
KVPIPE_INTERLEAVED_VNNI void pair_inputs(const uint8_t* w0, int64_t group_bytes, const Activations& a, int64_t j0,
                                         float* y, int64_t ldy) {
  __m512 acc[kInputs];
  const uint8_t* xr[kInputs];
  const float* da[kInputs];
  const int32_t* off[kInputs];
  for (int j = 0; j < kInputs; ++j) {
    acc[j] = _mm512_setzero_ps();
    xr[j] = a.x + (j0 + j) * a.x_stride + 2;
    da[j] = a.da + (j0 + j) * a.blocks;
    off[j] = a.offset + (j0 + j) * a.blocks;
  }
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* wb0 = w0 + b * Pair::kBlockBytes;
    const uint8_t* wb1 = wb0 + group_bytes;
    if (j0 == 0) prefetch_pair<Pair::kBlockBytes>(wb0, wb1);
    const __m512 dw = scales_pair(wb0, wb1);
    const PairBytes v = Pair::load(wb0 + 2 * kGroupRows, wb1 + 2 * kGroupRows);
    _Pragma("GCC unroll 8") for (int j = 0; j < kInputs; ++j) {
      const __m512i sum = pair_block_sums(v, xr[j] + b * kQ8_0ActivationBytes, off[j][b]);
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(da[j][b]));
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[j]);
    }
  }
  for (int j = 0; j < kInputs; ++j) _mm512_storeu_ps(y + (j0 + j) * ldy, acc[j]);
}

#pragma GCC diagnostic pop

template <int kInputs>
struct q4_0_pairs_vnni {
  KVPIPE_INTERLEAVED_VNNI static void run(const uint8_t* w0, int64_t group_bytes, const Activations& a, int64_t j0,
                                          float* y, int64_t ldy) {
    pair_inputs<Q4_0Pair, kInputs>(w0, group_bytes, a, j0, y, ldy);
  }
};

template <int kInputs>
struct q8_0_pairs_vnni {
  KVPIPE_INTERLEAVED_VNNI static void run(const uint8_t* w0, int64_t group_bytes, const Activations& a, int64_t j0,
                                          float* y, int64_t ldy) {
    pair_inputs<Q8_0Pair, kInputs>(w0, group_bytes, a, j0, y, ldy);
  }
};

// Groups [g_begin, g_end), their inputs in tiles of kWide (Tile<k>::run, k inputs each), then
// one of 4 where kWide is 8, then one of what is left. kWide is as many inputs as the registers
// hold beside a block's weight vectors (the entry points below say which). A lone input takes
// its groups two at a time, one from each half of the range (Tile<1, 2>).
template <template <int, int> class Tile, int kWide, typename Acts>
void tiled_groups(const uint8_t* w, int64_t g_begin, int64_t g_end, int64_t group_bytes, const Acts& a, int64_t n,
                  float* y, int64_t ldy) {
  static_assert(kWide == 2 || kWide == 4 || kWide == 8, "tiles of 2, 4 or 8 inputs");
  if (n == 1) {
    const int64_t half = (g_end - g_begin) / 2;
    for (int64_t g = g_begin; g < g_begin + half; ++g) {
      const uint8_t* wg[2] = {w + g * group_bytes, w + (g + half) * group_bytes};
      float* yg[2] = {y + g * kGroupRows, y + (g + half) * kGroupRows};
      Tile<1, 2>::run(wg, a, 0, yg, ldy);
    }
    for (int64_t g = g_begin + 2 * half; g < g_end; ++g) {
      const uint8_t* wg = w + g * group_bytes;
      float* yg = y + g * kGroupRows;
      Tile<1, 1>::run(&wg, a, 0, &yg, ldy);
    }
    return;
  }
  for (int64_t g = g_begin; g < g_end; ++g) {
    const uint8_t* const wg = w + g * group_bytes;
    float* const yg = y + g * kGroupRows;
    int64_t j = 0;
    for (; j + kWide <= n; j += kWide) Tile<kWide, 1>::run(&wg, a, j, &yg, ldy);
    if constexpr (kWide == 8)
      if (n - j >= 4) {
        Tile<4, 1>::run(&wg, a, j, &yg, ldy);
        j += 4;
      }
    if constexpr (kWide > 2) {
      if (n - j == 3) Tile<3, 1>::run(&wg, a, j, &yg, ldy);
      if (n - j == 2) Tile<2, 1>::run(&wg, a, j, &yg, ldy);
    }
    if (n - j == 1) Tile<1, 1>::run(&wg, a, j, &yg, ldy);
  }
}

// ---- Q4_K ----------------------------------------------------------------------------------
// Per super-block of a group and input: each sub-block's 8 row sums, times the rows' scales, into
// one int32 sum per row (at most 8 * 63 * 32 * 15 * 127); the mins through the activation's
// sub-block sums; then the two float terms, as q4_k_portable.

struct SuperAvx2 {
  // Eight vpmaddubsw pair sums of one sub-block add up in 16 bits (at most 8 * 2 * 15 * 127 =
  // 30480); vpmaddwd with the row's scale in both halves of its lane then gives
  // scale * (sub-block sum) in 32 bits.
  using Sum = __m256i;
  KVPIPE_INTERLEAVED_AVX2 static Sum zero() { return _mm256_setzero_si256(); }
  KVPIPE_INTERLEAVED_AVX2 static Sum add(Sum s, __m256i nibbles, const uint8_t* xq) {
    return _mm256_add_epi16(s, _mm256_maddubs_epi16(nibbles, _mm256_set1_epi32(load_i32(xq))));
  }
  KVPIPE_INTERLEAVED_AVX2 static __m256i scaled(Sum s, __m256i scale32) {
    return _mm256_madd_epi16(s, _mm256_or_si256(scale32, _mm256_slli_epi32(scale32, 16)));
  }
};

struct SuperVnni {
  using Sum = __m256i;
  KVPIPE_INTERLEAVED_VNNI static Sum zero() { return _mm256_setzero_si256(); }
  KVPIPE_INTERLEAVED_VNNI static Sum add(Sum s, __m256i nibbles, const uint8_t* xq) {
    return _mm256_dpbusd_epi32(s, nibbles, _mm256_set1_epi32(load_i32(xq)));
  }
  KVPIPE_INTERLEAVED_VNNI static __m256i scaled(Sum s, __m256i scale32) { return _mm256_mullo_epi32(s, scale32); }
};

#define KVPIPE_INTERLEAVED_SUPER_TILE(NAME, ATTR, OPS)                                                            \
  template <int kInputs, int kGroups = 1>                                                                         \
  struct NAME { ATTR static void run(const uint8_t* const* wg, const SuperActivations& a, int64_t j0, float* const* y, int64_t ldy) { \
    const __m256i mask = _mm256_set1_epi8(0x0f);                                                                  \
    __m256 acc[kGroups][kInputs];                                                                                 \
    const uint8_t* xr[kInputs];                                                                                   \
    for (int j = 0; j < kInputs; ++j) {                                                                           \
      for (int i = 0; i < kGroups; ++i) acc[i][j] = _mm256_setzero_ps();                                          \
      xr[j] = a.x + (j0 + j) * a.x_stride + 4;                                                                    \
    }                                                                                                             \
    for (int64_t b = 0; b < a.blocks; ++b) {                                                                      \
      _Pragma("GCC unroll 2") for (int i = 0; i < kGroups; ++i) {                                                 \
        const uint8_t* wb = wg[i] + b * kQ4KGroupBlockBytes;                                                      \
        if (j0 == 0)                                                                                              \
          for (int64_t off = 0; off < kQ4KGroupBlockBytes; off += 64)                                             \
            _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + off), _MM_HINT_T0);                  \
        __m256i sumi[kInputs];                                                                                    \
        for (int j = 0; j < kInputs; ++j) sumi[j] = _mm256_setzero_si256();                                       \
        for (int p = 0; p < 4; ++p) {                                                                             \
          typename OPS::Sum lo[kInputs], hi[kInputs];                                                             \
          for (int j = 0; j < kInputs; ++j) lo[j] = hi[j] = OPS::zero();                                          \
          const uint8_t* q = wb + kQ4KQs + 256 * p;                                                               \
          _Pragma("GCC unroll 8") for (int k = 0; k < 8; ++k) {                                                   \
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * k));               \
            const __m256i vlo = _mm256_and_si256(bytes, mask);                                                    \
            const __m256i vhi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);                              \
            for (int j = 0; j < kInputs; ++j) {                                                                   \
              const uint8_t* xq = xr[j] + b * kQ8KActivationBytes + 64 * p + 4 * k;                               \
              lo[j] = OPS::add(lo[j], vlo, xq);                                                                   \
              hi[j] = OPS::add(hi[j], vhi, xq + 32);                                                              \
            }                                                                                                     \
          }                                                                                                       \
          const __m256i sc_lo = _mm256_cvtepu8_epi32(                                                             \
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb + kQ4KScales + 16 * p)));                       \
          const __m256i sc_hi = _mm256_cvtepu8_epi32(                                                             \
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb + kQ4KScales + 16 * p + 8)));                   \
          for (int j = 0; j < kInputs; ++j)                                                                       \
            sumi[j] = _mm256_add_epi32(sumi[j], _mm256_add_epi32(OPS::scaled(lo[j], sc_lo), OPS::scaled(hi[j], sc_hi))); \
        }                                                                                                         \
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb)));                 \
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 16)));            \
        __m256i mins[4];                                                                                          \
        for (int p = 0; p < 4; ++p)                                                                               \
          mins[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + kQ4KMins + 16 * p))); \
        for (int j = 0; j < kInputs; ++j) {                                                                       \
          const int32_t* pairs = a.sum_pairs + ((j0 + j) * a.blocks + b) * 4;                                     \
          __m256i summ = _mm256_madd_epi16(mins[0], _mm256_set1_epi32(pairs[0]));                                 \
          for (int p = 1; p < 4; ++p) summ = _mm256_add_epi32(summ, _mm256_madd_epi16(mins[p], _mm256_set1_epi32(pairs[p]))); \
          const __m256 da = _mm256_set1_ps(a.da[(j0 + j) * a.blocks + b]);                                        \
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[j]), _mm256_mul_ps(dw, da), acc[i][j]);             \
          acc[i][j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_mul_ps(dm, da), acc[i][j]);               \
        }                                                                                                         \
      }                                                                                                           \
    }                                                                                                             \
    for (int i = 0; i < kGroups; ++i)                                                                             \
      for (int j = 0; j < kInputs; ++j) _mm256_storeu_ps(y[i] + (j0 + j) * ldy, acc[i][j]);                       \
  } };

KVPIPE_INTERLEAVED_SUPER_TILE(super_inputs_avx2, KVPIPE_INTERLEAVED_AVX2, SuperAvx2)
KVPIPE_INTERLEAVED_SUPER_TILE(super_inputs_vnni, KVPIPE_INTERLEAVED_VNNI, SuperVnni)

// ---- Q6_K ----------------------------------------------------------------------------------
// Per super-block of a group and input: each 16-value sub-block's 8 row sums times the rows'
// int8 scales into one int32 sum per row, less 32 times the scales times the activation's
// sub-block sums (vpmaddwd over a pair of sub-blocks), then one float term, as q6_k_portable.

struct Q6Avx2 {
  // A 6-bit value times a byte is at most 63 * 128, a vpmaddubsw pair 16128: two pairs add up
  // in 16 bits; vpmaddwd with the row's scale in both halves of its lane then gives scale times
  // the four values' sum in 32 bits.
  KVPIPE_INTERLEAVED_AVX2 static __m256i sub_block(const __m256i* v, const uint8_t* xq, __m256i scale32) {
    const __m256i scale = _mm256_or_si256(_mm256_and_si256(scale32, _mm256_set1_epi32(0xffff)),
                                          _mm256_slli_epi32(scale32, 16));
    const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(v[0], _mm256_set1_epi32(load_i32(xq))),
                                         _mm256_maddubs_epi16(v[1], _mm256_set1_epi32(load_i32(xq + 4))));
    const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(v[2], _mm256_set1_epi32(load_i32(xq + 8))),
                                         _mm256_maddubs_epi16(v[3], _mm256_set1_epi32(load_i32(xq + 12))));
    return _mm256_add_epi32(_mm256_madd_epi16(s01, scale), _mm256_madd_epi16(s23, scale));
  }
};

struct Q6Vnni {
  KVPIPE_INTERLEAVED_VNNI static __m256i sub_block(const __m256i* v, const uint8_t* xq, __m256i scale32) {
    __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), v[0], _mm256_set1_epi32(load_i32(xq)));
    for (int m = 1; m < 4; ++m) s = _mm256_dpbusd_epi32(s, v[m], _mm256_set1_epi32(load_i32(xq + 4 * m)));
    return _mm256_mullo_epi32(s, scale32);
  }
};

#define KVPIPE_INTERLEAVED_Q6K_TILE(NAME, ATTR, OPS)                                                              \
  template <int kInputs, int kGroups = 1>                                                                         \
  struct NAME { ATTR static void run(const uint8_t* const* wg, const SuperActivations& a, int64_t j0, float* const* y, int64_t ldy) { \
    const __m256i low4 = _mm256_set1_epi8(0x0f), high2 = _mm256_set1_epi8(0x30);                                  \
    __m256 acc[kGroups][kInputs];                                                                                 \
    const uint8_t* xr[kInputs];                                                                                   \
    for (int j = 0; j < kInputs; ++j) {                                                                           \
      for (int i = 0; i < kGroups; ++i) acc[i][j] = _mm256_setzero_ps();                                          \
      xr[j] = a.x + (j0 + j) * a.x_stride + 4;                                                                    \
    }                                                                                                             \
    for (int64_t b = 0; b < a.blocks; ++b) {                                                                      \
      _Pragma("GCC unroll 2") for (int i = 0; i < kGroups; ++i) {                                                 \
        const uint8_t* wb = wg[i] + b * kQ6KGroupBlockBytes;                                                      \
        if (j0 == 0)                                                                                              \
          for (int64_t off = 0; off < kQ6KGroupBlockBytes; off += 64)                                             \
            _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + off), _MM_HINT_T0);                  \
        __m256i sumi[kInputs];                                                                                    \
        for (int j = 0; j < kInputs; ++j) sumi[j] = _mm256_setzero_si256();                                       \
        for (int p = 0; p < 8; ++p) {                                                                             \
          /* lane i: the scales of row i's sub-blocks 2p (low int16) and 2p + 1 (high) */                         \
          const __m256i pair =                                                                                    \
              _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + kQ6KScales + 16 * p)));  \
          const __m256i scale[2] = {_mm256_srai_epi32(_mm256_slli_epi32(pair, 16), 16), _mm256_srai_epi32(pair, 16)}; \
          for (int h = 0; h < 2; ++h) {                                                                           \
            const uint8_t* c = wb + kQ6KQs + kQ6KSubBlockBytes * (2 * p + h);                                     \
            const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));                           \
            const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32));                      \
            const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64));                     \
            const __m256i v[4] = {                                                                                \
                _mm256_or_si256(_mm256_and_si256(lo, low4), _mm256_and_si256(_mm256_slli_epi16(top, 4), high2)),  \
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), low4),                                 \
                                _mm256_and_si256(_mm256_slli_epi16(top, 2), high2)),                              \
                _mm256_or_si256(_mm256_and_si256(hi, low4), _mm256_and_si256(top, high2)),                        \
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(hi, 4), low4),                                 \
                                _mm256_and_si256(_mm256_srli_epi16(top, 2), high2))};                             \
            for (int j = 0; j < kInputs; ++j)                                                                     \
              sumi[j] = _mm256_add_epi32(                                                                         \
                  sumi[j], OPS::sub_block(v, xr[j] + b * kQ8KActivationBytes + 16 * (2 * p + h), scale[h]));      \
          }                                                                                                       \
          for (int j = 0; j < kInputs; ++j) {                                                                     \
            const int32_t sums = a.sum_pairs[((j0 + j) * a.blocks + b) * 8 + p];                                  \
            sumi[j] = _mm256_sub_epi32(sumi[j],                                                                   \
                                       _mm256_slli_epi32(_mm256_madd_epi16(pair, _mm256_set1_epi32(sums)), 5));   \
          }                                                                                                       \
        }                                                                                                         \
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb)));                 \
        for (int j = 0; j < kInputs; ++j) {                                                                       \
          const __m256 da = _mm256_set1_ps(a.da[(j0 + j) * a.blocks + b]);                                        \
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[j]), _mm256_mul_ps(dw, da), acc[i][j]);             \
        }                                                                                                         \
      }                                                                                                           \
    }                                                                                                             \
    for (int i = 0; i < kGroups; ++i)                                                                             \
      for (int j = 0; j < kInputs; ++j) _mm256_storeu_ps(y[i] + (j0 + j) * ldy, acc[i][j]);                       \
  } };

KVPIPE_INTERLEAVED_Q6K_TILE(q6k_inputs_avx2, KVPIPE_INTERLEAVED_AVX2, Q6Avx2)
KVPIPE_INTERLEAVED_Q6K_TILE(q6k_inputs_vnni, KVPIPE_INTERLEAVED_VNNI, Q6Vnni)

// ---- Pairs of groups in 512-bit vectors (Q4_K, Q6_K) ----------------------------------------
// As for Q4_0 and Q8_0 above: the super-block tiles' operations, each lane a row of one of two
// adjacent groups.

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593, as above

// Bytes [0, 8) of a row set from each group, widened: lanes 0-7 the first group's, 8-15 the second's.
KVPIPE_INTERLEAVED_VNNI inline __m512i u8_pair_epi32(const uint8_t* p0, const uint8_t* p1) {
  return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0)),
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1))));
}

// 16 bytes from each group as 32 int16, unsigned or signed.
KVPIPE_INTERLEAVED_VNNI inline __m256i bytes16_pair(const uint8_t* p0, const uint8_t* p1) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1);
}

template <int kInputs>
struct q4k_pairs_vnni {
  KVPIPE_INTERLEAVED_VNNI static void run(const uint8_t* w0, int64_t group_bytes, const SuperActivations& a,
                                          int64_t j0, float* y, int64_t ldy) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    __m512 acc[kInputs];
    const uint8_t* xr[kInputs];
    for (int j = 0; j < kInputs; ++j) {
      acc[j] = _mm512_setzero_ps();
      xr[j] = a.x + (j0 + j) * a.x_stride + 4;
    }
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* wb0 = w0 + b * kQ4KGroupBlockBytes;
      const uint8_t* wb1 = wb0 + group_bytes;
      if (j0 == 0) prefetch_pair<kQ4KGroupBlockBytes>(wb0, wb1);
      __m512i sumi[kInputs];
      for (int j = 0; j < kInputs; ++j) sumi[j] = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {
        __m512i lo[kInputs], hi[kInputs];
        for (int j = 0; j < kInputs; ++j) lo[j] = hi[j] = _mm512_setzero_si512();
        const uint8_t* q0 = wb0 + kQ4KQs + 256 * p;
        const uint8_t* q1 = wb1 + kQ4KQs + 256 * p;
        _Pragma("GCC unroll 8") for (int k = 0; k < 8; ++k) {
          const __m512i bytes = load_pair(q0 + 32 * k, q1 + 32 * k);
          const __m512i vlo = _mm512_and_si512(bytes, mask);
          const __m512i vhi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask);
          for (int j = 0; j < kInputs; ++j) {
            const uint8_t* xq = xr[j] + b * kQ8KActivationBytes + 64 * p + 4 * k;
            lo[j] = _mm512_dpbusd_epi32(lo[j], vlo, _mm512_set1_epi32(load_i32(xq)));
            hi[j] = _mm512_dpbusd_epi32(hi[j], vhi, _mm512_set1_epi32(load_i32(xq + 32)));
          }
        }
        const __m512i sc_lo = u8_pair_epi32(wb0 + kQ4KScales + 16 * p, wb1 + kQ4KScales + 16 * p);
        const __m512i sc_hi = u8_pair_epi32(wb0 + kQ4KScales + 16 * p + 8, wb1 + kQ4KScales + 16 * p + 8);
        for (int j = 0; j < kInputs; ++j)
          sumi[j] = _mm512_add_epi32(sumi[j], _mm512_add_epi32(_mm512_mullo_epi32(lo[j], sc_lo),
                                                               _mm512_mullo_epi32(hi[j], sc_hi)));
      }
      const __m512 dw = scales_pair(wb0, wb1);
      const __m512 dm = scales_pair(wb0 + 16, wb1 + 16);
      __m512i mins[4];
      for (int p = 0; p < 4; ++p)
        mins[p] = _mm512_cvtepu8_epi16(bytes16_pair(wb0 + kQ4KMins + 16 * p, wb1 + kQ4KMins + 16 * p));
      for (int j = 0; j < kInputs; ++j) {
        const int32_t* pairs = a.sum_pairs + ((j0 + j) * a.blocks + b) * 4;
        __m512i summ = _mm512_madd_epi16(mins[0], _mm512_set1_epi32(pairs[0]));
        for (int p = 1; p < 4; ++p) summ = _mm512_add_epi32(summ, _mm512_madd_epi16(mins[p], _mm512_set1_epi32(pairs[p])));
        const __m512 da = _mm512_set1_ps(a.da[(j0 + j) * a.blocks + b]);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[j]), _mm512_mul_ps(dw, da), acc[j]);
        acc[j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_mul_ps(dm, da), acc[j]);
      }
    }
    for (int j = 0; j < kInputs; ++j) _mm512_storeu_ps(y + (j0 + j) * ldy, acc[j]);
  }
};

template <int kInputs>
struct q6k_pairs_vnni {
  KVPIPE_INTERLEAVED_VNNI static void run(const uint8_t* w0, int64_t group_bytes, const SuperActivations& a,
                                          int64_t j0, float* y, int64_t ldy) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), high2 = _mm512_set1_epi8(0x30);
    __m512 acc[kInputs];
    const uint8_t* xr[kInputs];
    for (int j = 0; j < kInputs; ++j) {
      acc[j] = _mm512_setzero_ps();
      xr[j] = a.x + (j0 + j) * a.x_stride + 4;
    }
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* wb0 = w0 + b * kQ6KGroupBlockBytes;
      const uint8_t* wb1 = wb0 + group_bytes;
      if (j0 == 0) prefetch_pair<kQ6KGroupBlockBytes>(wb0, wb1);
      __m512i sumi[kInputs];
      for (int j = 0; j < kInputs; ++j) sumi[j] = _mm512_setzero_si512();
      for (int p = 0; p < 8; ++p) {
        // lane i: the scales of its row's sub-blocks 2p (low int16) and 2p + 1 (high)
        const __m512i pair =
            _mm512_cvtepi8_epi16(bytes16_pair(wb0 + kQ6KScales + 16 * p, wb1 + kQ6KScales + 16 * p));
        const __m512i scale[2] = {_mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16), _mm512_srai_epi32(pair, 16)};
        for (int h = 0; h < 2; ++h) {
          const int64_t c = kQ6KQs + kQ6KSubBlockBytes * (2 * p + h);
          const __m512i lo = load_pair(wb0 + c, wb1 + c);
          const __m512i hi = load_pair(wb0 + c + 32, wb1 + c + 32);
          const __m512i top = load_pair(wb0 + c + 64, wb1 + c + 64);
          const __m512i v[4] = {
              _mm512_or_si512(_mm512_and_si512(lo, low4), _mm512_and_si512(_mm512_slli_epi16(top, 4), high2)),
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), low4),
                              _mm512_and_si512(_mm512_slli_epi16(top, 2), high2)),
              _mm512_or_si512(_mm512_and_si512(hi, low4), _mm512_and_si512(top, high2)),
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(hi, 4), low4),
                              _mm512_and_si512(_mm512_srli_epi16(top, 2), high2))};
          for (int j = 0; j < kInputs; ++j) {
            const uint8_t* xq = xr[j] + b * kQ8KActivationBytes + 16 * (2 * p + h);
            __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], _mm512_set1_epi32(load_i32(xq)));
            for (int m = 1; m < 4; ++m) sum = _mm512_dpbusd_epi32(sum, v[m], _mm512_set1_epi32(load_i32(xq + 4 * m)));
            sumi[j] = _mm512_add_epi32(sumi[j], _mm512_mullo_epi32(sum, scale[h]));
          }
        }
        for (int j = 0; j < kInputs; ++j) {
          const int32_t sums = a.sum_pairs[((j0 + j) * a.blocks + b) * 8 + p];
          sumi[j] = _mm512_sub_epi32(sumi[j], _mm512_slli_epi32(_mm512_madd_epi16(pair, _mm512_set1_epi32(sums)), 5));
        }
      }
      const __m512 dw = scales_pair(wb0, wb1);
      for (int j = 0; j < kInputs; ++j) {
        const __m512 da = _mm512_set1_ps(a.da[(j0 + j) * a.blocks + b]);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[j]), _mm512_mul_ps(dw, da), acc[j]);
      }
    }
    for (int j = 0; j < kInputs; ++j) _mm512_storeu_ps(y + (j0 + j) * ldy, acc[j]);
  }
};

#pragma GCC diagnostic pop

// Groups [g_begin, g_end) two at a time (PairTile<k>::run, tiles of kPairWide inputs, then one
// of 4 where kPairWide is 8, then one of what is left); a group left over, and a lone input's
// groups, as tiled_groups<Tile, kWide> does them.
template <template <int> class PairTile, int kPairWide, template <int, int> class Tile, int kWide, typename Acts>
KVPIPE_INTERLEAVED_VNNI void paired_groups(const uint8_t* w, int64_t g_begin, int64_t g_end, int64_t group_bytes,
                                           const Acts& a, int64_t n, float* y, int64_t ldy) {
  static_assert(kPairWide == 4 || kPairWide == 8, "pair tiles of 4 or 8 inputs");
  int64_t g = g_begin;
  if (n > 1)
    for (; g + 2 <= g_end; g += 2) {
      const uint8_t* const wg = w + g * group_bytes;
      float* const yg = y + g * kGroupRows;
      int64_t j = 0;
      for (; j + kPairWide <= n; j += kPairWide) PairTile<kPairWide>::run(wg, group_bytes, a, j, yg, ldy);
      if constexpr (kPairWide == 8)
        if (n - j >= 4) {
          PairTile<4>::run(wg, group_bytes, a, j, yg, ldy);
          j += 4;
        }
      switch (n - j) {
        case 3: PairTile<3>::run(wg, group_bytes, a, j, yg, ldy); break;
        case 2: PairTile<2>::run(wg, group_bytes, a, j, yg, ldy); break;
        case 1: PairTile<1>::run(wg, group_bytes, a, j, yg, ldy); break;
        default: break;
      }
    }
  if (g < g_end) tiled_groups<Tile, kWide>(w, g, g_end, group_bytes, a, n, y, ldy);
}

}  // namespace

// AVX2 has 16 vector registers: a 32-value block's 8 weight vectors and 4 inputs' accumulators
// fill them, and a super-block input's sum and accumulator beside its value vectors leave room
// for 2; AVX-512's 32 hold twice as many.
void q4_0_avx2(const uint8_t* w, int64_t g_begin, int64_t g_end, const Activations& a, int64_t n, float* y,
               int64_t ldy) {
  tiled_groups<q4_0_inputs_avx2, 4>(w, g_begin, g_end, a.blocks * kQ4_0GroupBlockBytes, a, n, y, ldy);
}

void q4_0_avx512vnni(const uint8_t* w, int64_t g_begin, int64_t g_end, const Activations& a, int64_t n, float* y,
                     int64_t ldy) {
  paired_groups<q4_0_pairs_vnni, 8, q4_0_inputs_vnni, 8>(w, g_begin, g_end, a.blocks * kQ4_0GroupBlockBytes, a, n, y, ldy);
}

void q8_0_avx2(const uint8_t* w, int64_t g_begin, int64_t g_end, const Activations& a, int64_t n, float* y,
               int64_t ldy) {
  tiled_groups<q8_0_inputs_avx2, 4>(w, g_begin, g_end, a.blocks * kQ8_0GroupBlockBytes, a, n, y, ldy);
}

void q8_0_avx512vnni(const uint8_t* w, int64_t g_begin, int64_t g_end, const Activations& a, int64_t n, float* y,
                     int64_t ldy) {
  paired_groups<q8_0_pairs_vnni, 8, q8_0_inputs_vnni, 8>(w, g_begin, g_end, a.blocks * kQ8_0GroupBlockBytes, a, n, y, ldy);
}

void q4_k_avx2(const uint8_t* w, int64_t g_begin, int64_t g_end, const SuperActivations& a, int64_t n, float* y,
               int64_t ldy) {
  tiled_groups<super_inputs_avx2, 2>(w, g_begin, g_end, a.blocks * kQ4KGroupBlockBytes, a, n, y, ldy);
}

void q4_k_avx512vnni(const uint8_t* w, int64_t g_begin, int64_t g_end, const SuperActivations& a, int64_t n,
                     float* y, int64_t ldy) {
  paired_groups<q4k_pairs_vnni, 4, super_inputs_vnni, 4>(w, g_begin, g_end, a.blocks * kQ4KGroupBlockBytes, a, n, y, ldy);
}

void q6_k_avx2(const uint8_t* w, int64_t g_begin, int64_t g_end, const SuperActivations& a, int64_t n, float* y,
               int64_t ldy) {
  tiled_groups<q6k_inputs_avx2, 2>(w, g_begin, g_end, a.blocks * kQ6KGroupBlockBytes, a, n, y, ldy);
}

void q6_k_avx512vnni(const uint8_t* w, int64_t g_begin, int64_t g_end, const SuperActivations& a, int64_t n,
                     float* y, int64_t ldy) {
  paired_groups<q6k_pairs_vnni, 4, q6k_inputs_vnni, 4>(w, g_begin, g_end, a.blocks * kQ6KGroupBlockBytes, a, n, y, ldy);
}

}  // namespace kvpipe::interleaved_impl

#endif  // __x86_64__
