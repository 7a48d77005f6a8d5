// Tensor parallelism's split of a model (engine/model/tensor_split.h) and the slices a tensor
// rank loads: heads, replicated KV heads, intermediate units dealt out in whole blocks,
// vocabulary rows, and the refusals naming parallel.tensor; block-aligned column slices of
// quantised rows, read from GGUF and safetensors files as only the slice's bytes; and the
// slices' products summing (row-parallel) or side by side (column-parallel) to the whole.
#include "engine/model/gguf.h"
#include "engine/model/model_weights.h"
#include "engine/model/safetensors.h"
#include "engine/model/tensor_split.h"
#include "engine/model/weight_matrix.h"
#include "tests/support/command.h"

#include <ATen/ATen.h>

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;

ModelConfig shape(int64_t heads, int64_t kv_heads, int64_t intermediate, int64_t vocab = 1000) {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = 64;
  c.hidden_size = heads * 64;
  c.intermediate_size = intermediate;
  c.vocab_size = vocab;
  c.num_layers = 2;
  return c;
}

std::string refusal(const ModelConfig& c, int size, SplitAlignment align = {}) {
  try {
    check_tensor_split(c, size, align);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// Q8_0 rows of `cols` values: each block a float16 scale of 1/64 and 32 int8 values.
at::Tensor q8_0_rows(int64_t rows, int64_t cols) {
  at::Tensor bytes = at::empty({rows, cols / 32 * 34}, at::kByte);
  const at::Tensor q = at::randint(-127, 128, {rows * cols}, at::TensorOptions().dtype(at::kChar));
  uint8_t* b = bytes.data_ptr<uint8_t>();
  const int8_t* v = q.data_ptr<int8_t>();
  for (int64_t i = 0; i < rows * cols / 32; ++i) {
    const uint16_t d = 0x2400;  // 1/64 in float16
    std::memcpy(b + i * 34, &d, 2);
    std::memcpy(b + i * 34 + 2, v + i * 32, 32);
  }
  return bytes;
}

TEST(TensorSplit, HeadsUnitsAndVocabularyInContiguousShares) {
  const ModelConfig c = shape(8, 4, 1024, 1001);
  const TensorSplit r1 = plan_tensor_split(c, 2, 1, {1, 256});
  EXPECT_EQ(r1.first_head, 4);
  EXPECT_EQ(r1.heads, 4);
  EXPECT_EQ(r1.first_kv_head, 2);
  EXPECT_EQ(r1.kv_heads, 2);
  EXPECT_EQ(r1.ff_begin, 512);
  EXPECT_EQ(r1.ff_units, 512);
  EXPECT_EQ(r1.vocab_begin, 500);
  EXPECT_EQ(r1.vocab_rows, 501);
  const TensorSplit whole = plan_tensor_split(c, 1, 0);
  EXPECT_TRUE(whole.whole());
  EXPECT_EQ(whole.heads, 8);
  EXPECT_EQ(whole.ff_units, 1024);
}

TEST(TensorSplit, MoreRanksThanKvHeadsShareEachKvHead) {
  const ModelConfig c = shape(8, 2, 1024);
  for (int r = 0; r < 8; ++r) {
    const TensorSplit s = plan_tensor_split(c, 8, r);
    EXPECT_EQ(s.heads, 1);
    EXPECT_EQ(s.kv_heads, 1);
    // Query head r reads KV head r / (8 / 2), as on one rank.
    EXPECT_EQ(s.first_kv_head, r / 4) << r;
  }
}

TEST(TensorSplit, IntermediateUnitsFallOnWholeBlocksAsEvenlyAsTheyCan) {
  // 1536 units are 6 blocks of 256: 4 ranks take 1, 2, 1, 2 blocks.
  const ModelConfig c = shape(8, 8, 1536);
  int64_t next = 0, total = 0;
  for (int r = 0; r < 4; ++r) {
    const TensorSplit s = plan_tensor_split(c, 4, r, {1, 256});
    EXPECT_EQ(s.ff_begin, next);
    EXPECT_EQ(s.ff_begin % 256, 0);
    EXPECT_EQ(s.ff_units % 256, 0);
    EXPECT_GE(s.ff_units, 256);
    EXPECT_LE(s.ff_units, 512);
    next = s.ff_begin + s.ff_units;
    total += s.ff_units;
  }
  EXPECT_EQ(total, 1536);
}

TEST(TensorSplit, SplitsThatCannotBeMadeAreRefusedByName) {
  EXPECT_NE(refusal(shape(6, 2, 512), 4).find("parallel.tensor: 4 does not divide the model's 6 attention heads"),
            std::string::npos);
  EXPECT_NE(refusal(shape(6, 2, 512), 3).find("the model's 2 KV heads: neither divides the other"),
            std::string::npos);
  // 8 heads of 64 over 4 ranks: 128 columns of o_proj per rank, not whole Q4_K blocks of 256.
  EXPECT_NE(refusal(shape(8, 8, 1024), 4, {256, 256})
                .find("gives each rank 2 heads of 64 = 128 columns of o_proj, which is not a whole number of its "
                      "256-value blocks"),
            std::string::npos)
      << refusal(shape(8, 8, 1024), 4, {256, 256});
  EXPECT_NE(refusal(shape(8, 8, 512), 4, {1, 256}).find("cannot each take a block of the 512 intermediate units"),
            std::string::npos);
  EXPECT_EQ(refusal(shape(8, 8, 1024), 2, {256, 256}), "");
}

TEST(WeightMatrixSlice, ColumnsOfBlocksFallOnBlockBoundaries) {
  const WeightMatrix m = WeightMatrix::from_blocks(QuantType::Q8_0, q8_0_rows(6, 128), 128);
  const WeightMatrix s = m.slice({1, 4, 32, 64});
  EXPECT_EQ(s.rows(), 4);
  EXPECT_EQ(s.cols(), 64);
  EXPECT_TRUE(at::equal(s.dequantize(), m.dequantize().narrow(0, 1, 4).narrow(1, 32, 64)));
  // The slice owns its bytes: a copy, not a view of the whole.
  EXPECT_EQ(s.bytes(), 4 * 2 * 34);
  EXPECT_THROW(m.slice({0, -1, 16, 32}), std::invalid_argument);
  EXPECT_THROW(m.slice({0, -1, 32, 48}), std::invalid_argument);
  EXPECT_THROW(m.slice({4, 3, 0, -1}), std::invalid_argument);
}

TEST(WeightMatrixSlice, RowParallelPartsSumToTheWholeProduct) {
  const at::Tensor w = at::randn({24, 96});
  const at::Tensor x = at::randn({3, 96});
  const WeightMatrix m = WeightMatrix::from_tensor(w);
  const at::Tensor whole = m.matmul(x);
  at::Tensor sum = at::zeros_like(whole);
  for (int64_t c0 : {0, 40}) {
    const int64_t n = c0 == 0 ? 40 : 56;
    sum += m.slice({0, -1, c0, n}).matmul(x.narrow(1, c0, n).contiguous());
  }
  EXPECT_TRUE(at::allclose(sum, whole, 1e-5, 1e-5));
  // Column-parallel: row slices side by side.
  const at::Tensor parts = at::cat({m.slice({0, 10, 0, -1}).matmul(x), m.slice({10, 14, 0, -1}).matmul(x)}, 1);
  EXPECT_TRUE(at::equal(parts, whole));
}

TEST(SlicedLoads, GgufAndSafetensorsReadOnlyTheSlice) {
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  const at::Tensor blocks = q8_0_rows(8, 256);
  const at::Tensor dense = at::randn({8, 256}).to(at::kHalf);
  {
    GgufWriter w;
    w.add_string("general.architecture", "llama");
    w.add_tensor("q8", 8 /* GGML_TYPE_Q8_0 */, {256, 8},
                 std::string(reinterpret_cast<const char*>(blocks.data_ptr()), blocks.nbytes()));
    w.add_tensor("f16", dense);
    w.write((dir / "m.gguf").string());
    write_safetensors((dir / "m.safetensors").string(), {{"f16", dense}}, {});
  }
  const GgufFile file((dir / "m.gguf").string());
  const MatrixSlice slice{2, 3, 64, 128};
  const WeightMatrix q = file.load_matrix("q8", slice);
  EXPECT_EQ(q.bytes(), 3 * 4 * 34);
  EXPECT_TRUE(at::equal(q.dequantize(), file.load_matrix("q8").dequantize().narrow(0, 2, 3).narrow(1, 64, 128)));
  EXPECT_TRUE(at::equal(file.load_matrix("f16", slice).dequantize(at::kHalf), dense.narrow(0, 2, 3).narrow(1, 64, 128)));
  try {
    file.load_matrix("q8", {0, -1, 16, 32});
    FAIL() << "a slice through a block loaded";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("do not fall on Q8_0 blocks of 32 values"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'q8'"), std::string::npos) << e.what();
  }
  const SafetensorsFile st((dir / "m.safetensors").string());
  EXPECT_TRUE(at::equal(st.load("f16", at::kFloat, slice), dense.narrow(0, 2, 3).narrow(1, 64, 128).to(at::kFloat)));
  fs::remove_all(dir);
}

TEST(SlicedLoads, TensorRanksWeightsAreSlicesOfTheWholeModel) {
  ModelConfig c = shape(4, 2, 96, 50);
  c.hidden_size = 64;
  c.head_dim = 16;
  c.max_position = 64;
  c.tie_embeddings = false;
  const WeightSelection all{{0, 2}, true, true, {}};
  const ModelWeights whole = random_weights(c, all, 4, 0.1, at::kFloat);
  for (int r = 0; r < 2; ++r) {
    WeightSelection sel = all;
    sel.split = plan_tensor_split(c, 2, r);
    const ModelWeights part = random_weights(c, sel, 4, 0.1, at::kFloat);
    const LayerWeights& w = whole.layer[1];
    const LayerWeights& p = part.layer[1];
    // q rows of heads 2r..2r+1, then k and v rows of KV head r.
    const at::Tensor qkv = w.qkv.dequantize();
    EXPECT_TRUE(at::equal(p.qkv.dequantize(), at::cat({qkv.narrow(0, 32 * r, 32), qkv.narrow(0, 64 + 16 * r, 16),
                                                       qkv.narrow(0, 96 + 16 * r, 16)})));
    EXPECT_TRUE(at::equal(p.o.dequantize(), w.o.dequantize().narrow(1, 32 * r, 32)));
    const at::Tensor gu = w.gate_up.dequantize();
    EXPECT_TRUE(at::equal(p.gate_up.dequantize(), at::cat({gu.narrow(0, 48 * r, 48), gu.narrow(0, 96 + 48 * r, 48)})));
    EXPECT_TRUE(at::equal(p.down.dequantize(), w.down.dequantize().narrow(1, 48 * r, 48)));
    EXPECT_TRUE(at::equal(part.lm_head.dequantize(), whole.lm_head.dequantize().narrow(0, 25 * r, 25)));
    EXPECT_TRUE(at::equal(part.layer[0].input_norm, whole.layer[0].input_norm));  // replicated
    EXPECT_LT(part.bytes(), whole.bytes() * 0.6);
  }
}

}  // namespace
}  // namespace kvpipe
