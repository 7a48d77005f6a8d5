// Paged decode attention: the CPU float64 reference of the partitioned algorithm against a
// direct softmax over keys and values gathered the engine's way (BlockPool::gather_keys), the
// entry point's refusals (no GPU needed), and the CUDA kernel against the reference (suites
// named Gpu*, registered under the `gpu` label, skipped without a GPU).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cache/block_pool.h"
#include "engine/kernels/cpu/paged_decode_reference.h"
#include "engine/kernels/cuda/paged_decode.h"

namespace kvpipe {
namespace {

// Contexts on both sides of the 512-token partition boundary, one spanning three partitions.
const std::vector<int32_t> kBoundaryContexts = {1, 511, 512, 513, 1500};

struct DecodeCase {
  std::vector<int32_t> context_lens;
  int64_t num_kv_heads = 2;
  int64_t group = 1;  // query heads per KV head
  int64_t head_dim = 64;
  int64_t block_size = 16;
  at::ScalarType dtype = at::kFloat;
  uint32_t seed = 1;
};

// One layer of a real BlockPool (the second of two, so the layer's view has an offset) filled
// at every slot, with queries and random block tables over it.
struct DecodeInputs {
  std::unique_ptr<BlockPool> pool;
  int64_t layer = 1;
  at::Tensor query;         // [seqs, heads, head_dim], the case's dtype
  at::Tensor block_tables;  // int32 [seqs, max_blocks]; -1 past each context
  at::Tensor context_lens;  // int32 [seqs]
  double scale = 0.0;

  at::Tensor key_cache() const { return pool->keys(layer); }
  at::Tensor value_cache() const { return pool->values(layer); }
};

DecodeInputs make_inputs(const DecodeCase& c) {
  const int64_t num_seqs = static_cast<int64_t>(c.context_lens.size());
  const int64_t longest = *std::max_element(c.context_lens.begin(), c.context_lens.end());
  // One column more than the longest context needs: entries past a context must not be read.
  const int64_t max_blocks = (longest + c.block_size - 1) / c.block_size + 1;
  const int64_t num_blocks = max_blocks + 7;
  KvShape shape;
  shape.num_layers = 2;
  shape.block_size = c.block_size;
  shape.num_kv_heads = c.num_kv_heads;
  shape.head_dim = c.head_dim;
  DecodeInputs in;
  in.pool = std::make_unique<BlockPool>(shape, num_blocks, c.dtype, at::Device(at::kCPU));

  at::manual_seed(c.seed);
  const int64_t slots = num_blocks * c.block_size;
  const at::Tensor all_slots = at::arange(slots, at::kLong);
  // Keys of std 3 make the softmax peaked, so partitions' maxima differ and the merge's
  // rescaling matters; each layer gets its own values.
  for (int64_t layer = 0; layer < 2; ++layer)
    in.pool->write(layer, all_slots, 3.0 * at::randn({slots, c.num_kv_heads, c.head_dim}),
                   at::rand({slots, c.num_kv_heads, c.head_dim}) * 2.0 - 1.0);
  in.query = at::randn({num_seqs, c.num_kv_heads * c.group, c.head_dim}).to(c.dtype);
  in.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));

  // Each sequence's blocks: a random draw without repetition from the whole pool (sequences
  // may share blocks, as they do under prefix caching).
  std::mt19937 rng(c.seed);
  std::vector<int32_t> table(num_seqs * max_blocks, -1);
  std::vector<int32_t> order(num_blocks);
  for (int64_t s = 0; s < num_seqs; ++s) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const int64_t used = (c.context_lens[s] + c.block_size - 1) / c.block_size;
    std::copy(order.begin(), order.begin() + used, table.begin() + s * max_blocks);
  }
  in.block_tables = at::tensor(table, at::kInt).view({num_seqs, max_blocks});
  in.context_lens = at::tensor(c.context_lens, at::kInt);
  return in;
}

// The straightforward statement: gather every key and value of the sequence through the pool's
// own gather, then one softmax over all scores, in float64.
at::Tensor direct_attention(const DecodeInputs& in) {
  const int64_t num_seqs = in.query.size(0), num_heads = in.query.size(1);
  const int64_t block_size = in.pool->block_size();
  const int64_t num_kv_heads = in.pool->shape().num_kv_heads, group = num_heads / num_kv_heads;
  std::vector<at::Tensor> outs;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = in.context_lens[s].item<int32_t>();
    std::vector<int64_t> slots(len);
    for (int64_t p = 0; p < len; ++p)
      slots[p] = static_cast<int64_t>(in.block_tables[s][p / block_size].item<int32_t>()) * block_size +
                 p % block_size;
    const at::Tensor slot_tensor = at::tensor(slots, at::kLong);
    const at::Tensor k = in.pool->gather_keys(in.layer, slot_tensor).to(at::kDouble);    // [L, kv, D]
    const at::Tensor v = in.pool->gather_values(in.layer, slot_tensor).to(at::kDouble);  // [L, kv, D]
    std::vector<at::Tensor> heads;
    for (int64_t h = 0; h < num_heads; ++h) {
      const at::Tensor q = in.query[s][h].to(at::kDouble);
      const at::Tensor scores = at::mv(k.select(1, h / group), q) * in.scale;
      heads.push_back(at::mv(v.select(1, h / group).t(), at::softmax(scores, 0)));
    }
    outs.push_back(at::stack(heads));
  }
  return at::stack(outs);
}

// Largest |a - b| / (1 + |b|) over all values (a relative error that stays meaningful near 0).
double max_relative_error(const at::Tensor& actual, const at::Tensor& expected) {
  const at::Tensor a = actual.to(at::kDouble).cpu(), b = expected.to(at::kDouble).cpu();
  return ((a - b).abs() / (b.abs() + 1.0)).max().item<double>();
}

void expect_invalid_argument(const std::function<void()>& call, const std::string& names) {
  try {
    call();
    ADD_FAILURE() << "no std::invalid_argument; expected one naming " << names;
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(names), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

std::string case_name(const DecodeCase& c) {
  return "group " + std::to_string(c.group) + ", head_dim " + std::to_string(c.head_dim) + ", block_size " +
         std::to_string(c.block_size) + ", " + c10::toString(c.dtype);
}

TEST(PagedDecodeReference, MatchesDirectSoftmaxAcrossPartitionBoundaries) {
  for (const int64_t group : {1, 3, 8}) {
    for (const int64_t block_size : {16, 5}) {
      DecodeCase c;
      c.context_lens = kBoundaryContexts;
      c.group = group;
      c.block_size = block_size;
      c.head_dim = 32;  // the reference takes any head_dim; small keeps the float64 loops fast
      c.seed = static_cast<uint32_t>(group * 100 + block_size);
      const DecodeInputs in = make_inputs(c);
      const at::Tensor got = paged_decode_reference(in.query, in.key_cache(), in.value_cache(), in.block_tables,
                                                    in.context_lens, c.block_size, in.scale);
      ASSERT_EQ(got.scalar_type(), at::kDouble);
      ASSERT_EQ(got.sizes(), in.query.sizes());
      // Both sides are float64 over the same values: only summation order differs.
      EXPECT_LT(max_relative_error(got, direct_attention(in)), 1e-12) << case_name(c);
    }
  }
}

TEST(PagedDecodeReference, ReadsHalfPrecisionPools) {
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    DecodeCase c;
    c.context_lens = {700, 3};
    c.group = 3;
    c.dtype = dtype;
    const DecodeInputs in = make_inputs(c);
    const at::Tensor got = paged_decode_reference(in.query, in.key_cache(), in.value_cache(), in.block_tables,
                                                  in.context_lens, c.block_size, in.scale);
    EXPECT_LT(max_relative_error(got, direct_attention(in)), 1e-12) << case_name(c);
  }
}

TEST(PagedDecodeReference, DependsOnEveryTokenOfTheContext) {
  // A changed value in the last token of a sequence's third partition moves that sequence's
  // output: the reference reads the whole context and only it.
  DecodeCase c;
  c.context_lens = {1500, 20};
  const DecodeInputs in = make_inputs(c);
  const at::Tensor before = paged_decode_reference(in.query, in.key_cache(), in.value_cache(), in.block_tables,
                                                   in.context_lens, c.block_size, in.scale);
  const int64_t last = 1499;
  const int64_t slot = in.block_tables[0][last / c.block_size].item<int32_t>() * c.block_size + last % c.block_size;
  in.value_cache()[slot].add_(100.0);
  const at::Tensor after = paged_decode_reference(in.query, in.key_cache(), in.value_cache(), in.block_tables,
                                                  in.context_lens, c.block_size, in.scale);
  EXPECT_GT((after[0] - before[0]).abs().max().item<double>(), 1e-6);
  EXPECT_LT(max_relative_error(after, direct_attention(in)), 1e-12);
}

TEST(PagedDecodeReference, RefusesContextsAndBlocksOutsideThePool) {
  DecodeCase c;
  c.context_lens = {40, 8};
  const DecodeInputs in = make_inputs(c);
  const auto run = [&](const at::Tensor& tables, const at::Tensor& lens) {
    paged_decode_reference(in.query, in.key_cache(), in.value_cache(), tables, lens, c.block_size, in.scale);
  };
  const int64_t capacity = in.block_tables.size(1) * c.block_size;
  expect_invalid_argument([&] { run(in.block_tables, at::tensor(std::vector<int32_t>{0, 8}, at::kInt)); },
                          "context_lens[0]");
  expect_invalid_argument(
      [&] { run(in.block_tables, at::tensor(std::vector<int32_t>{40, static_cast<int32_t>(capacity + 1)}, at::kInt)); },
      "context_lens[1]");
  at::Tensor tables = in.block_tables.clone();
  tables[1][0] = static_cast<int32_t>(in.pool->num_blocks());
  expect_invalid_argument([&] { run(tables, in.context_lens); }, "block_tables[1][0]");
  tables = in.block_tables.clone();
  tables[0][2] = -1;
  expect_invalid_argument([&] { run(tables, in.context_lens); }, "block_tables[0][2]");
}

// Refusals that need no GPU: the argument checks run before anything touches the device.
TEST(PagedDecodeEntry, RefusesBadInputNamingTheArgument) {
  DecodeCase c;
  c.context_lens = {30, 4};
  c.group = 2;
  const DecodeInputs in = make_inputs(c);
  const at::Tensor k = in.key_cache(), v = in.value_cache();
  const auto call = [&](const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& tables, const at::Tensor& lens) {
    const int64_t block_size = c.block_size;
    const double scale = in.scale;
    return [=] { paged_decode_attention(q, key, value, tables, lens, block_size, scale); };
  };
  expect_invalid_argument(call(in.query, k, v, in.block_tables.to(at::kLong), in.context_lens),
                          "block_tables must be int32");
  expect_invalid_argument(call(in.query, k, v, in.block_tables, in.context_lens.to(at::kLong)),
                          "context_lens must be int32");
  expect_invalid_argument(call(at::randn({2, 4, 96}), at::randn({16, 2, 96}), at::randn({16, 2, 96}),
                               in.block_tables, in.context_lens),
                          "head_dim 96");
  // 5 query heads over 2 KV heads: no whole group per KV head.
  expect_invalid_argument(call(at::randn({2, 5, 64}), k, v, in.block_tables, in.context_lens), "heads");
  expect_invalid_argument(call(in.query, k.to(at::kHalf), v, in.block_tables, in.context_lens), "key_cache dtype");
  expect_invalid_argument(call(in.query, k, v.narrow(0, 0, 32), in.block_tables, in.context_lens), "value_cache");
  expect_invalid_argument(call(in.query.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), in.block_tables,
                               in.context_lens),
                          "query dtype");
  expect_invalid_argument(call(in.query, k, v, in.block_tables.narrow(0, 0, 1), in.context_lens), "block_tables");
  expect_invalid_argument([&] { paged_decode_attention(in.query, k, v, in.block_tables, in.context_lens, 0, 1.0); },
                          "block_size");
  // Every check above passed these: only the device is wrong.
  expect_invalid_argument(call(in.query, k, v, in.block_tables, in.context_lens), "query must be a CUDA tensor");
}

// --- CUDA kernel against the reference (label gpu) ---

#define KVPIPE_SKIP_WITHOUT_GPU() \
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device: the paged decode kernel needs a GPU"

at::Tensor run_kernel(const DecodeInputs& in, int64_t block_size) {
  const at::Device gpu(at::kCUDA, 0);
  return paged_decode_attention(in.query.to(gpu), in.key_cache().to(gpu), in.value_cache().to(gpu),
                                in.block_tables.to(gpu), in.context_lens.to(gpu), block_size, in.scale);
}

// The kernel reads exactly the stored values the reference reads and accumulates in float32,
// whose error over 1500 tokens of |v| <= 1 stays below 1e-5 relative, so float32 outputs
// meet 1e-4. Float16 and bfloat16 outputs are rounded once to their dtype (2^-11 and 2^-8
// relative), and the query is used at that precision on both sides: 2e-2 bounds the output
// rounding with margin while a wrong partition or head would miss by far more.
void expect_kernel_matches_reference(at::ScalarType dtype, double tolerance) {
  for (const int64_t head_dim : {64, 128}) {
    for (const int64_t group : {1, 3, 8, 16}) {
      DecodeCase c;
      c.context_lens = kBoundaryContexts;
      c.group = group;
      c.head_dim = head_dim;
      c.dtype = dtype;
      c.seed = static_cast<uint32_t>(head_dim + group);
      const DecodeInputs in = make_inputs(c);
      const at::Tensor got = run_kernel(in, c.block_size);
      ASSERT_EQ(got.scalar_type(), dtype);
      ASSERT_EQ(got.sizes(), in.query.sizes());
      const at::Tensor expected = paged_decode_reference(in.query, in.key_cache(), in.value_cache(),
                                                         in.block_tables, in.context_lens, c.block_size, in.scale);
      EXPECT_LT(max_relative_error(got, expected), tolerance) << case_name(c);
    }
  }
}

TEST(GpuPagedDecode, MatchesReferenceFloat32) {
  KVPIPE_SKIP_WITHOUT_GPU();
  expect_kernel_matches_reference(at::kFloat, 1e-4);
}

TEST(GpuPagedDecode, MatchesReferenceBFloat16) {
  KVPIPE_SKIP_WITHOUT_GPU();
  expect_kernel_matches_reference(at::kBFloat16, 2e-2);
}

TEST(GpuPagedDecode, MatchesReferenceFloat16) {
  KVPIPE_SKIP_WITHOUT_GPU();
  expect_kernel_matches_reference(at::kHalf, 2e-2);
}

TEST(GpuPagedDecode, OddBlockSizeAndManySequences) {
  KVPIPE_SKIP_WITHOUT_GPU();
  DecodeCase c;
  for (int i = 0; i < 40; ++i) c.context_lens.push_back(1 + (i * 97) % 1100);
  c.block_size = 5;
  c.group = 4;
  c.num_kv_heads = 3;
  c.head_dim = 128;
  const DecodeInputs in = make_inputs(c);
  const at::Tensor expected = paged_decode_reference(in.query, in.key_cache(), in.value_cache(), in.block_tables,
                                                     in.context_lens, c.block_size, in.scale);
  EXPECT_LT(max_relative_error(run_kernel(in, c.block_size), expected), 1e-4);
}

TEST(GpuPagedDecode, BadBlockOrContextGivesNaNForThatSequenceOnly) {
  KVPIPE_SKIP_WITHOUT_GPU();
  DecodeCase c;
  c.context_lens = {600, 100, 30};
  DecodeInputs in = make_inputs(c);
  in.block_tables[0][35] = static_cast<int32_t>(in.pool->num_blocks());  // token 560..575
  in.context_lens[2] = static_cast<int32_t>(in.block_tables.size(1) * c.block_size + 1);
  const at::Tensor got = run_kernel(in, c.block_size).cpu();
  EXPECT_TRUE(got[0].isnan().all().item<bool>());
  EXPECT_TRUE(got[1].isfinite().all().item<bool>());
  EXPECT_TRUE(got[2].isnan().all().item<bool>());
}

}  // namespace
}  // namespace kvpipe
