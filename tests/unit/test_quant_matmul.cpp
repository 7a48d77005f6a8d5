// The thread pool, quant_matmul's paths and WeightMatrix, against float64 references of
// the dequantised weights (the per-type kernels have their own tests).
#include "engine/kernels/cpu/bf16_gemm.h"
#include "engine/kernels/cpu/f16_gemm.h"
#include "engine/kernels/cpu/int8_gemm.h"
#include "engine/kernels/cpu/quant_matmul.h"
#include "engine/kernels/cpu/thread_pool.h"
#include "engine/model/weight_matrix.h"
#include "tests/support/quant_rows.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

namespace kvpipe {
namespace {

using test::random_rows;
using test::reference;

TEST(ThreadPool, EveryIndexOnceForAnyThreadCount) {
  ThreadPool& pool = ThreadPool::instance();
  for (const int threads : {1, 2, 3, 1}) {
    pool.set_threads(threads);
    for (const int64_t n : {1, 5, 64, 1000}) {
      for (const int64_t align : {1, 4, 16}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        std::atomic<int> calls{0};
        pool.parallel_for(n, align, [&](int64_t b, int64_t e) {
          ++calls;
          EXPECT_LT(b, e);
          if (e < n) {
            EXPECT_EQ(e % align, 0);
          }
          for (int64_t i = b; i < e; ++i) ++hits[i];
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << threads << " " << n << " " << align;
        EXPECT_LE(calls.load(), threads);
      }
    }
  }
  pool.set_threads(1);
}

// parallel_chunks: every index once, every piece on whole chunks, whichever thread takes it;
// from inside a task, and from two threads at once (one of them then runs alone), the same.
TEST(ThreadPool, ChunksCoverEveryIndexOnce) {
  ThreadPool& pool = ThreadPool::instance();
  auto check = [&](int64_t n, int64_t chunk) {
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    pool.parallel_chunks(n, chunk, [&](int64_t b, int64_t e) {
      EXPECT_LT(b, e);
      EXPECT_EQ(b % chunk, 0);
      if (e < n) {
        EXPECT_EQ(e % chunk, 0);
      }
      for (int64_t i = b; i < e; ++i) ++hits[i];
    });
    for (int64_t i = 0; i < n; ++i)
      if (hits[i].load() != 1) return ::testing::AssertionFailure() << "n " << n << " chunk " << chunk << " index " << i;
    return ::testing::AssertionSuccess();
  };
  for (const int threads : {1, 2, 3}) {
    pool.set_threads(threads);
    for (const int64_t n : {1, 5, 64, 1000})
      for (const int64_t chunk : {1, 4, 7, 16}) ASSERT_TRUE(check(n, chunk)) << threads << " threads";
    std::atomic<int> nested_ok{0};
    pool.parallel_for(4, 1, [&](int64_t, int64_t) { nested_ok += check(100, 3) ? 1 : 0; });
    EXPECT_EQ(nested_ok.load(), std::min(threads, 4));
    std::atomic<int> concurrent_ok{0};
    std::thread other([&] {
      for (int i = 0; i < 200; ++i) concurrent_ok += check(257, 5) ? 1 : 0;
    });
    for (int i = 0; i < 200; ++i) concurrent_ok += check(300, 8) ? 1 : 0;
    other.join();
    EXPECT_EQ(concurrent_ok.load(), 400);
  }
  pool.set_threads(1);
}

TEST(ThreadPool, ExceptionsReachTheCallerAndNestedCallsRunInline) {
  ThreadPool& pool = ThreadPool::instance();
  pool.set_threads(2);
  EXPECT_THROW(pool.parallel_for(100, 1, [](int64_t b, int64_t) {
    if (b > 0) throw std::runtime_error("worker");
  }), std::runtime_error);
  std::atomic<int64_t> total{0};
  pool.parallel_for(10, 1, [&](int64_t b, int64_t e) {
    pool.parallel_for(e - b, 1, [&](int64_t ib, int64_t ie) { total += ie - ib; });
  });
  EXPECT_EQ(total.load(), 10);
  // Many short tasks in a row (a decode step's pattern): the pool keeps up and stays correct.
  int64_t sum = 0;
  for (int i = 0; i < 2000; ++i) {
    std::atomic<int64_t> part{0};
    pool.parallel_for(8, 1, [&](int64_t b, int64_t e) { part += e - b; });
    sum += part.load();
  }
  EXPECT_EQ(sum, 16000);
  pool.set_threads(1);
}

class QuantMatmul : public ::testing::TestWithParam<QuantType> {};

TEST_P(QuantMatmul, BothPathsMatchFloat64OnAnyThreadCount) {
  const QuantType type = GetParam();
  // 576 (SmolLM2's hidden size): rows of the 32-value types that are no multiple of 256.
  std::vector<int64_t> widths = {256, 768};
  if (quant_traits(type).block_values <= 32) widths.push_back(576);
  for (const int64_t cols : widths) {
  const int64_t rows = 72;
  const std::vector<uint8_t> w = random_rows(type, rows, cols, 7);
  std::mt19937 gen(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int threads : {1, 2}) {
    ThreadPool::instance().set_threads(threads);
    for (const int64_t n : {1, 3, 4, 5, 9, 12, 64, 70}) {
      std::vector<float> x(static_cast<size_t>(n * cols));
      for (auto& v : x) v = normal(gen);
      std::vector<double> magnitude;
      const std::vector<double> ref = reference(type, w, x, n, rows, cols, &magnitude);
      std::vector<MatmulPath> paths = {MatmulPath::kKernel, MatmulPath::kBlas};
      if (int8_gemm_choice(type)) paths.push_back(MatmulPath::kInt8);
      if (type == QuantType::BF16 && bf16_gemm_choice()) paths.push_back(MatmulPath::kBf16);
      if (type == QuantType::F16 && f16_gemm_choice()) paths.push_back(MatmulPath::kF16);
      if (type == QuantType::BF16 && f16_gemm_choice()) paths.push_back(MatmulPath::kBf16Widened);
      for (const MatmulPath path : paths) {
        std::vector<float> y(static_cast<size_t>(n * (rows + 3)), -1.0f);
        quant_matmul_on(path, x.data(), n, cols, type, w.data(), rows, cols, y.data(), rows + 3);
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t r = 0; r < rows; ++r) {
            const double want = ref[i * rows + r];
            // Q4_1's and Q5_1's kernels take the activation block sum as Q8_1 stores it, in
            // float16 (as ggml does): 2^-11 relative on that term (exact in test_quant_legacy).
            const bool q8_1 = type == QuantType::Q4_1 || type == QuantType::Q5_1;
            // The bfloat16 products round the activations to bfloat16: 2^-9 relative each
            // (BF16's kernel path too, where the processor has them: bf16_decode).
            const bool bf16 = path == MatmulPath::kBf16 ||
                              (type == QuantType::BF16 && path == MatmulPath::kKernel && bf16_gemm_choice());
            const double rel = bf16 ? 2.5e-3 : q8_1 ? 1e-3 : 1e-5;
            const double tol = rel * magnitude[i * rows + r] + 1e-6;
            ASSERT_NEAR(y[i * (rows + 3) + r], want, tol)
                << quant_name(type) << " " << matmul_path_name(path) << " n=" << n << " threads=" << threads;
          }
          for (int64_t r = rows; r < rows + 3; ++r) ASSERT_EQ(y[i * (rows + 3) + r], -1.0f) << "wrote past a row";
        }
      }
    }
  }
  }
  ThreadPool::instance().set_threads(1);
}

// A decode row gives the same numbers alone and inside a batch (batch invariance), past
// kMaxKernelInputs too, where the float types run blocks of rows against every input
// (batch_kernel), with rows that end in a part chunk and odd row counts.
TEST_P(QuantMatmul, RowResultsDoNotDependOnTheBatch) {
  const QuantType type = GetParam();
  std::vector<int64_t> widths = {256};
  if (quant_traits(type).block_values == 1) widths.push_back(277);
  for (const int64_t cols : widths) {
    for (const int64_t rows : {40, 7}) {
      const std::vector<uint8_t> w = random_rows(type, rows, cols, 11);
      for (const int64_t n : {7, 13}) {
        std::vector<float> x(static_cast<size_t>(n * cols));
        std::mt19937 gen(5);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (auto& v : x) v = normal(gen);
        std::vector<float> batch(static_cast<size_t>(n * rows)), one(static_cast<size_t>(rows));
        quant_matmul_on(MatmulPath::kKernel, x.data(), n, cols, type, w.data(), rows, cols, batch.data(), rows);
        for (int64_t i = 0; i < n; ++i) {
          quant_matmul_on(MatmulPath::kKernel, x.data() + i * cols, 1, cols, type, w.data(), rows, cols, one.data(),
                          rows);
          for (int64_t r = 0; r < rows; ++r)
            ASSERT_EQ(one[r], batch[i * rows + r])
                << quant_name(type) << " cols=" << cols << " rows=" << rows << " n=" << n << " input " << i
                << " row " << r;
        }
      }
    }
  }
}

// A decode kernel takes the rows of its range two at a time (one from each half, so that
// their weights stream from two places at once); a row's result is the one it gets alone, for
// every range it can fall in, odd lengths included.
TEST_P(QuantMatmul, RowResultsDoNotDependOnTheRowRange) {
  const QuantType type = GetParam();
  const int64_t cols = 256, rows = 11;
  const std::vector<uint8_t> w = random_rows(type, rows, cols, 17);
  const int64_t row_bytes = quant_row_bytes(type, cols);
  const ActivationType at = quant_traits(type).activation;
  const int64_t stride = at == ActivationType::F32 ? cols * 4 : activation_row_bytes(at, cols);
  std::mt19937 gen(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(kMaxKernelInputs * cols));
  for (auto& v : x) v = normal(gen);
  std::vector<uint8_t> a(static_cast<size_t>(kMaxKernelInputs * stride));
  for (int64_t j = 0; j < kMaxKernelInputs; ++j) {
    if (at == ActivationType::F32) std::memcpy(a.data() + j * stride, x.data() + j * cols, cols * sizeof(float));
    else quantize_activation_row(at, x.data() + j * cols, a.data() + j * stride, cols);
  }
  const DotKernel kernel = dot_kernel(type);
  for (int inputs = 1; inputs <= kMaxKernelInputs; ++inputs) {
    std::vector<float> alone(static_cast<size_t>(inputs * rows));
    for (int64_t r = 0; r < rows; ++r) kernel(w.data(), row_bytes, a.data(), stride, inputs, alone.data(), rows, r, r + 1, cols);
    for (int64_t begin = 0; begin < 4; ++begin)
      for (int64_t end = begin + 1; end <= rows; ++end) {
        std::vector<float> y(static_cast<size_t>(inputs * rows), -1.0f);
        kernel(w.data(), row_bytes, a.data(), stride, inputs, y.data(), rows, begin, end, cols);
        for (int j = 0; j < inputs; ++j)
          for (int64_t r = begin; r < end; ++r)
            ASSERT_EQ(y[j * rows + r], alone[j * rows + r])
                << quant_name(type) << " inputs=" << inputs << " rows [" << begin << ", " << end << ") row " << r;
      }
  }
}

// The path follows from the input count (and the processor) alone, never from a timing: the paths round
// differently, so a clock-made choice let a loaded machine change a job's tokens.
TEST_P(QuantMatmul, PathIsChosenByInputCountAlone) {
  const QuantType type = GetParam();
  const int64_t cols = 256, rows = 48;
  const std::vector<uint8_t> w = random_rows(type, rows, cols, 13);
  std::mt19937 gen(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int64_t n : {1, 4, 9, 17, 64, 65, 130}) {
    std::vector<float> x(static_cast<size_t>(n * cols));
    for (auto& v : x) v = normal(gen);
    // Past 64 inputs: the 8-bit products where this processor has them for the type.
    const MatmulPath expected = n <= 64 ? MatmulPath::kKernel : prompt_matmul_path(type);
    std::vector<float> want(static_cast<size_t>(n * rows)), got(want.size());
    quant_matmul_on(expected, x.data(), n, cols, type, w.data(), rows, cols, want.data(), rows);
    for (int repeat = 0; repeat < 3; ++repeat) {
      quant_matmul(x.data(), n, cols, type, w.data(), rows, cols, got.data(), rows);
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float)))
          << quant_name(type) << " n=" << n << " did not take the " << matmul_path_name(expected) << " path";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, QuantMatmul,
                         ::testing::Values(QuantType::F32, QuantType::F16, QuantType::BF16, QuantType::Q8_0,
                                           QuantType::Q4_0, QuantType::Q4_1, QuantType::Q5_0, QuantType::Q5_1,
                                           QuantType::IQ4_NL, QuantType::Q2_K, QuantType::Q3_K, QuantType::Q4_K,
                                           QuantType::Q5_K, QuantType::Q6_K, QuantType::IQ4_XS),
                         [](const ::testing::TestParamInfo<QuantType>& p) { return std::string(quant_name(p.param)); });

TEST(WeightMatrix, MixedTypesConcatenateAndComputeAsOneMatrix) {
  const int64_t cols = 256;
  const std::vector<uint8_t> a = random_rows(QuantType::Q4_K, 8, cols, 1);
  const std::vector<uint8_t> b = random_rows(QuantType::Q6_K, 4, cols, 2);
  auto blocks = [&](QuantType t, const std::vector<uint8_t>& bytes, int64_t rows) {
    return WeightMatrix::from_blocks(
        t, at::from_blob(const_cast<uint8_t*>(bytes.data()), {rows, quant_row_bytes(t, cols)}, at::kByte).clone(),
        cols);
  };
  const at::Tensor f = at::randn({3, cols});
  const WeightMatrix m = WeightMatrix::concat(
      {blocks(QuantType::Q4_K, a, 8), blocks(QuantType::Q4_K, a, 8), blocks(QuantType::Q6_K, b, 4),
       WeightMatrix::from_tensor(f)});
  EXPECT_EQ(m.rows(), 23);
  EXPECT_EQ(m.parts().size(), 3u);  // the two Q4_K pieces share one buffer
  EXPECT_EQ(m.type_name(), "Q4_K+Q6_K+F32");
  EXPECT_EQ(m.bytes(), 16 * 144 + 4 * 210 + 3 * cols * 4);
  const at::Tensor dense = m.dequantize(at::kDouble);
  const at::Tensor x = at::randn({2, cols});
  const at::Tensor y = m.matmul(x);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 23}));
  const at::Tensor ref = at::mm(x.to(at::kDouble), dense.t());
  // The block parts see x rounded to 8 bits (Q8_K: half a step of max|x|/127 per value), so
  // each output is within |W| (max|x| / 254) of the float64 product.
  const at::Tensor bound = at::mm(at::ones_like(x, at::kDouble) * (x.abs().max().item<double>() / 254.0), dense.abs().t());
  EXPECT_TRUE(((y.to(at::kDouble) - ref).abs() <= bound * 1.01 + 1e-4).all().item<bool>())
      << (y.to(at::kDouble) - ref).abs().max();
  // The float part is exact up to float32 rounding.
  EXPECT_TRUE(at::allclose(y.narrow(1, 20, 3).to(at::kDouble), ref.narrow(1, 20, 3), 1e-5, 1e-5));
  // Embedding rows across parts.
  const at::Tensor rows = m.gather_rows(at::tensor({0, 9, 17, 22}, at::kLong), at::kFloat);
  EXPECT_TRUE(at::equal(rows, dense.index_select(0, at::tensor({0, 9, 17, 22}, at::kLong)).to(at::kFloat)));
  EXPECT_THROW(m.gather_rows(at::tensor({23}, at::kLong), at::kFloat), std::out_of_range);
}

}  // namespace
}  // namespace kvpipe
