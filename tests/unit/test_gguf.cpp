#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "engine/model/gguf.h"
#include "engine/model/model_weights.h"
#include "launch/init_model.h"
#include "tests/support/command.h"

namespace kvpipe {
namespace {

namespace fs = std::filesystem;

ModelConfig small_config(const std::string& arch = "LlamaForCausalLM") {
  ModelConfig c = preset_config("tiny");
  c.architecture = arch;
  c.qkv_bias = arch == "Qwen2ForCausalLM";
  c.qk_norm = arch == "Qwen3ForCausalLM";
  c.vocab_size = 300;
  c.hidden_size = 64;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.intermediate_size = 96;
  c.max_position = 128;
  c.rope_theta = 500000.0;
  return c;
}

class GgufTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = kvpipe::testing::make_scratch_dir(); }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::string write_model(const ModelConfig& cfg, const std::string& name, uint64_t seed = 5,
                          at::ScalarType dtype = at::kFloat) {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& [n, shape] : hf_tensor_layout(cfg))
      tensors.emplace_back(n, random_tensor(n, shape, seed, 0.05));
    write_gguf_model(path(name), cfg, tensors, dtype);
    return path(name);
  }

  // The minimal valid file the malformed cases start from: llama metadata and one F32 tensor.
  GgufWriter minimal(const std::function<bool(const std::string&)>& keep = nullptr) {
    GgufWriter w;
    auto u32 = [&](const std::string& k, uint32_t v) {
      if (!keep || keep(k)) w.add_u32(k, v);
    };
    w.add_string("general.architecture", "llama");
    u32("llama.context_length", 64);
    u32("llama.embedding_length", 32);
    u32("llama.block_count", 1);
    u32("llama.feed_forward_length", 64);
    u32("llama.attention.head_count", 4);
    if (!keep || keep("llama.attention.layer_norm_rms_epsilon"))
      w.add_f32("llama.attention.layer_norm_rms_epsilon", 1e-6f);
    w.add_tensor("token_embd.weight", at::arange(16 * 32, at::kFloat).reshape({16, 32}));
    return w;
  }

  void write_bytes(const std::string& name, const std::string& bytes) {
    std::ofstream(path(name), std::ios::binary).write(bytes.data(), bytes.size());
  }

  fs::path dir_;
};

void expect_invalid(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    for (const auto& p : parts) EXPECT_NE(what.find(p), std::string::npos) << "'" << p << "' not in: " << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

// Offset of tensor `name`'s info fields (after its name) in a serialized file.
size_t tensor_info_at(const std::string& bytes, const std::string& name) {
  std::string key(8, '\0');
  const uint64_t n = name.size();
  std::memcpy(&key[0], &n, 8);
  key += name;
  const size_t at = bytes.find(key);
  EXPECT_NE(at, std::string::npos);
  return at + key.size();
}

TEST_F(GgufTest, ConfigRoundTrip) {
  for (const std::string arch : {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"}) {
    const ModelConfig c = small_config(arch);
    const ModelConfig r = load_model_config(write_model(c, "m.gguf"));
    EXPECT_EQ(r.architecture, arch);
    EXPECT_EQ(r.qkv_bias, c.qkv_bias);
    EXPECT_EQ(r.qk_norm, c.qk_norm);
    EXPECT_EQ(r.vocab_size, c.vocab_size);
    EXPECT_EQ(r.hidden_size, c.hidden_size);
    EXPECT_EQ(r.num_layers, c.num_layers);
    EXPECT_EQ(r.num_heads, c.num_heads);
    EXPECT_EQ(r.num_kv_heads, c.num_kv_heads);
    EXPECT_EQ(r.head_dim, c.head_dim);
    EXPECT_EQ(r.intermediate_size, c.intermediate_size);
    EXPECT_EQ(r.max_position, c.max_position);
    EXPECT_DOUBLE_EQ(r.rope_theta, c.rope_theta);
    EXPECT_FLOAT_EQ(r.rms_eps, c.rms_eps);
    EXPECT_EQ(r.tie_embeddings, c.tie_embeddings);
    EXPECT_EQ(r.bos_token_id, c.bos_token_id);
    EXPECT_EQ(r.eos_token_ids, c.eos_token_ids);
  }
}

// Loading from GGUF gives exactly the HF-layout weights: the q/k permutation is undone,
// Qwen3's q/k norms and Phi-3's fused attn_qkv and ffn_up land where the HF names put them.
TEST_F(GgufTest, WeightsMatchHfLayoutAfterUnpermutation) {
  for (const std::string arch : {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"}) {
    for (const bool tie : {false, true}) {
      ModelConfig c = small_config(arch);
      c.tie_embeddings = tie;
      const std::string file = write_model(c, "m.gguf");
      const WeightSelection all{{0, c.num_layers}, true, true, {}};
      const ModelWeights g = load_weights(file, load_model_config(file), all, at::kFloat);
      const ModelWeights h = random_weights(c, all, 5, 0.05, at::kFloat);
      EXPECT_TRUE(at::equal(g.embedding.dequantize(), h.embedding.dequantize()));
      EXPECT_TRUE(at::equal(g.lm_head.dequantize(), h.lm_head.dequantize()));
      EXPECT_TRUE(at::equal(g.final_norm, h.final_norm));
      for (int64_t i = 0; i < c.num_layers; ++i) {
        EXPECT_TRUE(at::equal(g.layer[i].qkv.dequantize(), h.layer[i].qkv.dequantize())) << arch << " layer " << i;
        EXPECT_TRUE(at::equal(g.layer[i].o.dequantize(), h.layer[i].o.dequantize()));
        EXPECT_TRUE(at::equal(g.layer[i].gate_up.dequantize(), h.layer[i].gate_up.dequantize()));
        EXPECT_TRUE(at::equal(g.layer[i].down.dequantize(), h.layer[i].down.dequantize()));
        EXPECT_TRUE(at::equal(g.layer[i].input_norm, h.layer[i].input_norm));
        EXPECT_TRUE(at::equal(g.layer[i].post_norm, h.layer[i].post_norm));
        EXPECT_EQ(g.layer[i].qkv_bias.defined(), c.qkv_bias);
        if (c.qkv_bias) {
          EXPECT_TRUE(at::equal(g.layer[i].qkv_bias, h.layer[i].qkv_bias));
        }
        ASSERT_EQ(g.layer[i].qk_norm.defined(), c.qk_norm) << arch;
        if (c.qk_norm) {
          EXPECT_TRUE(at::equal(g.layer[i].qk_norm, h.layer[i].qk_norm));
        }
      }
      GgufFile f(file);
      EXPECT_EQ(f.contains("output.weight"), !tie);
    }
  }
}

// The stored llama q/k rows follow llama.cpp's order: GGUF row h*hd + 2i + s is HF row
// h*hd + s*hd/2 + i; qwen2 (NEOX rotation) is stored unpermuted.
TEST_F(GgufTest, StoredQkRowsArePermutedForLlamaOnly) {
  const ModelConfig c = small_config();
  GgufFile f(write_model(c, "m.gguf"));
  const int64_t hd = c.head_dim;
  for (const auto& [gname, hname, heads] :
       {std::tuple<std::string, std::string, int64_t>{"blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", c.num_heads},
        {"blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight", c.num_kv_heads}}) {
    const at::Tensor stored = f.load(gname);
    const at::Tensor hf = random_tensor(hname, {heads * hd, c.hidden_size}, 5, 0.05);
    ASSERT_EQ(f.tensor(gname).ne, (std::vector<int64_t>{c.hidden_size, heads * hd}));
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < hd / 2; ++i)
        for (int64_t s = 0; s < 2; ++s)
          ASSERT_TRUE(at::equal(stored[h * hd + 2 * i + s], hf[h * hd + s * hd / 2 + i])) << gname;
    EXPECT_FALSE(at::equal(stored, hf));
  }
  GgufFile q(write_model(small_config("Qwen2ForCausalLM"), "q.gguf"));
  EXPECT_TRUE(at::equal(q.load("blk.1.attn_q.weight"),
                        random_tensor("model.layers.1.self_attn.q_proj.weight", {c.num_heads * hd, c.hidden_size}, 5, 0.05)));
}

TEST_F(GgufTest, HalfPrecisionFilesHoldTheSameValuesAsHf) {
  for (const auto dtype : {at::kHalf, at::kBFloat16}) {
    const ModelConfig c = small_config();
    const std::string file = write_model(c, "m.gguf", 5, dtype);
    const WeightSelection all{{0, c.num_layers}, true, true, {}};
    const ModelWeights g = load_weights(file, c, all, at::kFloat);
    const ModelWeights h = random_weights(c, all, 5, 0.05, dtype);
    EXPECT_TRUE(at::equal(g.embedding.dequantize(), h.embedding.dequantize()));
    EXPECT_TRUE(at::equal(g.layer[2].qkv.dequantize(), h.layer[2].qkv.dequantize()));
    EXPECT_TRUE(at::equal(g.layer[0].input_norm, h.layer[0].input_norm.to(at::kFloat)));
    EXPECT_EQ(GgufFile(file).tensor("blk.0.attn_q.weight").type,
              uint32_t(dtype == at::kHalf ? GgmlType::F16 : GgmlType::BF16));
    EXPECT_EQ(GgufFile(file).tensor("blk.0.attn_norm.weight").type, uint32_t(GgmlType::F32));
  }
}

// init-model writes the same numbers in both formats for the same flags.
TEST_F(GgufTest, InitModelGgufMatchesHf) {
  InitModelOptions o;
  o.config = small_config();
  o.seed = 11;
  o.std = 0.03;
  o.out = path("hf");
  init_model(o);
  o.format = "gguf";
  o.out = path("sub/m.gguf");
  init_model(o);
  const WeightSelection all{{0, o.config.num_layers}, true, true, {}};
  const ModelWeights h = load_weights(path("hf"), load_model_config(path("hf")), all, at::kFloat);
  const ModelWeights g = load_weights(o.out, load_model_config(o.out), all, at::kFloat);
  EXPECT_TRUE(at::equal(g.embedding.dequantize(), h.embedding.dequantize()));
  EXPECT_TRUE(at::equal(g.lm_head.dequantize(), h.lm_head.dequantize()));
  for (int64_t i = 0; i < o.config.num_layers; ++i) {
    EXPECT_TRUE(at::equal(g.layer[i].qkv.dequantize(), h.layer[i].qkv.dequantize()));
    EXPECT_TRUE(at::equal(g.layer[i].down.dequantize(), h.layer[i].down.dequantize()));
  }
}

TEST_F(GgufTest, Q8_0DequantisesAHandComputedBlock) {
  // One 32-value block: scale 0.5 (f16 0x3800), quants -16..15, then a second block with
  // scale -2 (0xC000) and quants 0, 1, -1, 127, -128, 0...
  std::string bytes;
  auto block = [&](uint16_t scale, const std::vector<int8_t>& q) {
    bytes.append(reinterpret_cast<const char*>(&scale), 2);
    for (int i = 0; i < 32; ++i) bytes.push_back(static_cast<char>(i < (int)q.size() ? q[i] : 0));
  };
  std::vector<int8_t> q1;
  for (int i = 0; i < 32; ++i) q1.push_back(static_cast<int8_t>(i - 16));
  block(0x3800, q1);
  block(0xC000, {0, 1, -1, 127, -128});
  GgufWriter w = minimal();
  w.add_tensor("q8", uint32_t(GgmlType::Q8_0), {32, 2}, bytes);
  w.write(path("q8.gguf"));
  const at::Tensor t = GgufFile(path("q8.gguf")).load("q8");
  ASSERT_EQ(t.sizes(), (std::vector<int64_t>{2, 32}));
  for (int i = 0; i < 32; ++i) EXPECT_EQ(t[0][i].item<float>(), 0.5f * (i - 16)) << i;
  const float second[] = {0, -2, 2, -254, 256};
  for (int i = 0; i < 5; ++i) EXPECT_EQ(t[1][i].item<float>(), second[i]) << i;
  for (int i = 5; i < 32; ++i) EXPECT_EQ(t[1][i].item<float>(), 0.0f);
}

TEST_F(GgufTest, BadMagic) {
  std::string b = minimal().serialize();
  b.replace(0, 4, "GGML");
  write_bytes("m.gguf", b);
  expect_invalid([&] { GgufFile f(path("m.gguf")); }, {path("m.gguf"), "bad magic"});
  write_bytes("short.gguf", "GG");
  expect_invalid([&] { GgufFile f(path("short.gguf")); }, {path("short.gguf"), "too short"});
}

TEST_F(GgufTest, UnsupportedVersion) {
  std::string b = minimal().serialize();
  const uint32_t v = 2;
  std::memcpy(&b[4], &v, 4);
  write_bytes("m.gguf", b);
  expect_invalid([&] { GgufFile f(path("m.gguf")); }, {path("m.gguf"), "unsupported GGUF version 2"});
}

TEST_F(GgufTest, TruncatedTensorData) {
  const std::string b = minimal().serialize();
  write_bytes("m.gguf", b.substr(0, b.size() - 8));
  expect_invalid([&] { GgufFile f(path("m.gguf")); },
                 {path("m.gguf"), "tensor 'token_embd.weight'", "runs past the end of the file"});
  write_bytes("h.gguf", b.substr(0, 40));  // inside the metadata
  expect_invalid([&] { GgufFile f(path("h.gguf")); }, {path("h.gguf"), "file ends inside the header"});
}

TEST_F(GgufTest, OffsetOutOfRange) {
  std::string b = minimal().serialize();
  const size_t at = tensor_info_at(b, "token_embd.weight");
  const uint64_t offset = uint64_t{1} << 40;  // aligned, far past the end
  std::memcpy(&b[at + 4 + 2 * 8 + 4], &offset, 8);
  write_bytes("m.gguf", b);
  expect_invalid([&] { GgufFile f(path("m.gguf")); }, {path("m.gguf"), "token_embd.weight", "runs past the end"});
  const uint64_t misaligned = 4;
  std::memcpy(&b[at + 4 + 2 * 8 + 4], &misaligned, 8);
  write_bytes("a.gguf", b);
  expect_invalid([&] { GgufFile f(path("a.gguf")); }, {path("a.gguf"), "not a multiple of the alignment"});
}

TEST_F(GgufTest, MissingHyperparameter) {
  minimal([](const std::string& k) { return k != "llama.block_count"; }).write(path("m.gguf"));
  expect_invalid([&] { load_model_config(path("m.gguf")); }, {path("m.gguf"), "missing metadata 'llama.block_count'"});
  minimal([](const std::string& k) { return k != "llama.attention.layer_norm_rms_epsilon"; })
      .write(path("e.gguf"));
  expect_invalid([&] { load_model_config(path("e.gguf")); },
                 {path("e.gguf"), "'llama.attention.layer_norm_rms_epsilon'"});
  // The valid file itself is accepted: the failures above come from the missing keys.
  minimal().write(path("ok.gguf"));
  EXPECT_EQ(load_model_config(path("ok.gguf")).num_layers, 1);
}

TEST_F(GgufTest, UnknownAndUnsupportedTensorTypes) {
  GgufWriter w = minimal();
  w.add_tensor("weird", 99, {32}, std::string(128, '\0'));
  w.write(path("u.gguf"));
  expect_invalid([&] { GgufFile f(path("u.gguf")); }, {path("u.gguf"), "tensor 'weird'", "unknown tensor type 99"});

  // Types ggml knows and kvpipe has no kernels for (the IQ types below IQ4, the ternary TQ
  // types): the header is fine, only loading the tensor is refused, by name.
  GgufWriter k = minimal();
  k.add_tensor("iq2", 16, {256}, std::string(66, '\0'));  // IQ2_XXS: one super-block
  k.add_tensor("tq1", 34, {256}, std::string(54, '\0'));  // TQ1_0: one super-block
  k.write(path("k.gguf"));
  GgufFile f(path("k.gguf"));
  expect_invalid([&] { f.load("iq2"); }, {path("k.gguf"), "tensor 'iq2'", "IQ2_XXS", "not supported"});
  expect_invalid([&] { f.load_matrix("iq2"); }, {path("k.gguf"), "tensor 'iq2'", "IQ2_XXS", "not supported"});
  expect_invalid([&] { f.load_matrix("tq1"); }, {path("k.gguf"), "tensor 'tq1'", "TQ1_0", "not supported"});
}

TEST_F(GgufTest, UnsupportedArchitecture) {
  GgufWriter w;
  w.add_string("general.architecture", "gpt2");
  w.write(path("g.gguf"));
  expect_invalid([&] { load_model_config(path("g.gguf")); }, {path("g.gguf"), "'gpt2'"});
}

// A rank reads only its layers' tensors: a tensor it does not load may be of a type that
// cannot be loaded at all.
TEST_F(GgufTest, RankLoadsOnlyItsLayers) {
  const ModelConfig c = small_config();
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [n, shape] : hf_tensor_layout(c)) tensors.emplace_back(n, random_tensor(n, shape, 5, 0.05));
  write_gguf_model(path("m.gguf"), c, tensors, at::kFloat);
  // Retype layer 2's down projection in place as I32, as many bytes per value as F32: the
  // header stays valid (every byte of the data section still belongs to one tensor), loading
  // that tensor is refused.
  std::string b = kvpipe::testing::slurp(path("m.gguf"));
  const size_t at = tensor_info_at(b, "blk.2.ffn_down.weight");
  const uint32_t i32 = 26;
  std::memcpy(&b[at + 4 + 2 * 8], &i32, 4);
  write_bytes("m.gguf", b);
  const ModelWeights first = load_weights(path("m.gguf"), c, {{0, 2}, true, false, {}}, at::kFloat);
  EXPECT_EQ(first.layer.size(), 2u);
  expect_invalid([&] { load_weights(path("m.gguf"), c, {{2, 3}, false, true, {}}, at::kFloat); },
                 {path("m.gguf"), "blk.2.ffn_down.weight", "I32"});
}

TEST(GgufNames, HfToGguf) {
  EXPECT_EQ(gguf_tensor_name("model.embed_tokens.weight"), "token_embd.weight");
  EXPECT_EQ(gguf_tensor_name("model.layers.12.self_attn.o_proj.weight"), "blk.12.attn_output.weight");
  EXPECT_EQ(gguf_tensor_name("model.layers.0.mlp.down_proj.weight"), "blk.0.ffn_down.weight");
  EXPECT_EQ(gguf_tensor_name("model.layers.3.post_attention_layernorm.weight"), "blk.3.ffn_norm.weight");
  EXPECT_EQ(gguf_tensor_name("lm_head.weight"), "output.weight");
  EXPECT_THROW(gguf_tensor_name("model.layers.x.mlp.down_proj.weight"), std::invalid_argument);
  const at::Tensor w = at::randn({2 * 8, 3});
  EXPECT_TRUE(at::equal(gguf_unpermute_rows(gguf_permute_rows(w, 2), 2), w));
}

}  // namespace
}  // namespace kvpipe
