// Qwen3, Phi-3 and Gemma 2 beside Llama, Mistral and Qwen2: config.json as transformers saves
// each one is read into the math it defines (Qwen3's q/k norms and its own default head size,
// Phi-3's fused projections and its sliding window, Gemma 2's scales, soft caps and
// interleaved sliding-window layers), every key that would change that math
// and kvpipe does not apply is refused by name, and the tensor layout is the one the HF files
// hold.
#include "engine/model/architecture.h"
#include "engine/model/model_config.h"
#include "engine/model/model_weights.h"
#include "tests/support/command.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;

// The shape keys of a small model; `arch` names the architecture.
std::string shape(const std::string& arch, int layers) {
  return R"("architectures": [")" + arch + R"("], "vocab_size": 300, "hidden_size": 64,
    "num_hidden_layers": )" + std::to_string(layers) + R"(, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
    "max_position_embeddings": 256)";
}

class Architectures : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::make_scratch_dir(); }
  void TearDown() override { fs::remove_all(dir_); }

  std::string config(const std::string& arch, const std::string& keys, int layers = 2) {
    const fs::path d = dir_ / ("m" + std::to_string(count_++));
    fs::create_directories(d);
    std::ofstream(d / "config.json") << "{" << shape(arch, layers) << (keys.empty() ? "" : ", ") << keys << "}";
    return d.string();
  }
  std::string refusal(const std::string& arch, const std::string& keys) {
    const std::string d = config(arch, keys);
    try {
      load_hf_config(d);
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.rfind(d + "/config.json: ", 0), 0u) << what;
      return what;
    }
    return "(loaded)";
  }

  fs::path dir_;
  int count_ = 0;
};

TEST_F(Architectures, Qwen3AsTransformersSavesIt) {
  const ModelConfig c = load_hf_config(config("Qwen3ForCausalLM", R"("head_dim": 48, "attention_bias": false,
      "use_sliding_window": false, "sliding_window": null, "max_window_layers": 28,
      "layer_types": ["full_attention", "full_attention"],
      "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"})"));
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.head_dim, 48);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1000000.0);
  // transformers' Qwen3Config defaults head_dim to 128, not hidden_size / heads.
  EXPECT_EQ(load_hf_config(config("Qwen3ForCausalLM", "")).head_dim, 128);
  EXPECT_EQ(load_hf_config(config("Qwen2ForCausalLM", "")).head_dim, 16);
}

TEST_F(Architectures, Phi3AsTransformersSavesIt) {
  // transformers 5 keeps partial_rotary_factor inside rope_parameters.
  const ModelConfig c = load_hf_config(config("Phi3ForCausalLM", R"("original_max_position_embeddings": 256,
      "sliding_window": null, "rope_parameters": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
      "rope_type": "default"})"));
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.max_position, 256);
  // Phi-3-mini's window on every layer: the context stops where it would start to matter.
  EXPECT_EQ(load_hf_config(config("Phi3ForCausalLM", R"("sliding_window": 100)")).max_position, 100);
  EXPECT_EQ(load_hf_config(config("Phi3ForCausalLM", R"("sliding_window": 1000)")).max_position, 256);
}

TEST_F(Architectures, Gemma2AsTransformersSavesIt) {
  const ModelConfig c = load_hf_config(config("Gemma2ForCausalLM", R"("head_dim": 32, "query_pre_attn_scalar": 64,
      "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 8, "attn_logit_softcapping": 50.0,
      "final_logit_softcapping": 30.0, "layer_types": ["sliding_attention", "full_attention"],
      "use_bidirectional_attention": null, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"})"));
  EXPECT_TRUE(c.gelu_tanh);
  EXPECT_TRUE(c.tie_embeddings);  // Gemma2Config's default
  EXPECT_DOUBLE_EQ(c.embedding_scale, 8.0);
  EXPECT_DOUBLE_EQ(c.attention_scale, 0.125);
  EXPECT_DOUBLE_EQ(c.attn_softcap, 50.0);
  EXPECT_DOUBLE_EQ(c.final_softcap, 30.0);
  EXPECT_EQ(c.layer_window(0), 8);
  EXPECT_EQ(c.layer_window(1), 0);
  EXPECT_TRUE(c.masked_or_capped_attention());
  // transformers' defaults: head_dim 256, every even layer sliding over 4096 keys; a null cap
  // turns capping off; a window the whole context fits in is no window.
  const ModelConfig d = load_hf_config(config("Gemma2ForCausalLM", R"("max_position_embeddings": 8192,
      "attn_logit_softcapping": null, "final_logit_softcapping": null)"));
  EXPECT_EQ(d.head_dim, 256);
  EXPECT_EQ(d.layer_window(0), 4096);
  EXPECT_EQ(d.layer_window(1), 0);
  EXPECT_DOUBLE_EQ(d.attn_softcap, 0.0);
  EXPECT_DOUBLE_EQ(d.final_softcap, 0.0);
  const ModelConfig e = load_hf_config(config("Gemma2ForCausalLM", R"("sliding_window": 256,
      "attn_logit_softcapping": null)"));
  EXPECT_EQ(e.layer_window(0), 0);
  EXPECT_FALSE(e.masked_or_capped_attention());
}

TEST_F(Architectures, Gemma3AsTransformersSavesIt) {
  const ModelConfig c = load_hf_config(config("Gemma3ForCausalLM", R"("head_dim": 32, "query_pre_attn_scalar": 32,
      "sliding_window": 8, "attn_logit_softcapping": null, "final_logit_softcapping": null, "_sliding_window_pattern": 6,
      "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {"full_attention": {"rope_theta": 1000000.0, "rope_type": "linear", "factor": 8.0},
                          "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}})"));
  EXPECT_TRUE(c.qk_norm);
  EXPECT_TRUE(c.gelu_tanh);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1000000.0);
  EXPECT_EQ(c.rope_scaling.type, "linear");  // the full layers' scaling
  EXPECT_DOUBLE_EQ(c.local_rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.attn_softcap, 0.0);
  EXPECT_EQ(c.layer_window(0), 8);
  EXPECT_EQ(c.layer_window(1), 0);
  // Without layer_types the pattern decides: five sliding layers of every six.
  const ModelConfig d = load_hf_config(
      config("Gemma3ForCausalLM", R"("sliding_window": 8, "rope_local_base_freq": 20000.0, "rope_theta": 500000.0)", 7));
  std::vector<int64_t> windows;
  for (int64_t l = 0; l < d.num_layers; ++l) windows.push_back(d.layer_window(l));
  EXPECT_EQ(windows, (std::vector<int64_t>{8, 8, 8, 8, 8, 0, 8}));
  EXPECT_DOUBLE_EQ(d.local_rope_theta, 20000.0);
  EXPECT_DOUBLE_EQ(d.rope_theta, 500000.0);
}

TEST_F(Architectures, WhatKvpipeDoesNotApplyIsRefusedByName) {
  EXPECT_NE(refusal("Qwen3ForCausalLM", R"("attention_bias": true)").find("'attention_bias: true'"),
            std::string::npos);
  EXPECT_NE(refusal("Qwen3ForCausalLM", R"("use_sliding_window": true, "sliding_window": 64)")
                .find("'use_sliding_window: true'"),
            std::string::npos);
  EXPECT_NE(refusal("Qwen3ForCausalLM", R"("layer_types": ["full_attention", "sliding_attention"])")
                .find("'layer_types': layer type string \"sliding_attention\""),
            std::string::npos);
  EXPECT_NE(refusal("Qwen3ForCausalLM", R"("hidden_act": "gelu")").find("'hidden_act' 'gelu'"), std::string::npos);
  // Phi-3 rotates part of each head; Qwen3's transformers code rotates whole heads.
  EXPECT_EQ(load_hf_config(config("Phi3ForCausalLM", R"("rope_parameters": {"partial_rotary_factor": 0.75,
      "rope_theta": 10000.0, "rope_type": "default"})")).rotary_dim, 12);
  EXPECT_EQ(load_hf_config(config("Phi3ForCausalLM", R"("partial_rotary_factor": 0.5)")).rope_dim(), 8);
  EXPECT_NE(refusal("Qwen3ForCausalLM", R"("rope_parameters": {"partial_rotary_factor": 0.75, "rope_theta": 10000.0,
      "rope_type": "default"})")
                .find("'rope_parameters.partial_rotary_factor' other than 1 is not supported for Qwen3ForCausalLM"),
            std::string::npos);
  EXPECT_NE(refusal("Phi3ForCausalLM", R"("partial_rotary_factor": 0.1)").find("'partial_rotary_factor' gives 1"),
            std::string::npos);
  // Phi-3's long-context scaling, under both of its names.
  for (const std::string type : {"longrope", "su"})
    EXPECT_NE(refusal("Phi3ForCausalLM", R"("rope_scaling": {"type": ")" + type +
                                              R"(", "short_factor": [1.0], "long_factor": [1.0]})")
                  .find("type '" + type + "'"),
              std::string::npos);
  EXPECT_NE(refusal("Phi3ForCausalLM", R"("attention_bias": true)").find("'attention_bias'"), std::string::npos);
  EXPECT_NE(refusal("Gemma3ForConditionalGeneration", "").find("unsupported architecture 'Gemma3ForConditionalGeneration'"),
            std::string::npos);
  EXPECT_NE(refusal("Gemma3ForCausalLM", R"("rope_parameters": {"full_attention": {"rope_theta": 1000000.0,
      "rope_type": "default"}, "sliding_attention": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}})")
                .find("'rope_parameters': 'sliding_attention': key 'factor'"),
            std::string::npos);
  EXPECT_NE(refusal("Gemma3ForCausalLM", R"("rope_parameters": {"full_attention": {"rope_theta": 1000000.0,
      "rope_type": "longrope", "factor": 2.0}, "sliding_attention": {"rope_theta": 10000.0}})")
                .find("type 'longrope'"),
            std::string::npos);
  EXPECT_NE(refusal("Gemma2ForCausalLM", R"("hidden_activation": "gelu")").find("'hidden_activation' 'gelu'"),
            std::string::npos);
  EXPECT_NE(refusal("Gemma2ForCausalLM", R"("use_bidirectional_attention": true)")
                .find("'use_bidirectional_attention: true'"),
            std::string::npos);
  EXPECT_NE(refusal("Gemma2ForCausalLM", R"("layer_types": ["full_attention", "chunked_attention"])")
                .find("'layer_types': layer type string \"chunked_attention\""),
            std::string::npos);
  EXPECT_NE(refusal("Gemma2ForCausalLM", R"("layer_types": ["full_attention"])").find("'layer_types' names 1 layers"),
            std::string::npos);
  EXPECT_NE(refusal("Gemma2ForCausalLM", R"("attention_bias": true)").find("'attention_bias'"), std::string::npos);
}

TEST_F(Architectures, TensorLayoutIsTheOneTheHfFilesHold) {
  auto names = [](const std::string& arch) {
    ModelConfig c = preset_config("tiny");
    c.architecture = arch;
    c.qk_norm = architecture(arch).qk_norm;
    c.num_layers = 1;
    std::vector<std::string> out;
    for (const auto& [name, shape] : hf_tensor_layout(c)) out.push_back(name + " " + c10::str(at::IntArrayRef(shape)));
    return out;
  };
  const std::vector<std::string> qwen3 = names("Qwen3ForCausalLM");
  EXPECT_NE(std::find(qwen3.begin(), qwen3.end(), "model.layers.0.self_attn.q_norm.weight [32]"), qwen3.end());
  EXPECT_NE(std::find(qwen3.begin(), qwen3.end(), "model.layers.0.self_attn.k_norm.weight [32]"), qwen3.end());
  const std::vector<std::string> phi3 = names("Phi3ForCausalLM");
  EXPECT_NE(std::find(phi3.begin(), phi3.end(), "model.layers.0.self_attn.qkv_proj.weight [512, 256]"), phi3.end());
  EXPECT_NE(std::find(phi3.begin(), phi3.end(), "model.layers.0.mlp.gate_up_proj.weight [1376, 256]"), phi3.end());
  for (const std::string& n : phi3) {
    EXPECT_EQ(n.find("q_proj"), std::string::npos) << n;
    EXPECT_EQ(n.find("gate_proj"), std::string::npos) << n;
  }
  const std::vector<std::string> gemma2 = names("Gemma2ForCausalLM");
  for (const char* norm : {"post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"})
    EXPECT_NE(std::find(gemma2.begin(), gemma2.end(), std::string("model.layers.0.") + norm + ".weight [256]"),
              gemma2.end())
        << norm;
  const std::vector<std::string> gemma3 = names("Gemma3ForCausalLM");
  EXPECT_NE(std::find(gemma3.begin(), gemma3.end(), "model.layers.0.self_attn.q_norm.weight [32]"), gemma3.end());
  EXPECT_THROW(names("Gemma3ForConditionalGeneration"), std::invalid_argument);
}

}  // namespace
}  // namespace kvpipe
