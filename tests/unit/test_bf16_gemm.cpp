// bf16_gemm: the activations' rounding to bfloat16, and the tiles of every ISA that runs here
// against a float64 product of the rounded activations and against each other.
#include "engine/kernels/cpu/bf16_gemm.h"
#include "engine/kernels/cpu/half_convert.h"
#include "engine/kernels/cpu/thread_pool.h"
#include "tests/support/quant_rows.h"

#include <c10/util/BFloat16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

namespace kvpipe {
namespace {

// Round to nearest even, as LibTorch's c10::BFloat16 rounds, over random values and the edges
// (ties both ways, the largest finite values, subnormals, infinities).
TEST(Bf16Gemm, ActivationsRoundLikeLibTorch) {
  std::mt19937 gen(1);
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<float> values = {0.0f, -0.0f, 1.0f, 1.00390625f, 1.01171875f, -1.00390625f, 3.4028235e38f,
                               -3.4028235e38f, 1e-40f, -1e-40f, std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(), 65504.0f, 1e-30f};
  for (int i = 0; i < 100000; ++i) {
    const float f = quant_impl::bits_to_fp32(bits(gen));
    if (!std::isnan(f)) values.push_back(f);
  }
  for (const float f : values) {
    const c10::BFloat16 want(f);
    ASSERT_EQ(quant_impl::fp32_to_bf16(f), want.x) << f;
  }
  EXPECT_TRUE(std::isnan(quant_impl::bf16_to_fp32(quant_impl::fp32_to_bf16(std::nanf("")))));
}

// y = x W^T in float64 over the weights and the activations rounded to bfloat16; `magnitude`
// gets sum |w x| per output.
std::vector<double> rounded_reference(const std::vector<uint8_t>& w, const std::vector<float>& x, int64_t n,
                                      int64_t rows, int64_t cols, std::vector<double>& magnitude) {
  std::vector<double> y(static_cast<size_t>(n * rows));
  magnitude.assign(y.size(), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, a = 0;
      for (int64_t c = 0; c < cols; ++c) {
        uint16_t wb;
        std::memcpy(&wb, &w[2 * (r * cols + c)], 2);
        const double p = static_cast<double>(quant_impl::bf16_to_fp32(wb)) *
                         quant_impl::bf16_to_fp32(quant_impl::fp32_to_bf16(x[j * cols + c]));
        s += p;
        a += std::abs(p);
      }
      y[j * rows + r] = s;
      magnitude[j * rows + r] = a;
    }
  return y;
}

// n activation rows of cols normal values, ldx apart (the gaps hold values too), and the same
// rows packed cols apart.
std::vector<float> strided_inputs(int64_t n, int64_t ldx, std::mt19937& gen) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n * ldx));
  for (auto& v : x) v = normal(gen);
  return x;
}

std::vector<float> strided_inputs_packed(const std::vector<float>& x, int64_t n, int64_t cols, int64_t ldx) {
  std::vector<float> packed(static_cast<size_t>(n * cols));
  for (int64_t j = 0; j < n; ++j) std::memcpy(&packed[j * cols], &x[j * ldx], sizeof(float) * static_cast<size_t>(cols));
  return packed;
}

// The portable tile within float32 rounding of the float64 product; every vector ISA that runs
// here within float32 rounding of the portable tile (the processor's instruction defines its own
// internal rounding), on 1 and 2 threads, for row counts that leave partial groups of 16 and
// panels of 64, input counts that leave partial tiles of 8, a strided x; nothing written past
// the rows.
TEST(Bf16Gemm, EveryIsaMatchesFloat64AndThePortableTile) {
  std::vector<Bf16GemmIsa> vector_isas;
  if (bf16_gemm_runs(Bf16GemmIsa::kAvx512Bf16)) vector_isas.push_back(Bf16GemmIsa::kAvx512Bf16);
  else std::printf("avx512-bf16 does not run on this processor: only the portable tile is checked\n");
  std::mt19937 gen(17);
  int64_t outputs = 0, identical = 0;
  for (const int64_t cols : {2, 96, 576}) {
    for (const int64_t rows : {5, 37, 83}) {
      const std::vector<uint8_t> w = test::random_rows(QuantType::BF16, rows, cols, 5 + static_cast<uint32_t>(cols));
      for (const int threads : {1, 2}) {
        ThreadPool::instance().set_threads(threads);
        for (const int64_t n : {1, 7, 8, 13, 67}) {
          const int64_t ldx = cols + 3, ldy = rows + 3;
          const std::vector<float> x = strided_inputs(n, ldx, gen);
          std::vector<double> magnitude;
          const std::vector<double> ref = rounded_reference(w, strided_inputs_packed(x, n, cols, ldx), n, rows, cols, magnitude);
          const auto* wb = reinterpret_cast<const uint16_t*>(w.data());
          std::vector<float> portable(static_cast<size_t>(n * ldy), -1.0f);
          bf16_gemm(Bf16GemmIsa::kPortable, x.data(), n, ldx, wb, rows, cols, portable.data(), ldy);
          for (int64_t j = 0; j < n; ++j) {
            for (int64_t r = 0; r < rows; ++r)
              ASSERT_NEAR(portable[j * ldy + r], ref[j * rows + r], 1e-5 * magnitude[j * rows + r] + 1e-6)
                  << "cols=" << cols << " rows=" << rows << " n=" << n << " input " << j << " row " << r;
            for (int64_t r = rows; r < ldy; ++r) ASSERT_EQ(portable[j * ldy + r], -1.0f) << "wrote past the rows";
          }
          for (Bf16GemmIsa isa : vector_isas) {
            std::vector<float> y(static_cast<size_t>(n * ldy), -1.0f);
            bf16_gemm(isa, x.data(), n, ldx, wb, rows, cols, y.data(), ldy);
            for (int64_t i = 0; i < n * ldy; ++i) identical += y[i] == portable[i];
            outputs += n * ldy;
            for (int64_t j = 0; j < n; ++j) {
              for (int64_t r = 0; r < rows; ++r)
                ASSERT_NEAR(y[j * ldy + r], portable[j * ldy + r], 1e-6 * magnitude[j * rows + r] + 1e-7)
                    << bf16_gemm_isa_name(isa) << " cols=" << cols << " rows=" << rows << " n=" << n
                    << " threads=" << threads << " input " << j << " row " << r;
              for (int64_t r = rows; r < ldy; ++r) ASSERT_EQ(y[j * ldy + r], -1.0f) << "wrote past the rows";
            }
          }
        }
      }
    }
  }
  if (outputs > 0) std::printf("vector tiles equal to the portable one bit for bit: %lld of %lld outputs\n",
                               static_cast<long long>(identical), static_cast<long long>(outputs));
  ThreadPool::instance().set_threads(1);
}

// A row's result does not depend on the other inputs of the call (batch invariance).
TEST(Bf16Gemm, RowResultsDoNotDependOnTheOtherInputs) {
  const std::optional<Bf16GemmIsa> isa = bf16_gemm_choice();
  const Bf16GemmIsa used = isa ? *isa : Bf16GemmIsa::kPortable;
  const int64_t cols = 256, rows = 40, n = 70;
  const std::vector<uint8_t> w = test::random_rows(QuantType::BF16, rows, cols, 11);
  const auto* wb = reinterpret_cast<const uint16_t*>(w.data());
  std::vector<float> x(static_cast<size_t>(n * cols));
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : x) v = normal(gen);
  std::vector<float> all(static_cast<size_t>(n * rows)), one(static_cast<size_t>(rows));
  bf16_gemm(used, x.data(), n, cols, wb, rows, cols, all.data(), rows);
  for (int64_t j : {0, 9, 69}) {
    bf16_gemm(used, x.data() + j * cols, 1, cols, wb, rows, cols, one.data(), rows);
    ASSERT_EQ(0, std::memcmp(one.data(), all.data() + j * rows, sizeof(float) * rows)) << "input " << j;
  }
}

// bf16_decode: within float32 rounding of the float64 product over the rounded activations
// (columns that leave a partial chunk of 32, odd row counts for the pairs of rows, input counts
// past the groups of 4, a strided x and y, 1 and 2 threads); each row's result the same bits
// alone, in a batch and in any row range, and within float32 rounding of bf16_gemm's tiles.
TEST(Bf16Decode, MatchesFloat64AndDoesNotDependOnTheBatchOrTheRows) {
  if (!bf16_gemm_runs(Bf16GemmIsa::kAvx512Bf16))
    GTEST_SKIP() << "avx512-bf16 does not run on this processor: BF16 decode uses the float32 dot kernels";
  std::mt19937 gen(23);
  for (const int64_t cols : {2, 96, 1000}) {
    for (const int64_t rows : {1, 7, 83}) {
      const std::vector<uint8_t> w = test::random_rows(QuantType::BF16, rows, cols, 9 + static_cast<uint32_t>(rows));
      const auto* wb = reinterpret_cast<const uint16_t*>(w.data());
      for (const int threads : {1, 2}) {
        ThreadPool::instance().set_threads(threads);
        for (const int64_t n : {1, 2, 4, 5, 13, 64}) {
          const int64_t ldx = cols + 3, ldy = rows + 3;
          const std::vector<float> x = strided_inputs(n, ldx, gen);
          std::vector<double> magnitude;
          const std::vector<double> ref = rounded_reference(w, strided_inputs_packed(x, n, cols, ldx), n, rows, cols, magnitude);
          std::vector<float> y(static_cast<size_t>(n * ldy), -1.0f), tiles(y.size(), -1.0f);
          bf16_decode(Bf16GemmIsa::kAvx512Bf16, x.data(), n, ldx, wb, rows, cols, y.data(), ldy);
          bf16_gemm(Bf16GemmIsa::kAvx512Bf16, x.data(), n, ldx, wb, rows, cols, tiles.data(), ldy);
          for (int64_t j = 0; j < n; ++j) {
            for (int64_t r = 0; r < rows; ++r) {
              const double tol = 1e-5 * magnitude[j * rows + r] + 1e-6;
              ASSERT_NEAR(y[j * ldy + r], ref[j * rows + r], tol)
                  << "cols=" << cols << " rows=" << rows << " n=" << n << " input " << j << " row " << r;
              ASSERT_NEAR(y[j * ldy + r], tiles[j * ldy + r], tol) << "against the prompt tiles";
            }
            for (int64_t r = rows; r < ldy; ++r) ASSERT_EQ(y[j * ldy + r], -1.0f) << "wrote past the rows";
          }
          // Each input alone, and each row alone: the same bits.
          for (int64_t j = 0; j < n; j += 3) {
            std::vector<float> one(static_cast<size_t>(rows));
            bf16_decode(Bf16GemmIsa::kAvx512Bf16, x.data() + j * ldx, 1, ldx, wb, rows, cols, one.data(), rows);
            ASSERT_EQ(0, std::memcmp(one.data(), &y[j * ldy], sizeof(float) * static_cast<size_t>(rows)))
                << "input " << j << " of " << n << " alone, cols=" << cols << " rows=" << rows;
            for (int64_t r = 0; r < rows; r += 5) {
              float single = -1.0f;
              bf16_decode(Bf16GemmIsa::kAvx512Bf16, x.data() + j * ldx, 1, ldx, wb + r * cols, 1, cols, &single, 1);
              ASSERT_EQ(single, one[r]) << "row " << r << " alone, cols=" << cols;
            }
          }
        }
      }
    }
  }
  ThreadPool::instance().set_threads(1);
}

TEST(Bf16Gemm, OddRowsAndIsasThatDoNotRunAreRefused) {
  const uint16_t w[6] = {};
  const float x[6] = {};
  float y[2] = {};
  EXPECT_THROW(bf16_gemm(Bf16GemmIsa::kPortable, x, 1, 3, w, 2, 3, y, 2), std::invalid_argument);
  // The decode rows have no portable form: the dot kernels serve BF16 where the instruction is
  // missing.
  EXPECT_THROW(bf16_decode(Bf16GemmIsa::kPortable, x, 1, 2, w, 2, 2, y, 2), std::invalid_argument);
  if (!bf16_gemm_runs(Bf16GemmIsa::kAvx512Bf16)) {
    EXPECT_THROW(bf16_decode(Bf16GemmIsa::kAvx512Bf16, x, 1, 2, w, 2, 2, y, 2), std::invalid_argument);
    EXPECT_FALSE(bf16_gemm_choice());
    EXPECT_THROW(bf16_gemm(Bf16GemmIsa::kAvx512Bf16, x, 1, 2, w, 2, 2, y, 2), std::invalid_argument);
  } else {
    EXPECT_EQ(bf16_gemm_choice(), Bf16GemmIsa::kAvx512Bf16);
    EXPECT_THROW(bf16_decode(Bf16GemmIsa::kAvx512Bf16, x, 1, 3, w, 2, 3, y, 2), std::invalid_argument);
  }
}

}  // namespace
}  // namespace kvpipe
