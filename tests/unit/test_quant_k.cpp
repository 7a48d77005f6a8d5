// The 256-value super-block types (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) and their Q8_K
// activations: dequantisation of hand-built blocks whose values are known, the activation
// quantiser against ggml's reference algorithm written out here, and both dot kernels (the one
// dot_kernel picks and the portable one) against float64 products of the dequantised rows
// over many shapes, strides and input counts, and against each other.
#include "engine/kernels/cpu/cpu_features.h"
#include "engine/kernels/cpu/quant_impl.h"
#include "engine/kernels/cpu/quant_types.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

constexpr int64_t kQK = 256;
constexpr int64_t kQ8KBytes = 292;

const QuantType kKTypes[] = {QuantType::Q4_K, QuantType::Q5_K, QuantType::Q6_K,
                             QuantType::Q2_K, QuantType::Q3_K, QuantType::IQ4_XS};

// Where a super-block keeps its float16 d, and its dmin (-1: none).
int d_offset(QuantType type) {
  switch (type) {
    case QuantType::Q6_K: return 208;
    case QuantType::Q2_K: return 80;
    case QuantType::Q3_K: return 108;
    default: return 0;
  }
}
int dmin_offset(QuantType type) {
  switch (type) {
    case QuantType::Q4_K:
    case QuantType::Q5_K: return 2;
    case QuantType::Q2_K: return 82;
    default: return -1;
  }
}

// Half-precision bits of sign * 2^(exponent - 15) * (1 + mantissa / 1024): every value used
// here is a normal half, built from its fields so no conversion is under test.
uint16_t half_bits(int sign, int exponent, int mantissa) {
  return static_cast<uint16_t>((sign < 0 ? 0x8000 : 0) | (exponent << 10) | mantissa);
}

void put_half(uint8_t* p, uint16_t h) { std::memcpy(p, &h, 2); }

// The 12 scale bytes of Q4_K/Q5_K from eight 6-bit scales and mins, written from the format
// (the inverse of ggml's get_scale_min_k4): sub-blocks 0-3 in the low 6 bits of bytes 0-3
// (scales) and 4-7 (mins); sub-blocks 4-7 as low nibbles in bytes 8-11 (scale low, min high)
// with their top two bits in the top of bytes 0-3 (scales) and 4-7 (mins).
void pack_scales_mins(const int sc[8], const int mn[8], uint8_t* out) {
  for (int j = 0; j < 4; ++j) {
    out[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    out[j + 4] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
    out[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xf) | ((mn[j + 4] & 0xf) << 4));
  }
}

TEST(QuantK, Q4KHandBuiltBlock) {
  const int sc[8] = {1, 2, 63, 17, 32, 5, 48, 63};
  const int mn[8] = {0, 3, 7, 63, 16, 33, 1, 62};
  std::vector<uint8_t> block(144);
  put_half(&block[0], half_bits(1, 15, 0));   // d = 1
  put_half(&block[2], half_bits(1, 14, 0));   // dmin = 0.5
  pack_scales_mins(sc, mn, &block[4]);
  // Value l of sub-block s holds (l + 3s) % 16; chunk j packs sub-block 2j in the low nibbles
  // of qs[32j..32j+31] and sub-block 2j+1 in the high nibbles.
  auto q = [](int s, int l) { return (l + 3 * s) % 16; };
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) block[16 + 32 * j + l] = static_cast<uint8_t>(q(2 * j, l) | (q(2 * j + 1, l) << 4));
  std::vector<float> out(kQK);
  dequantize_row(QuantType::Q4_K, block.data(), out.data(), kQK);
  for (int s = 0; s < 8; ++s)
    for (int l = 0; l < 32; ++l)
      ASSERT_EQ(out[32 * s + l], 1.0f * sc[s] * q(s, l) - 0.5f * mn[s]) << "sub-block " << s << " value " << l;
}

TEST(QuantK, Q5KHandBuiltBlock) {
  const int sc[8] = {63, 1, 2, 3, 40, 41, 16, 31};
  const int mn[8] = {5, 0, 63, 9, 62, 17, 32, 15};
  std::vector<uint8_t> block(176);
  put_half(&block[0], half_bits(1, 13, 0));   // d = 0.25
  put_half(&block[2], half_bits(-1, 16, 0));  // dmin = -2
  pack_scales_mins(sc, mn, &block[4]);
  // Value l of sub-block s holds (5l + s) % 32: its low four bits as in Q4_K (qs at 48), its
  // fifth bit as bit s of qh[l] (qh at 16).
  auto q = [](int s, int l) { return (5 * l + s) % 32; };
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l)
      block[48 + 32 * j + l] = static_cast<uint8_t>((q(2 * j, l) & 0xf) | ((q(2 * j + 1, l) & 0xf) << 4));
  for (int l = 0; l < 32; ++l) {
    int h = 0;
    for (int s = 0; s < 8; ++s) h |= (q(s, l) >> 4) << s;
    block[16 + l] = static_cast<uint8_t>(h);
  }
  std::vector<float> out(kQK);
  dequantize_row(QuantType::Q5_K, block.data(), out.data(), kQK);
  for (int s = 0; s < 8; ++s)
    for (int l = 0; l < 32; ++l)
      ASSERT_EQ(out[32 * s + l], 0.25f * sc[s] * q(s, l) + 2.0f * mn[s]) << "sub-block " << s << " value " << l;
}

TEST(QuantK, Q6KHandBuiltBlock) {
  const int8_t sc[16] = {1, -1, 127, -128, 3, 5, -7, 9, 11, -13, 64, 0, 2, -2, 100, -100};
  std::vector<uint8_t> block(210);
  // Value i (0..255) holds the 6-bit (7i + 11) % 64 and means d * sc[i / 16] * (q - 32).
  auto q = [](int i) { return (7 * i + 11) % 64; };
  // Half h covers values 128h..128h+127: value 128h + 32k + l (k = 0..3, l = 0..31) keeps its
  // low nibble in ql[64h + l + 32 * (k % 2)] (low nibble for k < 2, high for k >= 2) and its
  // top two bits at bit 2k of qh[32h + l].
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 32; ++l) {
        const int v = q(128 * h + 32 * k + l);
        block[64 * h + l + 32 * (k % 2)] |= static_cast<uint8_t>((v & 0xf) << (k < 2 ? 0 : 4));
        block[128 + 32 * h + l] |= static_cast<uint8_t>((v >> 4) << (2 * k));
      }
  std::memcpy(&block[192], sc, 16);
  put_half(&block[208], half_bits(1, 12, 512));  // d = 0.1875
  std::vector<float> out(kQK);
  dequantize_row(QuantType::Q6_K, block.data(), out.data(), kQK);
  for (int i = 0; i < kQK; ++i) ASSERT_EQ(out[i], 0.1875f * sc[i / 16] * (q(i) - 32)) << "value " << i;
}

TEST(QuantK, Q2KHandBuiltBlock) {
  std::vector<uint8_t> block(84);
  // Sub-block s has scale (s + 1) % 16 (low nibble) and min (3s) % 16 (high nibble).
  for (int s = 0; s < 16; ++s) block[s] = static_cast<uint8_t>(((s + 1) % 16) | (((3 * s) % 16) << 4));
  // Value 128h + 32k + l holds (l + k + h) % 4 in bits 2k, 2k+1 of qs[32h + l].
  auto q = [](int i) { return (i % 32 + (i / 32) % 4 + i / 128) % 4; };
  for (int i = 0; i < kQK; ++i) block[16 + 32 * (i / 128) + i % 32] |= static_cast<uint8_t>(q(i) << (2 * ((i / 32) % 4)));
  put_half(&block[80], half_bits(1, 14, 0));   // d = 0.5
  put_half(&block[82], half_bits(-1, 13, 0));  // dmin = -0.25
  std::vector<float> out(kQK);
  dequantize_row(QuantType::Q2_K, block.data(), out.data(), kQK);
  for (int i = 0; i < kQK; ++i) {
    const int s = i / 16;
    ASSERT_EQ(out[i], 0.5f * ((s + 1) % 16) * q(i) + 0.25f * ((3 * s) % 16)) << "value " << i;
  }
}

TEST(QuantK, Q3KHandBuiltBlock) {
  std::vector<uint8_t> block(110);
  // Sixteen 6-bit scales (5s + 2) % 64, meaning scale - 32: low nibbles of scale i in byte i
  // (i < 8) or the high nibble of byte i - 8; the top two bits at bits 2(i / 4) of byte 8 + i % 4.
  auto sc = [](int i) { return (5 * i + 2) % 64; };
  for (int i = 0; i < 16; ++i) {
    block[96 + (i < 8 ? i : i - 8)] |= static_cast<uint8_t>((sc(i) & 0xf) << (i < 8 ? 0 : 4));
    block[96 + 8 + i % 4] |= static_cast<uint8_t>((sc(i) >> 4) << (2 * (i / 4)));
  }
  // Value 128h + 32k + l holds q in -4..3 as (q + 4) & 3 in bits 2k, 2k+1 of qs[32h + l] and
  // the third bit (set for q >= 0) at bit 4h + k of hmask[l].
  auto q = [](int i) { return (7 * i + 3) % 8 - 4; };
  for (int i = 0; i < kQK; ++i) {
    const int h = i / 128, k = (i / 32) % 4, l = i % 32;
    block[32 + 32 * h + l] |= static_cast<uint8_t>(((q(i) + 4) & 3) << (2 * k));
    if (q(i) >= 0) block[l] |= static_cast<uint8_t>(1 << (4 * h + k));
  }
  put_half(&block[108], half_bits(-1, 12, 0));  // d = -0.125
  std::vector<float> out(kQK);
  dequantize_row(QuantType::Q3_K, block.data(), out.data(), kQK);
  for (int i = 0; i < kQK; ++i) ASSERT_EQ(out[i], -0.125f * (sc(i / 16) - 32) * q(i)) << "value " << i;
}

TEST(QuantK, IQ4XSHandBuiltBlock) {
  static const int kGrid[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
  std::vector<uint8_t> block(136);
  // Eight 6-bit scales (9s + 1) % 64, meaning scale - 32: low nibble in scales_l[s / 2] (low
  // nibble for even s), top two bits at bits 2s of the 16-bit scales_h.
  auto sc = [](int s) { return (9 * s + 1) % 64; };
  uint16_t high = 0;
  for (int s = 0; s < 8; ++s) {
    block[4 + s / 2] |= static_cast<uint8_t>((sc(s) & 0xf) << (4 * (s % 2)));
    high = static_cast<uint16_t>(high | ((sc(s) >> 4) << (2 * s)));
  }
  std::memcpy(&block[2], &high, 2);
  // Value 32s + j indexes the grid with (3j + s) % 16: low nibble of qs[16s + j] for j < 16,
  // high nibble of qs[16s + j - 16] after.
  auto n = [](int i) { return (3 * (i % 32) + i / 32) % 16; };
  for (int i = 0; i < kQK; ++i) {
    const int s = i / 32, j = i % 32;
    block[8 + 16 * s + j % 16] |= static_cast<uint8_t>(n(i) << (j < 16 ? 0 : 4));
  }
  put_half(&block[0], half_bits(1, 11, 0));  // d = 1/16
  std::vector<float> out(kQK);
  dequantize_row(QuantType::IQ4_XS, block.data(), out.data(), kQK);
  for (int i = 0; i < kQK; ++i)
    ASSERT_EQ(out[i], 0.0625f * (sc(i / 32) - 32) * kGrid[n(i)]) << "value " << i;
}

TEST(QuantK, Float16ScalesDecodeExactly) {
  // One Q6_K block per scale, every sub-block scale 1 and every quant 33 (one step above the
  // offset), so each value is d itself: normals, subnormals, both zeros, the extremes.
  const uint16_t halves[] = {0x3c00, 0xc000, 0x0001, 0x8001, 0x03ff, 0x0400, 0x7bff, 0xfbff, 0x0000, 0x8000, 0x1234};
  const double expected[] = {1.0,  -2.0, std::ldexp(1.0, -24), -std::ldexp(1.0, -24), 1023 * std::ldexp(1.0, -24),
                             std::ldexp(1.0, -14), 65504.0, -65504.0, 0.0, 0.0, std::ldexp(1.0 + 0x234 / 1024.0, 4 - 15)};
  for (size_t i = 0; i < sizeof halves / sizeof halves[0]; ++i) {
    std::vector<uint8_t> block(210, 0);
    for (int l = 0; l < 128; ++l) block[l] = 0x11;         // low nibbles 1
    for (int l = 0; l < 64; ++l) block[128 + l] = 0xaa;    // top bits 10: q = 33
    std::memset(&block[192], 1, 16);
    put_half(&block[208], halves[i]);
    std::vector<float> out(kQK);
    dequantize_row(QuantType::Q6_K, block.data(), out.data(), kQK);
    for (int j = 0; j < kQK; ++j) ASSERT_EQ(out[j], static_cast<float>(expected[i])) << std::hex << halves[i];
    // The dot kernels decode the same scale: all-ones activations quantise to -127 steps of
    // -1/127, so the product is 256 * d.
    std::vector<float> ones(kQK, 1.0f);
    std::vector<uint8_t> xq(kQ8KBytes);
    quantize_activation_row(ActivationType::Q8_K, ones.data(), xq.data(), kQK);
    float xd;
    std::memcpy(&xd, xq.data(), 4);
    for (DotKernel kernel : {dot_kernel(QuantType::Q6_K), portable_dot_kernel(QuantType::Q6_K)}) {
      float y = -1;
      kernel(block.data(), 210, xq.data(), kQ8KBytes, 1, &y, 1, 0, 1, kQK);
      EXPECT_FLOAT_EQ(y, static_cast<float>(expected[i] * 256 * (-127.0 * xd))) << std::hex << halves[i];
    }
  }
}

TEST(QuantK, DequantizeRowCoversEverySuperBlock) {
  // Two super-blocks of Q6_K whose d differ: the second block's values are the first's, doubled.
  std::vector<uint8_t> row(2 * 210);
  std::mt19937 gen(7);
  for (int i = 0; i < 208; ++i) row[i] = static_cast<uint8_t>(gen());
  put_half(&row[208], half_bits(1, 10, 0));
  std::memcpy(&row[210], &row[0], 208);
  put_half(&row[210 + 208], half_bits(1, 11, 0));
  std::vector<float> out(2 * kQK);
  dequantize_row(QuantType::Q6_K, row.data(), out.data(), 2 * kQK);
  for (int i = 0; i < kQK; ++i) ASSERT_EQ(out[kQK + i], 2 * out[i]) << i;
}

TEST(QuantK, OtherTypesAreRefused) {
  float out[32];
  uint8_t block[34] = {};
  EXPECT_THROW(quant_impl::k_dequantize_row(QuantType::Q8_0, block, out, 32), std::invalid_argument);
  EXPECT_THROW(quant_impl::k_portable_kernel(QuantType::Q4_0), std::invalid_argument);
  EXPECT_EQ(quant_impl::k_avx2_kernel(QuantType::F32), nullptr);
}

// ggml's quantize_row_q8_K_ref, written out independently of kvpipe's: the value of largest
// magnitude (the first one on ties) maps to -127, iscale = -127 / max, quants rounded to the
// nearest integer with ties to even, d = 1 / iscale; an all-zero block is all zeros.
std::vector<uint8_t> reference_q8k(const std::vector<float>& x) {
  std::vector<uint8_t> out(x.size() / kQK * kQ8KBytes, 0);
  for (size_t b = 0; b < x.size() / kQK; ++b) {
    const float* xb = x.data() + b * kQK;
    uint8_t* yb = out.data() + b * kQ8KBytes;
    float max = 0, amax = 0;
    for (int j = 0; j < kQK; ++j)
      if (std::fabs(xb[j]) > amax) amax = std::fabs(xb[j]), max = xb[j];
    if (amax == 0) continue;
    const float iscale = -127.f / max;
    int8_t qs[kQK];
    for (int j = 0; j < kQK; ++j) qs[j] = static_cast<int8_t>(std::min(127L, std::lrint(iscale * xb[j])));
    std::memcpy(yb + 4, qs, kQK);
    for (int k = 0; k < 16; ++k) {
      int16_t s = 0;
      for (int l = 0; l < 16; ++l) s = static_cast<int16_t>(s + qs[16 * k + l]);
      std::memcpy(yb + 4 + kQK + 2 * k, &s, 2);
    }
    const float d = 1 / iscale;
    std::memcpy(yb, &d, 4);
  }
  return out;
}

// Rows of activations shaped like decode's: standard normal values with an outlier (20x)
// every 97 values, so blocks differ in scale and in the sign of their extreme.
std::vector<float> activation_rows(int64_t n, int64_t cols, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n * cols));
  for (auto& v : x) v = normal(gen);
  for (int64_t i = 0; i < n * cols; i += 97) x[i] *= 20;
  return x;
}

TEST(QuantK, Q8KQuantisationMatchesGgmlReference) {
  const int64_t cols = 8 * kQK;
  std::vector<float> x = activation_rows(1, cols, 11);
  // Block 1: all zero. Block 2: the extreme is negative. Block 3: values of exact halves
  // after scaling (max 127, so iscale = -1 and x = k + 0.5 rounds to even). Block 4: the two
  // extremes tie in magnitude with opposite signs, negative first. Block 5: tiny values.
  std::fill(x.begin() + kQK, x.begin() + 2 * kQK, 0.0f);
  x[2 * kQK + 100] = -1e3f;
  for (int j = 0; j < kQK; ++j) x[3 * kQK + j] = static_cast<float>(j % 200 - 100) + 0.5f;
  x[3 * kQK + 7] = 127.0f;
  x[4 * kQK + 5] = -1e3f;
  x[4 * kQK + 9] = 1e3f;
  for (int j = 0; j < kQK; ++j) x[5 * kQK + j] *= 1e-30f;
  x[6 * kQK] = -0.0f;

  std::vector<uint8_t> q(static_cast<size_t>(activation_row_bytes(ActivationType::Q8_K, cols)));
  quantize_activation_row(ActivationType::Q8_K, x.data(), q.data(), cols);
  const std::vector<uint8_t> expected = reference_q8k(x);
  ASSERT_EQ(q.size(), expected.size());
  for (size_t i = 0; i < q.size(); ++i)
    ASSERT_EQ(q[i], expected[i]) << "byte " << i << " (block " << i / kQ8KBytes << ", offset " << i % kQ8KBytes
                                 << ")";

  std::vector<float> deq(static_cast<size_t>(cols));
  dequantize_activation_row(ActivationType::Q8_K, q.data(), deq.data(), cols);
  for (int64_t b = 0; b < cols / kQK; ++b) {
    const uint8_t* yb = q.data() + b * kQ8KBytes;
    float d;
    std::memcpy(&d, yb, 4);
    const int8_t* qs = reinterpret_cast<const int8_t*>(yb + 4);
    float amax = 0;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[b * kQK + j]));
    bool extreme_seen = false;
    for (int j = 0; j < kQK; ++j) {
      const float v = x[b * kQK + j];
      ASSERT_GE(qs[j], -127);
      ASSERT_EQ(deq[b * kQK + j], d * qs[j]);
      // Half a step, plus the float rounding of iscale * x.
      ASSERT_LE(std::fabs(v - d * qs[j]), std::fabs(d) * 0.5f * (1 + 1e-5f) + 1e-6f * amax) << b << " " << j;
      if (!extreme_seen && std::fabs(v) == amax && amax > 0) {
        // The first value of largest magnitude is exactly -127 steps.
        ASSERT_EQ(qs[j], -127) << b << " " << j;
        extreme_seen = true;
      }
    }
    for (int k = 0; k < 16; ++k) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) sum += qs[16 * k + l];
      int16_t bsum;
      std::memcpy(&bsum, yb + 4 + kQK + 2 * k, 2);
      ASSERT_EQ(bsum, sum) << "block " << b << " bsum " << k;
    }
  }
  // The all-zero block: d, quants and sums all zero.
  for (int64_t i = kQ8KBytes; i < 2 * kQ8KBytes; ++i) ASSERT_EQ(q[i], 0) << i;
}

TEST(QuantK, Q8KQuantisationOfManyRandomRows) {
  // Many scales (so the rounding of iscale * x is exercised over many exponents) against the
  // reference, byte for byte.
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> expo(-20.0f, 20.0f);
  for (int t = 0; t < 200; ++t) {
    std::vector<float> x = activation_rows(1, 2 * kQK, 100 + t);
    const float scale = std::exp2(expo(gen));
    for (auto& v : x) v *= scale;
    std::vector<uint8_t> q(2 * kQ8KBytes);
    quantize_activation_row(ActivationType::Q8_K, x.data(), q.data(), 2 * kQK);
    ASSERT_EQ(q, reference_q8k(x)) << "row " << t;
  }
}

// Random rows of `type`: random bytes for quants and packed scales, then modest normal
// float16 scales (dmin of either sign) so every product stays finite.
std::vector<uint8_t> random_k_rows(QuantType type, int64_t rows, int64_t stride, int64_t cols, uint32_t seed) {
  std::mt19937 gen(seed);
  // Exponent 0: a subnormal scale, which the vector kernels' F16C conversion must read as the
  // portable decoder does.
  std::uniform_int_distribution<int> byte(0, 255), exponent(0, 13), mantissa(0, 1023), sign(0, 1);
  std::vector<uint8_t> w(static_cast<size_t>(rows * stride));
  for (auto& b : w) b = static_cast<uint8_t>(byte(gen));
  const QuantTraits& t = quant_traits(type);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols / kQK; ++b) {
      uint8_t* p = w.data() + r * stride + b * t.block_bytes;
      const uint16_t d = half_bits(sign(gen) ? 1 : -1, exponent(gen), mantissa(gen));
      const uint16_t dmin = half_bits(sign(gen) ? 1 : -1, exponent(gen), mantissa(gen));
      put_half(p + d_offset(type), d);
      if (dmin_offset(type) >= 0) put_half(p + dmin_offset(type), dmin);
    }
  return w;
}

struct Shape {
  int64_t rows, cols, row_begin, row_end;
};

void check_kernel(const char* which, DotKernel kernel, QuantType type, const Shape& s, int inputs, uint32_t seed) {
  const int64_t row_bytes = quant_row_bytes(type, s.cols);
  const int64_t w_stride = row_bytes + 48;  // rows with a gap between them
  const std::vector<uint8_t> w = random_k_rows(type, s.rows, w_stride, s.cols, seed);
  const int64_t act_bytes = activation_row_bytes(ActivationType::Q8_K, s.cols);
  const int64_t x_stride = act_bytes + 37;  // and activation rows at odd offsets
  std::vector<uint8_t> xq(static_cast<size_t>(x_stride * inputs + 1));
  uint8_t* x = xq.data() + 1;
  const std::vector<float> xf = activation_rows(inputs, s.cols, seed + 1);
  std::vector<float> xd(static_cast<size_t>(inputs * s.cols));
  for (int i = 0; i < inputs; ++i) {
    quantize_activation_row(ActivationType::Q8_K, xf.data() + i * s.cols, x + i * x_stride, s.cols);
    dequantize_activation_row(ActivationType::Q8_K, x + i * x_stride, xd.data() + i * s.cols, s.cols);
  }
  const int64_t ldy = s.rows + 5;
  const float sentinel = -12345.0f;
  std::vector<float> y(static_cast<size_t>(ldy * inputs), sentinel);
  kernel(w.data(), w_stride, x, x_stride, inputs, y.data(), ldy, s.row_begin, s.row_end, s.cols);

  std::vector<float> wf(static_cast<size_t>(s.cols));
  for (int64_t r = 0; r < s.rows; ++r) {
    const bool in_range = r >= s.row_begin && r < s.row_end;
    if (in_range) dequantize_row(type, w.data() + r * w_stride, wf.data(), s.cols);
    for (int i = 0; i < inputs; ++i) {
      const float got = y[i * ldy + r];
      if (!in_range) {
        ASSERT_EQ(got, sentinel) << which << " wrote row " << r << " outside its range";
        continue;
      }
      double ref = 0, mag = 0;
      for (int64_t c = 0; c < s.cols; ++c) {
        const double p = static_cast<double>(wf[c]) * xd[i * s.cols + c];
        ref += p;
        mag += std::fabs(p);
      }
      ASSERT_NEAR(got, ref, 1e-5 * mag + 1e-6)
          << which << " " << quant_name(type) << " cols " << s.cols << " row " << r << " input " << i << " of "
          << inputs;
    }
  }
  // Nothing past the inputs' rows of y either.
  for (int64_t r = s.rows; r < ldy; ++r)
    for (int i = 0; i < inputs; ++i) ASSERT_EQ(y[i * ldy + r], sentinel);
}

TEST(QuantK, DotKernelsMatchFloat64Reference) {
  const Shape shapes[] = {{5, 256, 0, 5}, {13, 512, 3, 11}, {9, 4096, 1, 9}, {6, 1280, 5, 6}, {4, 768, 2, 2},
                          {3, 1536, 0, 3}};
  uint32_t seed = 1;
  for (QuantType type : kKTypes)
    for (const Shape& s : shapes)
      for (int inputs = 1; inputs <= kMaxKernelInputs; ++inputs) {
        check_kernel("dot_kernel", dot_kernel(type), type, s, inputs, seed);
        check_kernel("portable_dot_kernel", portable_dot_kernel(type), type, s, inputs, seed);
        ++seed;
      }
}

TEST(QuantK, DotKernelsAgreeOnExtremeQuants) {
  // Every quant and scale at its largest (or most negative) with activations at +-127: the
  // 16- and 32-bit integer sums of the vector kernels must not saturate or wrap.
  const int64_t cols = 1024;
  for (QuantType type : kKTypes) {
    const int64_t row_bytes = quant_row_bytes(type, cols);
    const QuantTraits& t = quant_traits(type);
    std::vector<uint8_t> w(static_cast<size_t>(2 * row_bytes), 0xff);
    for (int64_t b = 0; b < 2 * cols / kQK; ++b) {
      uint8_t* p = w.data() + b * t.block_bytes;
      if (type == QuantType::Q6_K) {
        // Scales -128 on the first row (quants 63 -> +31 steps), 127 on the second.
        std::memset(p + 192, b < cols / kQK ? 0x80 : 0x7f, 16);
      } else if (b >= cols / kQK && (type == QuantType::Q3_K || type == QuantType::IQ4_XS)) {
        // The second row all zero bits: scales -32 times the most negative quant (-4, or
        // the grid's -127).
        std::memset(p, 0, static_cast<size_t>(t.block_bytes));
      }
      put_half(p + d_offset(type), half_bits(1, 15, 0));
      if (dmin_offset(type) >= 0) put_half(p + dmin_offset(type), half_bits(-1, 15, 0));
    }
    std::vector<float> xf(static_cast<size_t>(2 * cols));
    for (int64_t c = 0; c < cols; ++c) xf[c] = 1.0f, xf[cols + c] = (c % 2) ? 1.0f : -1.0f;
    const int64_t act = activation_row_bytes(ActivationType::Q8_K, cols);
    std::vector<uint8_t> xq(static_cast<size_t>(2 * act));
    std::vector<float> xd(static_cast<size_t>(2 * cols));
    for (int i = 0; i < 2; ++i) {
      quantize_activation_row(ActivationType::Q8_K, xf.data() + i * cols, xq.data() + i * act, cols);
      dequantize_activation_row(ActivationType::Q8_K, xq.data() + i * act, xd.data() + i * cols, cols);
    }
    std::vector<float> wf(static_cast<size_t>(cols));
    for (DotKernel kernel : {dot_kernel(type), portable_dot_kernel(type)}) {
      float y[4];
      kernel(w.data(), row_bytes, xq.data(), act, 2, y, 2, 0, 2, cols);
      for (int r = 0; r < 2; ++r) {
        dequantize_row(type, w.data() + r * row_bytes, wf.data(), cols);
        for (int i = 0; i < 2; ++i) {
          double ref = 0, mag = 0;
          for (int64_t c = 0; c < cols; ++c) {
            ref += static_cast<double>(wf[c]) * xd[i * cols + c];
            mag += std::fabs(static_cast<double>(wf[c]) * xd[i * cols + c]);
          }
          EXPECT_NEAR(y[i * 2 + r], ref, 1e-5 * mag + 1e-6) << quant_name(type) << " row " << r << " input " << i;
        }
      }
    }
  }
}

// Q4_K's and Q5_K's VNNI kernels, where the processor runs them, against the AVX2 ones on the
// same rows: vpdpwssd forms the same integers as madd + add, so every result is the same float,
// bit for bit, for every input count and row range; and dot_kernel hands them out there. Rows
// at their extremes too, where a narrower sum would saturate.
TEST(QuantK, VnniKernelsEqualTheAvx2OnesBitForBit) {
  if (!quant_impl::use_avx512_vnni())
    GTEST_SKIP() << "the VNNI kernels do not run here: avx512-vnni "
                 << probe_cpu_feature(CpuFeature::kAvx512Vnni).describe() << ", KVPIPE_CPU_KERNELS "
                 << (std::getenv("KVPIPE_CPU_KERNELS") ? std::getenv("KVPIPE_CPU_KERNELS") : "unset");
  for (const QuantType type : kKTypes) {
    const DotKernel vnni = quant_impl::k_vnni_kernel(type);
    if (type != QuantType::Q4_K && type != QuantType::Q5_K) {
      EXPECT_EQ(vnni, nullptr) << quant_name(type);
      continue;
    }
    ASSERT_NE(vnni, nullptr) << quant_name(type);
    EXPECT_EQ(dot_kernel(type), vnni) << quant_name(type);
    const DotKernel avx2 = quant_impl::k_avx2_kernel(type);
    const int64_t cols = 1536, rows = 9;
    const int64_t row_bytes = quant_row_bytes(type, cols);
    std::vector<uint8_t> w = random_k_rows(type, rows, row_bytes, cols, 700 + static_cast<uint32_t>(type));
    // Row 0: every quant, scale and min at its top (d and dmin kept: the bytes after them).
    const int64_t block_bytes = quant_traits(type).block_bytes;
    for (int64_t b = 0; b < cols / kQK; ++b) std::memset(w.data() + b * block_bytes + 4, 0xff, block_bytes - 4);
    const int64_t act = activation_row_bytes(ActivationType::Q8_K, cols);
    std::vector<float> xf = activation_rows(kMaxKernelInputs, cols, 23);
    for (int64_t c = 0; c < cols; ++c) xf[c] = -1.0f;  // input 0: every byte at -127
    std::vector<uint8_t> xq(static_cast<size_t>(act * kMaxKernelInputs));
    for (int i = 0; i < kMaxKernelInputs; ++i)
      quantize_activation_row(ActivationType::Q8_K, xf.data() + i * cols, xq.data() + i * act, cols);
    for (int inputs = 1; inputs <= kMaxKernelInputs; ++inputs)
      for (const int64_t begin : {int64_t{0}, int64_t{3}}) {
        std::vector<float> a(static_cast<size_t>(rows * inputs), -1.0f), b(a.size(), -1.0f);
        vnni(w.data(), row_bytes, xq.data(), act, inputs, a.data(), rows, begin, rows, cols);
        avx2(w.data(), row_bytes, xq.data(), act, inputs, b.data(), rows, begin, rows, cols);
        ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)))
            << quant_name(type) << " inputs=" << inputs << " rows from " << begin;
        EXPECT_TRUE(std::isfinite(a[begin])) << quant_name(type);
      }
  }
}

TEST(QuantK, VectorKernelsAgreeWithPortable) {
  // Both kernels sum the same exact integer products and differ only in the float32 rounding
  // of each super-block's scaled sums.
  if (std::string(dot_kernel_isa()) == "portable") GTEST_SKIP() << "no vector kernels on this processor";
  const int64_t cols = 2048, rows = 6;
  for (QuantType type : kKTypes) {
    const int64_t row_bytes = quant_row_bytes(type, cols);
    const std::vector<uint8_t> w = random_k_rows(type, rows, row_bytes, cols, 300 + static_cast<uint32_t>(type));
    const int64_t act = activation_row_bytes(ActivationType::Q8_K, cols);
    const std::vector<float> xf = activation_rows(kMaxKernelInputs, cols, 17);
    std::vector<uint8_t> xq(static_cast<size_t>(act * kMaxKernelInputs));
    std::vector<float> xd(static_cast<size_t>(cols * kMaxKernelInputs)), wf(static_cast<size_t>(cols));
    for (int i = 0; i < kMaxKernelInputs; ++i) {
      quantize_activation_row(ActivationType::Q8_K, xf.data() + i * cols, xq.data() + i * act, cols);
      dequantize_activation_row(ActivationType::Q8_K, xq.data() + i * act, xd.data() + i * cols, cols);
    }
    for (int inputs = 1; inputs <= kMaxKernelInputs; ++inputs) {
      std::vector<float> vec(static_cast<size_t>(rows * inputs)), port(vec.size());
      dot_kernel(type)(w.data(), row_bytes, xq.data(), act, inputs, vec.data(), rows, 0, rows, cols);
      portable_dot_kernel(type)(w.data(), row_bytes, xq.data(), act, inputs, port.data(), rows, 0, rows, cols);
      for (int64_t r = 0; r < rows; ++r) {
        dequantize_row(type, w.data() + r * row_bytes, wf.data(), cols);
        for (int i = 0; i < inputs; ++i) {
          double mag = 0;
          for (int64_t c = 0; c < cols; ++c) mag += std::fabs(static_cast<double>(wf[c]) * xd[i * cols + c]);
          ASSERT_NEAR(vec[i * rows + r], port[i * rows + r], 1e-5 * mag + 1e-6)
              << quant_name(type) << " row " << r << " input " << i << " of " << inputs;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvpipe
