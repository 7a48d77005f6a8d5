// ModelConfig: the shape and hyper-parameters of a Llama-family decoder-only model.
//
// Read from an HF config.json (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) or
// taken from a named preset. Anything the engine does not implement (another architecture,
// an activation other than SiLU, a rope_scaling type, an active sliding window shorter than
// the context) is refused with std::invalid_argument naming the file and key: a model is
// never run with math that differs from its definition.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvpipe {

struct ModelConfig {
  std::string architecture = "LlamaForCausalLM";
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  int64_t max_position = 2048;
  double rope_theta = 10000.0;
  double rms_eps = 1e-6;
  bool tie_embeddings = false;
  bool qkv_bias = false;           // Qwen2
  std::vector<int64_t> eos_token_ids;
  int64_t bos_token_id = -1;

  // Checks internal consistency (positive sizes, heads divisible by kv heads, ...);
  // `source` names the file or preset in messages.
  void validate(const std::string& source) const;

  // Parameters of one decoder layer, and of the embedding (= LM head when untied).
  int64_t layer_params() const;
  int64_t embedding_params() const { return vocab_size * hidden_size; }
  int64_t total_params() const;
  // Bytes of K and V for one token of one layer, at `element_size` bytes per value.
  int64_t kv_bytes_per_token_layer(int64_t element_size) const {
    return 2 * num_kv_heads * head_dim * element_size;
  }
};

// Reads `dir`/config.json.
ModelConfig load_hf_config(const std::string& dir);
// Writes `cfg` as an HF config.json (LlamaForCausalLM or Qwen2ForCausalLM) into `dir`.
void write_hf_config(const ModelConfig& cfg, const std::string& dir, const std::string& torch_dtype);

// Named shapes for random-weight models: "tiny" and "small".
ModelConfig preset_config(const std::string& name);
std::vector<std::string> preset_names();

}  // namespace kvpipe
