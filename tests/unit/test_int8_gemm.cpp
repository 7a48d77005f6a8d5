// int8_gemm: the unsigned 8-bit form of each type's rows, and the tile kernels of every ISA
// that runs here against a float64 product and against each other (bit for bit).
#include "engine/kernels/cpu/int8_gemm.h"
#include "engine/kernels/cpu/quant_impl.h"
#include "engine/kernels/cpu/thread_pool.h"
#include "tests/support/quant_rows.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

constexpr QuantType kSupported[] = {QuantType::Q8_0, QuantType::Q4_0, QuantType::Q4_1, QuantType::Q5_0,
                                    QuantType::Q5_1, QuantType::IQ4_NL, QuantType::Q2_K, QuantType::Q3_K,
                                    QuantType::Q4_K, QuantType::Q5_K, QuantType::Q6_K, QuantType::IQ4_XS};

// Scales and offsets per run of 32 values, or of 16 for Q2_K, Q3_K and Q6_K.
int64_t scale_run(QuantType type) {
  return type == QuantType::Q2_K || type == QuantType::Q3_K || type == QuantType::Q6_K ? 16 : 32;
}

std::vector<uint8_t> activations(QuantType type, const std::vector<float>& x, int64_t n, int64_t cols) {
  const ActivationType at = quant_traits(type).activation;
  const int64_t stride = activation_row_bytes(at, cols);
  std::vector<uint8_t> a(static_cast<size_t>(n * stride));
  for (int64_t j = 0; j < n; ++j) quantize_activation_row(at, x.data() + j * cols, a.data() + j * stride, cols);
  return a;
}

class Int8Gemm : public ::testing::TestWithParam<QuantType> {};

// d * u + m gives back every stored value exactly: the form loses nothing.
TEST_P(Int8Gemm, UnsignedFormHoldsTheStoredValues) {
  const QuantType type = GetParam();
  const int64_t cols = 512, rows = 6;
  const std::vector<uint8_t> w = test::random_rows(type, rows, cols, 21);
  const int64_t row_bytes = quant_row_bytes(type, cols);
  std::vector<uint8_t> u(static_cast<size_t>(cols));
  const int64_t run = scale_run(type);
  std::vector<float> d(static_cast<size_t>(cols / run)), m(d.size()), want(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w.data() + r * row_bytes;
    ASSERT_TRUE(quant_impl::legacy_unpack_row_u8(type, row, cols, u.data(), d.data(), m.data()) ||
                quant_impl::k_unpack_row_u8(type, row, cols, u.data(), d.data(), m.data()));
    dequantize_row(type, row, want.data(), cols);
    for (int64_t c = 0; c < cols; ++c) {
      const float got = static_cast<float>(static_cast<double>(d[c / run]) * u[c] + m[c / run]);
      ASSERT_EQ(got, want[c]) << quant_name(type) << " row " << r << " value " << c;
    }
  }
}

// Every ISA that runs the type here: within float32 rounding of the float64 product, equal
// to the portable kernel bit for bit, on 1 and 2 threads, for row counts that leave a partial
// group of 8 and input counts that leave partial tiles; nothing written past the rows.
TEST_P(Int8Gemm, EveryIsaMatchesFloat64AndThePortableKernelExactly) {
  const QuantType type = GetParam();
  std::vector<int64_t> widths = {256, 768};
  if (quant_traits(type).block_values == 32) widths.push_back(576);
  std::vector<Int8GemmIsa> vector_isas;
  for (Int8GemmIsa isa : {Int8GemmIsa::kAvx2, Int8GemmIsa::kAvx512Vnni})
    if (int8_gemm_runs(isa, type)) vector_isas.push_back(isa);
    else std::printf("%s: not computed by %s on this processor\n", quant_name(type), int8_gemm_isa_name(isa));
  std::mt19937 gen(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int64_t cols : widths) {
    const int64_t rows = 45;  // five groups and a part: pairs, and a pair whose second group is partial
    const std::vector<uint8_t> w = test::random_rows(type, rows, cols, 5 + static_cast<uint32_t>(cols));
    for (const int threads : {1, 2}) {
      ThreadPool::instance().set_threads(threads);
      for (const int64_t n : {1, 3, 8, 13, 67}) {
        std::vector<float> x(static_cast<size_t>(n * cols));
        for (auto& v : x) v = normal(gen);
        std::vector<double> magnitude;
        const std::vector<double> ref = test::reference(type, w, x, n, rows, cols, &magnitude);
        const std::vector<uint8_t> a = activations(type, x, n, cols);
        const int64_t stride = activation_row_bytes(quant_traits(type).activation, cols), ldy = rows + 3;
        std::vector<float> portable(static_cast<size_t>(n * ldy), -1.0f);
        int8_gemm(Int8GemmIsa::kPortable, a.data(), stride, n, type, w.data(), rows, cols, portable.data(), ldy);
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t r = 0; r < rows; ++r)
            ASSERT_NEAR(portable[j * ldy + r], ref[j * rows + r], 1e-5 * magnitude[j * rows + r] + 1e-6)
                << quant_name(type) << " cols=" << cols << " n=" << n << " input " << j << " row " << r;
          for (int64_t r = rows; r < ldy; ++r) ASSERT_EQ(portable[j * ldy + r], -1.0f) << "wrote past the rows";
        }
        for (Int8GemmIsa isa : vector_isas) {
          std::vector<float> y(static_cast<size_t>(n * ldy), -1.0f);
          int8_gemm(isa, a.data(), stride, n, type, w.data(), rows, cols, y.data(), ldy);
          ASSERT_EQ(0, std::memcmp(y.data(), portable.data(), y.size() * sizeof(float)))
              << quant_name(type) << " " << int8_gemm_isa_name(isa) << " cols=" << cols << " n=" << n
              << " threads=" << threads;
        }
      }
    }
  }
  ThreadPool::instance().set_threads(1);
}

INSTANTIATE_TEST_SUITE_P(Types, Int8Gemm, ::testing::ValuesIn(kSupported),
                         [](const ::testing::TestParamInfo<QuantType>& p) { return std::string(quant_name(p.param)); });

TEST(Int8GemmChoice, TypesWithoutTheFormAndIsasThatSaturateAreRefused) {
  for (QuantType type : {QuantType::F32, QuantType::F16, QuantType::BF16}) {
    EXPECT_FALSE(int8_gemm_supports(type)) << quant_name(type);
    EXPECT_FALSE(int8_gemm_choice(type)) << quant_name(type);
    float y = 0;
    const uint8_t zeros[4096] = {};
    EXPECT_THROW(int8_gemm(Int8GemmIsa::kPortable, zeros, 1024, 1, type, zeros, 1, 256, &y, 1),
                 std::invalid_argument)
        << quant_name(type);
  }
  // vpmaddubsw's 16-bit pair sums overflow for bytes past 127.
  for (QuantType type : {QuantType::Q8_0, QuantType::IQ4_NL, QuantType::IQ4_XS})
    EXPECT_FALSE(int8_gemm_runs(Int8GemmIsa::kAvx2, type)) << quant_name(type);
  // The choice names an ISA that runs the type.
  for (QuantType type : kSupported)
    if (const auto isa = int8_gemm_choice(type)) EXPECT_TRUE(int8_gemm_runs(*isa, type)) << quant_name(type);
}

}  // namespace
}  // namespace kvpipe
