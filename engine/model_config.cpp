#include "engine/model_config.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <stdexcept>

namespace kvpipe {
namespace {

using nlohmann::json;

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw std::invalid_argument(source + ": " + what);
}

int64_t get_int(const json& j, const std::string& key, const std::string& src) {
  if (!j.contains(key)) fail(src, "missing key '" + key + "'");
  const json& v = j.at(key);
  if (!v.is_number_integer()) fail(src, "key '" + key + "' must be an integer");
  return v.get<int64_t>();
}

double get_number(const json& j, const std::string& key, double fallback, const std::string& src) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  if (!j.at(key).is_number()) fail(src, "key '" + key + "' must be a number");
  return j.at(key).get<double>();
}

}  // namespace

void ModelConfig::validate(const std::string& source) const {
  auto positive = [&](int64_t v, const char* key) {
    if (v <= 0) fail(source, std::string("'") + key + "' must be positive, got " + std::to_string(v));
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(num_layers, "num_hidden_layers");
  positive(num_heads, "num_attention_heads");
  positive(num_kv_heads, "num_key_value_heads");
  positive(head_dim, "head_dim");
  positive(intermediate_size, "intermediate_size");
  positive(max_position, "max_position_embeddings");
  if (num_heads % num_kv_heads != 0)
    fail(source, "num_attention_heads (" + std::to_string(num_heads) +
                     ") is not a multiple of num_key_value_heads (" +
                     std::to_string(num_kv_heads) + ")");
  if (head_dim % 2 != 0) fail(source, "head_dim must be even for RoPE");
  if (rope_theta <= 0) fail(source, "'rope_theta' must be positive");
  if (rms_eps <= 0) fail(source, "'rms_norm_eps' must be positive");
  for (int64_t id : eos_token_ids)
    if (id < 0 || id >= vocab_size) fail(source, "'eos_token_id' " + std::to_string(id) + " is outside the vocabulary");
}

int64_t ModelConfig::layer_params() const {
  const int64_t q = num_heads * head_dim, kv = num_kv_heads * head_dim;
  int64_t attn = hidden_size * (q + 2 * kv) + q * hidden_size;
  if (qkv_bias) attn += q + 2 * kv;
  return attn + 3 * hidden_size * intermediate_size + 2 * hidden_size;
}

int64_t ModelConfig::total_params() const {
  return num_layers * layer_params() + embedding_params() * (tie_embeddings ? 1 : 2) + hidden_size;
}

ModelConfig load_hf_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path);
  if (!in) fail(path, "cannot open (a model directory needs config.json)");
  json j;
  try {
    in >> j;
  } catch (const json::exception& e) {
    fail(path, std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object()) fail(path, "top level is not a JSON object");

  ModelConfig c;
  if (!j.contains("architectures") || !j["architectures"].is_array() || j["architectures"].empty() ||
      !j["architectures"][0].is_string())
    fail(path, "missing key 'architectures'");
  c.architecture = j["architectures"][0].get<std::string>();
  if (c.architecture != "LlamaForCausalLM" && c.architecture != "MistralForCausalLM" &&
      c.architecture != "Qwen2ForCausalLM")
    fail(path, "unsupported architecture '" + c.architecture +
                   "' (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)");
  c.qkv_bias = c.architecture == "Qwen2ForCausalLM";
  if (j.contains("attention_bias") && j["attention_bias"].is_boolean() && j["attention_bias"].get<bool>()) {
    if (c.architecture != "LlamaForCausalLM" && c.architecture != "Qwen2ForCausalLM")
      fail(path, "'attention_bias' is not supported for " + c.architecture);
    // Llama's attention_bias also puts a bias on o_proj, which the engine does not have.
    if (c.architecture == "LlamaForCausalLM") fail(path, "'attention_bias: true' is not supported");
  }
  if (j.contains("mlp_bias") && j["mlp_bias"].is_boolean() && j["mlp_bias"].get<bool>())
    fail(path, "'mlp_bias: true' is not supported");

  c.vocab_size = get_int(j, "vocab_size", path);
  c.hidden_size = get_int(j, "hidden_size", path);
  c.num_layers = get_int(j, "num_hidden_layers", path);
  c.num_heads = get_int(j, "num_attention_heads", path);
  c.num_kv_heads = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                       ? get_int(j, "num_key_value_heads", path)
                       : c.num_heads;
  c.intermediate_size = get_int(j, "intermediate_size", path);
  c.max_position = j.contains("max_position_embeddings") ? get_int(j, "max_position_embeddings", path) : 2048;
  c.head_dim = j.contains("head_dim") && !j["head_dim"].is_null()
                   ? get_int(j, "head_dim", path)
                   : (c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
  c.rope_theta = get_number(j, "rope_theta", 10000.0, path);
  c.rms_eps = get_number(j, "rms_norm_eps", 1e-6, path);
  c.tie_embeddings = j.value("tie_word_embeddings", false);

  const std::string act = j.value("hidden_act", std::string("silu"));
  if (act != "silu") fail(path, "unsupported 'hidden_act' '" + act + "' (only silu)");
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const json& rs = j["rope_scaling"];
    std::string type = rs.value("rope_type", rs.value("type", std::string("?")));
    if (type != "default")
      fail(path, "unsupported 'rope_scaling' type '" + type + "' (only plain RoPE is implemented)");
  }
  if (j.contains("partial_rotary_factor") && get_number(j, "partial_rotary_factor", 1.0, path) != 1.0)
    fail(path, "'partial_rotary_factor' other than 1 is not supported");
  // A sliding window changes attention only past its length: cap the context there instead
  // of running longer sequences with the wrong mask.
  const bool qwen_window = c.architecture == "Qwen2ForCausalLM" && j.value("use_sliding_window", false);
  if (c.architecture == "Qwen2ForCausalLM" && qwen_window)
    fail(path, "'use_sliding_window: true' is not supported");
  if (c.architecture == "MistralForCausalLM" && j.contains("sliding_window") &&
      j["sliding_window"].is_number_integer()) {
    const int64_t w = j["sliding_window"].get<int64_t>();
    if (w > 0 && w < c.max_position) c.max_position = w;
  }
  if (j.contains("eos_token_id")) {
    const json& e = j["eos_token_id"];
    if (e.is_number_integer()) c.eos_token_ids.push_back(e.get<int64_t>());
    else if (e.is_array())
      for (const json& x : e)
        if (x.is_number_integer()) c.eos_token_ids.push_back(x.get<int64_t>());
  }
  if (j.contains("bos_token_id") && j["bos_token_id"].is_number_integer()) c.bos_token_id = j["bos_token_id"].get<int64_t>();
  c.validate(path);
  return c;
}

void write_hf_config(const ModelConfig& c, const std::string& dir, const std::string& torch_dtype) {
  json j;
  j["architectures"] = {c.architecture};
  j["model_type"] = c.architecture == "Qwen2ForCausalLM" ? "qwen2" : (c.architecture == "MistralForCausalLM" ? "mistral" : "llama");
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["intermediate_size"] = c.intermediate_size;
  j["max_position_embeddings"] = c.max_position;
  j["rope_theta"] = c.rope_theta;
  j["rms_norm_eps"] = c.rms_eps;
  j["tie_word_embeddings"] = c.tie_embeddings;
  j["hidden_act"] = "silu";
  j["rope_scaling"] = nullptr;
  j["torch_dtype"] = torch_dtype;
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_ids.size() == 1) j["eos_token_id"] = c.eos_token_ids[0];
  else if (!c.eos_token_ids.empty()) j["eos_token_id"] = c.eos_token_ids;
  const std::string path = dir + "/config.json";
  std::ofstream out(path);
  if (!out) throw std::invalid_argument(path + ": cannot write");
  out << j.dump(2) << "\n";
  if (!out) throw std::invalid_argument(path + ": write failed");
}

ModelConfig preset_config(const std::string& name) {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  if (name == "tiny") {
    c.vocab_size = 512, c.hidden_size = 256, c.num_layers = 4, c.num_heads = 8, c.num_kv_heads = 4;
    c.intermediate_size = 688, c.max_position = 2048;
  } else if (name == "small") {
    c.vocab_size = 8192, c.hidden_size = 1024, c.num_layers = 8, c.num_heads = 16, c.num_kv_heads = 8;
    c.intermediate_size = 2816, c.max_position = 4096;
  } else {
    throw std::invalid_argument("unknown preset '" + name + "' (known: tiny, small)");
  }
  c.head_dim = c.hidden_size / c.num_heads;
  c.rope_theta = 10000.0;
  c.rms_eps = 1e-5;
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  return c;
}

std::vector<std::string> preset_names() { return {"tiny", "small"}; }

}  // namespace kvpipe
