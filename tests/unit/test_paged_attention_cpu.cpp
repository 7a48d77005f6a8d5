// The CPU's paged decode attention (engine/kernels/cpu/paged_attention.h) against float64
// references: the paged decode reference over the same block tables (float storage, no
// window), and a direct softmax over the keys each query may see, decoded by the pool's own
// gather (every stored type, windows with sinks, sliding windows and soft-capped scores), at
// block sizes 1, 5 and 16, on the portable and the vector build. Then whole generations on the
// kernel against the per-sequence path.
#include "cache/block_pool.h"
#include "engine/attention_backend.h"
#include "engine/kernels/cpu/paged_attention.h"
#include "engine/kernels/cpu/paged_decode_reference.h"
#include "engine/kernels/cpu/thread_pool.h"
#include "tests/support/logprob_compare.h"
#include "tests/support/paged_kv_fixture.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

struct Case {
  std::vector<int32_t> context_lens;
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
  at::Tensor query;   // float32 [seqs, heads, head_dim]
  std::vector<int32_t> tables;
  int64_t max_blocks = 0;
  float scale = 0.0f;
};

Inputs make_inputs(const Case& c) {
  const int64_t seqs = static_cast<int64_t>(c.context_lens.size());
  const int64_t longest = *std::max_element(c.context_lens.begin(), c.context_lens.end());
  Inputs in;
  in.max_blocks = (longest + c.block_size - 1) / c.block_size + 1;  // a column past every context
  const int64_t num_blocks = in.max_blocks + 5;
  in.pool = kvpipe::testing::random_kv_pool(c.kv_heads, c.head_dim, c.block_size, num_blocks, c.dtype, c.seed);
  in.query = at::randn({seqs, c.kv_heads * c.group, c.head_dim});
  in.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  in.tables = kvpipe::testing::scattered_block_tables(c.context_lens, c.block_size, in.max_blocks, num_blocks, c.seed);
  return in;
}

bool sees(int64_t k, int64_t p, const PagedDecodeWindow& w) { return kvpipe::testing::window_sees(k, p, w); }

// Every visible key and value decoded by BlockPool::gather (the engine's own decode of the
// stored type), one softmax over them in float64.
at::Tensor direct_float64(const Inputs& in, const Case& c) {
  const int64_t seqs = in.query.size(0), heads = in.query.size(1);
  std::vector<at::Tensor> outs;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t len = c.context_lens[s], p = len - 1;
    std::vector<int64_t> slots;
    for (int64_t k = 0; k < len; ++k)
      if (sees(k, p, c.window))
        slots.push_back(static_cast<int64_t>(in.tables[s * in.max_blocks + k / c.block_size]) * c.block_size +
                        k % c.block_size);
    const at::Tensor st = at::tensor(slots, at::kLong);
    const at::Tensor k = in.pool->gather_keys(in.layer, st).to(at::kDouble);
    const at::Tensor v = in.pool->gather_values(in.layer, st).to(at::kDouble);
    std::vector<at::Tensor> per_head;
    for (int64_t h = 0; h < heads; ++h) {
      at::Tensor scores = at::mv(k.select(1, h / c.group), in.query[s][h].to(at::kDouble)) * in.scale;
      if (c.window.softcap > 0) scores = (scores / c.window.softcap).tanh() * c.window.softcap;
      per_head.push_back(at::mv(v.select(1, h / c.group).t(), at::softmax(scores, 0)));
    }
    outs.push_back(at::stack(per_head));
  }
  return at::stack(outs);
}

at::Tensor run_kernel(const Inputs& in, const Case& c) {
  at::Tensor out = at::empty_like(in.query);
  paged_decode_attention_cpu(in.query.data_ptr<float>(), in.query.size(0), in.query.size(1),
                             paged_kv_layer(*in.pool, in.layer), in.tables.data(), in.max_blocks, c.context_lens.data(),
                             c.window, in.scale, out.data_ptr<float>());
  return out;
}

double max_relative_error(const at::Tensor& a, const at::Tensor& b) {
  return ((a.to(at::kDouble) - b).abs() / (b.abs() + 1.0)).max().item<double>();
}

std::string describe(const Case& c) {
  return kv_dtype_name(c.dtype) + ", block_size " + std::to_string(c.block_size) + ", group " +
         std::to_string(c.group) + ", window sinks " + std::to_string(c.window.sinks) + " recent " +
         std::to_string(c.window.recent) + " sliding " + std::to_string(c.window.sliding) + " softcap " +
         std::to_string(c.window.softcap) + " (" + paged_attention_isa() + ")";
}

// Contexts on both sides of the kernel's 256-key partitions, one spanning three of them.
const std::vector<int32_t> kContexts = {1, 7, 255, 256, 257, 700};

TEST(CpuPagedAttention, MatchesFloat64ForEveryStoredTypeWindowAndBlockSize) {
  std::vector<PagedDecodeWindow> windows(5);
  windows[1].sinks = 4, windows[1].recent = 37;   // attention sinks plus recent keys
  windows[2].recent = 300;                        // no sinks, a window wider than a partition
  windows[3].sliding = 50;                        // a layer's own sliding window (Gemma 2)
  windows[4].sliding = 300, windows[4].softcap = 50.0, windows[4].sinks = 2, windows[4].recent = 100;
  int checked = 0;
  for (const KvDtype dtype : {KvDtype::kFloat32, KvDtype::kFloat16, KvDtype::kBFloat16, KvDtype::kQ8_0})
    for (const int64_t block_size : {1, 5, 16})
      for (const int64_t group : {1, 3})
        for (const PagedDecodeWindow& window : windows) {
          Case c;
          c.context_lens = kContexts, c.dtype = dtype, c.block_size = block_size, c.group = group, c.window = window;
          c.seed = static_cast<uint32_t>(++checked);
          const Inputs in = make_inputs(c);
          EXPECT_LT(max_relative_error(run_kernel(in, c), direct_float64(in, c)), 2e-5) << describe(c);
        }
  EXPECT_EQ(checked, 4 * 3 * 2 * 5);
}

// Where both apply (float storage, no window) the kernel agrees with the paged decode
// reference, the GPU kernel's specification, on the same block tables.
TEST(CpuPagedAttention, AgreesWithThePagedDecodeReference) {
  for (const KvDtype dtype : {KvDtype::kFloat32, KvDtype::kFloat16, KvDtype::kBFloat16}) {
    Case c;
    c.context_lens = {1, 300, 513, 1100}, c.dtype = dtype, c.group = 4, c.head_dim = 128, c.block_size = 16;
    Inputs in = make_inputs(c);
    const at::Tensor q = in.query.to(kv_storage_scalar_type(dtype));
    const at::Tensor tables = at::tensor(in.tables, at::kInt).view({-1, in.max_blocks});
    const at::Tensor want = paged_decode_reference(q, in.pool->keys(in.layer), in.pool->values(in.layer), tables,
                                                   at::tensor(c.context_lens, at::kInt), c.block_size, in.scale);
    // The reference reads the query in the pool's dtype: so does the kernel here.
    in.query = q.to(at::kFloat);
    EXPECT_LT(max_relative_error(run_kernel(in, c), want), 2e-5) << describe(c);
  }
}

// The vector build and the portable one give the same values up to float32 rounding
// (KVPIPE_CPU_KERNELS=portable runs the latter for the whole process: ctest runs this test in a
// process of its own, so it sets the variable before the kernels' first use).
TEST(CpuPagedAttention, PortableBuildMatchesFloat64) {
  setenv("KVPIPE_CPU_KERNELS", "portable", 1);
  ASSERT_STREQ(paged_attention_isa(), "portable") << "a kernel ran before this test set KVPIPE_CPU_KERNELS";
  for (const KvDtype dtype : {KvDtype::kFloat32, KvDtype::kFloat16, KvDtype::kBFloat16, KvDtype::kQ8_0}) {
    Case c;
    c.context_lens = kContexts, c.dtype = dtype, c.block_size = 5, c.group = 2, c.head_dim = 40;
    if (dtype == KvDtype::kQ8_0) c.head_dim = 64;
    c.window.sinks = 3, c.window.recent = 90;
    const Inputs in = make_inputs(c);
    EXPECT_LT(max_relative_error(run_kernel(in, c), direct_float64(in, c)), 2e-5) << describe(c);
  }
  // The choice stays made in this process; the kvpipe processes later tests start must not
  // inherit the variable when tests share a process (gtest run by hand).
  unsetenv("KVPIPE_CPU_KERNELS");
}

// Many sequences split over two threads give the values one thread gives.
TEST(CpuPagedAttention, ThreadsSplitTheWorkWithoutChangingIt) {
  Case c;
  for (int i = 0; i < 24; ++i) c.context_lens.push_back(1 + (i * 97) % 600);
  c.group = 3, c.dtype = KvDtype::kFloat16;
  const Inputs in = make_inputs(c);
  const at::Tensor one = run_kernel(in, c);
  ThreadPool::instance().set_threads(2);
  const at::Tensor two = run_kernel(in, c);
  ThreadPool::instance().set_threads(1);
  EXPECT_TRUE(at::equal(one, two));
  EXPECT_LT(max_relative_error(two, direct_float64(in, c)), 2e-5);
}

TEST(CpuPagedAttention, RefusesContextsAndBlocksOutsideThePool) {
  Case c;
  c.context_lens = {20};
  Inputs in = make_inputs(c);
  for (const int32_t bad : {0, static_cast<int32_t>(in.max_blocks * c.block_size + 1)}) {
    c.context_lens = {bad};
    try {
      run_kernel(in, c);
      ADD_FAILURE() << "context length " << bad << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("context_lens"), std::string::npos) << e.what();
    }
  }
  c.context_lens = {20};
  in.tables[1] = static_cast<int32_t>(in.pool->num_blocks());  // the block of positions 16..31
  try {
    run_kernel(in, c);
    ADD_FAILURE() << "a block outside the pool was read";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("block_tables"), std::string::npos) << e.what();
  }
  // A block a window freed (-1) is never read while the window hides it, and refused when a
  // visible position falls in it. Context 20 (query at 19) with 3 recent keys sees 17..19, in
  // block 1; with 2 sinks also 0 and 1, in block 0.
  Inputs windowed = make_inputs(c);
  windowed.tables[0] = -1;
  c.window.recent = 3;
  EXPECT_NO_THROW(run_kernel(windowed, c));
  c.window.sinks = 2;
  EXPECT_THROW(run_kernel(windowed, c), std::invalid_argument);
}

// Every step on the CPU takes the paged path (decode steps the decode kernel, prefill the tiled
// prefill one), every stored type and window included, unless the per-sequence path is pinned.
TEST(CpuPagedAttention, EveryStepTakesThePagedPathOnTheCpu) {
  KvShape shape;
  shape.num_layers = 1, shape.block_size = 16, shape.num_kv_heads = 2, shape.head_dim = 64;
  StepBatch decode, prefill;
  SeqStep s;
  s.context_len = 5, s.num_new = 1, s.sample = true, s.block_table = {0};
  decode.seqs = {s};
  decode.token_ids = {3};
  s.context_len = 0, s.num_new = 6;
  prefill.seqs = {s};
  prefill.token_ids.assign(6, 3);
  for (const KvDtype dtype : {KvDtype::kFloat32, KvDtype::kFloat16, KvDtype::kBFloat16, KvDtype::kQ8_0}) {
    const BlockPool pool(shape, 2, at::kFloat, at::kCPU, dtype);
    EXPECT_EQ(choose_attention_path(at::kFloat, 64, false, pool, decode, std::nullopt), AttentionPath::kPagedDecode);
    StepBatch windowed = decode;
    windowed.window_recent = 4;
    EXPECT_EQ(choose_attention_path(at::kFloat, 64, false, pool, windowed, std::nullopt, /*masked_or_capped=*/true),
              AttentionPath::kPagedDecode);
    EXPECT_EQ(choose_attention_path(at::kFloat, 64, false, pool, prefill, std::nullopt), AttentionPath::kPagedDecode);
    EXPECT_EQ(choose_attention_path(at::kFloat, 64, false, pool, prefill, AttentionPath::kPerSequence),
              AttentionPath::kPerSequence);
    EXPECT_EQ(choose_attention_path(at::kFloat, 64, false, pool, decode, AttentionPath::kPerSequence),
              AttentionPath::kPerSequence);
  }
}

// Whole generations: the paged kernels' tokens and log-probabilities (the prompt on the prefill
// kernel, then the decode one) against the per-sequence path's (KVPIPE_ATTENTION=per_sequence)
// on the same job, for a float32 cache, a q8_0 cache with a window, and a bfloat16 cache in
// blocks of 5 tokens; the kernels' run must have taken the paged path for every layer call.
// The two paths' float32 rounding differs by about 1e-7; a 16- or 8-bit cache stores the next
// layer's K/V rounded, and where such a difference moves a value across a rounding boundary it
// becomes one step of the stored type (1/127 of a q8_0 group's largest value), hence each
// cache type's own tolerance.
TEST(CpuPagedAttention, GenerationMatchesThePerSequencePath) {
  const auto dir = kvpipe::testing::make_scratch_dir();
  std::string prompt;
  for (int i = 0; i < 100; ++i) prompt += (i ? "," : "") + std::to_string((i * 53) % 500 + 3);
  struct Variant {
    const char* name;
    const char* cache;
    double tolerance;
  } variants[] = {{"float32", "cache: {block_size: 16, memory: 16MiB}", 1e-4},
                  {"q8_0 with a window", "cache: {block_size: 16, memory: 16MiB, dtype: q8_0, window: {sinks: 4, recent: 24}}",
                   2e-3},
                  {"blocks of 5", "cache: {block_size: 5, memory: 16MiB, dtype: bfloat16}", 3e-4}};
  for (const Variant& v : variants) {
    kvpipe::testing::write_greedy_job(dir, "\"dummy:tiny\"", prompt, 24);
    {
      std::ifstream in(dir / "job.yaml");
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      text = std::regex_replace(text, std::regex("cache: \\{[^}\\n]*\\}"), v.cache);
      std::ofstream(dir / "job.yaml") << text;
    }
    std::vector<kvpipe::testing::LogprobStep> steps[2];
    for (int i = 0; i < 2; ++i) {
      const std::filesystem::path lp = dir / ("logprobs_" + std::to_string(i) + ".jsonl");
      const std::string command = std::string(i == 0 ? "KVPIPE_ATTENTION=per_sequence " : "") + KVPIPE_BINARY +
                                  " generate --log-level debug --config " + (dir / "job.yaml").string() +
                                  " --logprobs-out " + lp.string();
      const auto result = kvpipe::testing::run_command(command, dir);
      ASSERT_EQ(result.code, 0) << v.name << ": " << result.err;
      const std::regex paged("attention layer calls paged ([0-9]+)");
      std::smatch m;
      ASSERT_TRUE(std::regex_search(result.err, m, paged)) << result.err;
      const std::regex per_sequence("per_sequence ([0-9]+)");
      std::smatch ps;
      ASSERT_TRUE(std::regex_search(result.err, ps, per_sequence)) << result.err;
      if (i == 0) {
        EXPECT_EQ(m[1], "0") << v.name;
      } else {
        EXPECT_NE(m[1], "0") << v.name << ": the default run did not take the paged kernels";
        EXPECT_EQ(ps[1], "0") << v.name << ": a step of the default run went per sequence";
      }
      steps[i] = kvpipe::testing::parse_logprob_steps(kvpipe::testing::slurp(lp));
    }
    const auto c = kvpipe::testing::compare_logprob_steps(steps[1], steps[0], 24, v.tolerance, 10 * v.tolerance);
    EXPECT_TRUE(c.failure.empty()) << v.name << ": " << c.failure;
    EXPECT_EQ(c.compared, 24) << v.name;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvpipe
