#include "engine/model_weights.h"

#include "engine/gguf.h"
#include "engine/safetensors.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <memory>
#include <stdexcept>

namespace kvpipe {
namespace {

const char* kDummyPrefix = "dummy:";

bool is_gguf_path(const std::string& path) {
  const std::string ext = ".gguf";
  return path.size() > ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0;
}

std::string layer_name(int64_t i, const std::string& suffix) {
  return "model.layers." + std::to_string(i) + "." + suffix;
}

// FNV-1a: a stable hash (std::hash is not guaranteed across builds) for per-tensor seeds.
uint64_t stable_hash(const std::string& s, uint64_t seed) {
  uint64_t h = 1469598103934665603ULL ^ (seed * 0x9E3779B97F4A7C15ULL);
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

bool is_norm(const std::string& name) {
  return name.find("norm") != std::string::npos;
}

using TensorSource = std::function<at::Tensor(const std::string&, const std::vector<int64_t>&)>;

}  // namespace

int64_t ModelWeights::bytes() const {
  int64_t total = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) total += t.numel() * static_cast<int64_t>(t.element_size());
  };
  add(embedding);
  add(final_norm);
  if (!(config.tie_embeddings && lm_head.defined() && embedding.defined() &&
        lm_head.data_ptr() == embedding.data_ptr()))
    add(lm_head);
  for (const auto& l : layer) {
    add(l.input_norm), add(l.qkv), add(l.qkv_bias), add(l.o), add(l.post_norm);
    add(l.gate_up), add(l.down);
  }
  return total;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> hf_tensor_layout(const ModelConfig& c) {
  const int64_t h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  out.push_back({"model.embed_tokens.weight", {c.vocab_size, h}});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    out.push_back({layer_name(i, "input_layernorm.weight"), {h}});
    out.push_back({layer_name(i, "self_attn.q_proj.weight"), {q, h}});
    out.push_back({layer_name(i, "self_attn.k_proj.weight"), {kv, h}});
    out.push_back({layer_name(i, "self_attn.v_proj.weight"), {kv, h}});
    if (c.qkv_bias) {
      out.push_back({layer_name(i, "self_attn.q_proj.bias"), {q}});
      out.push_back({layer_name(i, "self_attn.k_proj.bias"), {kv}});
      out.push_back({layer_name(i, "self_attn.v_proj.bias"), {kv}});
    }
    out.push_back({layer_name(i, "self_attn.o_proj.weight"), {h, q}});
    out.push_back({layer_name(i, "post_attention_layernorm.weight"), {h}});
    out.push_back({layer_name(i, "mlp.gate_proj.weight"), {c.intermediate_size, h}});
    out.push_back({layer_name(i, "mlp.up_proj.weight"), {c.intermediate_size, h}});
    out.push_back({layer_name(i, "mlp.down_proj.weight"), {h, c.intermediate_size}});
  }
  out.push_back({"model.norm.weight", {h}});
  if (!c.tie_embeddings) out.push_back({"lm_head.weight", {c.vocab_size, h}});
  return out;
}

at::Tensor random_tensor(const std::string& name, const std::vector<int64_t>& shape, uint64_t seed,
                         double std) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(stable_hash(name, seed));
  at::Tensor t = at::normal(0.0, std, shape, gen, at::TensorOptions().dtype(at::kFloat));
  if (is_norm(name)) t.add_(1.0);
  return t;
}

at::ScalarType parse_dtype(const std::string& name, const std::string& what) {
  if (name == "float32") return at::kFloat;
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  throw std::invalid_argument(what + ": unknown dtype '" + name + "' (float32, float16, bfloat16)");
}

ModelConfig load_model_config(const std::string& path) {
  if (path.rfind(kDummyPrefix, 0) == 0) {
    ModelConfig cfg = preset_config(path.substr(std::string(kDummyPrefix).size()));
    cfg.validate(path);
    return cfg;
  }
  if (is_gguf_path(path)) return load_gguf_config(path);
  return load_hf_config(path);
}

namespace {

ModelWeights build_weights(const ModelConfig& cfg, const WeightSelection& sel, at::ScalarType dtype,
                           const TensorSource& source) {
  if (sel.layers.begin < 0 || sel.layers.end > cfg.num_layers || sel.layers.begin > sel.layers.end)
    throw std::invalid_argument("layer range [" + std::to_string(sel.layers.begin) + ", " +
                                std::to_string(sel.layers.end) + ") is outside the model's " +
                                std::to_string(cfg.num_layers) + " layers");
  auto get = [&](const std::string& name, std::vector<int64_t> shape) {
    return source(name, shape).to(dtype).contiguous();
  };
  const int64_t h = cfg.hidden_size, q = cfg.num_heads * cfg.head_dim,
                kv = cfg.num_kv_heads * cfg.head_dim, ff = cfg.intermediate_size;
  ModelWeights w;
  w.config = cfg;
  w.layers = sel.layers;
  if (sel.embedding || (sel.head && cfg.tie_embeddings))
    w.embedding = get("model.embed_tokens.weight", {cfg.vocab_size, h});
  if (sel.head) {
    w.final_norm = get("model.norm.weight", {h});
    w.lm_head = cfg.tie_embeddings ? w.embedding : get("lm_head.weight", {cfg.vocab_size, h});
    if (!sel.embedding && cfg.tie_embeddings) w.embedding = at::Tensor();
  }
  for (int64_t i = sel.layers.begin; i < sel.layers.end; ++i) {
    LayerWeights l;
    l.input_norm = get(layer_name(i, "input_layernorm.weight"), {h});
    l.qkv = at::cat({get(layer_name(i, "self_attn.q_proj.weight"), {q, h}),
                     get(layer_name(i, "self_attn.k_proj.weight"), {kv, h}),
                     get(layer_name(i, "self_attn.v_proj.weight"), {kv, h})});
    if (cfg.qkv_bias)
      l.qkv_bias = at::cat({get(layer_name(i, "self_attn.q_proj.bias"), {q}),
                            get(layer_name(i, "self_attn.k_proj.bias"), {kv}),
                            get(layer_name(i, "self_attn.v_proj.bias"), {kv})});
    l.o = get(layer_name(i, "self_attn.o_proj.weight"), {h, q});
    l.post_norm = get(layer_name(i, "post_attention_layernorm.weight"), {h});
    l.gate_up = at::cat({get(layer_name(i, "mlp.gate_proj.weight"), {ff, h}),
                         get(layer_name(i, "mlp.up_proj.weight"), {ff, h})});
    l.down = get(layer_name(i, "mlp.down_proj.weight"), {h, ff});
    w.layer.push_back(std::move(l));
  }
  return w;
}

}  // namespace

ModelWeights random_weights(const ModelConfig& cfg, const WeightSelection& sel, uint64_t seed,
                            double std, at::ScalarType dtype) {
  return build_weights(cfg, sel, dtype, [seed, std](const std::string& name, const std::vector<int64_t>& shape) {
    return random_tensor(name, shape, seed, std);
  });
}

ModelWeights load_weights(const std::string& path, const ModelConfig& cfg,
                          const WeightSelection& sel, at::ScalarType dtype) {
  if (path.rfind(kDummyPrefix, 0) == 0) return random_weights(cfg, sel, 0, kDefaultInitStd, dtype);
  if (is_gguf_path(path)) {
    auto file = std::make_shared<GgufFile>(path);
    return build_weights(cfg, sel, dtype, [file, cfg](const std::string& name,
                                                      const std::vector<int64_t>& shape) {
      return load_gguf_tensor(*file, cfg, name, shape);
    });
  }
  auto files = std::make_shared<SafetensorsModel>(path);
  return build_weights(cfg, sel, dtype, [files, path, dtype](const std::string& name,
                                                             const std::vector<int64_t>& shape) {
    const std::vector<int64_t> actual = files->shape(name);
    if (actual != shape)
      throw std::invalid_argument(path + ": tensor '" + name + "' has shape " +
                                  c10::str(at::IntArrayRef(actual)) + ", config.json implies " +
                                  c10::str(at::IntArrayRef(shape)));
    return files->load(name, dtype);
  });
}

}  // namespace kvpipe
