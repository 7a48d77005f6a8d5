// f16_gemm and bf16_widened_gemm: the tiles of every ISA that runs here against a float64
// product and against each other (bit for bit), and a row's independence from the other inputs
// of the call.
#include "engine/kernels/cpu/f16_gemm.h"
#include "engine/kernels/cpu/half_convert.h"
#include "engine/kernels/cpu/thread_pool.h"
#include "tests/support/quant_rows.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace kvpipe {
namespace {

// The product under test for F16 or BF16 rows.
void half_gemm(QuantType type, F16GemmIsa isa, const float* x, int64_t n, int64_t ldx, const uint16_t* w,
               int64_t rows, int64_t cols, float* y, int64_t ldy) {
  if (type == QuantType::BF16) return bf16_widened_gemm(isa, x, n, ldx, w, rows, cols, y, ldy);
  f16_gemm(isa, x, n, ldx, w, rows, cols, y, ldy);
}

// y = x W^T in float64 (x rows ldx apart); `magnitude` gets sum |w x| per output.
std::vector<double> reference(QuantType type, const std::vector<uint8_t>& w, const std::vector<float>& x, int64_t n,
                              int64_t ldx, int64_t rows, int64_t cols, std::vector<double>& magnitude) {
  std::vector<double> y(static_cast<size_t>(n * rows));
  magnitude.assign(y.size(), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, a = 0;
      for (int64_t c = 0; c < cols; ++c) {
        uint16_t h;
        std::memcpy(&h, &w[2 * (r * cols + c)], 2);
        const float wv = type == QuantType::BF16 ? quant_impl::bf16_to_fp32(h) : quant_impl::fp16_to_fp32(h);
        const double p = static_cast<double>(wv) * x[j * ldx + c];
        s += p;
        a += std::abs(p);
      }
      y[j * rows + r] = s;
      magnitude[j * rows + r] = a;
    }
  return y;
}

// The portable tile within float32 rounding of the float64 product; every vector ISA that runs
// here equal to it bit for bit, on 1 and 2 threads, for row counts that leave partial groups of
// 16 and panels of 64, input counts that leave partial tiles of 12 and span several slices of
// tiles (1100 values a row: slices of 4 tiles), odd row lengths, a strided x; nothing written
// past the rows. For F16 rows (f16_gemm) and BF16 rows (bf16_widened_gemm).
TEST(F16Gemm, EveryIsaMatchesFloat64AndThePortableTileBitForBit) {
  std::vector<F16GemmIsa> vector_isas;
  if (f16_gemm_runs(F16GemmIsa::kAvx512)) vector_isas.push_back(F16GemmIsa::kAvx512);
  else std::printf("f16_gemm: avx512 does not run on this processor: only the portable tile is checked\n");
  std::mt19937 gen(23);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const QuantType type : {QuantType::F16, QuantType::BF16})
  for (const int64_t cols : {1, 3, 96, 577, 1100}) {
    for (const int64_t rows : {5, 37, 83}) {
      const std::vector<uint8_t> w = test::random_rows(type, rows, cols, 9 + static_cast<uint32_t>(cols));
      const auto* wh = reinterpret_cast<const uint16_t*>(w.data());
      for (const int threads : {1, 2}) {
        ThreadPool::instance().set_threads(threads);
        for (const int64_t n : {1, 7, 12, 13, 21, 70}) {
          if (cols == 1100 && n < 70) continue;  // the slices are what this width is for
          const int64_t ldx = cols + 3, ldy = rows + 3;
          std::vector<float> x(static_cast<size_t>(n * ldx));
          for (auto& v : x) v = normal(gen);
          std::vector<double> magnitude;
          const std::vector<double> ref = reference(type, w, x, n, ldx, rows, cols, magnitude);
          std::vector<float> portable(static_cast<size_t>(n * ldy), -1.0f);
          half_gemm(type, F16GemmIsa::kPortable, x.data(), n, ldx, wh, rows, cols, portable.data(), ldy);
          for (int64_t j = 0; j < n; ++j) {
            for (int64_t r = 0; r < rows; ++r)
              ASSERT_NEAR(portable[j * ldy + r], ref[j * rows + r], 1e-5 * magnitude[j * rows + r] + 1e-6)
                  << quant_name(type) << " cols=" << cols << " rows=" << rows << " n=" << n << " input " << j
                  << " row " << r;
            for (int64_t r = rows; r < ldy; ++r) ASSERT_EQ(portable[j * ldy + r], -1.0f) << "wrote past the rows";
          }
          for (F16GemmIsa isa : vector_isas) {
            std::vector<float> y(static_cast<size_t>(n * ldy), -1.0f);
            half_gemm(type, isa, x.data(), n, ldx, wh, rows, cols, y.data(), ldy);
            ASSERT_EQ(0, std::memcmp(y.data(), portable.data(), y.size() * sizeof(float)))
                << quant_name(type) << " " << f16_gemm_isa_name(isa) << " cols=" << cols << " rows=" << rows
                << " n=" << n << " threads=" << threads;
          }
        }
      }
    }
  }
  ThreadPool::instance().set_threads(1);
}

// A row's result does not depend on the other inputs of the call (batch invariance).
TEST(F16Gemm, RowResultsDoNotDependOnTheOtherInputs) {
  const std::optional<F16GemmIsa> isa = f16_gemm_choice();
  const F16GemmIsa used = isa ? *isa : F16GemmIsa::kPortable;
  const int64_t cols = 256, rows = 40, n = 70;
  for (const QuantType type : {QuantType::F16, QuantType::BF16}) {
    const std::vector<uint8_t> w = test::random_rows(type, rows, cols, 11);
    const auto* wh = reinterpret_cast<const uint16_t*>(w.data());
    std::vector<float> x(static_cast<size_t>(n * cols));
    std::mt19937 gen(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& v : x) v = normal(gen);
    std::vector<float> all(static_cast<size_t>(n * rows)), one(static_cast<size_t>(rows));
    half_gemm(type, used, x.data(), n, cols, wh, rows, cols, all.data(), rows);
    for (const int64_t j : {0, 13, 69}) {
      half_gemm(type, used, x.data() + j * cols, 1, cols, wh, rows, cols, one.data(), rows);
      EXPECT_EQ(0, std::memcmp(one.data(), all.data() + j * rows, one.size() * sizeof(float)))
          << quant_name(type) << " input " << j;
    }
  }
}

}  // namespace
}  // namespace kvpipe
