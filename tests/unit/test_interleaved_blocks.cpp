// interleaved_blocks (Q4_0, Q8_0, Q4_K, Q6_K): the layout holds every stored byte, every ISA's product
// matches a float64 one and the portable kernel bit for bit, and a WeightMatrix repacked at load computes, looks
// up and dequantises as the stored one does.
#include "engine/kernels/cpu/interleaved_blocks.h"
#include "engine/kernels/cpu/quant_matmul.h"
#include "engine/kernels/cpu/thread_pool.h"
#include "engine/model/weight_matrix.h"
#include "tests/support/quant_rows.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

at::Tensor block_tensor(const std::vector<uint8_t>& w, int64_t rows) {
  return at::from_blob(const_cast<uint8_t*>(w.data()), {rows, static_cast<int64_t>(w.size()) / rows}, at::kByte)
      .clone();
}

class InterleavedBlocks : public ::testing::TestWithParam<QuantType> {};

// Every stored byte comes back, Q4_K's packed 6-bit scales and mins included.
TEST_P(InterleavedBlocks, RepackKeepsEveryRowsBytes) {
  const QuantType type = GetParam();
  const int64_t rows = 24, cols = quant_traits(type).block_values == 32 ? 320 : 768;
  const std::vector<uint8_t> w = test::random_rows(type, rows, cols, 3);
  const int64_t row_bytes = quant_row_bytes(type, cols);
  std::vector<uint8_t> packed(static_cast<size_t>(rows * interleaved_row_bytes(type, cols)));
  std::vector<uint8_t> row(static_cast<size_t>(row_bytes));
  interleave_rows(type, w.data(), rows, cols, packed.data());
  EXPECT_NE(0, std::memcmp(packed.data(), w.data(), w.size())) << "the layout changed nothing";
  for (int64_t r = 0; r < rows; ++r) {
    deinterleave_row(type, packed.data(), r, cols, row.data());
    ASSERT_EQ(0, std::memcmp(row.data(), w.data() + r * row_bytes, static_cast<size_t>(row_bytes))) << "row " << r;
  }
  EXPECT_THROW(interleave_rows(type, w.data(), 12, cols, packed.data()), std::invalid_argument);
  EXPECT_THROW(interleave_rows(QuantType::Q5_0, w.data(), 8, 256, packed.data()), std::invalid_argument);
}

// The n inputs x (n x cols floats) times the interleaved matrix: the portable kernel within
// float32 rounding of the float64 product of the stored rows w, writing nothing past the rows
// of y, and each of `isas` equal to it bit for bit. `what` names the case in failures.
void expect_float64_then_portable_exactly(QuantType type, const std::vector<uint8_t>& w, const std::vector<uint8_t>& packed,
                                          const std::vector<float>& x, int64_t n, int64_t rows, int64_t cols,
                                          const std::vector<InterleaveIsa>& isas, const std::string& what) {
  std::vector<double> magnitude;
  const std::vector<double> ref = test::reference(type, w, x, n, rows, cols, &magnitude);
  const ActivationType at = quant_traits(type).activation;
  const int64_t stride = activation_row_bytes(at, cols), ldy = rows + 3;
  std::vector<uint8_t> a(static_cast<size_t>(n * stride));
  for (int64_t j = 0; j < n; ++j) quantize_activation_row(at, x.data() + j * cols, a.data() + j * stride, cols);
  std::vector<float> portable(static_cast<size_t>(n * ldy), -1.0f);
  interleaved_matmul(InterleaveIsa::kPortable, a.data(), stride, n, type, packed.data(), rows, cols, portable.data(),
                     ldy);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t r = 0; r < rows; ++r)
      ASSERT_NEAR(portable[j * ldy + r], ref[j * rows + r], 1e-5 * magnitude[j * rows + r] + 1e-6)
          << what << " input " << j << " row " << r;
    for (int64_t r = rows; r < ldy; ++r) ASSERT_EQ(portable[j * ldy + r], -1.0f) << "wrote past the rows";
  }
  for (InterleaveIsa isa : isas) {
    std::vector<float> y(static_cast<size_t>(n * ldy), -1.0f);
    interleaved_matmul(isa, a.data(), stride, n, type, packed.data(), rows, cols, y.data(), ldy);
    ASSERT_EQ(0, std::memcmp(y.data(), portable.data(), y.size() * sizeof(float)))
        << interleave_isa_name(isa) << " " << what;
  }
}

// Within float32 rounding of the float64 product; every ISA that runs here equal to the
// portable kernel bit for bit, on 1 and 2 threads, at input counts that leave partial tiles.
TEST_P(InterleavedBlocks, EveryIsaMatchesFloat64AndThePortableKernelExactly) {
  const QuantType type = GetParam();
  std::vector<InterleaveIsa> vector_isas;
  for (InterleaveIsa isa : {InterleaveIsa::kAvx2, InterleaveIsa::kAvx512Vnni})
    if (interleave_runs(isa)) vector_isas.push_back(isa);
    else std::printf("interleaved %s: %s does not run on this processor\n", quant_name(type), interleave_isa_name(isa));
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::vector<int64_t> widths =
      quant_traits(type).block_values == 32 ? std::vector<int64_t>{32, 576, 1024} : std::vector<int64_t>{256, 1024, 2816};
  for (const int64_t cols : widths) {
    const int64_t rows = 40;
    const std::vector<uint8_t> w = test::random_rows(type, rows, cols, 7 + static_cast<uint32_t>(cols));
    std::vector<uint8_t> packed(static_cast<size_t>(rows * interleaved_row_bytes(type, cols)));
    interleave_rows(type, w.data(), rows, cols, packed.data());
    for (const int threads : {1, 2}) {
      ThreadPool::instance().set_threads(threads);
      for (const int64_t n : {1, 2, 3, 4, 5, 9, 13, 70}) {
        std::vector<float> x(static_cast<size_t>(n * cols));
        for (auto& v : x) v = normal(gen);
        expect_float64_then_portable_exactly(type, w, packed, x, n, rows, cols, vector_isas,
                                             "cols=" + std::to_string(cols) + " n=" + std::to_string(n) +
                                                 " threads=" + std::to_string(threads));
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
  ThreadPool::instance().set_threads(1);
}

// The largest sums the kernels meet: every value at its top (Q4_0 and Q4_K nibbles 15, Q6_K
// 63) against activations all at their largest magnitude, where AVX2's 16-bit partial sums of
// vpmaddubsw pairs come closest to wrapping (random rows stay far below). Every ISA equals the
// portable kernel, and that the float64 product.
TEST(InterleavedBlocksExtremes, LargestValuesAgainstFullActivationsStayExact) {
  struct Values {
    QuantType type;
    int64_t begin, end;  // the value bytes in each stored block
  };
  for (const Values v :
       {Values{QuantType::Q4_0, 2, 18}, Values{QuantType::Q4_K, 16, 144}, Values{QuantType::Q6_K, 0, 192}}) {
    const QuantType type = v.type;
    const int64_t rows = 16, cols = 512, n = 5;
    std::vector<uint8_t> w = test::random_rows(type, rows, cols, 41);
    const int64_t block_bytes = quant_row_bytes(type, quant_traits(type).block_values);
    for (size_t b = 0; b < w.size(); b += static_cast<size_t>(block_bytes))
      std::memset(w.data() + b + v.begin, 0xff, static_cast<size_t>(v.end - v.begin));
    std::vector<uint8_t> packed(static_cast<size_t>(rows * interleaved_row_bytes(type, cols)));
    interleave_rows(type, w.data(), rows, cols, packed.data());
    std::vector<float> x(static_cast<size_t>(n * cols));
    for (int64_t j = 0; j < n; ++j)
      for (int64_t c = 0; c < cols; ++c) x[j * cols + c] = j % 2 == 0 ? 1.0f : -1.0f;
    std::vector<InterleaveIsa> isas;
    for (InterleaveIsa isa : {InterleaveIsa::kAvx2, InterleaveIsa::kAvx512Vnni})
      if (interleave_runs(isa)) isas.push_back(isa);
    for (const int64_t inputs : {int64_t{1}, n}) {
      expect_float64_then_portable_exactly(type, w, packed, x, inputs, rows, cols, isas,
                                           std::string(quant_name(type)) + " inputs=" + std::to_string(inputs));
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// 43 rows: 40 repacked, 3 left as stored. Products at decode and prompt sizes stay within
// float32 rounding of the stored matrix's; lookups and dequantisation give the same values.
TEST_P(InterleavedBlocks, RepackedMatrixComputesAsTheStoredOne) {
  const QuantType type = GetParam();
  const int64_t rows = 43, cols = 256;
  const std::vector<uint8_t> w = test::random_rows(type, rows, cols, 29);
  const WeightMatrix stored = WeightMatrix::from_blocks(type, block_tensor(w, rows), cols);
  const WeightMatrix packed = stored.interleaved();
  ASSERT_EQ(packed.parts().size(), 2u);
  EXPECT_TRUE(packed.parts()[0].interleaved);
  EXPECT_EQ(packed.parts()[0].rows, 40);
  EXPECT_FALSE(packed.parts()[1].interleaved);
  EXPECT_EQ(packed.interleaved_bytes(), 40 * interleaved_row_bytes(type, cols));
  EXPECT_EQ(packed.bytes(), stored.bytes() + 40 * (interleaved_row_bytes(type, cols) - quant_row_bytes(type, cols)));
  EXPECT_EQ(packed.rows(), rows);
  EXPECT_EQ(packed.type_name(), quant_name(type));
  EXPECT_TRUE(at::equal(packed.dequantize(), stored.dequantize()));
  const at::Tensor ids = at::tensor({42, 0, 17, 39, 40}, at::kLong);
  EXPECT_TRUE(at::equal(packed.gather_rows(ids, at::kFloat), stored.gather_rows(ids, at::kFloat)));
  // Concatenated (q/k/v): interleaved parts of a type join into one.
  const WeightMatrix twice = WeightMatrix::concat({packed.interleaved(), packed});
  EXPECT_EQ(twice.rows(), 2 * rows);
  EXPECT_TRUE(at::equal(twice.dequantize(), at::cat({stored.dequantize(), stored.dequantize()})));
  at::manual_seed(3);
  for (const int64_t n : {1, 4, 100}) {
    const at::Tensor x = at::randn({n, cols});
    const at::Tensor want = at::mm(x.to(at::kDouble), stored.dequantize(at::kDouble).t());
    const at::Tensor got = packed.matmul(x), old = stored.matmul(x);
    const at::Tensor scale = at::mm(x.abs().to(at::kDouble), stored.dequantize(at::kDouble).abs().t());
    EXPECT_TRUE(((got.to(at::kDouble) - old.to(at::kDouble)).abs() <= 1e-5 * scale + 1e-6).all().item<bool>())
        << "n=" << n;
    // Both multiply the activations' 8-bit values, so they are as far from the float64
    // product of the float activations as the activation rounding takes them.
    EXPECT_TRUE(((got.to(at::kDouble) - want).abs() <= 2e-2 * scale + 1e-4).all().item<bool>()) << "n=" << n;
  }
  EXPECT_THROW(packed.slice({0, 8, 0, -1}), std::invalid_argument);
  EXPECT_THROW(packed.select_rows(at::arange(rows)), std::invalid_argument);
  // Other types and float matrices are shared as they are.
  const WeightMatrix dense = WeightMatrix::from_tensor(at::randn({16, 64}));
  EXPECT_EQ(dense.interleaved().interleaved_bytes(), 0);
  EXPECT_EQ(dense.interleaved().storage_id(), dense.storage_id());
}

INSTANTIATE_TEST_SUITE_P(Types, InterleavedBlocks, ::testing::Values(QuantType::Q4_0, QuantType::Q8_0, QuantType::Q4_K, QuantType::Q6_K),
                         [](const ::testing::TestParamInfo<QuantType>& p) { return std::string(quant_name(p.param)); });

}  // namespace
}  // namespace kvpipe
