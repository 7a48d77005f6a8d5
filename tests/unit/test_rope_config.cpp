// RoPE as a model file defines it: transformers 5's `rope_parameters` and the earlier
// `rope_theta` + `rope_scaling` give the same model, the llama3 and linear scalings change the
// frequencies as transformers does, GGUF's rope_freqs.weight and rope.scaling.* keys are read,
// and any RoPE type or key kvpipe does not apply is refused by name.
#include "engine/model/gguf.h"
#include "engine/model/model_config.h"
#include "engine/model/model_weights.h"
#include "launch/init_model.h"
#include "tests/support/command.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;

const char* kShape = R"("architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
  "head_dim": 16, "max_position_embeddings": 256)";
const char* kLlama3 = R"("rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
  "high_freq_factor": 4.0, "original_max_position_embeddings": 32)";

class RopeConfig : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::make_scratch_dir(); }
  void TearDown() override { fs::remove_all(dir_); }

  // A model directory whose config.json has the shape above and `rope` keys.
  std::string config(const std::string& name, const std::string& rope) {
    const fs::path d = dir_ / name;
    fs::create_directories(d);
    std::ofstream(d / "config.json") << "{" << kShape << ", " << rope << "}";
    return d.string();
  }
  std::string refusal(const std::string& name, const std::string& rope) {
    try {
      load_hf_config(config(name, rope));
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "(loaded)";
  }
  fs::path dir_;
};

TEST_F(RopeConfig, ThetaFromRopeParametersAsTransformers5WritesIt) {
  const ModelConfig current = load_hf_config(config("current", R"("rope_parameters": {"rope_type": "default",
      "rope_theta": 500000.0})"));
  EXPECT_DOUBLE_EQ(current.rope_theta, 500000.0);
  EXPECT_EQ(current.rope_scaling.type, "default");
  const ModelConfig legacy = load_hf_config(config("legacy", R"("rope_theta": 500000.0, "rope_scaling": null)"));
  EXPECT_DOUBLE_EQ(legacy.rope_theta, 500000.0);
  EXPECT_EQ(rope_inv_freq(current), rope_inv_freq(legacy));
}

TEST_F(RopeConfig, Llama3ScalingInBothLayoutsMatchesItsDefinition) {
  const ModelConfig current =
      load_hf_config(config("current", std::string(R"("rope_parameters": {"rope_theta": 500000.0, )") + kLlama3 + "}"));
  const ModelConfig legacy =
      load_hf_config(config("legacy", std::string(R"("rope_theta": 500000.0, "rope_scaling": {)") + kLlama3 + "}"));
  EXPECT_EQ(current.rope_scaling.type, "llama3");
  EXPECT_EQ(current.rope_scaling.original_max_position, 32);
  const std::vector<double> a = rope_inv_freq(current), b = rope_inv_freq(legacy);
  ASSERT_EQ(a.size(), 8u);
  EXPECT_EQ(a, b);
  // Wavelengths shorter than 32 / 4 positions keep their frequency, longer than 32 / 1 are
  // stretched eightfold, and those between are blended (never outside the two).
  for (size_t i = 0; i < a.size(); ++i) {
    const double plain = 1.0 / std::pow(500000.0, 2.0 * static_cast<double>(i) / 16.0);
    const double wavelen = 2 * M_PI / plain;
    if (wavelen < 8) EXPECT_DOUBLE_EQ(a[i], plain) << i;
    else if (wavelen > 32) EXPECT_DOUBLE_EQ(a[i], plain / 8) << i;
    else EXPECT_TRUE(a[i] <= plain && a[i] >= plain / 8) << i;
  }
  const ModelConfig linear = load_hf_config(config("linear", R"("rope_parameters": {"rope_type": "linear",
      "rope_theta": 10000.0, "factor": 4.0})"));
  const std::vector<double> l = rope_inv_freq(linear);
  for (size_t i = 0; i < l.size(); ++i)
    EXPECT_DOUBLE_EQ(l[i], 1.0 / std::pow(10000.0, 2.0 * static_cast<double>(i) / 16.0) / 4.0) << i;
}

TEST_F(RopeConfig, WhatKvpipeDoesNotApplyIsRefusedByName) {
  const struct {
    std::string rope;
    std::vector<std::string> says;
  } cases[] = {
      {R"("rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})",
       {"'rope_parameters' type 'yarn'", "supported: default, linear, llama3"}},
      {R"("rope_scaling": {"type": "dynamic", "factor": 2.0})", {"'rope_scaling' type 'dynamic'"}},
      {R"("rope_scaling": {"rope_type": "longrope", "factor": 2.0})", {"'rope_scaling' type 'longrope'"}},
      {std::string(R"("rope_parameters": {"rope_theta": 10000.0, "mscale": 1.2, )") + kLlama3 + "}",
       {"'rope_parameters': key 'mscale' is not supported for RoPE type 'llama3'"}},
      {R"("rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})",
       {"key 'partial_rotary_factor'"}},
      {R"("rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0})",
       {"'original_max_position_embeddings'"}},
      {R"("rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": -2.0})",
       {"'factor' must be a finite positive number"}},
      {R"("rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": "big"})",
       {"'factor': expected a number"}},
      {R"("rope_parameters": 3)", {"'rope_parameters': expected an object or null"}},
  };
  int i = 0;
  for (const auto& c : cases) {
    const std::string message = refusal("m" + std::to_string(i++), c.rope);
    for (const std::string& part : c.says) EXPECT_NE(message.find(part), std::string::npos) << message;
    EXPECT_NE(message.find("config.json"), std::string::npos) << message;
  }
}

// A GGUF file of `cfg` with init-model's writer, plus `extra` metadata.
std::string write_gguf(const fs::path& path, const ModelConfig& cfg,
                       const std::function<void(GgufWriter&)>& extra = {}) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, shape] : hf_tensor_layout(cfg)) tensors.emplace_back(name, random_tensor(name, shape, 1, 0.02));
  if (extra)
    write_gguf_file(path.string(), cfg, tensors, at::kFloat, [&](GgufWriter& w) { extra(w); });
  else
    write_gguf_model(path.string(), cfg, tensors, at::kFloat);
  return path.string();
}

TEST_F(RopeConfig, GgufCarriesLlama3AsFrequencyFactorsAndLinearAsMetadata) {
  ModelConfig cfg =
      load_hf_config(config("llama3", std::string(R"("rope_parameters": {"rope_theta": 500000.0, )") + kLlama3 + "}"));
  {
    const GgufFile f(write_gguf(dir_ / "llama3.gguf", cfg));
    ASSERT_TRUE(f.contains("rope_freqs.weight"));
    const ModelConfig read = gguf_config(f);
    EXPECT_EQ(read.rope_scaling.freq_factors.size(), 8u);
    const std::vector<double> want = rope_inv_freq(cfg), got = rope_inv_freq(read);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i] / want[i], 1.0, 1e-6) << i;  // F32 divisors
  }
  cfg.rope_scaling = RopeScaling{};
  cfg.rope_scaling.type = "linear";
  cfg.rope_scaling.factor = 4.0;
  {
    const GgufFile f(write_gguf(dir_ / "linear.gguf", cfg));
    EXPECT_FALSE(f.contains("rope_freqs.weight"));
    const ModelConfig read = gguf_config(f);
    EXPECT_EQ(read.rope_scaling.type, "linear");
    EXPECT_DOUBLE_EQ(read.rope_scaling.factor, 4.0);
  }
}

TEST_F(RopeConfig, GgufRopeScalingKvpipeDoesNotApplyIsRefusedByName) {
  const ModelConfig cfg = load_hf_config(config("plain", R"("rope_theta": 10000.0)"));
  auto refused = [&](const std::string& name, const std::function<void(GgufWriter&)>& extra) {
    try {
      const GgufFile f(write_gguf(dir_ / name, cfg, extra));
      gguf_config(f);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(loaded)");
  };
  const std::string yarn = refused("yarn.gguf", [](GgufWriter& w) { w.add_string("llama.rope.scaling.type", "yarn"); });
  EXPECT_NE(yarn.find("llama.rope.scaling.type 'yarn' is not supported"), std::string::npos) << yarn;
  const std::string attn =
      refused("attn.gguf", [](GgufWriter& w) { w.add_f32("llama.rope.scaling.attn_factor", 0.5f); });
  EXPECT_NE(attn.find("llama.rope.scaling.attn_factor"), std::string::npos) << attn;
  const std::string factor = refused("factor.gguf", [](GgufWriter& w) {
    w.add_string("llama.rope.scaling.type", "linear");
    w.add_f32("llama.rope.scaling.factor", -1.0f);
  });
  EXPECT_NE(factor.find("'llama.rope.scaling.factor' must be a finite positive number"), std::string::npos) << factor;
}

}  // namespace
}  // namespace kvpipe
