// RoPE as a model file defines it: transformers 5's `rope_parameters` and the earlier
// `rope_theta` + `rope_scaling` give the same model, the llama3, yarn and linear scalings change
// the frequencies as transformers does (dynamic only past the context kvpipe serves), GGUF's rope_freqs.weight and rope.scaling.* keys are read,
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
#include <iterator>
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

TEST_F(RopeConfig, YarnInBothLayoutsFollowsItsDefinition) {
  const char* yarn = R"("rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64)";
  const ModelConfig current =
      load_hf_config(config("current", std::string(R"("rope_parameters": {"rope_theta": 10000.0, )") + yarn + "}"));
  const ModelConfig legacy =
      load_hf_config(config("legacy", std::string(R"("rope_theta": 10000.0, "rope_scaling": {)") + yarn + "}"));
  const RopeScaling& rs = current.rope_scaling;
  EXPECT_EQ(rs.type, "yarn");
  EXPECT_EQ(rs.original_max_position, 64);
  EXPECT_DOUBLE_EQ(rs.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(rs.beta_slow, 1.0);
  // The paper's attention factor: 0.1 ln(factor) + 1.
  EXPECT_DOUBLE_EQ(rs.attention_factor, 0.1 * std::log(4.0) + 1.0);
  const std::vector<double> a = rope_inv_freq(current);
  EXPECT_EQ(a, rope_inv_freq(legacy));
  EXPECT_DOUBLE_EQ(legacy.rope_scaling.attention_factor, rs.attention_factor);
  // Pairs that turn more than beta_fast times over the original 64 positions keep their
  // frequency, fewer than beta_slow times are interpolated by `factor`, and a ramp joins them.
  ASSERT_EQ(a.size(), 8u);
  for (size_t i = 0; i < a.size(); ++i) {
    const double plain = 1.0 / std::pow(10000.0, 2.0 * static_cast<double>(i) / 16.0);
    const double turns = 64.0 * plain / (2 * M_PI);
    if (turns > 32) EXPECT_DOUBLE_EQ(a[i], plain) << i;
    else if (turns < 1) EXPECT_DOUBLE_EQ(a[i], plain / 4) << i;
    else EXPECT_TRUE(a[i] <= plain && a[i] >= plain / 4) << i;
    if (i > 0) {
      EXPECT_LT(a[i], a[i - 1]) << i;
    }
  }

  // mscale and mscale_all_dim (DeepSeek's) give their ratio; an explicit attention_factor wins;
  // a missing factor is the ratio of the two contexts (256 / 64).
  const ModelConfig deepseek = load_hf_config(config("deepseek", std::string(R"("rope_parameters": {"rope_theta": 10000.0,
      "mscale": 1.0, "mscale_all_dim": 0.5, )") + yarn + "}"));
  EXPECT_DOUBLE_EQ(deepseek.rope_scaling.attention_factor, (0.1 * std::log(4.0) + 1.0) / (0.05 * std::log(4.0) + 1.0));
  const ModelConfig explicit_factor = load_hf_config(config("explicit", std::string(R"("rope_parameters": {"rope_theta": 10000.0,
      "attention_factor": 0.75, )") + yarn + "}"));
  EXPECT_DOUBLE_EQ(explicit_factor.rope_scaling.attention_factor, 0.75);
  const ModelConfig implied = load_hf_config(config("implied", R"("rope_parameters": {"rope_theta": 10000.0,
      "rope_type": "yarn", "factor": null, "original_max_position_embeddings": 64})"));
  EXPECT_DOUBLE_EQ(implied.rope_scaling.factor, 4.0);
}

TEST_F(RopeConfig, DynamicIsTheDefaultWithinTheContext) {
  // transformers rescales dynamic RoPE only for sequences longer than max_position_embeddings,
  // which kvpipe never serves.
  const ModelConfig dynamic =
      load_hf_config(config("dynamic", R"("rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})"));
  const ModelConfig plain = load_hf_config(config("plain", R"("rope_theta": 10000.0)"));
  EXPECT_EQ(dynamic.rope_scaling.type, "dynamic");
  EXPECT_DOUBLE_EQ(dynamic.rope_scaling.factor, 2.0);
  EXPECT_EQ(rope_inv_freq(dynamic), rope_inv_freq(plain));
  EXPECT_EQ(dynamic.max_position, plain.max_position);
}

TEST_F(RopeConfig, InitModelWritesRopeParametersAsTransformers5Does) {
  ModelConfig cfg = load_hf_config(config("src", std::string(R"("rope_parameters": {"rope_theta": 500000.0, )") + kLlama3 + "}"));
  const fs::path out = dir_ / "written";
  fs::create_directories(out);
  write_hf_config(cfg, out.string(), "float32");
  std::ifstream in(out / "config.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"rope_parameters\""), std::string::npos) << text;
  EXPECT_EQ(text.find("\"rope_scaling\""), std::string::npos) << text;
  EXPECT_EQ(text.find("\"rope_theta\": 500000"), text.rfind("\"rope_theta\"")) << "one rope_theta, inside the object";
  const ModelConfig back = load_hf_config(out.string());
  EXPECT_EQ(rope_inv_freq(back), rope_inv_freq(cfg));
  EXPECT_DOUBLE_EQ(back.rope_theta, 500000.0);
}

TEST_F(RopeConfig, WhatKvpipeDoesNotApplyIsRefusedByName) {
  const struct {
    std::string rope;
    std::vector<std::string> says;
  } cases[] = {
      {R"("rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})",
       {"'original_max_position_embeddings'"}},
      {R"("rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
          "original_max_position_embeddings": 64, "extrapolation_factor": 0.5})",
       {"'rope_parameters': key 'extrapolation_factor' is not supported for RoPE type 'yarn'"}},
      {R"("rope_scaling": {"rope_type": "longrope", "factor": 2.0})",
       {"'rope_scaling' type 'longrope'", "supported: default, linear, dynamic, yarn, llama3"}},
      {R"("rope_scaling": {"type": "dynamic", "factor": 2.0, "low_freq_factor": 1.0})",
       {"'rope_scaling': key 'low_freq_factor' is not supported for RoPE type 'dynamic'"}},
      {std::string(R"("rope_parameters": {"rope_theta": 10000.0, "mscale": 1.2, )") + kLlama3 + "}",
       {"'rope_parameters': key 'mscale' is not supported for RoPE type 'llama3'"}},
      {R"("rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})",
       {"'rope_parameters.partial_rotary_factor' other than 1 is not supported for LlamaForCausalLM"}},
      {R"("rope_theta": 10000.0, "partial_rotary_factor": 0.5)",
       {"'partial_rotary_factor' other than 1 is not supported for LlamaForCausalLM"}},
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

TEST_F(RopeConfig, GgufCarriesYarnAndTheAttentionFactorAsLlamaCppReadsThem) {
  const ModelConfig cfg = load_hf_config(config("yarn", R"("rope_parameters": {"rope_theta": 10000.0,
      "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
      "attention_factor": 1.5})"));
  const GgufFile f(write_gguf(dir_ / "yarn.gguf", cfg));
  EXPECT_EQ(f.get_string("llama.rope.scaling.type"), "yarn");
  EXPECT_EQ(f.get_int("llama.rope.scaling.original_context_length"), 64);
  const ModelConfig read = gguf_config(f);
  EXPECT_EQ(read.rope_scaling.type, "yarn");
  EXPECT_NEAR(read.rope_scaling.attention_factor, 1.5, 1e-6);  // F32 metadata
  EXPECT_DOUBLE_EQ(read.rope_scaling.beta_fast, 16.0);
  const std::vector<double> want = rope_inv_freq(cfg), got = rope_inv_freq(read);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i] / want[i], 1.0, 1e-6) << i;

  // attn_factor alone multiplies cos and sin, as llama.cpp's rope does with any scaling.
  const ModelConfig plain = load_hf_config(config("plain", R"("rope_theta": 10000.0)"));
  const ModelConfig scaled =
      gguf_config(GgufFile(write_gguf(dir_ / "attn.gguf", plain, [](GgufWriter& w) {
        w.add_f32("llama.rope.scaling.attn_factor", 0.5f);
      })));
  EXPECT_DOUBLE_EQ(scaled.rope_scaling.attention_factor, 0.5);
  EXPECT_EQ(rope_inv_freq(scaled), rope_inv_freq(plain));
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
  const std::string longrope =
      refused("longrope.gguf", [](GgufWriter& w) { w.add_string("llama.rope.scaling.type", "longrope"); });
  EXPECT_NE(longrope.find("llama.rope.scaling.type 'longrope' is not supported (none, linear, yarn)"), std::string::npos)
      << longrope;
  const std::string ext = refused("ext.gguf", [](GgufWriter& w) {
    w.add_string("llama.rope.scaling.type", "yarn");
    w.add_f32("llama.rope.scaling.yarn_ext_factor", 0.5f);
  });
  EXPECT_NE(ext.find("llama.rope.scaling.yarn_ext_factor other than 1"), std::string::npos) << ext;
  const std::string attn =
      refused("attn.gguf", [](GgufWriter& w) { w.add_f32("llama.rope.scaling.attn_factor", -0.5f); });
  EXPECT_NE(attn.find("'llama.rope.scaling.attn_factor' must be a finite positive number"), std::string::npos) << attn;
  // llama.cpp's converter permutes a llama head's rows as a whole: a part cannot rotate.
  ModelConfig partial = cfg;
  partial.rotary_dim = 8;
  std::string rotary;
  try {
    gguf_config(GgufFile(write_gguf(dir_ / "partial.gguf", partial)));
  } catch (const std::invalid_argument& e) {
    rotary = e.what();
  }
  EXPECT_NE(rotary.find("llama.rope.dimension_count 8 differs from the head dimension 16"), std::string::npos) << rotary;
  const std::string factor = refused("factor.gguf", [](GgufWriter& w) {
    w.add_string("llama.rope.scaling.type", "linear");
    w.add_f32("llama.rope.scaling.factor", -1.0f);
  });
  EXPECT_NE(factor.find("'llama.rope.scaling.factor' must be a finite positive number"), std::string::npos) << factor;
}

}  // namespace
}  // namespace kvpipe
