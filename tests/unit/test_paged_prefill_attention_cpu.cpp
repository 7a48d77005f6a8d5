// The CPU's tiled prefill attention over the paged pool (engine/kernels/cpu/paged_prefill_attention.h)
// against a float64 softmax over the keys each new token may see, decoded by the pool's own
// gather: every stored type, windows with sinks, sliding windows and soft-capped scores, block
// sizes 1, 5 and 16, prompts with and without a cached prefix, on the vector and the portable
// build. Then the guarantee that a row's result is the same bit for bit whatever tile, thread,
// batch or step computes it, and the refusals.
#include "cache/block_pool.h"
#include "engine/kernels/cpu/paged_attention.h"
#include "engine/kernels/cpu/paged_prefill_attention.h"
#include "engine/kernels/cpu/thread_pool.h"
#include "tests/support/paged_kv_fixture.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

struct Seq {
  int32_t cached = 0;  // tokens before this step
  int32_t fresh = 0;   // new tokens (queries)
};

struct Case {
  std::vector<Seq> seqs;
  int64_t kv_heads = 2;
  int64_t group = 1;
  int64_t head_dim = 64;
  int64_t block_size = 16;
  KvDtype dtype = KvDtype::kFloat32;
  PagedDecodeWindow window;
  uint32_t seed = 1;
};

struct Inputs {
  std::unique_ptr<BlockPool> pool;
  int64_t layer = 1;  // the second of two layers: its storage starts at an offset
  at::Tensor query;   // float32 [tokens, heads, head_dim]
  std::vector<int32_t> tables, lens, cu;
  int64_t max_blocks = 0;
  float scale = 0.0f;
};

Inputs make_inputs(const Case& c) {
  Inputs in;
  in.cu.push_back(0);
  int64_t longest = 1;
  for (const Seq& s : c.seqs) {
    in.lens.push_back(s.cached + s.fresh);
    in.cu.push_back(in.cu.back() + s.fresh);
    longest = std::max<int64_t>(longest, s.cached + s.fresh);
  }
  in.max_blocks = (longest + c.block_size - 1) / c.block_size + 1;  // a column past every context
  const int64_t num_blocks = in.max_blocks + 5;
  in.pool = kvpipe::testing::random_kv_pool(c.kv_heads, c.head_dim, c.block_size, num_blocks, c.dtype, c.seed);
  in.query = at::randn({in.cu.back(), c.kv_heads * c.group, c.head_dim});
  in.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  in.tables = kvpipe::testing::scattered_block_tables(in.lens, c.block_size, in.max_blocks, num_blocks, c.seed);
  return in;
}

bool sees(int64_t k, int64_t p, const PagedDecodeWindow& w) { return kvpipe::testing::window_sees(k, p, w); }

// Each sequence's keys and values decoded by BlockPool::gather (the engine's own decode of the
// stored type), then for every new token one softmax in float64 over the keys it sees.
at::Tensor direct_float64(const Inputs& in, const Case& c) {
  const int64_t heads = in.query.size(1);
  std::vector<at::Tensor> outs;
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    const int64_t len = in.lens[s], n = c.seqs[s].fresh;
    if (n == 0) continue;
    std::vector<int64_t> slots;
    for (int64_t k = 0; k < len; ++k)
      slots.push_back(static_cast<int64_t>(in.tables[s * in.max_blocks + k / c.block_size]) * c.block_size +
                      k % c.block_size);
    const at::Tensor st = at::tensor(slots, at::kLong);
    const at::Tensor k = in.pool->gather_keys(in.layer, st).to(at::kDouble);    // [len, kvh, hd]
    const at::Tensor v = in.pool->gather_values(in.layer, st).to(at::kDouble);
    at::Tensor hidden = at::zeros({n, len}, at::kBool);
    auto mask = hidden.accessor<bool, 2>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t key = 0; key < len; ++key) mask[i][key] = !sees(key, len - n + i, c.window);
    const at::Tensor q = in.query.narrow(0, in.cu[s], n).to(at::kDouble);  // [n, heads, hd]
    std::vector<at::Tensor> per_head;
    for (int64_t h = 0; h < heads; ++h) {
      at::Tensor scores = at::mm(q.select(1, h), k.select(1, h / c.group).t()) * in.scale;
      if (c.window.softcap > 0) scores = (scores / c.window.softcap).tanh() * c.window.softcap;
      scores.masked_fill_(hidden, -std::numeric_limits<double>::infinity());
      per_head.push_back(at::mm(at::softmax(scores, 1), v.select(1, h / c.group)));
    }
    outs.push_back(at::stack(per_head, 1));
  }
  return at::cat(outs);
}

at::Tensor run_kernel(const Inputs& in, const Case& c) {
  at::Tensor out = at::full_like(in.query, std::nanf(""));
  paged_prefill_attention_cpu(in.query.data_ptr<float>(), in.query.size(1), paged_kv_layer(*in.pool, in.layer),
                              in.tables.data(), in.max_blocks, in.lens.data(), in.cu.data(),
                              static_cast<int64_t>(c.seqs.size()), c.window, in.scale, out.data_ptr<float>());
  return out;
}

double max_relative_error(const at::Tensor& a, const at::Tensor& b) {
  return ((a.to(at::kDouble) - b).abs() / (b.abs() + 1.0)).max().item<double>();
}

std::string describe(const Case& c) {
  return kv_dtype_name(c.dtype) + ", block_size " + std::to_string(c.block_size) + ", group " +
         std::to_string(c.group) + ", head_dim " + std::to_string(c.head_dim) + ", window sinks " +
         std::to_string(c.window.sinks) + " recent " + std::to_string(c.window.recent) + " sliding " +
         std::to_string(c.window.sliding) + " softcap " + std::to_string(c.window.softcap) + " (" +
         paged_attention_isa() + ")";
}

// A one-token step beside prompts; a prompt of several tiles; prompts after cached prefixes
// that end inside a chunk and span several chunks.
const std::vector<Seq> kSeqs = {{0, 1}, {0, 70}, {37, 33}, {250, 45}};

TEST(CpuPagedPrefill, MatchesFloat64ForEveryStoredTypeWindowAndBlockSize) {
  std::vector<PagedDecodeWindow> windows(5);
  windows[1].sinks = 4, windows[1].recent = 37;  // attention sinks plus recent keys
  windows[2].recent = 100;                       // no sinks
  windows[3].sliding = 50;                       // a layer's own sliding window (Gemma 2)
  windows[4].sliding = 120, windows[4].softcap = 50.0, windows[4].sinks = 2, windows[4].recent = 60;
  int checked = 0;
  for (const KvDtype dtype : {KvDtype::kFloat32, KvDtype::kFloat16, KvDtype::kBFloat16, KvDtype::kQ8_0})
    for (const int64_t block_size : {1, 5, 16})
      for (const int64_t group : {1, 3})
        for (const PagedDecodeWindow& window : windows) {
          Case c;
          c.seqs = kSeqs, c.dtype = dtype, c.block_size = block_size, c.group = group, c.window = window;
          c.seed = static_cast<uint32_t>(++checked);
          const Inputs in = make_inputs(c);
          EXPECT_LT(max_relative_error(run_kernel(in, c), direct_float64(in, c)), 2e-5) << describe(c);
        }
  EXPECT_EQ(checked, 4 * 3 * 2 * 5);
}

// Head sizes other than 64, among them one the vector build leaves to the portable tiles (40),
// and a group of 8 query heads per KV head (tiles of 8 tokens).
TEST(CpuPagedPrefill, MatchesFloat64ForOtherHeadSizesAndGroups) {
  for (const int64_t head_dim : {32, 40, 72, 128})
    for (const int64_t group : {2, 8}) {
      Case c;
      c.seqs = {{0, 40}, {13, 20}}, c.head_dim = head_dim, c.group = group, c.block_size = 16;
      c.dtype = head_dim % 32 == 0 ? KvDtype::kQ8_0 : KvDtype::kFloat16, c.window.sinks = 4, c.window.recent = 24;
      const Inputs in = make_inputs(c);
      EXPECT_LT(max_relative_error(run_kernel(in, c), direct_float64(in, c)), 2e-5) << describe(c);
    }
}

// The vector build and the portable one agree with float64 (KVPIPE_CPU_KERNELS=portable runs
// the latter for the whole process: ctest runs this test in a process of its own, so it sets
// the variable before the kernels' first use).
TEST(CpuPagedPrefill, PortableBuildMatchesFloat64) {
  setenv("KVPIPE_CPU_KERNELS", "portable", 1);
  ASSERT_STREQ(paged_attention_isa(), "portable") << "a kernel ran before this test set KVPIPE_CPU_KERNELS";
  for (const KvDtype dtype : {KvDtype::kFloat32, KvDtype::kFloat16, KvDtype::kBFloat16, KvDtype::kQ8_0}) {
    Case c;
    c.seqs = kSeqs, c.dtype = dtype, c.block_size = 5, c.group = 2, c.head_dim = 64;
    c.window.sinks = 3, c.window.recent = 90;
    const Inputs in = make_inputs(c);
    EXPECT_LT(max_relative_error(run_kernel(in, c), direct_float64(in, c)), 2e-5) << describe(c);
  }
  unsetenv("KVPIPE_CPU_KERNELS");
}

// The kernel on `in`'s pool with other queries, sequences and tables.
at::Tensor run_on(const Inputs& in, const at::Tensor& query, const std::vector<int32_t>& tables,
                  const std::vector<int32_t>& lens, const std::vector<int32_t>& cu, const PagedDecodeWindow& window) {
  at::Tensor out = at::full_like(query, std::nanf(""));
  paged_prefill_attention_cpu(query.data_ptr<float>(), query.size(1), paged_kv_layer(*in.pool, in.layer), tables.data(),
                              in.max_blocks, lens.data(), cu.data(), static_cast<int64_t>(lens.size()), window, in.scale,
                              out.data_ptr<float>());
  return out;
}

// A row's result depends on nothing but its own keys: the same bits from one call over a whole
// prompt, from the prompt split into two steps (the second after a cached prefix), from two
// threads, and from the prompt batched behind another sequence.
TEST(CpuPagedPrefill, RowsAreTheSameWhateverTileThreadBatchOrStep) {
  for (const int64_t group : {1, 3}) {
    Case c;
    c.seqs = {{0, 150}}, c.group = group, c.dtype = KvDtype::kBFloat16;
    const Inputs in = make_inputs(c);
    const at::Tensor one = run_kernel(in, c);
    const at::Tensor head = in.query.narrow(0, 0, 59).contiguous(), rest = in.query.narrow(0, 59, 91).contiguous();
    EXPECT_TRUE(at::equal(run_on(in, head, in.tables, {59}, {0, 59}, c.window), one.narrow(0, 0, 59)))
        << "group " << group;
    EXPECT_TRUE(at::equal(run_on(in, rest, in.tables, {150}, {0, 91}, c.window), one.narrow(0, 59, 91)))
        << "group " << group;

    ThreadPool::instance().set_threads(2);
    const at::Tensor two = run_kernel(in, c);
    ThreadPool::instance().set_threads(1);
    EXPECT_TRUE(at::equal(one, two)) << "group " << group;

    std::vector<int32_t> tables = in.tables;
    tables.insert(tables.end(), in.tables.begin(), in.tables.end());
    const at::Tensor other = at::randn({30, in.query.size(1), in.query.size(2)});
    const at::Tensor batched = run_on(in, at::cat({other, in.query}), tables, {40, 150}, {0, 30, 180}, c.window);
    EXPECT_TRUE(at::equal(batched.narrow(0, 30, 150), one)) << "group " << group;
  }
}

TEST(CpuPagedPrefill, RefusesContextsOffsetsAndBlocksOutsideThePool) {
  Case c;
  c.seqs = {{4, 16}};
  Inputs in = make_inputs(c);
  auto refused = [&](const char* what) {
    try {
      run_kernel(in, c);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  in.lens = {15};  // fewer than the new tokens
  refused("context_lens");
  in.lens = {static_cast<int32_t>(in.max_blocks * c.block_size + 1)};
  refused("context_lens");
  in.lens = {20};
  in.cu = {16, 0};
  refused("cu_seqlens_q");
  in.cu = {0, 16};
  in.tables[1] = static_cast<int32_t>(in.pool->num_blocks());  // the block of positions 16..19
  refused("block_tables");
  // A block a window freed (-1) is never read while the window hides it from every new token:
  // tokens at 18 and 19 with 2 recent keys see 17..19, all in block 1 (positions 16..31).
  in.tables[1] = static_cast<int32_t>(in.pool->num_blocks()) - 1;
  in.tables[0] = -1;
  const at::Tensor last_two = in.query.narrow(0, 0, 2).contiguous();
  PagedDecodeWindow window;
  window.recent = 2;
  EXPECT_NO_THROW(run_on(in, last_two, in.tables, {20}, {0, 2}, window));
  window.sinks = 1;  // and position 0, in the freed block
  try {
    run_on(in, last_two, in.tables, {20}, {0, 2}, window);
    ADD_FAILURE() << "a freed block was read";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("block_tables"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvpipe
