// The float and 32-value block types' AVX2 + FMA half (quant_impl.h): dot kernels for F32,
// F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL rows, and vector paths of the Q8_0 / Q8_1 activation
// quantiser and of dequantize_row. The file is built for baseline x86-64; the functions carry
// target attributes and are called only where the processor has AVX2, FMA and F16C.
//
// The integer scheme is llama.cpp's: a block's 32 weight bytes times the activation's 32 bytes
// with maddubs (unsigned x signed bytes, pairs summed to 16 bits), widened to int32 with madd,
// converted to float and scaled by d_w * d_x. Q8_0's signed weights give maddubs their
// absolute value and lend their sign to the activation, and so do IQ4_NL's, looked up from
// their nibbles with a byte shuffle. Q4_0's, Q4_1's, Q5_0's and Q5_1's quants go in unsigned
// as stored (Q5's fifth bits spread from their 32-bit word onto the nibbles), and a
// per-block term is added apart: Q4_1's and Q5_1's m_w * s_x (s_x the activation block's
// stored fp16 sum, as ggml does) and Q4_0's and Q5_0's offset of 8 or 16 as
// -offset d_w d_x sum(q_x), from activation sums taken once per call.
//
// Each kernel is instantiated for 1..kMaxKernelInputs inputs: a weight block (or eight float
// weights) is unpacked once and multiplied into every input while it sits in registers, so a
// group of inputs streams the weights once. An input's sums are formed the same way whatever
// the group size, so a row's result does not depend on the batch it came in.
#include "engine/kernels/cpu/quant_impl.h"

#if defined(__x86_64__)

#include "engine/kernels/cpu/half_convert.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#define KVPIPE_LEGACY_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVPIPE_LEGACY_VNNI \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))

namespace kvpipe::quant_impl {

void legacy_quantize_activation_row_avx2(ActivationType type, const float* x, void* dst,
                                         int64_t cols);
bool legacy_dequantize_row_avx2(QuantType type, const void* src, float* dst, int64_t cols);

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ8_0Bytes = 34;
constexpr int64_t kQ4_0Bytes = 18;
constexpr int64_t kQ4_1Bytes = 20;
constexpr int64_t kQ8_1Bytes = 36;
constexpr int64_t kQ5_0Bytes = 22;
constexpr int64_t kQ5_1Bytes = 24;
constexpr int64_t kIQ4NLBytes = 18;

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

KVPIPE_LEGACY_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

KVPIPE_LEGACY_AVX2 inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

KVPIPE_LEGACY_AVX2 inline __m256i load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

KVPIPE_LEGACY_AVX2 inline __m256 load_ps(const uint8_t* p) {
  return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
}

// ---- float rows ------------------------------------------------------------------------
// Eight weights as float32 from each stored float type.
struct LoadF32 {
  static constexpr int64_t kBytes = 4;
  KVPIPE_LEGACY_AVX2 static __m256 load8(const uint8_t* p) { return load_ps(p); }
  static float load1(const uint8_t* p) {
    float v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
};

struct LoadF16 {
  static constexpr int64_t kBytes = 2;
  KVPIPE_LEGACY_AVX2 static __m256 load8(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static float load1(const uint8_t* p) { return fp16_to_fp32(load_u16(p)); }
};

struct LoadBF16 {
  static constexpr int64_t kBytes = 2;
  // A bfloat16 is the upper half of a float32: widen each to 32 bits and shift it up.
  KVPIPE_LEGACY_AVX2 static __m256 load8(const uint8_t* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static float load1(const uint8_t* p) { return bf16_to_fp32(load_u16(p)); }
};

// Chunks of 32 columns: each input's chunk is summed into a temporary (a chain of four
// FMAs) and the temporary added into the input's accumulator, so the loop-carried chain is
// one add per 32 columns however many inputs share the weights, and one input needs just two
// registers (the same arithmetic for every group size keeps results batch-independent).
template <int M, typename Load>
KVPIPE_LEGACY_AVX2 inline void float_chunks(const uint8_t* row, const uint8_t* x, int64_t x_stride,
                                            __m256* acc, int64_t c_begin, int64_t c_end) {
  constexpr int64_t kB = Load::kBytes;
  for (int64_t c = c_begin; c < c_end; c += 32) {
    const __m256 w0 = Load::load8(row + c * kB);
    const __m256 w1 = Load::load8(row + (c + 8) * kB);
    const __m256 w2 = Load::load8(row + (c + 16) * kB);
    const __m256 w3 = Load::load8(row + (c + 24) * kB);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const uint8_t* xm = x + m * x_stride + c * 4;
      __m256 t = _mm256_mul_ps(w0, load_ps(xm));
      t = _mm256_fmadd_ps(w1, load_ps(xm + 32), t);
      t = _mm256_fmadd_ps(w2, load_ps(xm + 64), t);
      t = _mm256_fmadd_ps(w3, load_ps(xm + 96), t);
      acc[m] = _mm256_add_ps(acc[m], t);
    }
  }
}

// The columns past the last full chunk, then the row's result.
template <int M, typename Load>
KVPIPE_LEGACY_AVX2 inline void float_finish(const uint8_t* row, const uint8_t* x, int64_t x_stride,
                                            __m256* acc, int64_t c, int64_t cols, float* y,
                                            int64_t ldy, int64_t r) {
  constexpr int64_t kB = Load::kBytes;
  for (; c + 8 <= cols; c += 8) {
    const __m256 w0 = Load::load8(row + c * kB);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m)
      acc[m] = _mm256_fmadd_ps(w0, load_ps(x + m * x_stride + c * 4), acc[m]);
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    __m128 s = _mm_set_ss(hsum(acc[m]));
    const uint8_t* xm = x + m * x_stride;
    for (int64_t k = c; k < cols; ++k) {
      float xv;
      std::memcpy(&xv, xm + 4 * k, sizeof xv);
      s = _mm_fmadd_ss(_mm_set_ss(Load::load1(row + k * kB)), _mm_set_ss(xv), s);
    }
    y[m * ldy + r] = _mm_cvtss_f32(s);
  }
}

// Float activations are 4 bytes a value: four inputs of 4096 columns are 64 KiB, past the L1
// cache, and rereading them from L2 for every row would make the group slower than its
// weights. Wide inputs therefore go through the columns in slices of about 8 KiB of
// activations, over kRowTile rows at a time (their accumulators parked in memory between
// slices). The sums are formed in the same order either way.
constexpr int64_t kFloatSliceBytes = 8 << 10;
constexpr int64_t kRowTile = 4;

template <int M, typename Load>
KVPIPE_LEGACY_AVX2 void dot_float(const uint8_t* w, int64_t w_stride, const uint8_t* x,
                                  int64_t x_stride, float* y, int64_t ldy, int64_t row_begin,
                                  int64_t row_end, int64_t cols) {
  const int64_t full = cols / 32 * 32;
  if (M * cols * 4 <= 2 * kFloatSliceBytes) {
    // Two rows at a time, one from each half of the range, their chunks in turn: two streams
    // through memory keep more of the core's reads in flight than one. Each row's sums are
    // formed exactly as alone.
    const int64_t half = (row_end - row_begin) / 2;
    for (int64_t r = row_begin; r < row_begin + half; ++r) {
      const uint8_t* row_a = w + r * w_stride;
      const uint8_t* row_b = w + (r + half) * w_stride;
      __m256 acc_a[M], acc_b[M];
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) acc_a[m] = acc_b[m] = _mm256_setzero_ps();
      for (int64_t c = 0; c < full; c += 32) {
        float_chunks<M, Load>(row_a, x, x_stride, acc_a, c, c + 32);
        float_chunks<M, Load>(row_b, x, x_stride, acc_b, c, c + 32);
      }
      float_finish<M, Load>(row_a, x, x_stride, acc_a, full, cols, y, ldy, r);
      float_finish<M, Load>(row_b, x, x_stride, acc_b, full, cols, y, ldy, r + half);
    }
    for (int64_t r = row_begin + 2 * half; r < row_end; ++r) {
      const uint8_t* row = w + r * w_stride;
      __m256 acc[M];
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
      float_chunks<M, Load>(row, x, x_stride, acc, 0, full);
      float_finish<M, Load>(row, x, x_stride, acc, full, cols, y, ldy, r);
    }
    return;
  }
  const int64_t slice = std::max<int64_t>(32, kFloatSliceBytes / (4 * M) / 32 * 32);
  for (int64_t r0 = row_begin; r0 < row_end; r0 += kRowTile) {
    const int64_t nr = std::min(kRowTile, row_end - r0);
    __m256 acc[kRowTile][M];
    for (int64_t i = 0; i < nr; ++i)
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) acc[i][m] = _mm256_setzero_ps();
    for (int64_t c0 = 0; c0 < full; c0 += slice) {
      const int64_t c1 = std::min(full, c0 + slice);
      for (int64_t i = 0; i < nr; ++i) {
        __m256 a[M];
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) a[m] = acc[i][m];
        float_chunks<M, Load>(w + (r0 + i) * w_stride, x, x_stride, a, c0, c1);
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) acc[i][m] = a[m];
      }
    }
    for (int64_t i = 0; i < nr; ++i)
      float_finish<M, Load>(w + (r0 + i) * w_stride, x, x_stride, acc[i], full, cols, y, ldy,
                            r0 + i);
  }
}

// ---- 32-value blocks ---------------------------------------------------------------------
enum class BlockKind { kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kIQ4_NL };

template <BlockKind kKind>
struct BlockLayout {
  static constexpr int64_t kWBytes = kKind == BlockKind::kQ8_0   ? kQ8_0Bytes
                                     : kKind == BlockKind::kQ4_0 ? kQ4_0Bytes
                                     : kKind == BlockKind::kQ4_1 ? kQ4_1Bytes
                                     : kKind == BlockKind::kQ5_0 ? kQ5_0Bytes
                                     : kKind == BlockKind::kQ5_1 ? kQ5_1Bytes
                                                                 : kIQ4NLBytes;
  // Q4_1 and Q5_1: an offset m_w per block, and Q8_1 activations that carry their sums.
  static constexpr bool kMin = kKind == BlockKind::kQ4_1 || kKind == BlockKind::kQ5_1;
  // Q4_0 and Q5_0: unsigned quants whose offset (8 or 16) goes through the activation sums.
  static constexpr int kOffset = kKind == BlockKind::kQ4_0 ? 8 : kKind == BlockKind::kQ5_0 ? 16 : 0;
  // Q8_0 and IQ4_NL: signed weights, their sign moved onto the activation.
  static constexpr bool kSigned = kKind == BlockKind::kQ8_0 || kKind == BlockKind::kIQ4_NL;
  static constexpr int64_t kXBytes = kMin ? kQ8_1Bytes : kQ8_0Bytes;
  static constexpr int64_t kXQs = kMin ? 4 : 2;
};

// The activation side of the block scales, converted once per call: d_x, and the per-block
// offset term's activation factor (Q8_1's s_x for Q4_1 and Q5_1; -offset * sum q_x for Q4_0
// and Q5_0, whose weights are taken unsigned and their offset applied through it). Padded to
// a multiple of 8 blocks with zeros.
struct ActivationScales {
  std::vector<float> d, s;
};

template <BlockKind kKind>
KVPIPE_LEGACY_AVX2 void prepare_activation_scales(const uint8_t* x, int64_t x_stride, int inputs,
                                                  int64_t blocks, int64_t padded,
                                                  ActivationScales& sc) {
  using L = BlockLayout<kKind>;
  const size_t n = static_cast<size_t>(inputs * padded);
  sc.d.assign(n, 0.0f);
  if constexpr (!L::kSigned) sc.s.assign(n, 0.0f);
  for (int m = 0; m < inputs; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* xb = x + m * x_stride + b * L::kXBytes;
      sc.d[m * padded + b] = _cvtsh_ss(load_u16(xb));
      if constexpr (L::kMin) {
        sc.s[m * padded + b] = _cvtsh_ss(load_u16(xb + 2));
      } else if constexpr (L::kOffset != 0) {
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), load256(xb + L::kXQs));
        sc.s[m * padded + b] =
            static_cast<float>(-L::kOffset * hsum_i32(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1))));
      }
    }
  }
}

// One fp16 field (d_w at p, or m_w at p + 2) of up to eight consecutive blocks as float32,
// zero past `n`. The halves are packed in general registers, idle in the block loop, so this
// runs alongside the vector work (storing them and reloading them as a vector would stall on
// store forwarding).
template <int64_t kStride>
KVPIPE_LEGACY_AVX2 inline __m256 gather_halves(const uint8_t* p, int64_t n) {
  uint64_t lo = 0, hi = 0;
  if (n >= 8) {
    lo = uint64_t{load_u16(p)} | uint64_t{load_u16(p + kStride)} << 16 |
         uint64_t{load_u16(p + 2 * kStride)} << 32 | uint64_t{load_u16(p + 3 * kStride)} << 48;
    hi = uint64_t{load_u16(p + 4 * kStride)} | uint64_t{load_u16(p + 5 * kStride)} << 16 |
         uint64_t{load_u16(p + 6 * kStride)} << 32 | uint64_t{load_u16(p + 7 * kStride)} << 48;
  } else {
    for (int64_t k = 0; k < n; ++k) {
      const uint64_t h = load_u16(p + k * kStride);
      if (k < 4)
        lo |= h << (16 * k);
      else
        hi |= h << (16 * (k - 4));
    }
  }
  return _mm256_cvtph_ps(_mm_set_epi64x(static_cast<long long>(hi), static_cast<long long>(lo)));
}

// Nibbles 0..15 of a Q4 block as bytes in value order: the 16 bytes go to both halves, the
// upper half shifted down by 4, so low nibbles give values 0..15 and high nibbles 16..31.
KVPIPE_LEGACY_AVX2 inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m256i both =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_setr_epi64x(0, 0, 4, 4)),
                          _mm256_set1_epi8(0x0f));
}

// Q5's fifth bits (the 32-bit word at `qh`, value i's at bit i) as 0x10 in byte i: byte i of
// the vector takes byte i / 8 of the word, and the bit i % 8 of it is tested.
KVPIPE_LEGACY_AVX2 inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t word;
  std::memcpy(&word, qh, sizeof word);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(word)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i select = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(0x10));
}

// One weight block, unpacked: `a` is what maddubs takes as its unsigned operand and `sign`
// (signed kinds) the bytes whose sign moves onto the activation.
struct WeightBlock {
  __m256i a, sign;
};

template <BlockKind kKind>
KVPIPE_LEGACY_AVX2 inline WeightBlock load_block(const uint8_t* wb) {
  WeightBlock blk;
  if constexpr (kKind == BlockKind::kQ8_0) {
    blk.sign = load256(wb + 2);
    blk.a = _mm256_sign_epi8(blk.sign, blk.sign);
  } else if constexpr (kKind == BlockKind::kQ4_0) {
    blk.a = unpack_nibbles(wb + 2);
    blk.sign = blk.a;  // unused: the offset of 8 is applied through the activation sums
  } else if constexpr (kKind == BlockKind::kQ4_1) {
    blk.a = unpack_nibbles(wb + 4);
    blk.sign = blk.a;  // unused: Q4_1's nibbles are unsigned
  } else if constexpr (kKind == BlockKind::kQ5_0) {
    blk.a = _mm256_or_si256(unpack_nibbles(wb + 6), fifth_bits(wb + 2));
    blk.sign = blk.a;  // unused: the offset of 16 is applied through the activation sums
  } else if constexpr (kKind == BlockKind::kQ5_1) {
    blk.a = _mm256_or_si256(unpack_nibbles(wb + 8), fifth_bits(wb + 4));
    blk.sign = blk.a;  // unused: Q5_1's quants are unsigned
  } else {
    const __m256i grid = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues)));
    blk.sign = _mm256_shuffle_epi8(grid, unpack_nibbles(wb + 2));
    blk.a = _mm256_sign_epi8(blk.sign, blk.sign);
  }
  return blk;
}

// The block's 32 products with one activation block, in eight int32 partial sums as floats.
template <BlockKind kKind>
KVPIPE_LEGACY_AVX2 inline __m256 block_products(const WeightBlock& blk, const uint8_t* xqs) {
  __m256i q = load256(xqs);
  if constexpr (BlockLayout<kKind>::kSigned) q = _mm256_sign_epi8(q, blk.sign);
  const __m256i pairs = _mm256_maddubs_epi16(blk.a, q);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// The same products with AVX-512 VNNI: vpdpbusd sums each lane's four byte products straight
// into 32 bits. Exact, as maddubs is where its 16-bit pair sums cannot saturate, which they
// cannot here (at most 2 * 127 * 127 for Q8_0, 2 * 31 * 127 for the Q5 types): so the two
// give the same integers and the kernels the same floats, bit for bit.
template <BlockKind kKind>
KVPIPE_LEGACY_VNNI inline __m256 block_products_vnni(const WeightBlock& blk, const uint8_t* xqs) {
  __m256i q = load256(xqs);
  if constexpr (BlockLayout<kKind>::kSigned) q = _mm256_sign_epi8(q, blk.sign);
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), blk.a, q));
}

// How far ahead of the group being computed the block kernels ask for weights: on weights
// streamed from memory, with the hardware prefetcher alone these loops ran 15-25% slower
// (EPYC, one thread; 2 and 4 KiB ahead measured alike, 0.5-1 KiB in between).
constexpr int64_t kPrefetchBytes = 2048;

// Blocks go in groups of eight, whose d_w * d_x products (and offset terms) are formed eight
// at a time, and within a group in pairs: the pair's two scaled products are summed first and
// then added to the accumulator, halving the loop-carried chain (one input would otherwise
// wait on an FMA's latency every block).
// One body, compiled twice: with AVX2's byte products, and with AVX-512 VNNI's.
#define KVPIPE_DOT_BLOCKS(NAME, ATTR, PRODUCTS)                                                               \
template <int M, BlockKind kKind>                                                                             \
ATTR void NAME(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, float* y, int64_t ldy,  \
               int64_t row_begin, int64_t row_end, int64_t cols) {                                            \
  using L = BlockLayout<kKind>;                                                                               \
  constexpr bool kMin = L::kMin;                                                                              \
  constexpr bool kOffset = !L::kSigned; /* a per-block term besides d_w d_x q_w.q_x */                        \
  const int64_t blocks = cols / kBlock;                                                                       \
  const int64_t padded = (blocks + 7) / 8 * 8;                                                                \
  thread_local ActivationScales xsc;                                                                          \
  prepare_activation_scales<kKind>(x, x_stride, M, blocks, padded, xsc);                                      \
  const float* xd = xsc.d.data();                                                                             \
  const float* xs = kOffset ? xsc.s.data() : nullptr;                                                         \
                                                                                                              \
  for (int64_t r = row_begin; r < row_end; ++r) {                                                             \
    const uint8_t* row = w + r * w_stride;                                                                    \
    __m256 acc[M], offset[M];                                                                                 \
  _Pragma("GCC unroll 4")                                                                                     \
    for (int m = 0; m < M; ++m) {                                                                             \
      acc[m] = _mm256_setzero_ps();                                                                           \
      offset[m] = _mm256_setzero_ps();                                                                        \
    }                                                                                                         \
    for (int64_t g = 0; g < blocks; g += 8) {                                                                 \
      const uint8_t* wg = row + g * L::kWBytes;                                                               \
      for (int64_t off = 0; off < 8 * L::kWBytes; off += 64)                                                  \
        _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetchBytes + off), _MM_HINT_T0);                  \
      const int64_t n = std::min<int64_t>(8, blocks - g);                                                     \
      const __m256 dw = gather_halves<L::kWBytes>(wg, n);                                                     \
      __m256 mw = _mm256_setzero_ps();                                                                        \
      if constexpr (kMin) mw = gather_halves<L::kWBytes>(wg + 2, n);                                          \
      alignas(32) float scale[M][8];                                                                          \
  _Pragma("GCC unroll 4")                                                                                     \
      for (int m = 0; m < M; ++m) {                                                                           \
        const __m256 s8 = _mm256_mul_ps(dw, _mm256_loadu_ps(xd + m * padded + g));                            \
        _mm256_store_ps(scale[m], s8);                                                                        \
        if constexpr (kMin) {                                                                                 \
          offset[m] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xs + m * padded + g), offset[m]);                   \
        } else if constexpr (kOffset) {                                                                       \
          offset[m] = _mm256_fmadd_ps(s8, _mm256_loadu_ps(xs + m * padded + g), offset[m]);                   \
        }                                                                                                     \
      }                                                                                                       \
      int64_t k = 0;                                                                                          \
      for (; k + 2 <= n; k += 2) {                                                                            \
        const uint8_t* wb = wg + k * L::kWBytes;                                                              \
        const WeightBlock b0 = load_block<kKind>(wb);                                                         \
        const WeightBlock b1 = load_block<kKind>(wb + L::kWBytes);                                            \
  _Pragma("GCC unroll 4")                                                                                     \
        for (int m = 0; m < M; ++m) {                                                                         \
          const uint8_t* xb = x + m * x_stride + (g + k) * L::kXBytes;                                        \
          const __m256 p0 = PRODUCTS<kKind>(b0, xb + L::kXQs);                                                \
          const __m256 p1 = PRODUCTS<kKind>(b1, xb + L::kXBytes + L::kXQs);                                   \
          const __m256 t = _mm256_fmadd_ps(p1, _mm256_broadcast_ss(&scale[m][k + 1]),                         \
                                           _mm256_mul_ps(p0, _mm256_broadcast_ss(&scale[m][k])));             \
          acc[m] = _mm256_add_ps(acc[m], t);                                                                  \
        }                                                                                                     \
      }                                                                                                       \
      if (k < n) {                                                                                            \
        const WeightBlock b0 = load_block<kKind>(wg + k * L::kWBytes);                                        \
  _Pragma("GCC unroll 4")                                                                                     \
        for (int m = 0; m < M; ++m) {                                                                         \
          const __m256 p0 =                                                                                   \
              PRODUCTS<kKind>(b0, x + m * x_stride + (g + k) * L::kXBytes + L::kXQs);                         \
          acc[m] = _mm256_fmadd_ps(p0, _mm256_broadcast_ss(&scale[m][k]), acc[m]);                            \
        }                                                                                                     \
      }                                                                                                       \
    }                                                                                                         \
  _Pragma("GCC unroll 4")                                                                                     \
    for (int m = 0; m < M; ++m)                                                                               \
      y[m * ldy + r] = kOffset ? hsum(acc[m]) + hsum(offset[m]) : hsum(acc[m]);                               \
  }                                                                                                           \
}

KVPIPE_DOT_BLOCKS(dot_blocks, KVPIPE_LEGACY_AVX2, block_products)
KVPIPE_DOT_BLOCKS(dot_blocks_vnni, KVPIPE_LEGACY_VNNI, block_products_vnni)

// ---- dispatch ----------------------------------------------------------------------------
template <template <int> class K>
DotKernel by_inputs(int inputs) {
  switch (inputs) {
    case 1:
      return K<1>::run;
    case 2:
      return K<2>::run;
    case 3:
      return K<3>::run;
    default:
      return K<4>::run;
  }
}

template <typename Load>
struct FloatKernels {
  template <int M>
  struct K {
    static void run(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, int,
                    float* y, int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
      dot_float<M, Load>(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
    }
  };
};

template <BlockKind kKind>
struct BlockKernels {
  template <int M>
  struct K {
    static void run(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, int,
                    float* y, int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
      dot_blocks<M, kKind>(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
    }
  };
};

template <BlockKind kKind>
struct VnniBlockKernels {
  template <int M>
  struct K {
    static void run(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, int,
                    float* y, int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
      dot_blocks_vnni<M, kKind>(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
    }
  };
};

// One entry point per type that picks the instantiation for the call's input count.
template <template <int> class K>
void dispatch_inputs(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride,
                     int inputs, float* y, int64_t ldy, int64_t row_begin, int64_t row_end,
                     int64_t cols) {
  static_assert(kMaxKernelInputs == 4, "one instantiation per input count");
  if (inputs < 1 || inputs > kMaxKernelInputs)
    throw std::invalid_argument("legacy AVX2 kernel: inputs must be 1.." +
                                std::to_string(kMaxKernelInputs));
  by_inputs<K>(inputs)(w, w_stride, x, x_stride, inputs, y, ldy, row_begin, row_end, cols);
}

// ---- activation quantiser ----------------------------------------------------------------
// roundf (halves away from zero) of integral-range floats: truncate, then step away from zero
// where the dropped fraction is at least one half. The fraction v - trunc(v) is exact.
KVPIPE_LEGACY_AVX2 inline __m256 round_half_away(__m256 v) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256 frac = _mm256_andnot_ps(sign_bit, _mm256_sub_ps(v, t));
  const __m256 away = _mm256_or_ps(_mm256_and_ps(v, sign_bit), _mm256_set1_ps(1.0f));
  return _mm256_add_ps(t,
                       _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ), away));
}

}  // namespace

// The portable quantiser's arithmetic (quant_legacy.cpp) on eight values at a time: the same
// float division for d, reciprocal, products and rounding, so the bytes are identical.
KVPIPE_LEGACY_AVX2 void legacy_quantize_activation_row_avx2(ActivationType type, const float* x,
                                                            void* dst, int64_t cols) {
  const bool with_sum = type == ActivationType::Q8_1;
  const int64_t block_bytes = with_sum ? kQ8_1Bytes : kQ8_0Bytes;
  const int64_t qs_offset = with_sum ? 4 : 2;
  auto* out = static_cast<uint8_t*>(dst);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < cols / kBlock; ++b, x += kBlock) {
    uint8_t* yb = out + b * block_bytes;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
    const __m256 m01 = _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask));
    const __m256 m23 = _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask));
    const __m256 m8 = _mm256_max_ps(m01, m23);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 scale = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvttps_epi32(round_half_away(_mm256_mul_ps(v[i], scale)));
    // packs work within 128-bit lanes; the permute puts the 32 bytes back in value order.
    const __m256i q16a = _mm256_packs_epi32(q[0], q[1]);
    const __m256i q16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(yb + qs_offset), q8);
    const uint16_t dh = fp32_to_fp16(d);
    std::memcpy(yb, &dh, sizeof dh);
    if (with_sum) {
      const int sum =
          hsum_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
      const uint16_t sh = fp32_to_fp16(static_cast<float>(sum) * d);
      std::memcpy(yb + 2, &sh, sizeof sh);
    }
  }
}

// dequantize_row's vector path (the BLAS path dequantises tiles of weights with it). Every
// value is exact in float32 as in the portable loop: Q4_1's d * q is exact, so fusing "+ m"
// into an FMA rounds once, exactly as the separate add does.
KVPIPE_LEGACY_AVX2 bool legacy_dequantize_row_avx2(QuantType type, const void* src, float* dst,
                                                   int64_t cols) {
  const auto* s = static_cast<const uint8_t*>(src);
  switch (type) {
    case QuantType::F16:
    case QuantType::BF16: {
      const bool bf16 = type == QuantType::BF16;
      int64_t c = 0;
      for (; c + 8 <= cols; c += 8)
        _mm256_storeu_ps(dst + c, bf16 ? LoadBF16::load8(s + 2 * c) : LoadF16::load8(s + 2 * c));
      for (; c < cols; ++c) dst[c] = bf16 ? LoadBF16::load1(s + 2 * c) : LoadF16::load1(s + 2 * c);
      return true;
    }
    case QuantType::Q8_0:
      for (int64_t b = 0; b < cols / kBlock; ++b, dst += kBlock) {
        const uint8_t* blk = s + b * kQ8_0Bytes;
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
        for (int i = 0; i < 4; ++i) {
          const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i));
          _mm256_storeu_ps(dst + 8 * i,
                           _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
        }
      }
      return true;
    case QuantType::Q4_0:
    case QuantType::Q4_1: {
      const bool q4_1 = type == QuantType::Q4_1;
      const int64_t block_bytes = q4_1 ? kQ4_1Bytes : kQ4_0Bytes;
      for (int64_t b = 0; b < cols / kBlock; ++b, dst += kBlock) {
        const uint8_t* blk = s + b * block_bytes;
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
        const __m256 m = _mm256_set1_ps(q4_1 ? _cvtsh_ss(load_u16(blk + 2)) : 0.0f);
        __m256i q = unpack_nibbles(blk + (q4_1 ? 4 : 2));
        if (!q4_1) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
        const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
        for (int i = 0; i < 4; ++i) {
          const __m128i q8 =
              i % 2 ? _mm_unpackhi_epi64(halves[i / 2], halves[i / 2]) : halves[i / 2];
          const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
          _mm256_storeu_ps(dst + 8 * i, q4_1 ? _mm256_fmadd_ps(d, v, m) : _mm256_mul_ps(d, v));
        }
      }
      return true;
    }
    default:
      return false;
  }
}

// The 32-value block types' kernels of one family (BlockKernels or VnniBlockKernels); nullptr
// for other types.
template <template <BlockKind> class Family>
DotKernel block_kernel(QuantType type) {
  switch (type) {
    case QuantType::Q8_0:
      return dispatch_inputs<Family<BlockKind::kQ8_0>::template K>;
    case QuantType::Q4_0:
      return dispatch_inputs<Family<BlockKind::kQ4_0>::template K>;
    case QuantType::Q4_1:
      return dispatch_inputs<Family<BlockKind::kQ4_1>::template K>;
    case QuantType::Q5_0:
      return dispatch_inputs<Family<BlockKind::kQ5_0>::template K>;
    case QuantType::Q5_1:
      return dispatch_inputs<Family<BlockKind::kQ5_1>::template K>;
    case QuantType::IQ4_NL:
      return dispatch_inputs<Family<BlockKind::kIQ4_NL>::template K>;
    default:
      return nullptr;
  }
}

DotKernel legacy_avx2_kernel(QuantType type) {
  switch (type) {
    case QuantType::F32:
      return dispatch_inputs<FloatKernels<LoadF32>::K>;
    case QuantType::F16:
      return dispatch_inputs<FloatKernels<LoadF16>::K>;
    case QuantType::BF16:
      return dispatch_inputs<FloatKernels<LoadBF16>::K>;
    default:
      break;
  }
  if (const DotKernel k = block_kernel<BlockKernels>(type)) return k;
  throw std::invalid_argument(std::string("legacy_avx2_kernel: ") + quant_name(type) +
                              " is not a float or 32-value block type");
}

DotKernel legacy_vnni_kernel(QuantType type) { return block_kernel<VnniBlockKernels>(type); }

}  // namespace kvpipe::quant_impl

#else  // no x86 vector code in this build

namespace kvpipe::quant_impl {
DotKernel legacy_avx2_kernel(QuantType) {
  return nullptr;
}
DotKernel legacy_vnni_kernel(QuantType) {
  return nullptr;
}
}  // namespace kvpipe::quant_impl

#endif
