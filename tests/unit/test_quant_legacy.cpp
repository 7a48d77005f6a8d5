// The float and 32-value block types (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) of
// quant_types.h: both kernel sets against a float64 reference of the dequantised rows and
// against each other, the Q8_0 / Q8_1 activation
// quantiser's rounding and error, dequantize_row on hand-built blocks, the fp16 helpers, and
// the float types' decoding and Q8_0 quantisation against the gguf package's
// (tests/peer/gguf_legacy_reference.py; the block types' decoding is in
// test_quant_gguf_reference.cpp).
#include "engine/kernels/cpu/cpu_features.h"
#include "engine/kernels/cpu/half_convert.h"
#include "engine/kernels/cpu/quant_impl.h"
#include "engine/kernels/cpu/quant_types.h"
#include "tests/support/command.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvpipe {
namespace {

using quant_impl::fp16_to_fp32;
using quant_impl::fp32_to_fp16;

const QuantType kLegacyTypes[] = {QuantType::F32,  QuantType::F16,  QuantType::BF16,
                                  QuantType::Q8_0, QuantType::Q4_0, QuantType::Q4_1,
                                  QuantType::Q5_0, QuantType::Q5_1, QuantType::IQ4_NL};

// The types with an offset m per block (and Q8_1 activations that carry their sums).
bool has_min(QuantType t) { return t == QuantType::Q4_1 || t == QuantType::Q5_1; }

bool is_block_type(QuantType t) {
  return quant_traits(t).block_values == 32;
}

uint16_t u16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

void put_u16(uint8_t* p, uint16_t v) {
  std::memcpy(p, &v, 2);
}

uint32_t fp32_to_bits_for_test(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// fp16 bits of a random sign times 2^[lo, hi] with a random mantissa, built from bits so the
// data does not lean on the converter under test.
uint16_t random_half(std::mt19937& gen, int lo_exp, int hi_exp, bool any_sign) {
  std::uniform_int_distribution<int> exp(lo_exp + 15, hi_exp + 15), mant(0, 1023), coin(0, 1);
  const int sign = any_sign && coin(gen) ? 0x8000 : 0;
  return static_cast<uint16_t>(sign | (exp(gen) << 10) | mant(gen));
}

// `rows` random rows of `type`, each `stride` bytes apart (stride >= the row's bytes; the gap
// is filled with junk a kernel must not read as weights).
std::vector<uint8_t> random_rows(QuantType type, int64_t rows, int64_t cols, int64_t stride,
                                 uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint8_t> w(static_cast<size_t>(rows * stride));
  for (auto& b : w) b = static_cast<uint8_t>(byte(gen));
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* row = w.data() + r * stride;
    switch (type) {
      case QuantType::F32:
        for (int64_t c = 0; c < cols; ++c) {
          const float v = normal(gen);
          std::memcpy(row + 4 * c, &v, 4);
        }
        break;
      case QuantType::F16:
        // Any finite half, subnormals and 65504 included.
        for (int64_t c = 0; c < cols; ++c) {
          uint16_t h;
          do h = static_cast<uint16_t>(byte(gen) | (byte(gen) << 8));
          while (((h >> 10) & 0x1f) == 0x1f);
          put_u16(row + 2 * c, h);
        }
        break;
      case QuantType::BF16:
        for (int64_t c = 0; c < cols; ++c) {
          std::uniform_int_distribution<int> exp(127 - 30, 127 + 30);
          const int e = c % 17 == 0 ? 0 : exp(gen);  // some zeros and bfloat16 subnormals
          put_u16(row + 2 * c,
                  static_cast<uint16_t>((byte(gen) & 1) << 15 | e << 7 | (byte(gen) & 0x7f)));
        }
        break;
      default: {
        const QuantTraits& t = quant_traits(type);
        for (int64_t b = 0; b < cols / 32; ++b) {
          uint8_t* blk = row + b * t.block_bytes;
          put_u16(blk, random_half(gen, -9, -4, true));
          if (has_min(type)) put_u16(blk + 2, random_half(gen, -8, -2, true));
        }
      }
    }
  }
  return w;
}

// Activation values: normal, with blocks of very different scales and one all-zero block.
std::vector<float> random_activations(int64_t cols, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(cols));
  for (int64_t c = 0; c < cols; ++c) {
    const int64_t block = c / 32;
    const float scale = block % 5 == 1 ? 1e-3f : block % 5 == 3 ? 40.0f : 1.0f;
    x[c] = block == 2 ? 0.0f : scale * normal(gen);
  }
  return x;
}

struct Reference {
  double value = 0;
  double magnitude = 0;  // sum of |terms| the kernel adds, for the rounding tolerance
};

// W[r] . X[j] in float64 from dequantize_row and dequantize_activation_row. For Q4_1 and Q5_1
// the kernels use, as ggml does, the activation block's stored fp16 sum s for the m_w term; the
// reference swaps that term in so that only float32 rounding separates it from the kernels.
Reference reference_dot(QuantType type, const uint8_t* wrow, const uint8_t* xrow, int64_t cols) {
  const ActivationType at = quant_traits(type).activation;
  std::vector<float> wf(static_cast<size_t>(cols)), xf(static_cast<size_t>(cols));
  dequantize_row(type, wrow, wf.data(), cols);
  dequantize_activation_row(at, xrow, xf.data(), cols);
  Reference ref;
  if (!has_min(type)) {
    for (int64_t c = 0; c < cols; ++c) {
      ref.value += static_cast<double>(wf[c]) * xf[c];
      ref.magnitude += std::abs(static_cast<double>(wf[c]) * xf[c]);
    }
    return ref;
  }
  for (int64_t b = 0; b < cols / 32; ++b) {
    const uint8_t* wb = wrow + b * quant_traits(type).block_bytes;
    const uint8_t* xb = xrow + b * 36;
    const double m = fp16_to_fp32(u16_at(wb + 2)), s = fp16_to_fp32(u16_at(xb + 2));
    for (int64_t c = b * 32; c < b * 32 + 32; ++c) {
      const double dq = static_cast<double>(wf[c]) - m;  // exact: d * q in float32
      ref.value += dq * xf[c];
      ref.magnitude += std::abs(dq * xf[c]);
    }
    ref.value += m * s;
    ref.magnitude += std::abs(m * s);
  }
  return ref;
}

struct KernelCase {
  QuantType type;
  int64_t cols, rows, row_begin, row_end;
};

// Runs `kernel` on shifted strides and checks every output against the reference and that
// nothing outside [row_begin, row_end) x inputs was written.
void check_kernel(DotKernel kernel, const char* which, const KernelCase& k, int inputs,
                  uint32_t seed) {
  const QuantType type = k.type;
  const ActivationType at = quant_traits(type).activation;
  const int64_t row_bytes = quant_row_bytes(type, k.cols);
  const int64_t w_stride = row_bytes + 6;
  const std::vector<uint8_t> w = random_rows(type, k.rows, k.cols, w_stride, seed);
  const int64_t x_stride = activation_row_bytes(at, k.cols) + 12;
  std::vector<uint8_t> x(static_cast<size_t>(x_stride * inputs + 4), 0xAB);
  for (int j = 0; j < inputs; ++j) {
    const std::vector<float> xv = random_activations(k.cols, seed * 31 + j);
    quantize_activation_row(at, xv.data(), x.data() + 4 + j * x_stride, k.cols);
  }
  const uint8_t* xp = x.data() + 4;  // off a 4-byte boundary's natural alignment for the blocks
  const int64_t ldy = k.rows + 5;
  const float sentinel = -12345.0f;
  std::vector<float> y(static_cast<size_t>(ldy * kMaxKernelInputs), sentinel);
  kernel(w.data(), w_stride, xp, x_stride, inputs, y.data(), ldy, k.row_begin, k.row_end, k.cols);
  for (int j = 0; j < kMaxKernelInputs; ++j) {
    for (int64_t r = 0; r < ldy; ++r) {
      const float got = y[j * ldy + r];
      if (j >= inputs || r < k.row_begin || r >= k.row_end) {
        ASSERT_EQ(got, sentinel) << which << " wrote y[" << j << ", " << r << "]";
        continue;
      }
      const Reference ref = reference_dot(type, w.data() + r * w_stride, xp + j * x_stride, k.cols);
      ASSERT_NEAR(got, ref.value, 1e-5 * ref.magnitude + 1e-12)
          << which << " " << quant_name(type) << " cols=" << k.cols << " inputs=" << inputs
          << " row=" << r << " input=" << j;
    }
  }
}

std::vector<KernelCase> kernel_cases() {
  std::vector<KernelCase> cases;
  for (const QuantType t : kLegacyTypes) {
    std::vector<int64_t> cols = {32, 64, 256, 576, 4096};
    if (!is_block_type(t)) cols.insert(cols.end(), {1, 7, 37, 100, 4099});
    for (const int64_t c : cols) {
      cases.push_back({t, c, 13, 0, 13});
      cases.push_back({t, c, 11, 3, 10});
      cases.push_back({t, c, 4, 3, 4});
    }
  }
  return cases;
}

TEST(QuantLegacy, KernelsMatchFloat64ReferenceOnEveryShapeAndInputCount) {
  uint32_t seed = 1;
  for (const KernelCase& k : kernel_cases()) {
    for (int inputs = 1; inputs <= kMaxKernelInputs; ++inputs) {
      ++seed;
      check_kernel(dot_kernel(k.type), dot_kernel_isa(), k, inputs, seed);
      check_kernel(portable_dot_kernel(k.type), "portable", k, inputs, seed);
      if (HasFatalFailure()) return;
    }
  }
}

// The float types' AVX-512 kernels, on the processors that run them (the AVX-512 probe of
// cpu_features.h passed), against the float64 reference on every shape and input count, and
// what dot_kernel hands out there; skipped, with the probe's word, elsewhere.
TEST(QuantLegacy, FloatAvx512KernelsMatchFloat64ReferenceWhereTheProcessorRunsThem) {
  if (!quant_impl::use_avx512())
    GTEST_SKIP() << "the float AVX-512 kernels do not run here: avx512 "
                 << probe_cpu_feature(CpuFeature::kAvx512).describe() << ", KVPIPE_CPU_KERNELS "
                 << (std::getenv("KVPIPE_CPU_KERNELS") ? std::getenv("KVPIPE_CPU_KERNELS") : "unset");
  EXPECT_STREQ(float_kernel_isa(), "avx512");
  uint32_t seed = 500;
  int checked = 0;
  for (const KernelCase& k : kernel_cases()) {
    if (is_block_type(k.type)) continue;
    const DotKernel avx512 = quant_impl::float_avx512_kernel(k.type);
    ASSERT_NE(avx512, nullptr) << quant_name(k.type);
    EXPECT_EQ(dot_kernel(k.type), avx512) << quant_name(k.type);
    for (int inputs = 1; inputs <= kMaxKernelInputs; ++inputs, ++checked) {
      check_kernel(avx512, "avx512", k, inputs, ++seed);
      if (HasFatalFailure()) return;
    }
  }
  EXPECT_GT(checked, 0);
  EXPECT_EQ(quant_impl::float_avx512_kernel(QuantType::Q8_0), nullptr);
}

// The block types' VNNI kernels, where the processor runs them, against the AVX2 ones on the
// same rows: vpdpbusd forms the same integers as maddubs + madd, so every result is the same
// float, bit for bit, for every shape and input count; and dot_kernel hands them out there.
TEST(QuantLegacy, VnniBlockKernelsEqualTheAvx2OnesBitForBit) {
  if (!quant_impl::use_avx512_vnni())
    GTEST_SKIP() << "the VNNI block kernels do not run here: avx512-vnni "
                 << probe_cpu_feature(CpuFeature::kAvx512Vnni).describe() << ", KVPIPE_CPU_KERNELS "
                 << (std::getenv("KVPIPE_CPU_KERNELS") ? std::getenv("KVPIPE_CPU_KERNELS") : "unset");
  EXPECT_STREQ(block_kernel_isa(), "avx512-vnni");
  int checked = 0;
  uint32_t seed = 900;
  for (const QuantType type : kLegacyTypes) {
    if (!is_block_type(type)) {
      EXPECT_EQ(quant_impl::legacy_vnni_kernel(type), nullptr) << quant_name(type);
      continue;
    }
    const DotKernel vnni = quant_impl::legacy_vnni_kernel(type);
    const DotKernel avx2 = quant_impl::legacy_avx2_kernel(type);
    ASSERT_NE(vnni, nullptr) << quant_name(type);
    EXPECT_EQ(dot_kernel(type), vnni) << quant_name(type);
    const ActivationType at = quant_traits(type).activation;
    for (const int64_t cols : {int64_t{32}, int64_t{64}, int64_t{288}, int64_t{576}, int64_t{4096}}) {
      const int64_t rows = 11, row_bytes = quant_row_bytes(type, cols);
      const std::vector<uint8_t> w = random_rows(type, rows, cols, row_bytes, ++seed);
      const int64_t x_stride = activation_row_bytes(at, cols);
      std::vector<uint8_t> x(static_cast<size_t>(x_stride * kMaxKernelInputs));
      for (int j = 0; j < kMaxKernelInputs; ++j)
        quantize_activation_row(at, random_activations(cols, ++seed).data(), x.data() + j * x_stride, cols);
      for (int inputs = 1; inputs <= kMaxKernelInputs; ++inputs, ++checked) {
        std::vector<float> a(static_cast<size_t>(rows * inputs)), b(a.size());
        vnni(w.data(), row_bytes, x.data(), x_stride, inputs, a.data(), rows, 2, rows, cols);
        avx2(w.data(), row_bytes, x.data(), x_stride, inputs, b.data(), rows, 2, rows, cols);
        for (int j = 0; j < inputs; ++j)
          for (int64_t r = 2; r < rows; ++r)
            ASSERT_EQ(a[j * rows + r], b[j * rows + r])
                << quant_name(type) << " cols=" << cols << " inputs=" << inputs << " row=" << r << " input=" << j;
      }
    }
  }
  EXPECT_GT(checked, 0);
}

// quant_matmul hands a row to groups of different sizes; its result must not depend on that.
TEST(QuantLegacy, RowResultsDoNotDependOnInputCount) {
  for (const QuantType type : kLegacyTypes) {
    for (const int64_t cols : {int64_t{96}, int64_t{4096}}) {
      const ActivationType at = quant_traits(type).activation;
      const int64_t row_bytes = quant_row_bytes(type, cols), rows = 9;
      const std::vector<uint8_t> w = random_rows(type, rows, cols, row_bytes, 5);
      const int64_t x_stride = activation_row_bytes(at, cols);
      std::vector<uint8_t> x(static_cast<size_t>(x_stride * kMaxKernelInputs));
      for (int j = 0; j < kMaxKernelInputs; ++j)
        quantize_activation_row(at, random_activations(cols, 70 + j).data(),
                                x.data() + j * x_stride, cols);
      for (const DotKernel kernel : {dot_kernel(type), portable_dot_kernel(type)}) {
        std::vector<float> together(static_cast<size_t>(rows * kMaxKernelInputs));
        for (int inputs = 2; inputs <= kMaxKernelInputs; ++inputs) {
          kernel(w.data(), row_bytes, x.data(), x_stride, inputs, together.data(), rows, 0, rows,
                 cols);
          for (int j = 0; j < inputs; ++j) {
            std::vector<float> alone(static_cast<size_t>(rows));
            kernel(w.data(), row_bytes, x.data() + j * x_stride, x_stride, 1, alone.data(), rows, 0,
                   rows, cols);
            for (int64_t r = 0; r < rows; ++r)
              ASSERT_EQ(alone[r], together[j * rows + r])
                  << quant_name(type) << " inputs=" << inputs << " j=" << j;
          }
        }
      }
    }
  }
}

// The vector kernels against the portable ones on the same rows: both sum exact integer
// products and differ only in float32 rounding of the scaled block sums, so they agree to a
// few ulps of the sum of |terms|, far inside any layout or scale mistake.
TEST(QuantLegacy, VectorKernelsAgreeWithPortable) {
  if (std::string(dot_kernel_isa()) == "portable") GTEST_SKIP() << "no vector kernels on this processor";
  for (const QuantType type : kLegacyTypes) {
    const ActivationType at = quant_traits(type).activation;
    const int64_t cols = 576, rows = 7, row_bytes = quant_row_bytes(type, cols);
    const std::vector<uint8_t> w = random_rows(type, rows, cols, row_bytes, 91);
    const int64_t x_stride = activation_row_bytes(at, cols);
    std::vector<uint8_t> x(static_cast<size_t>(x_stride * kMaxKernelInputs));
    for (int j = 0; j < kMaxKernelInputs; ++j)
      quantize_activation_row(at, random_activations(cols, 40 + j).data(), x.data() + j * x_stride, cols);
    for (int inputs = 1; inputs <= kMaxKernelInputs; ++inputs) {
      std::vector<float> vec(static_cast<size_t>(rows * inputs)), port(vec.size());
      dot_kernel(type)(w.data(), row_bytes, x.data(), x_stride, inputs, vec.data(), rows, 0, rows, cols);
      portable_dot_kernel(type)(w.data(), row_bytes, x.data(), x_stride, inputs, port.data(), rows, 0, rows, cols);
      for (int j = 0; j < inputs; ++j)
        for (int64_t r = 0; r < rows; ++r) {
          const Reference ref = reference_dot(type, w.data() + r * row_bytes, x.data() + j * x_stride, cols);
          ASSERT_NEAR(vec[j * rows + r], port[j * rows + r], 1e-5 * ref.magnitude + 1e-12)
              << quant_name(type) << " inputs=" << inputs << " row=" << r << " input=" << j;
        }
    }
  }
}

// ---- activation quantiser --------------------------------------------------------------

// ggml's quantize_row_q8_0_ref written out plainly: the bytes the quantiser must produce.
void expected_q8_block(const float* x, int8_t* q, float* d_out) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(std::roundf(x[i] * id));
  *d_out = d;
}

std::vector<float> quantiser_inputs() {
  std::vector<float> x = random_activations(32 * 40, 9);
  std::mt19937 gen(4);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  // Ties: with amax = 127 the products are the values themselves, so k + 0.5 must round away
  // from zero (roundf), not to even; 0.49999997 must give 0.
  float* tie = x.data() + 32 * 3;
  for (int i = 0; i < 32; ++i)
    tie[i] = (i % 2 ? -1.0f : 1.0f) * (static_cast<float>(i) * 4.0f + 0.5f);
  tie[31] = 127.0f;
  tie[30] = 0.49999997f;
  tie[29] = -126.5f;
  // Large, tiny and mixed magnitudes in one block each. (Q8_1 stores d * sum q as fp16, as
  // ggml does, so a block whose sum passes 65504 would store inf: kept below that here.)
  for (int i = 0; i < 32; ++i) x[32 * 5 + i] = 2e3f * uni(gen);
  for (int i = 0; i < 32; ++i) x[32 * 6 + i] = 1e-6f * uni(gen);
  for (int i = 0; i < 32; ++i) x[32 * 7 + i] = i == 7 ? -900.0f : 1e-3f * uni(gen);
  for (int i = 0; i < 32; ++i) x[32 * 8 + i] = -0.0f;
  return x;
}

TEST(QuantLegacy, ActivationQuantiserRoundsAsGgmlReference) {
  const std::vector<float> x = quantiser_inputs();
  const int64_t cols = static_cast<int64_t>(x.size());
  for (const ActivationType at : {ActivationType::Q8_0, ActivationType::Q8_1}) {
    const bool q8_1 = at == ActivationType::Q8_1;
    const int64_t block_bytes = q8_1 ? 36 : 34, qs = q8_1 ? 4 : 2;
    std::vector<uint8_t> out(static_cast<size_t>(activation_row_bytes(at, cols)));
    ASSERT_EQ(static_cast<int64_t>(out.size()), cols / 32 * block_bytes);
    quantize_activation_row(at, x.data(), out.data(), cols);
    for (int64_t b = 0; b < cols / 32; ++b) {
      const uint8_t* blk = out.data() + b * block_bytes;
      int8_t q[32];
      float d;
      expected_q8_block(x.data() + b * 32, q, &d);
      int sum = 0;
      for (int i = 0; i < 32; ++i) {
        ASSERT_EQ(static_cast<int8_t>(blk[qs + i]), q[i]) << "block " << b << " value " << i;
        sum += q[i];
      }
      // d stored as the nearest fp16 of amax / 127.
      const double d16 = fp16_to_fp32(u16_at(blk));
      ASSERT_LE(std::abs(d16 - d),
                std::ldexp(std::abs(static_cast<double>(d)), -11) + std::ldexp(1.0, -25));
      if (q8_1) {
        const double s = fp16_to_fp32(u16_at(blk + 2)), want = static_cast<double>(sum) * d;
        ASSERT_LE(std::abs(s - want), std::ldexp(std::abs(want), -11) + std::ldexp(1.0, -25))
            << "block " << b;
      }
    }
    // The tie block checked by value too, against roundf's halves away from zero.
    const uint8_t* tie = out.data() + 3 * block_bytes + qs;
    EXPECT_EQ(static_cast<int8_t>(tie[0]), 1);      // 0.5
    EXPECT_EQ(static_cast<int8_t>(tie[1]), -5);     // -4.5
    EXPECT_EQ(static_cast<int8_t>(tie[29]), -127);  // -126.5
    EXPECT_EQ(static_cast<int8_t>(tie[30]), 0);     // 0.49999997
    EXPECT_EQ(static_cast<int8_t>(tie[31]), 127);
  }
}

TEST(QuantLegacy, ActivationRoundTripErrorIsHalfAStep) {
  const std::vector<float> x = quantiser_inputs();
  const int64_t cols = static_cast<int64_t>(x.size());
  for (const ActivationType at : {ActivationType::Q8_0, ActivationType::Q8_1}) {
    std::vector<uint8_t> q(static_cast<size_t>(activation_row_bytes(at, cols)));
    std::vector<float> back(static_cast<size_t>(cols));
    quantize_activation_row(at, x.data(), q.data(), cols);
    dequantize_activation_row(at, q.data(), back.data(), cols);
    for (int64_t b = 0; b < cols / 32; ++b) {
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
      const double d = amax / 127.0;
      const double d16 =
          fp16_to_fp32(u16_at(q.data() + b * (at == ActivationType::Q8_1 ? 36 : 34)));
      // Half a step of the exact scale, plus what the stored fp16 scale is off by times
      // |q| <= 127 (2^-11 relative for normal halves; tiny blocks lose more to fp16
      // subnormals, as in ggml) and float32 rounding of x / d.
      ASSERT_LE(std::abs(d16 - d), std::max(std::ldexp(d, -11), std::ldexp(1.0, -25)) * (1 + 1e-6));
      const double bound = 0.5 * d + 127.0 * std::abs(d16 - d) + 1e-6 * d + 1e-30;
      for (int i = 0; i < 32; ++i) {
        const int64_t c = b * 32 + i;
        ASSERT_LE(std::abs(static_cast<double>(x[c]) - back[c]), bound) << "column " << c;
      }
    }
  }
}

TEST(QuantLegacy, ZeroBlockQuantisesToZeroScaleAndValues) {
  std::vector<float> x(64, 0.0f);
  x[33] = -0.0f;
  x[40] = 2.0f;  // second block non-zero
  for (const ActivationType at : {ActivationType::Q8_0, ActivationType::Q8_1}) {
    const bool q8_1 = at == ActivationType::Q8_1;
    std::vector<uint8_t> q(static_cast<size_t>(activation_row_bytes(at, 64)), 0x55);
    quantize_activation_row(at, x.data(), q.data(), 64);
    EXPECT_EQ(u16_at(q.data()), 0);
    if (q8_1) {
      EXPECT_EQ(u16_at(q.data() + 2), 0);
    }
    for (int i = 0; i < 32; ++i) EXPECT_EQ(q[(q8_1 ? 4 : 2) + i], 0);
    std::vector<float> back(64, 7.0f);
    dequantize_activation_row(at, q.data(), back.data(), 64);
    for (int i = 0; i < 32; ++i) EXPECT_EQ(back[i], 0.0f);
    EXPECT_EQ(back[40], fp16_to_fp32(fp32_to_fp16(2.0f / 127.0f)) * 127.0f);
  }
  // F32 activations are the values themselves.
  std::vector<float> f(5), g(5);
  for (int i = 0; i < 5; ++i) f[i] = 0.1f * static_cast<float>(i) - 0.2f;
  std::vector<uint8_t> raw(static_cast<size_t>(activation_row_bytes(ActivationType::F32, 5)));
  quantize_activation_row(ActivationType::F32, f.data(), raw.data(), 5);
  dequantize_activation_row(ActivationType::F32, raw.data(), g.data(), 5);
  EXPECT_EQ(f, g);
}

// ---- against the gguf package -------------------------------------------------------------

class QuantLegacyGguf : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = kvpipe::testing::make_scratch_dir();
    const kvpipe::testing::CommandResult probe =
        kvpipe::testing::run_command(std::string(KVPIPE_PYTHON) + " -c 'import gguf, numpy'", dir_);
    ASSERT_EQ(probe.code, 0) << "the gguf package is not importable by " << KVPIPE_PYTHON
                             << ": run scripts/setup.sh --references\n"
                             << probe.err;
  }
  void TearDown() override {
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  // Runs gguf_legacy_reference.py `mode` on `bytes` and returns what it wrote.
  std::string reference(const std::string& mode, const char* type, const void* bytes, size_t size) {
    const std::filesystem::path in = dir_ / "in.bin", out = dir_ / "out.bin";
    std::ofstream(in, std::ios::binary)
        .write(static_cast<const char*>(bytes), static_cast<std::streamsize>(size));
    const kvpipe::testing::CommandResult r =
        kvpipe::testing::run_command(std::string(KVPIPE_PYTHON) + " " + KVPIPE_SOURCE_DIR +
                                         "/tests/peer/gguf_legacy_reference.py " + mode + " " +
                                         type + " " + in.string() + " " + out.string(),
                                     dir_);
    EXPECT_EQ(r.code, 0) << r.err;
    return kvpipe::testing::slurp(out);
  }
  std::filesystem::path dir_;
};

TEST_F(QuantLegacyGguf, FloatRowsDecodeAsGguf) {
  const int64_t cols = 4096;
  for (const QuantType type : {QuantType::F32, QuantType::F16, QuantType::BF16}) {
    // Random bit patterns, every finite one allowed (subnormals and signed zeros included).
    std::mt19937 gen(static_cast<uint32_t>(type) + 40);
    const int64_t bytes = quant_row_bytes(type, cols), elem = quant_traits(type).block_bytes;
    std::vector<uint8_t> raw(static_cast<size_t>(bytes));
    for (int64_t c = 0; c < cols; ++c) {
      uint32_t v;
      do v = gen();
      while (elem == 4                             ? (v & 0x7f800000u) == 0x7f800000u
             : elem == 2 && type == QuantType::F16 ? (v & 0x7c00u) == 0x7c00u
                                                   : (v & 0x7f80u) == 0x7f80u);
      std::memcpy(raw.data() + c * elem, &v, static_cast<size_t>(elem));
    }
    const std::string ref = reference("dequantize", quant_name(type), raw.data(), raw.size());
    ASSERT_EQ(ref.size(), static_cast<size_t>(cols * 4)) << quant_name(type);
    std::vector<float> got(static_cast<size_t>(cols));
    dequantize_row(type, raw.data(), got.data(), cols);
    for (int64_t c = 0; c < cols; ++c) {
      float want;
      std::memcpy(&want, ref.data() + 4 * c, 4);
      ASSERT_EQ(fp32_to_bits_for_test(got[c]), fp32_to_bits_for_test(want))
          << quant_name(type) << " value " << c;
    }
  }
}

TEST_F(QuantLegacyGguf, Q8_0ActivationsQuantiseAsGgufBitForBit) {
  const std::vector<float> x = quantiser_inputs();
  std::vector<uint8_t> got(static_cast<size_t>(
      activation_row_bytes(ActivationType::Q8_0, static_cast<int64_t>(x.size()))));
  quantize_activation_row(ActivationType::Q8_0, x.data(), got.data(),
                          static_cast<int64_t>(x.size()));
  const std::string ref = reference("quantize", "Q8_0", x.data(), x.size() * sizeof(float));
  ASSERT_EQ(ref.size(), got.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(got[i], static_cast<uint8_t>(ref[i])) << "block " << i / 34 << " byte " << i % 34;
}

// ---- dequantize_row on known blocks ------------------------------------------------------

TEST(QuantLegacy, DequantizeHandBuiltBlocks) {
  {
    uint8_t blk[34];
    put_u16(blk, 0x3800);  // d = 0.5
    for (int i = 0; i < 32; ++i)
      blk[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(i * 8 - 128));
    float v[32];
    dequantize_row(QuantType::Q8_0, blk, v, 32);
    for (int i = 0; i < 32; ++i) EXPECT_EQ(v[i], 0.5f * static_cast<float>(i * 8 - 128)) << i;
  }
  {
    uint8_t blk[18];
    put_u16(blk, 0xC000);  // d = -2
    for (int j = 0; j < 16; ++j) blk[2 + j] = static_cast<uint8_t>(j | (15 - j) << 4);
    float v[32];
    dequantize_row(QuantType::Q4_0, blk, v, 32);
    for (int j = 0; j < 16; ++j) {
      EXPECT_EQ(v[j], -2.0f * static_cast<float>(j - 8)) << j;
      EXPECT_EQ(v[j + 16], -2.0f * static_cast<float>(7 - j)) << j;
    }
  }
  {
    // Two Q4_1 blocks: d = 0.25, m = -1; then d = 3, m = 0.5.
    uint8_t blk[40];
    put_u16(blk, 0x3400);
    put_u16(blk + 2, 0xBC00);
    put_u16(blk + 20, 0x4200);
    put_u16(blk + 22, 0x3800);
    for (int j = 0; j < 16; ++j) {
      blk[4 + j] = static_cast<uint8_t>((15 - j) | j << 4);
      blk[24 + j] = static_cast<uint8_t>(j | j << 4);
    }
    float v[64];
    dequantize_row(QuantType::Q4_1, blk, v, 64);
    for (int j = 0; j < 16; ++j) {
      EXPECT_EQ(v[j], 0.25f * static_cast<float>(15 - j) - 1.0f) << j;
      EXPECT_EQ(v[j + 16], 0.25f * static_cast<float>(j) - 1.0f) << j;
      EXPECT_EQ(v[32 + j], 3.0f * static_cast<float>(j) + 0.5f) << j;
      EXPECT_EQ(v[48 + j], 3.0f * static_cast<float>(j) + 0.5f) << j;
    }
  }
  {
    const uint16_t halves[] = {0x3C00, 0xC000, 0x0001, 0x7BFF, 0x0400, 0x8000, 0x3555, 0x03FF};
    const float want[] = {1.0f,     -2.0f, 0x1p-24f,    65504.0f,
                          0x1p-14f, -0.0f, 0x1.554p-2f, 0x1.ff8p-15f};
    uint8_t raw[16];
    for (int i = 0; i < 8; ++i) put_u16(raw + 2 * i, halves[i]);
    float v[8];
    dequantize_row(QuantType::F16, raw, v, 8);
    for (int i = 0; i < 8; ++i) {
      EXPECT_EQ(v[i], want[i]) << i;
      EXPECT_EQ(std::signbit(v[i]), std::signbit(want[i])) << i;
    }
  }
  {
    const uint16_t bf[] = {0x3F80, 0xC040, 0x0000, 0x4780};
    const float want[] = {1.0f, -3.0f, 0.0f, 65536.0f};
    uint8_t raw[8];
    for (int i = 0; i < 4; ++i) put_u16(raw + 2 * i, bf[i]);
    float v[4];
    dequantize_row(QuantType::BF16, raw, v, 4);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(v[i], want[i]) << i;
  }
  {
    const float f[] = {1.5f, -0.0f, 3e-41f};
    float v[3];
    dequantize_row(QuantType::F32, f, v, 3);
    EXPECT_EQ(std::memcmp(f, v, sizeof f), 0);
  }
}

double half_value(uint16_t h);

// Random rows (any finite fp16 scale: subnormal, zero, either sign) decode as the format says,
// value for value; written out here apart from the library's decoders.
TEST(QuantLegacy, DequantizeRandomRowsAsTheFormatDefines) {
  std::mt19937 gen(77);
  const int64_t cols = 1024 + 32;
  for (const QuantType type : kLegacyTypes) {
    const int64_t bytes = quant_row_bytes(type, cols);
    std::vector<uint8_t> raw = random_rows(type, 1, cols, bytes, 3 + static_cast<uint32_t>(type));
    if (is_block_type(type)) {
      for (int64_t b = 0; b < cols / 32; ++b) {
        for (int f = 0; f < (has_min(type) ? 2 : 1); ++f) {
          uint16_t h;
          do h = static_cast<uint16_t>(gen());
          while ((h & 0x7c00) == 0x7c00);
          put_u16(raw.data() + b * quant_traits(type).block_bytes + 2 * f, h);
        }
      }
    }
    std::vector<float> got(static_cast<size_t>(cols));
    dequantize_row(type, raw.data(), got.data(), cols);
    for (int64_t c = 0; c < cols; ++c) {
      float want = 0;
      const int64_t b = c / 32, j = c % 32;
      switch (type) {
        case QuantType::F32:
          std::memcpy(&want, raw.data() + 4 * c, 4);
          break;
        case QuantType::F16:
          want = static_cast<float>(half_value(u16_at(raw.data() + 2 * c)));
          break;
        case QuantType::BF16: {
          const uint32_t u = static_cast<uint32_t>(u16_at(raw.data() + 2 * c)) << 16;
          std::memcpy(&want, &u, 4);
          break;
        }
        case QuantType::Q8_0: {
          const uint8_t* blk = raw.data() + b * 34;
          want = static_cast<float>(half_value(u16_at(blk)) * static_cast<int8_t>(blk[2 + j]));
          break;
        }
        case QuantType::Q4_0: {
          const uint8_t* blk = raw.data() + b * 18;
          const int q = j < 16 ? (blk[2 + j] & 0xf) : (blk[2 + j - 16] >> 4);
          want = static_cast<float>(half_value(u16_at(blk)) * (q - 8));
          break;
        }
        case QuantType::Q5_0:
        case QuantType::Q5_1: {
          // Four bytes of fifth bits (value j's is bit j % 8 of byte j / 8), then the nibbles;
          // Q5_0 is offset by 16, Q5_1 adds m as Q4_1 does.
          const bool q5_1 = type == QuantType::Q5_1;
          const uint8_t* blk = raw.data() + b * (q5_1 ? 24 : 22);
          const uint8_t* qh = blk + (q5_1 ? 4 : 2);
          const uint8_t* qs = qh + 4;
          const int q = (j < 16 ? (qs[j] & 0xf) : (qs[j - 16] >> 4)) | (((qh[j / 8] >> (j % 8)) & 1) << 4);
          want = q5_1 ? static_cast<float>(half_value(u16_at(blk)) * q) + static_cast<float>(half_value(u16_at(blk + 2)))
                      : static_cast<float>(half_value(u16_at(blk)) * (q - 16));
          break;
        }
        case QuantType::IQ4_NL: {
          static const int kGrid[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
          const uint8_t* blk = raw.data() + b * 18;
          const int q = j < 16 ? (blk[2 + j] & 0xf) : (blk[2 + j - 16] >> 4);
          want = static_cast<float>(half_value(u16_at(blk)) * kGrid[q]);
          break;
        }
        default: {  // Q4_1: d * q exact, then one float32 rounding of "+ m" as ggml
          const uint8_t* blk = raw.data() + b * 20;
          const int q = j < 16 ? (blk[4 + j] & 0xf) : (blk[4 + j - 16] >> 4);
          want = static_cast<float>(half_value(u16_at(blk)) * q) +
                 static_cast<float>(half_value(u16_at(blk + 2)));
        }
      }
      ASSERT_EQ(got[c], want) << quant_name(type) << " value " << c;
    }
  }
}

TEST(QuantLegacy, KTypesAndKActivationsAreRejected) {
  float v[256];
  uint8_t raw[512] = {};
  EXPECT_THROW(quant_impl::legacy_dequantize_row(QuantType::Q4_K, raw, v, 256),
               std::invalid_argument);
  EXPECT_THROW(quant_impl::legacy_portable_kernel(QuantType::Q6_K), std::invalid_argument);
  EXPECT_THROW(quant_impl::legacy_quantize_activation_row(ActivationType::Q8_K, v, raw, 256),
               std::invalid_argument);
  EXPECT_THROW(quant_impl::legacy_dequantize_activation_row(ActivationType::Q8_K, raw, v, 256),
               std::invalid_argument);
  // Input counts past the kernels' arrays.
  for (const QuantType type : kLegacyTypes) {
    for (const DotKernel kernel : {dot_kernel(type), portable_dot_kernel(type)}) {
      for (const int inputs : {0, kMaxKernelInputs + 1}) {
        EXPECT_THROW(kernel(raw, 0, raw, 0, inputs, v, 1, 0, 1, 32), std::invalid_argument)
            << quant_name(type) << " inputs=" << inputs;
      }
    }
  }
}

// ---- fp16 helpers ------------------------------------------------------------------------

double half_value(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -mag : mag;
}

TEST(QuantLegacy, HalfConversionsAreExactAndRoundToNearestEven) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t hh = static_cast<uint16_t>(h);
    const float f = fp16_to_fp32(hh);
    if (((h >> 10) & 0x1f) == 0x1f) {
      EXPECT_EQ(std::isnan(f), (h & 0x3ff) != 0) << h;
      if ((h & 0x3ff) == 0) {
        EXPECT_TRUE(std::isinf(f)) << h;
      }
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), half_value(hh)) << h;
    ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << h;
    ASSERT_EQ(fp32_to_fp16(f), hh) << h;
    // Midway to the next half up in magnitude: ties go to the even mantissa.
    if ((h & 0x7fff) < 0x7bff) {
      const double mid = (half_value(hh) + half_value(static_cast<uint16_t>(h + 1))) / 2;
      const uint16_t even = (h & 1) ? static_cast<uint16_t>(h + 1) : hh;
      ASSERT_EQ(fp32_to_fp16(static_cast<float>(mid)), even) << h;
    }
  }
  EXPECT_EQ(fp32_to_fp16(65519.996f), 0x7BFF);
  EXPECT_EQ(fp32_to_fp16(65520.0f), 0x7C00);
  EXPECT_EQ(fp32_to_fp16(-1e10f), 0xFC00);
  EXPECT_EQ(fp32_to_fp16(0x1p-25f), 0x0000);  // tie with 0: even
  EXPECT_EQ(fp32_to_fp16(std::nextafter(0x1p-25f, 1.0f)), 0x0001);
  EXPECT_EQ(fp32_to_fp16(-1e-30f), 0x8000);
  EXPECT_EQ(fp32_to_fp16(NAN) & 0x7e00, 0x7e00);

  // Random floats land on the nearest half (ties to even already checked above).
  std::mt19937 gen(12);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffffffffu);
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = bits(gen);
    u = (u & 0x807fffffu) | ((100u + (u >> 23) % 45u) << 23);  // |f| in about [2^-27, 2^17)
    float f;
    std::memcpy(&f, &u, 4);
    const uint16_t h = fp32_to_fp16(f);
    if (((h >> 10) & 0x1f) == 0x1f) {
      ASSERT_GE(std::abs(f), 65520.0f);
      continue;
    }
    const double err = std::abs(static_cast<double>(f) - half_value(h));
    const uint16_t up = static_cast<uint16_t>(h + 1), down = static_cast<uint16_t>(h - 1);
    if ((up & 0x7c00) != 0x7c00) {
      ASSERT_LE(err, std::abs(f - half_value(up))) << f;
    }
    if ((h & 0x7fff) != 0) {
      ASSERT_LE(err, std::abs(f - half_value(down))) << f;
    }
  }
}

#if defined(__x86_64__)
__attribute__((target("f16c"))) uint16_t f16c_from_float(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}

TEST(QuantLegacy, HalfConversionMatchesF16cWhereAvailable) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "no F16C on this processor";
  std::mt19937 gen(21);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffffffffu);
  for (int i = 0; i < 500000; ++i) {
    const uint32_t u = bits(gen);
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f)) continue;
    ASSERT_EQ(fp32_to_fp16(f), f16c_from_float(f)) << std::hex << u;
  }
}
#endif

}  // namespace
}  // namespace kvpipe
