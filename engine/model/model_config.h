// ModelConfig: the shape and hyper-parameters of a Llama-family decoder-only model.
//
// Read from an HF config.json (the architectures of engine/model/architecture.h: Llama,
// Mistral, Qwen2, Qwen3, Phi-3) or taken from a named preset. RoPE comes from transformers 5's `rope_parameters` or from the
// earlier `rope_theta` + `rope_scaling` alike (types default, linear and llama3). Anything the
// engine does not implement (another architecture, an activation other than SiLU, another
// RoPE type or a RoPE key it does not know, an active sliding window shorter than the
// context) is refused with std::invalid_argument naming the file and key: a model is
// never run with math that differs from its definition. So is a value of the wrong JSON
// type, a hyper-parameter that is not a finite positive number, and a size beyond the
// bounds below: every size is checked before anything is allocated or partitioned by it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kvpipe {

// Bounds on a model's shape, far above every released model of the supported families
// (Llama 3.1 405B: 126 layers, hidden 16384, 128 heads, feed-forward 53248, vocabulary
// 128256; Qwen2.5-1M: 1010000 positions), so that only a corrupt or hostile file meets them.
// With every size inside them the parameter count and the byte counts derived from it fit
// in int64_t.
inline constexpr int64_t kMaxModelLayers = 4096;
inline constexpr int64_t kMaxModelHeads = 4096;                      // attention heads
inline constexpr int64_t kMaxModelHeadDim = 4096;
inline constexpr int64_t kMaxModelHidden = int64_t{1} << 17;         // 131072
inline constexpr int64_t kMaxModelIntermediate = int64_t{1} << 20;   // 1048576
inline constexpr int64_t kMaxModelVocab = int64_t{1} << 24;          // 16777216
inline constexpr int64_t kMaxModelPositions = int64_t{1} << 24;      // 16777216
inline constexpr int64_t kMaxModelParams = int64_t{1} << 48;
// A config.json is a few kilobytes; reading stops well before a runaway file fills memory.
inline constexpr uint64_t kMaxConfigJsonBytes = uint64_t{16} << 20;

// How RoPE's inverse frequencies are scaled: transformers' rope types (llama3: Llama 3.1 and
// 3.2's long-context scaling; linear: position interpolation; yarn: NTK-by-parts interpolation
// with its attention factor; dynamic: NTK scaling that transformers applies only past
// max_position_embeddings, which kvpipe never serves, so within the context it is the default),
// and GGUF's per-frequency divisors (rope_freqs.weight, which llama.cpp's converter writes for
// llama3 models).
struct RopeScaling {
  std::string type = "default";         // default | linear | dynamic | yarn | llama3
  double factor = 1.0;                  // linear, dynamic, yarn, llama3
  double low_freq_factor = 1.0;         // llama3
  double high_freq_factor = 4.0;        // llama3
  int64_t original_max_position = 0;    // llama3, yarn: original_max_position_embeddings
  double beta_fast = 32.0;              // yarn: rotations where extrapolation ends
  double beta_slow = 1.0;               // yarn: rotations where interpolation begins
  bool truncate = true;                 // yarn: the ramp's ends rounded to whole dimensions
  double attention_factor = 1.0;        // cos and sin are multiplied by it (yarn's mscale)
  std::vector<double> freq_factors;     // GGUF: inverse frequency i is divided by [i]
};

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
  RopeScaling rope_scaling;
  // Dimensions of each head that RoPE rotates, the first ones (partial_rotary_factor,
  // rope.dimension_count); 0 means all of them. The rest pass through unrotated.
  int64_t rotary_dim = 0;
  double rms_eps = 1e-6;
  bool tie_embeddings = false;
  bool qkv_bias = false;           // Qwen2
  bool qk_norm = false;            // Qwen3: RMSNorm over each q and k head before RoPE
  // Gemma 2 (engine/model/architecture.h): GeGLU (gelu, tanh approximation) instead of
  // SwiGLU, embeddings times `embedding_scale`, attention scores times `attention_scale`
  // (0: head_dim^-0.5), then soft-capped as cap * tanh(score / cap) (0: not capped), as are
  // the LM head's logits, and the layers that `sliding_layers` marks see only the last
  // `sliding_window` keys (themselves included).
  bool gelu_tanh = false;
  double embedding_scale = 1.0;
  double attention_scale = 0.0;
  double attn_softcap = 0.0;
  double final_softcap = 0.0;
  int64_t sliding_window = 0;        // 0: no layer is windowed (also when the context fits in it)
  std::vector<bool> sliding_layers;  // empty, or one per layer: the local (sliding) layers
  // Gemma 3: the RoPE base of the local layers, which take no RoPE scaling (0: they rotate
  // as the others do).
  double local_rope_theta = 0.0;
  std::vector<int64_t> eos_token_ids;
  int64_t bos_token_id = -1;

  int64_t rope_dim() const { return rotary_dim > 0 ? rotary_dim : head_dim; }

  // Checks internal consistency (sizes positive and within the bounds above, heads
  // divisible by kv heads, finite positive rope_theta and rms_norm_eps, ...); `source` names
  // the file or preset in messages, and `key_name`, when given, turns a config.json key into
  // the name the source gives it (GGUF metadata keys).
  void validate(const std::string& source,
                const std::function<std::string(const std::string&)>& key_name = {}) const;

  // Parameters of one decoder layer, and of the embedding (= LM head when untied).
  int64_t layer_params() const;
  int64_t embedding_params() const { return vocab_size * hidden_size; }
  int64_t total_params() const;
  // Bytes of K and V for one token of one layer, at `element_size` bytes per value.
  int64_t kv_bytes_per_token_layer(int64_t element_size) const {
    return 2 * num_kv_heads * head_dim * element_size;
  }
  bool local_layer(int64_t layer) const {
    return layer < static_cast<int64_t>(sliding_layers.size()) && sliding_layers[layer];
  }
  // The window of `layer` (0: it sees every earlier key).
  int64_t layer_window(int64_t layer) const { return local_layer(layer) ? sliding_window : 0; }
  // Whether some layer's attention is more than a causal softmax (soft-capped or windowed):
  // only the per-sequence attention path computes those.
  bool masked_or_capped_attention() const;
};

// RoPE's inverse frequencies for `cfg`, in float64 [rope_dim / 2]: theta^(-2i / rope_dim),
// scaled as `cfg.rope_scaling` says (transformers' rope init functions: linear divides every
// frequency by `factor`; llama3 and yarn divide the low frequencies by it, keep the high ones
// and blend those between; GGUF's freq_factors divide each on top).
std::vector<double> rope_inv_freq(const ModelConfig& cfg);

// Whether `architecture` (an HF class name) can rotate only the first dimensions of a head.
bool supports_partial_rotary(const std::string& architecture);

// Reads `dir`/config.json.
ModelConfig load_hf_config(const std::string& dir);
// Writes `cfg` as an HF config.json into `dir`.
void write_hf_config(const ModelConfig& cfg, const std::string& dir, const std::string& torch_dtype);

// Named shapes for random-weight models: "tiny" and "small".
ModelConfig preset_config(const std::string& name);
std::vector<std::string> preset_names();

}  // namespace kvpipe
