// kvpipe's decoding of every block type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K,
// Q4_K, Q5_K, Q6_K, IQ4_XS) against the gguf
// package's (tests/peer/gguf_dequantize.py, numpy over ggml's layout), value for value: random
// quants and packed scales under float16 scales of every kind (normal, subnormal, zero, either
// sign), so the layouts, the 6-bit scale packing and the float16 decoding all meet a reference
// no one here wrote. Fails, naming the fix, when the gguf package is not installed.
#include "engine/kernels/cpu/quant_types.h"
#include "tests/support/command.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace kvpipe {
namespace {

class QuantGguf : public ::testing::TestWithParam<QuantType> {
 protected:
  void SetUp() override {
    dir_ = kvpipe::testing::make_scratch_dir();
    const kvpipe::testing::CommandResult probe =
        kvpipe::testing::run_command(std::string(KVPIPE_PYTHON) + " -c 'import gguf, numpy'", dir_);
    ASSERT_EQ(probe.code, 0) << "the gguf package is not importable by " << KVPIPE_PYTHON
                             << ": run scripts/setup.sh --references\n" << probe.err;
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  fs::path dir_;
};

// A float16 scale of one of the kinds the decoder must get right; mostly modest normals.
uint16_t random_half(std::mt19937& gen) {
  const uint16_t sign = (gen() & 1) ? 0x8000 : 0;
  switch (gen() % 8) {
    case 0: return static_cast<uint16_t>(sign | (gen() % 0x400));  // subnormal (or zero)
    case 1: return sign;                                           // signed zero
    case 2: return static_cast<uint16_t>(sign | ((1 + gen() % 30) << 10) | (gen() % 0x400));  // any normal
    default: return static_cast<uint16_t>(sign | ((4 + gen() % 12) << 10) | (gen() % 0x400));
  }
}

TEST_P(QuantGguf, DequantizeRowMatchesGgufPackage) {
  const QuantType type = GetParam();
  const int64_t rows = 24, cols = 1024;
  const QuantTraits& t = quant_traits(type);
  const int64_t row_bytes = quant_row_bytes(type, cols);
  std::mt19937 gen(static_cast<uint32_t>(type) + 1);
  std::vector<uint8_t> w(static_cast<size_t>(rows * row_bytes));
  for (auto& b : w) b = static_cast<uint8_t>(gen());
  for (int64_t b = 0; b < rows * cols / t.block_values; ++b) {
    uint8_t* p = w.data() + b * t.block_bytes;
    const uint16_t d = random_half(gen), dmin = random_half(gen);
    // Where each type keeps its float16 scale and its min (the others hold quants or packed
    // scales, random already).
    switch (type) {
      case QuantType::Q6_K: std::memcpy(p + 208, &d, 2); break;
      case QuantType::Q3_K: std::memcpy(p + 108, &d, 2); break;
      case QuantType::Q2_K:
        std::memcpy(p + 80, &d, 2);
        std::memcpy(p + 82, &dmin, 2);
        break;
      case QuantType::Q4_1:
      case QuantType::Q5_1:
      case QuantType::Q4_K:
      case QuantType::Q5_K:
        std::memcpy(p, &d, 2);
        std::memcpy(p + 2, &dmin, 2);
        break;
      default: std::memcpy(p, &d, 2);  // Q8_0, Q4_0, Q5_0, IQ4_NL, IQ4_XS
    }
  }
  const fs::path in = dir_ / "rows.bin", out = dir_ / "values.f32";
  std::ofstream(in, std::ios::binary).write(reinterpret_cast<const char*>(w.data()), static_cast<std::streamsize>(w.size()));
  const kvpipe::testing::CommandResult r = kvpipe::testing::run_command(
      std::string(KVPIPE_PYTHON) + " " + KVPIPE_SOURCE_DIR + "/tests/peer/gguf_dequantize.py " + quant_name(type) +
          " " + std::to_string(rows) + " " + std::to_string(cols) + " " + in.string() + " " + out.string(),
      dir_);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string ref = kvpipe::testing::slurp(out);
  ASSERT_EQ(ref.size(), static_cast<size_t>(rows * cols * 4));

  std::vector<float> got(static_cast<size_t>(cols));
  for (int64_t row = 0; row < rows; ++row) {
    dequantize_row(type, w.data() + row * row_bytes, got.data(), cols);
    for (int64_t c = 0; c < cols; ++c) {
      float expected;
      std::memcpy(&expected, ref.data() + 4 * (row * cols + c), 4);
      // Equal values (so +0 and -0 agree), both computed in float32 in ggml's order.
      ASSERT_EQ(got[c], expected) << quant_name(type) << " row " << row << " value " << c << " (super-block "
                                  << c / t.block_values << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(BlockTypes, QuantGguf,
                         ::testing::Values(QuantType::Q8_0, QuantType::Q4_0, QuantType::Q4_1, QuantType::Q5_0,
                                           QuantType::Q5_1, QuantType::IQ4_NL, QuantType::Q2_K, QuantType::Q3_K,
                                           QuantType::Q4_K, QuantType::Q5_K, QuantType::Q6_K, QuantType::IQ4_XS),
                         [](const ::testing::TestParamInfo<QuantType>& info) {
                           return std::string(quant_name(info.param));
                         });

}  // namespace
}  // namespace kvpipe
