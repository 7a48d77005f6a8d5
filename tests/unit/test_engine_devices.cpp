// The engine's correctness checks on every device and attention path: decode against a full
// recompute, a batch against each request alone, prefix reuse against none. On the CPU the
// batched attention paths (varlen, paged decode) run their references over the same packed
// indices the GPU kernels read, so the packing is checked here; the suites named Gpu* run the
// same checks with the CUDA kernels (label `gpu`, skipped without a GPU), plus BF16 on the
// GPU against float32 on the CPU.
#include "cache/block_pool.h"
#include "engine/attention_backend.h"
#include "engine/decode_graphs.h"
#include "engine/engine.h"
#include "engine/model_shard.h"
#include "engine/model/model_weights.h"
#include "tests/support/engine_run.h"
#include "tests/support/reference_model.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

using kvpipe::testing::Generated;
using kvpipe::testing::make_request;

struct DeviceCase {
  std::string name;
  at::DeviceType device = at::kCPU;
  at::ScalarType dtype = at::kFloat;
  std::optional<AttentionPath> path;  // unset: what each step allows, fastest first
  std::vector<AttentionPath> uses;     // paths a prefill followed by decodes must take
};

std::ostream& operator<<(std::ostream& out, const DeviceCase& c) { return out << c.name; }

// Head size 64 so that the CUDA kernels (64 or 128) take it; grouped-query attention.
ModelConfig device_config() {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = 97;
  c.hidden_size = 128;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.intermediate_size = 160;
  c.max_position = 512;
  c.rope_theta = 10000.0;
  c.rms_eps = 1e-5;
  c.eos_token_ids = {2};
  return c;
}

std::vector<int64_t> prompt_of(int64_t len, int64_t salt, int64_t vocab) {
  std::vector<int64_t> p(len);
  for (int64_t i = 0; i < len; ++i) p[i] = (i * 29 + salt * 13 + 5) % vocab;
  return p;
}

bool is_16bit(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// Log-probabilities differ by at most this between a run and its reference: float32 sums in
// another order on another device, or 16-bit activations (the 2e-2 for BF16 against
// float32 is checked separately, on a real-sized comparison below).
double tolerance(const DeviceCase& c) {
  if (is_16bit(c.dtype)) return 5e-2;
  return c.device == at::kCPU ? 1e-4 : 1e-3;
}

class DeviceRuns : public ::testing::TestWithParam<DeviceCase> {
 protected:
  void SetUp() override {
    if (GetParam().device == at::kCUDA && !at::hasCUDA())
      GTEST_SKIP() << "no CUDA device: " << GetParam().name << " needs a GPU";
    cfg_ = device_config();
    cpu_weights_ = random_weights(cfg_, {{0, cfg_.num_layers}, true, true, {}}, 5, 0.1, at::kFloat);
  }

  ModelShard shard() const {
    const DeviceCase& c = GetParam();
    const at::Device device = c.device == at::kCPU ? at::Device(at::kCPU) : at::Device(at::kCUDA, 0);
    ModelShard s(c.device == at::kCPU && c.dtype == at::kFloat ? cpu_weights_
                                                                  : move_weights(cpu_weights_, device, c.dtype));
    s.set_attention_path(c.path);
    return s;
  }

  Generated run(const ModelShard& s, const std::vector<Request>& requests, int64_t max_batch = 32,
                int64_t max_tokens = 2048, bool prefix_reuse = false) const {
    SchedulerOptions o;
    o.block_size = 16;
    o.max_batch = max_batch;
    o.max_tokens_per_step = max_tokens;
    o.prefix_reuse = prefix_reuse;
    return kvpipe::testing::run_engine(s, o, 96, requests);
  }

  void check_decode_matches_full_recompute();
  void check_batch_matches_each_request_alone();
  void check_prefix_reuse_matches_no_reuse();

  ModelConfig cfg_;
  ModelWeights cpu_weights_;
};

at::Tensor log_probs(const at::Tensor& logits) { return at::log_softmax(logits.to(at::kDouble), -1); }

// Where two greedy runs of one request part, the step must be a near-tie of `reference`'s
// logits (its two best tokens within `gap`), and every step before must agree within `tol`.
void expect_same_run(const std::vector<int64_t>& tokens, const std::vector<at::Tensor>& logits,
                     const std::vector<int64_t>& ref_tokens, const std::vector<at::Tensor>& ref_logits, double tol,
                     bool exact_tokens, const std::string& what) {
  ASSERT_EQ(tokens.size(), ref_tokens.size()) << what;
  for (size_t s = 0; s < tokens.size(); ++s) {
    EXPECT_LE((log_probs(logits[s]) - log_probs(ref_logits[s])).abs().max().item<double>(), tol)
        << what << " step " << s;
    if (tokens[s] == ref_tokens[s]) continue;
    const at::Tensor top = std::get<0>(ref_logits[s].topk(2));
    const double gap = (top[0] - top[1]).item<double>();
    EXPECT_FALSE(exact_tokens) << what << " step " << s << ": token " << tokens[s] << " vs " << ref_tokens[s];
    EXPECT_LE(gap, 2 * tol) << what << " step " << s << ": tokens part where the reference's best two are "
                            << gap << " apart";
    return;  // later steps follow different tokens
  }
}

void DeviceRuns::check_decode_matches_full_recompute() {
  const ModelShard s = shard();
  const std::vector<int64_t> prompt = prompt_of(45, 1, cfg_.vocab_size);
  const int64_t steps = 24;
  const Generated g = run(s, {make_request(0, prompt, steps)});
  ASSERT_EQ(static_cast<int64_t>(g.tokens.at(0).size()), steps);
  std::vector<int64_t> all = prompt;
  all.insert(all.end(), g.tokens.at(0).begin(), g.tokens.at(0).end());
  // Teacher-forced on the run's own tokens, in float32 on the CPU.
  const at::Tensor ref = kvpipe::testing::full_recompute_logits(cpu_weights_, all);
  double worst = 0.0;
  for (int64_t i = 0; i < steps; ++i)
    worst = std::max(worst,
                     (log_probs(g.logits.at(0)[i]) - log_probs(ref[prompt.size() - 1 + i])).abs().max().item<double>());
  EXPECT_LE(worst, tolerance(GetParam()));
  for (const AttentionPath p : GetParam().uses)
    EXPECT_GT(s.attention_calls(p), 0) << "no step took the " << attention_path_name(p) << " path";
}

// Requests of different lengths joining at different steps, prompts split into chunks: mixed
// steps of prefill chunks and decodes, each request as it is alone.
void DeviceRuns::check_batch_matches_each_request_alone() {
  const ModelShard s = shard();
  std::vector<Request> requests;
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {3, 14, 0}, {37, 10, 0}, {16, 18, 2}, {70, 6, 5}, {1, 20, 9}, {9, 12, 9}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto [len, max_new, arrival] = shapes[i];
    requests.push_back(make_request(static_cast<int64_t>(i), prompt_of(len, static_cast<int64_t>(i), cfg_.vocab_size),
                                    max_new, arrival));
  }
  const Generated batched = run(s, requests, /*max_batch=*/4, /*max_tokens=*/24);
  for (const Request& r : requests) {
    Request alone = r;
    alone.arrival_step = 0;
    const Generated single = run(s, {alone});
    expect_same_run(batched.tokens.at(r.id), batched.logits.at(r.id), single.tokens.at(r.id), single.logits.at(r.id),
                    tolerance(GetParam()), !is_16bit(GetParam().dtype), "request " + std::to_string(r.id));
  }
}

// A second request on the first one's cached prefix reads shared blocks.
void DeviceRuns::check_prefix_reuse_matches_no_reuse() {
  const ModelShard s = shard();
  std::vector<int64_t> prefix = prompt_of(40, 3, cfg_.vocab_size);
  std::vector<int64_t> second = prefix;
  second.insert(second.end(), {7, 8, 9});
  const std::vector<Request> requests = {make_request(0, prefix, 6), make_request(1, second, 10, 8)};
  const Generated reuse = run(s, requests, 32, 2048, /*prefix_reuse=*/true);
  const Generated plain = run(s, requests, 32, 2048, /*prefix_reuse=*/false);
  EXPECT_GT(reuse.prefix.hit_tokens, 0);
  for (const Request& r : requests)
    expect_same_run(reuse.tokens.at(r.id), reuse.logits.at(r.id), plain.tokens.at(r.id), plain.logits.at(r.id),
                    tolerance(GetParam()), !is_16bit(GetParam().dtype), "request " + std::to_string(r.id));
}

std::string case_name(const ::testing::TestParamInfo<DeviceCase>& info) { return info.param.name; }

class EngineDevices : public DeviceRuns {};
TEST_P(EngineDevices, DecodeMatchesFullRecompute) { check_decode_matches_full_recompute(); }
TEST_P(EngineDevices, BatchMatchesEachRequestAlone) { check_batch_matches_each_request_alone(); }
TEST_P(EngineDevices, PrefixReuseMatchesNoReuse) { check_prefix_reuse_matches_no_reuse(); }

INSTANTIATE_TEST_SUITE_P(
    Cpu, EngineDevices,
    ::testing::Values(DeviceCase{"cpu_float32", at::kCPU, at::kFloat, std::nullopt, {AttentionPath::kPagedDecode}},
                      DeviceCase{"cpu_float32_per_sequence", at::kCPU, at::kFloat, AttentionPath::kPerSequence,
                                 {AttentionPath::kPerSequence}},
                      DeviceCase{"cpu_float32_varlen_reference", at::kCPU, at::kFloat, AttentionPath::kVarlen, {AttentionPath::kVarlen}}),
    case_name);

// The same checks on the GPU (the Gpu prefix puts them under the `gpu` label): float32 and
// 16-bit, each attention path forced and the automatic choice (paged decode for decode steps,
// FlashAttention varlen for prefill and mixed steps in 16-bit).
class GpuEngineDevices : public DeviceRuns {};
TEST_P(GpuEngineDevices, DecodeMatchesFullRecompute) { check_decode_matches_full_recompute(); }
TEST_P(GpuEngineDevices, BatchMatchesEachRequestAlone) { check_batch_matches_each_request_alone(); }
TEST_P(GpuEngineDevices, PrefixReuseMatchesNoReuse) { check_prefix_reuse_matches_no_reuse(); }

INSTANTIATE_TEST_SUITE_P(
    Gpu, GpuEngineDevices,
    ::testing::Values(DeviceCase{"cuda_float32", at::kCUDA, at::kFloat, std::nullopt,
                                 {AttentionPath::kPagedDecode, AttentionPath::kPerSequence}},
                      DeviceCase{"cuda_float32_per_sequence", at::kCUDA, at::kFloat, AttentionPath::kPerSequence,
                                 {AttentionPath::kPerSequence}},
                      DeviceCase{"cuda_bfloat16", at::kCUDA, at::kBFloat16, std::nullopt,
                                 {AttentionPath::kVarlen, AttentionPath::kPagedDecode}},
                      DeviceCase{"cuda_bfloat16_varlen", at::kCUDA, at::kBFloat16, AttentionPath::kVarlen, {AttentionPath::kVarlen}},
                      DeviceCase{"cuda_bfloat16_per_sequence", at::kCUDA, at::kBFloat16, AttentionPath::kPerSequence,
                                 {AttentionPath::kPerSequence}},
                      DeviceCase{"cuda_float16", at::kCUDA, at::kHalf, std::nullopt,
                                 {AttentionPath::kVarlen, AttentionPath::kPagedDecode}}),
    case_name);

// BF16 on the GPU against float32 on the CPU on the same weights (an init-model scale of
// 0.02), greedy: log-probabilities within 2e-2, tokens equal until a near-tie.
TEST(GpuBFloat16, LogProbsMatchCpuFloat32) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device: BF16 on the GPU needs one";
  ModelConfig cfg = device_config();
  cfg.vocab_size = 512;
  const ModelWeights cpu = random_weights(cfg, {{0, cfg.num_layers}, true, true, {}}, 9, 0.02, at::kFloat);
  const ModelShard cpu_shard(cpu);
  const ModelShard gpu_shard(move_weights(cpu, at::Device(at::kCUDA, 0), at::kBFloat16));
  SchedulerOptions o;
  o.block_size = 16;
  std::vector<Request> requests;
  for (int64_t i = 0; i < 4; ++i) requests.push_back(make_request(i, prompt_of(20 + 30 * i, i, cfg.vocab_size), 16));
  const Generated want = kvpipe::testing::run_engine(cpu_shard, o, 96, requests);
  const Generated got = kvpipe::testing::run_engine(gpu_shard, o, 96, requests);
  for (const Request& r : requests)
    expect_same_run(got.tokens.at(r.id), got.logits.at(r.id), want.tokens.at(r.id), want.logits.at(r.id), 2e-2,
                    /*exact_tokens=*/false, "request " + std::to_string(r.id));
}

TEST(DecodeGraphs, BucketsPadToPowersOfTwoThenMultiplesOfEight) {
  EXPECT_EQ(decode_graph_bucket(1, 64), 1);
  EXPECT_EQ(decode_graph_bucket(3, 64), 4);
  EXPECT_EQ(decode_graph_bucket(8, 64), 8);
  EXPECT_EQ(decode_graph_bucket(9, 64), 16);
  EXPECT_EQ(decode_graph_bucket(17, 64), 24);
  EXPECT_EQ(decode_graph_bucket(64, 64), 64);
  EXPECT_EQ(decode_graph_bucket(61, 62), 62);  // capped at max_batch
  EXPECT_EQ(decode_graph_bucket(65, 64), 0);
  EXPECT_EQ(decode_graph_bucket(0, 64), 0);
  // Graphs are a GPU's: a shard on the CPU is refused.
  const ModelShard cpu_shard(random_weights(device_config(), {{0, 2}, true, true, {}}, 1, 0.1, at::kFloat));
  BlockPool pool(cpu_shard.kv_shape(16), 4, at::kFloat, at::kCPU);
  EXPECT_THROW({ DecodeGraphs graphs(cpu_shard, pool, 8, 3); }, std::invalid_argument);
}

// Decode steps replayed from CUDA graphs (padded batches, rows joining and leaving between
// steps) give what the same steps give launched one kernel at a time.
TEST(GpuDecodeGraphs, ReplayMatchesEagerSteps) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device: CUDA graphs need a GPU";
  const ModelConfig cfg = device_config();
  const ModelWeights cpu = random_weights(cfg, {{0, cfg.num_layers}, true, true, {}}, 5, 0.1, at::kFloat);
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const ModelShard shard(move_weights(cpu, at::Device(at::kCUDA, 0), dtype));
    std::vector<Request> requests;
    for (int64_t i = 0; i < 11; ++i)
      requests.push_back(make_request(i, prompt_of(5 + 7 * i, i, cfg.vocab_size), 6 + i, i / 2));
    SchedulerOptions o;
    o.block_size = 16;
    o.max_batch = 16;
    const int64_t blocks = 96;
    const Generated eager = kvpipe::testing::run_engine(shard, o, blocks, requests);
    BlockPool pool(shard.kv_shape(o.block_size), blocks + 1, dtype, shard.device());
    DecodeGraphs graphs(shard, pool, o.max_batch, blocks);
    LocalExecutor executor(shard, pool, nullptr, &graphs);
    EngineOptions eo;
    eo.scheduler = o;
    eo.scheduler.max_context = cfg.max_position;
    eo.keep_logits = true;
    Engine engine(executor, cfg, blocks, eo);
    for (const Request& r : requests) engine.add(r);
    Generated replayed;
    engine.run([&](const TokenEvent& ev) {
      replayed.tokens[ev.request_id].push_back(ev.token);
      replayed.logits[ev.request_id].push_back(at::from_blob(const_cast<float*>(ev.logits), {ev.vocab}).clone());
    });
    EXPECT_GE(graphs.graphs_captured(), 2) << "batches of several sizes should have replayed";
    EXPECT_GT(graphs.replays(), graphs.graphs_captured());
    const DeviceCase c{"graphs", at::kCUDA, dtype, std::nullopt, {}};
    for (const Request& r : requests)
      expect_same_run(replayed.tokens.at(r.id), replayed.logits.at(r.id), eager.tokens.at(r.id), eager.logits.at(r.id),
                      tolerance(c), dtype == at::kFloat, "request " + std::to_string(r.id));
  }
}

// Graphs of one instance capture into that instance's memory pool: a second DecodeGraphs,
// made after the first is gone, captures and replays too (with a pool shared by the process
// the allocator refuses that capture).
TEST(GpuDecodeGraphs, SecondInstanceCapturesAfterTheFirstIsGone) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device: CUDA graphs need a GPU";
  const ModelConfig cfg = device_config();
  const ModelShard shard(move_weights(random_weights(cfg, {{0, cfg.num_layers}, true, true, {}}, 5, 0.1, at::kFloat),
                                      at::Device(at::kCUDA, 0), at::kBFloat16));
  SchedulerOptions o;
  o.block_size = 16;
  o.max_batch = 4;
  const int64_t blocks = 32;
  std::vector<std::vector<int64_t>> outputs;
  for (int round = 0; round < 3; ++round) {
    BlockPool pool(shard.kv_shape(o.block_size), blocks + 1, at::kBFloat16, shard.device());
    DecodeGraphs graphs(shard, pool, o.max_batch, blocks);
    LocalExecutor executor(shard, pool, nullptr, &graphs);
    EngineOptions eo;
    eo.scheduler = o;
    eo.scheduler.max_context = cfg.max_position;
    Engine engine(executor, cfg, blocks, eo);
    engine.add(make_request(0, prompt_of(20, 1, cfg.vocab_size), 8));
    std::vector<int64_t> tokens;
    engine.run([&](const TokenEvent& ev) { tokens.push_back(ev.token); });
    EXPECT_EQ(graphs.graphs_captured(), 1) << "round " << round;
    EXPECT_EQ(graphs.replays(), 7) << "round " << round << ": every decode step after the prefill";
    outputs.push_back(tokens);
  }
  EXPECT_EQ(outputs[1], outputs[0]);
  EXPECT_EQ(outputs[2], outputs[0]);
}

// Which path a step takes: on the CPU decode steps take its paged kernel (every stored type
// and window), on a GPU a window keeps the step on the per-sequence path and the paged kernel
// reads only float storage of the compute dtype.
TEST(AttentionBackend, PathFollowsDeviceStepAndPool) {
  const ModelConfig cfg = device_config();
  KvShape shape;
  shape.num_layers = 1, shape.block_size = 16, shape.num_kv_heads = cfg.num_kv_heads, shape.head_dim = cfg.head_dim;
  const BlockPool pool(shape, 4, at::kFloat, at::kCPU);
  const BlockPool q8(shape, 4, at::kFloat, at::kCPU, KvDtype::kQ8_0);
  StepBatch decode;
  for (int64_t i = 0; i < 2; ++i) {
    SeqStep s;
    s.request_id = i, s.context_len = 5, s.num_new = 1, s.sample = true, s.block_table = {static_cast<int32_t>(i)};
    decode.seqs.push_back(s);
    decode.token_ids.push_back(3);
  }
  const StepContext ctx = make_step_context(decode, 16);
  ASSERT_TRUE(ctx.decode_only);
  const at::Tensor q = at::zeros({2, cfg.num_heads, cfg.head_dim});
  EXPECT_EQ(choose_attention_path(q, pool, decode, ctx, std::nullopt), AttentionPath::kPagedDecode);
  EXPECT_EQ(choose_attention_path(q, pool, decode, ctx, AttentionPath::kPerSequence), AttentionPath::kPerSequence);
  EXPECT_EQ(choose_attention_path(q, q8, decode, ctx, AttentionPath::kPagedDecode), AttentionPath::kPagedDecode);
  EXPECT_EQ(choose_attention_path(at::kFloat, cfg.head_dim, /*on_gpu=*/true, q8, decode, AttentionPath::kPagedDecode),
            AttentionPath::kPerSequence);
  EXPECT_EQ(choose_attention_path(q, pool, decode, ctx, AttentionPath::kVarlen), AttentionPath::kVarlen);
  StepBatch windowed = decode;
  windowed.window_recent = 4;
  EXPECT_EQ(choose_attention_path(q, pool, windowed, ctx, AttentionPath::kPagedDecode), AttentionPath::kPagedDecode);
  EXPECT_EQ(choose_attention_path(at::kFloat, cfg.head_dim, /*on_gpu=*/true, pool, windowed, AttentionPath::kPagedDecode),
            AttentionPath::kPerSequence);
  EXPECT_EQ(choose_attention_path(q, pool, windowed, ctx, AttentionPath::kVarlen), AttentionPath::kPagedDecode);
  // Soft-capped scores or sliding-window layers (Gemma 2) the GPU's batched kernels do not
  // compute: such a model's steps take the per-sequence path there whatever is preferred; the
  // CPU's paged kernel computes them.
  EXPECT_EQ(choose_attention_path(q, pool, decode, ctx, AttentionPath::kPagedDecode, /*masked_or_capped=*/true),
            AttentionPath::kPagedDecode);
  EXPECT_EQ(choose_attention_path(q, pool, decode, ctx, AttentionPath::kVarlen, /*masked_or_capped=*/true),
            AttentionPath::kPagedDecode);
  for (const bool on_gpu : {false, true})
    for (const at::ScalarType dtype : {at::kFloat, at::kHalf})
      for (const std::optional<AttentionPath> preferred :
           {std::optional<AttentionPath>(), std::optional<AttentionPath>(AttentionPath::kPagedDecode),
            std::optional<AttentionPath>(AttentionPath::kVarlen)})
        EXPECT_EQ(choose_attention_path(dtype, 128, on_gpu, pool, decode, preferred, /*masked_or_capped=*/true),
                  !on_gpu && dtype == at::kFloat ? AttentionPath::kPagedDecode : AttentionPath::kPerSequence);
  // ... where a plain model's decode step on a GPU takes the paged kernel.
  EXPECT_EQ(choose_attention_path(at::kFloat, 128, /*on_gpu=*/true, pool, decode, std::nullopt),
            AttentionPath::kPagedDecode);
  EXPECT_EQ(parse_attention_path("paged", "x"), AttentionPath::kPagedDecode);
  EXPECT_THROW(parse_attention_path("flash", "KVPIPE_ATTENTION"), std::invalid_argument);
  // Chosen before the step's tensors exist, the same way.
  for (const std::optional<AttentionPath> preferred :
       {std::optional<AttentionPath>(), std::optional<AttentionPath>(AttentionPath::kPagedDecode),
        std::optional<AttentionPath>(AttentionPath::kVarlen)})
    for (const StepBatch* b : {&decode, &windowed})
      EXPECT_EQ(choose_attention_path(at::kFloat, cfg.head_dim, /*on_gpu=*/false, pool, *b, preferred),
                choose_attention_path(q, pool, *b, ctx, preferred));
}

// A step's per-key indices are built only when its path reads them: never for the steps the
// CPU's paged kernels take (decode and prefill), always for the per-sequence and varlen paths;
// and a path that needs them refuses a context built without.
TEST(AttentionBackend, KeyIndicesOnlyForThePathsThatReadThem) {
  const ModelConfig cfg = device_config();
  ModelShard shard(random_weights(cfg, {{0, cfg.num_layers}, true, true, {}}, 1, 0.1, at::kFloat));
  const BlockPool pool(shard.kv_shape(16), 8, at::kFloat, at::kCPU);
  StepBatch decode, prefill;
  for (int64_t i = 0; i < 2; ++i) {
    SeqStep s;
    s.request_id = i, s.context_len = 5, s.num_new = 1, s.sample = true, s.block_table = {static_cast<int32_t>(i)};
    decode.seqs.push_back(s);
    decode.token_ids.push_back(3);
    s.context_len = 0, s.num_new = 6;
    prefill.seqs.push_back(s);
    prefill.token_ids.insert(prefill.token_ids.end(), 6, 3);
  }
  StepBatch windowed = decode;
  windowed.window_recent = 4;
  EXPECT_FALSE(attention_reads_keys(AttentionPath::kPagedDecode));
  EXPECT_TRUE(attention_reads_keys(AttentionPath::kVarlen));
  EXPECT_TRUE(attention_reads_keys(AttentionPath::kPerSequence));
  shard.set_attention_path(std::nullopt);  // the CPU's own path for decode: its paged kernel
  EXPECT_FALSE(shard.step_reads_keys(pool, decode));
  shard.set_attention_path(AttentionPath::kPerSequence);
  EXPECT_TRUE(shard.step_reads_keys(pool, decode));
  shard.set_attention_path(AttentionPath::kVarlen);
  EXPECT_TRUE(shard.step_reads_keys(pool, decode));
  shard.set_attention_path(AttentionPath::kPagedDecode);
  EXPECT_FALSE(shard.step_reads_keys(pool, decode));
  EXPECT_FALSE(shard.step_reads_keys(pool, prefill));   // the prefill kernel reads the block tables
  EXPECT_FALSE(shard.step_reads_keys(pool, windowed));  // the CPU's kernels read windows too
  // run_stage builds the lean context for the paged prefill and decode steps, and they compute.
  BlockPool run_pool(shard.kv_shape(16), 8, at::kFloat, at::kCPU);
  EXPECT_NO_THROW(run_stage(shard, run_pool, prefill, {}));
  EXPECT_NO_THROW(run_stage(shard, run_pool, decode, {}));
  EXPECT_EQ(shard.attention_calls(AttentionPath::kPagedDecode), 2 * cfg.num_layers);
  // The per-sequence path refuses a context without key indices instead of reading past it.
  shard.set_attention_path(AttentionPath::kPerSequence);
  const StepContext lean = make_step_context(decode, 16, at::kCPU, /*key_indices=*/false);
  EXPECT_THROW(shard.forward(shard.embed(lean.token_ids), decode, lean, run_pool), std::logic_error);
}

}  // namespace
}  // namespace kvpipe
