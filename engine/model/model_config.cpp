#include "engine/model/model_config.h"

#include "engine/model/architecture.h"
#include "engine/model/mapped_file.h"

#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <stdexcept>

namespace kvpipe {

bool supports_partial_rotary(const std::string& architecture) {
  const Architecture* a = find_architecture(architecture);
  return a != nullptr && a->partial_rotary;
}

namespace {

using nlohmann::json;

constexpr const char* kSupportedRopeTypes = "default, linear, dynamic, yarn, llama3";
bool is_supported_rope_type(const std::string& type) {
  return type == "default" || type == "linear" || type == "dynamic" || type == "yarn" || type == "llama3";
}

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  std::string message = source + ": " + what;
  std::replace_if(
      message.begin(), message.end(), [](char c) { return c == '\n' || c == '\r'; }, ' ');
  throw std::invalid_argument(message);
}

// "string \"yes\"", "number 5", ...: what a key holds, short enough for a one-line message.
std::string describe(const json& v) {
  std::string text = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  if (v.is_string()) return "string " + text;
  if (v.is_boolean()) return "boolean " + text;
  if (v.is_number()) return "number " + text;
  if (v.is_null()) return "null";
  return std::string(v.type_name()) + " " + text;
}

[[noreturn]] void wrong_type(const std::string& src, const std::string& key, const std::string& expected,
                             const json& v) {
  fail(src, "'" + key + "': expected " + expected + ", got " + describe(v));
}

// The value of `key`, or nothing when it is absent or null (HF writes null for "unset").
const json* find(const json& j, const std::string& key) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

int64_t as_int(const json& v, const std::string& key, const std::string& src) {
  if (!v.is_number_integer() ||
      (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())))
    wrong_type(src, key, "an integer", v);
  return v.get<int64_t>();
}

int64_t get_int(const json& j, const std::string& key, const std::string& src) {
  const json* v = find(j, key);
  if (v == nullptr) fail(src, "missing key '" + key + "'");
  return as_int(*v, key, src);
}

int64_t get_int(const json& j, const std::string& key, int64_t fallback, const std::string& src) {
  const json* v = find(j, key);
  return v == nullptr ? fallback : as_int(*v, key, src);
}

double get_number(const json& j, const std::string& key, double fallback, const std::string& src) {
  const json* v = find(j, key);
  if (v == nullptr) return fallback;
  if (!v->is_number()) wrong_type(src, key, "a number", *v);
  return v->get<double>();
}

bool get_bool(const json& j, const std::string& key, bool fallback, const std::string& src) {
  const json* v = find(j, key);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) wrong_type(src, key, "true or false", *v);
  return v->get<bool>();
}

std::string get_string(const json& j, const std::string& key, const std::string& fallback, const std::string& src) {
  const json* v = find(j, key);
  if (v == nullptr) return fallback;
  if (!v->is_string()) wrong_type(src, key, "a string", *v);
  return v->get<std::string>();
}

}  // namespace

void ModelConfig::validate(const std::string& source,
                           const std::function<std::string(const std::string&)>& key_name) const {
  auto key = [&](const char* hf_key) { return "'" + (key_name ? key_name(hf_key) : std::string(hf_key)) + "'"; };
  // Bounds first: nothing below, and nothing the caller does next, may multiply an unchecked
  // size.
  auto size = [&](int64_t v, const char* hf_key, int64_t max) {
    if (v <= 0) fail(source, key(hf_key) + " must be positive, got " + std::to_string(v));
    if (v > max)
      fail(source, key(hf_key) + " is " + std::to_string(v) + ", more than the " + std::to_string(max) +
                       " supported");
  };
  size(vocab_size, "vocab_size", kMaxModelVocab);
  size(hidden_size, "hidden_size", kMaxModelHidden);
  size(num_layers, "num_hidden_layers", kMaxModelLayers);
  size(num_heads, "num_attention_heads", kMaxModelHeads);
  size(num_kv_heads, "num_key_value_heads", kMaxModelHeads);
  size(head_dim, "head_dim", kMaxModelHeadDim);
  size(intermediate_size, "intermediate_size", kMaxModelIntermediate);
  size(max_position, "max_position_embeddings", kMaxModelPositions);
  if (num_heads % num_kv_heads != 0)
    fail(source, key("num_attention_heads") + " (" + std::to_string(num_heads) + ") is not a multiple of " +
                     key("num_key_value_heads") + " (" + std::to_string(num_kv_heads) + ")");
  if (head_dim % 2 != 0) fail(source, key("head_dim") + " must be even for RoPE, got " + std::to_string(head_dim));
  // NaN fails every comparison, so the tests are written to let only finite positives pass.
  if (!(std::isfinite(rope_theta) && rope_theta > 0))
    fail(source, key("rope_theta") + " must be a finite positive number, got " + std::to_string(rope_theta));
  if (!(std::isfinite(rms_eps) && rms_eps > 0))
    fail(source, key("rms_norm_eps") + " must be a finite positive number, got " + std::to_string(rms_eps));
  const RopeScaling& rs = rope_scaling;
  if (!is_supported_rope_type(rs.type))
    fail(source, key("rope_type") + " '" + rs.type + "' is not supported (" + kSupportedRopeTypes + ")");
  if (rs.type != "default" && !(std::isfinite(rs.factor) && rs.factor > 0))
    fail(source, key("factor") + " must be a finite positive number, got " + std::to_string(rs.factor));
  if (rs.type == "llama3") {
    if (!(std::isfinite(rs.low_freq_factor) && std::isfinite(rs.high_freq_factor) && rs.low_freq_factor > 0 &&
          rs.high_freq_factor > rs.low_freq_factor))
      fail(source, key("low_freq_factor") + " and " + key("high_freq_factor") +
                       " must be finite with 0 < low_freq_factor < high_freq_factor, got " +
                       std::to_string(rs.low_freq_factor) + " and " + std::to_string(rs.high_freq_factor));
  }
  if (rs.type == "llama3" || rs.type == "yarn") {
    if (rs.original_max_position <= 0 || rs.original_max_position > kMaxModelPositions)
      fail(source, key("original_max_position_embeddings") + " must be in 1.." + std::to_string(kMaxModelPositions) +
                       ", got " + std::to_string(rs.original_max_position));
  }
  if (rs.type == "yarn" && !(std::isfinite(rs.beta_fast) && std::isfinite(rs.beta_slow) && rs.beta_fast > 0 &&
                             rs.beta_slow > 0))
    fail(source, key("beta_fast") + " and " + key("beta_slow") + " must be finite positive numbers, got " +
                     std::to_string(rs.beta_fast) + " and " + std::to_string(rs.beta_slow));
  if (!(std::isfinite(rs.attention_factor) && rs.attention_factor > 0))
    fail(source, key("attention_factor") + " must be a finite positive number, got " +
                     std::to_string(rs.attention_factor));
  if (rotary_dim != 0 && (rotary_dim < 2 || rotary_dim > head_dim || rotary_dim % 2 != 0))
    fail(source, key("partial_rotary_factor") + " gives " + std::to_string(rotary_dim) +
                     " rotated dimensions of " + std::to_string(head_dim) + "; they must be even and at least 2");
  if (!rs.freq_factors.empty()) {
    if (static_cast<int64_t>(rs.freq_factors.size()) != rope_dim() / 2)
      fail(source, key("rope_freqs") + " holds " + std::to_string(rs.freq_factors.size()) +
                       " factors, not one per rotated pair (" + std::to_string(rope_dim() / 2) + ")");
    for (double f : rs.freq_factors)
      if (!(std::isfinite(f) && f > 0))
        fail(source, key("rope_freqs") + " must hold finite positive factors, got " + std::to_string(f));
  }
  auto non_negative = [&](double v, const char* hf_key) {
    if (!(std::isfinite(v) && v >= 0))
      fail(source, key(hf_key) + " must be a finite number >= 0, got " + std::to_string(v));
  };
  non_negative(attention_scale, "query_pre_attn_scalar");
  non_negative(local_rope_theta, "rope_local_base_freq");
  non_negative(attn_softcap, "attn_logit_softcapping");
  non_negative(final_softcap, "final_logit_softcapping");
  if (!(std::isfinite(embedding_scale) && embedding_scale > 0))
    fail(source, "embedding scale must be a finite positive number, got " + std::to_string(embedding_scale));
  if (sliding_window < 0) fail(source, key("sliding_window") + " must be >= 0, got " + std::to_string(sliding_window));
  if (!sliding_layers.empty() && static_cast<int64_t>(sliding_layers.size()) != num_layers)
    fail(source, key("layer_types") + " names " + std::to_string(sliding_layers.size()) + " layers, not " +
                     key("num_hidden_layers") + " = " + std::to_string(num_layers));
  for (int64_t id : eos_token_ids)
    if (id < 0 || id >= vocab_size)
      fail(source, key("eos_token_id") + " " + std::to_string(id) + " is outside the vocabulary (0.." +
                       std::to_string(vocab_size - 1) + ")");
  // Within the bounds the count fits in 128 bits many times over; the limit keeps every byte
  // count derived from it inside int64_t.
  const __int128 q = static_cast<__int128>(num_heads) * head_dim, kv = static_cast<__int128>(num_kv_heads) * head_dim;
  const __int128 layer = static_cast<__int128>(hidden_size) * (2 * q + 2 * kv) + 3 * q + 3 * kv +
                         static_cast<__int128>(3) * hidden_size * intermediate_size + 2 * hidden_size;
  const __int128 total = layer * num_layers + static_cast<__int128>(vocab_size) * hidden_size * 2 + hidden_size;
  if (total > kMaxModelParams)
    fail(source, "the model's shape (" + key("num_hidden_layers") + " " + std::to_string(num_layers) + ", " +
                     key("hidden_size") + " " + std::to_string(hidden_size) + ", " + key("intermediate_size") +
                     " " + std::to_string(intermediate_size) + ", " + key("vocab_size") + " " +
                     std::to_string(vocab_size) + ") means more than 2^48 parameters");
}

int64_t ModelConfig::layer_params() const {
  const int64_t q = num_heads * head_dim, kv = num_kv_heads * head_dim;
  int64_t attn = hidden_size * (q + 2 * kv) + q * hidden_size;
  if (qkv_bias) attn += q + 2 * kv;
  if (qk_norm) attn += 2 * head_dim;
  const Architecture* arch = find_architecture(architecture);
  const int64_t norms = arch != nullptr && arch->sandwich_norms ? 4 : 2;
  return attn + 3 * hidden_size * intermediate_size + norms * hidden_size;
}

bool ModelConfig::masked_or_capped_attention() const {
  if (attn_softcap > 0) return true;
  for (int64_t l = 0; l < num_layers; ++l)
    if (layer_window(l) > 0) return true;
  return false;
}

int64_t ModelConfig::total_params() const {
  return num_layers * layer_params() + embedding_params() * (tie_embeddings ? 1 : 2) + hidden_size;
}

namespace {

// yarn's attention factor from mscale and mscale_all_dim, as transformers' get_mscale.
double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

// RoPE from transformers 5's `rope_parameters` (theta, scaling and partial_rotary_factor in
// one object) or, for files written before it, from `rope_theta`, `rope_scaling` and a top-level
// `partial_rotary_factor`. Every key of the object must be one kvpipe applies: a key it does
// not know may change the math, so it is refused by name. Defaults are transformers'.
void read_rope(const json& j, const std::string& path, ModelConfig& c) {
  const json* params = find(j, "rope_parameters");
  const char* object_key = params != nullptr ? "rope_parameters" : "rope_scaling";
  const json* rs = params != nullptr ? params : find(j, "rope_scaling");
  c.rope_theta = get_number(j, "rope_theta", 10000.0, path);
  double partial = get_number(j, "partial_rotary_factor", 1.0, path);
  const char* partial_key = "partial_rotary_factor";
  if (rs != nullptr) {
    if (!rs->is_object()) wrong_type(path, object_key, "an object or null", *rs);
    const std::string src = path + ": '" + object_key + "'";
    if (params != nullptr) c.rope_theta = get_number(*rs, "rope_theta", c.rope_theta, src);
    RopeScaling& s = c.rope_scaling;
    s.type = get_string(*rs, "rope_type", get_string(*rs, "type", "default", src), src);
    if (!is_supported_rope_type(s.type))
      fail(path, "unsupported '" + std::string(object_key) + "' type '" + s.type + "' (supported: " +
                     kSupportedRopeTypes + ")");
    std::vector<std::string> known = {"rope_type", "type", "rope_theta", "partial_rotary_factor"};
    if (find(*rs, "partial_rotary_factor") != nullptr) {
      partial = get_number(*rs, "partial_rotary_factor", 1.0, src);
      partial_key = "rope_parameters.partial_rotary_factor";
    }
    if (s.type == "linear" || s.type == "dynamic" || s.type == "llama3") {
      s.factor = get_number(*rs, "factor", 1.0, src);
      known.push_back("factor");
    }
    if (s.type == "llama3") {
      s.low_freq_factor = get_number(*rs, "low_freq_factor", 1.0, src);
      s.high_freq_factor = get_number(*rs, "high_freq_factor", 4.0, src);
      s.original_max_position = get_int(*rs, "original_max_position_embeddings", src);
      known.insert(known.end(), {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"});
    }
    if (s.type == "yarn") {
      s.original_max_position = get_int(*rs, "original_max_position_embeddings", src);
      // transformers: a missing factor is the ratio of the two contexts; 0 or a missing beta
      // takes the paper's default.
      const json* factor = find(*rs, "factor");
      s.factor = factor != nullptr && !factor->is_null()
                     ? get_number(*rs, "factor", 1.0, src)
                     : static_cast<double>(c.max_position) / static_cast<double>(s.original_max_position);
      const double beta_fast = get_number(*rs, "beta_fast", 0.0, src), beta_slow = get_number(*rs, "beta_slow", 0.0, src);
      s.beta_fast = beta_fast != 0 ? beta_fast : 32.0;
      s.beta_slow = beta_slow != 0 ? beta_slow : 1.0;
      s.truncate = get_bool(*rs, "truncate", true, src);
      const double mscale = get_number(*rs, "mscale", 0.0, src), mscale_all = get_number(*rs, "mscale_all_dim", 0.0, src);
      const json* attention = find(*rs, "attention_factor");
      if (attention != nullptr && !attention->is_null())
        s.attention_factor = get_number(*rs, "attention_factor", 1.0, src);
      else if (mscale != 0 && mscale_all != 0)
        s.attention_factor = yarn_mscale(s.factor, mscale) / yarn_mscale(s.factor, mscale_all);
      else
        s.attention_factor = yarn_mscale(s.factor, 1.0);
      known.insert(known.end(), {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
                                 "mscale", "mscale_all_dim", "attention_factor"});
    }
    for (const auto& [name, value] : rs->items())
      if (std::find(known.begin(), known.end(), name) == known.end() && !value.is_null())
        fail(path, "'" + std::string(object_key) + "': key '" + name + "' is not supported for RoPE type '" + s.type +
                       "'");
  }
  if (partial != 1.0) {
    if (!(std::isfinite(partial) && partial > 0 && partial < 1))
      fail(path, "'" + std::string(partial_key) + "' must be in (0, 1], got " + std::to_string(partial));
    if (!supports_partial_rotary(c.architecture))
      fail(path, "'" + std::string(partial_key) + "' other than 1 is not supported for " + c.architecture +
                     " (transformers rotates every dimension of its heads)");
    // transformers: int(head_dim * partial_rotary_factor).
    c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * partial);
  }
}

}  // namespace

namespace {

// A number that config.json may set to null to turn its feature off (Gemma's soft-capping):
// absent is transformers' default, null is 0 (off).
double get_nullable_number(const json& j, const std::string& key, double fallback, const std::string& src) {
  const auto it = j.find(key);
  if (it == j.end()) return fallback;
  if (it->is_null()) return 0.0;
  if (!it->is_number()) wrong_type(src, key, "a number or null", *it);
  return it->get<double>();
}

// Gemma 2's attention as Gemma2Config defines it: scores scaled by query_pre_attn_scalar^-0.5
// and soft-capped, logits soft-capped, and layers of layer_types (by default every even
// one) windowed by sliding_window, which the window a whole context fits in turns off.
void read_gemma_attention(const json& j, const std::string& path, ModelConfig& c) {
  if (get_bool(j, "use_bidirectional_attention", false, path))
    fail(path, "'use_bidirectional_attention: true' is not supported");
  const double scalar = get_number(j, "query_pre_attn_scalar", 256.0, path);
  if (!(std::isfinite(scalar) && scalar > 0))
    fail(path, "'query_pre_attn_scalar' must be a finite positive number, got " + std::to_string(scalar));
  c.attention_scale = 1.0 / std::sqrt(scalar);
  const Architecture& arch = architecture(c.architecture);
  c.attn_softcap = get_nullable_number(j, "attn_logit_softcapping", arch.default_attn_softcap, path);
  c.final_softcap = get_nullable_number(j, "final_logit_softcapping", arch.default_final_softcap, path);
  const auto window = j.find("sliding_window");
  c.sliding_window = window == j.end() ? 4096 : window->is_null() ? 0 : get_int(j, "sliding_window", path);
  c.sliding_layers.assign(c.num_layers, false);
  if (const json* types = find(j, "layer_types")) {
    if (!types->is_array()) wrong_type(path, "layer_types", "a list of layer types", *types);
    if (static_cast<int64_t>(types->size()) != c.num_layers)
      fail(path, "'layer_types' names " + std::to_string(types->size()) + " layers, not 'num_hidden_layers' = " +
                     std::to_string(c.num_layers));
    for (size_t i = 0; i < types->size(); ++i) {
      const json& t = (*types)[i];
      const std::string name = t.is_string() ? t.get<std::string>() : "";
      if (name != "full_attention" && name != "sliding_attention")
        fail(path, "'layer_types': layer type " + describe(t) +
                       " is not supported (full_attention, sliding_attention)");
      c.sliding_layers[i] = name == "sliding_attention";
    }
  } else {
    const int64_t pattern = get_int(j, "sliding_window_pattern", get_int(j, "_sliding_window_pattern", arch.sliding_pattern, path), path);
    if (pattern <= 0) fail(path, "'sliding_window_pattern' must be positive, got " + std::to_string(pattern));
    for (int64_t i = 0; i < c.num_layers; ++i) c.sliding_layers[i] = (i + 1) % pattern != 0;
  }
  // The layers stay local (Gemma 3's RoPE base is theirs) even where no window masks.
  if (c.sliding_window <= 0 || c.sliding_window >= c.max_position) c.sliding_window = 0;
}

// Gemma 3's RoPE: transformers 5 nests one rope_parameters object per layer type; the full
// layers' is read as any model's, the sliding layers' must be plain RoPE and gives their
// base. Earlier files give that base as rope_local_base_freq.
void take_local_rope(json& j, const std::string& path, ModelConfig& c) {
  c.local_rope_theta = get_number(j, "rope_local_base_freq", 10000.0, path);
  const auto params = j.find("rope_parameters");
  if (params == j.end() || !params->is_object() || !params->contains("sliding_attention")) return;
  const std::string src = path + ": 'rope_parameters'";
  for (const auto& [name, value] : params->items())
    if (name != "full_attention" && name != "sliding_attention")
      fail(path, "'rope_parameters': key '" + name + "' is not supported (full_attention, sliding_attention)");
  const json local = (*params)["sliding_attention"];
  if (!local.is_object()) wrong_type(path, "rope_parameters.sliding_attention", "an object", local);
  for (const auto& [name, value] : local.items())
    if (name != "rope_theta" && name != "rope_type")
      fail(path, "'rope_parameters': 'sliding_attention': key '" + name + "' is not supported");
  if (get_string(local, "rope_type", "default", src) != "default")
    fail(path, "'rope_parameters': 'sliding_attention': rope_type '" + get_string(local, "rope_type", "", src) +
                   "' is not supported (only default)");
  c.local_rope_theta = get_number(local, "rope_theta", c.local_rope_theta, src);
  const json full = params->contains("full_attention") ? (*params)["full_attention"] : json(nullptr);
  j["rope_parameters"] = full;
}

// Which keys each layer attends to. kvpipe's layers all attend to every earlier key, so a
// sliding window is taken only where it cannot change attention: past its length it is
// honoured by capping the context there (Mistral, Phi-3), and windows on some layers only
// (Qwen2's and Qwen3's use_sliding_window, layer_types naming sliding layers) are refused.
void read_attention_layers(const json& j, const std::string& path, ModelConfig& c) {
  if (architecture(c.architecture).gemma) return read_gemma_attention(j, path, c);
  const bool qwen = c.architecture == "Qwen2ForCausalLM" || c.architecture == "Qwen3ForCausalLM";
  if (qwen && get_bool(j, "use_sliding_window", false, path)) fail(path, "'use_sliding_window: true' is not supported");
  if (const json* types = find(j, "layer_types")) {
    if (!types->is_array()) wrong_type(path, "layer_types", "a list of layer types", *types);
    for (const json& t : *types)
      if (!t.is_string() || t.get<std::string>() != "full_attention")
        fail(path, "'layer_types': layer type " + describe(t) + " is not supported (only full_attention)");
  }
  if (c.architecture == "MistralForCausalLM" || c.architecture == "Phi3ForCausalLM") {
    const int64_t w = get_int(j, "sliding_window", 0, path);
    if (w > 0 && w < c.max_position) c.max_position = w;
  }
}

}  // namespace

std::vector<double> rope_inv_freq(const ModelConfig& c) {
  const RopeScaling& rs = c.rope_scaling;
  const int64_t dim = c.rope_dim(), half = dim / 2;
  std::vector<double> inv(half);
  for (int64_t i = 0; i < half; ++i)
    inv[i] = 1.0 / std::pow(c.rope_theta, static_cast<double>(2 * i) / static_cast<double>(dim));
  if (rs.type == "linear") {
    for (double& f : inv) f /= rs.factor;
  } else if (rs.type == "llama3") {
    // transformers' _compute_llama3_parameters: wavelengths longer than the original context
    // over low_freq_factor are stretched by `factor`, shorter than it over high_freq_factor
    // kept, and those between interpolated.
    const double old_len = static_cast<double>(rs.original_max_position);
    const double low_wavelen = old_len / rs.low_freq_factor, high_wavelen = old_len / rs.high_freq_factor;
    for (double& f : inv) {
      const double wavelen = 2.0 * M_PI / f;
      if (wavelen > low_wavelen) {
        f /= rs.factor;
      } else if (!(wavelen < high_wavelen)) {
        const double smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
        f = (1.0 - smooth) * f / rs.factor + smooth * f;
      }
    }
  } else if (rs.type == "yarn") {
    // transformers' _compute_yarn_parameters (and llama.cpp's ggml_rope_yarn_corr_dims): pairs
    // that turn fewer than beta_slow times over the original context are interpolated, more
    // than beta_fast times kept, and a linear ramp over the pair index blends those between.
    const double base = c.rope_theta, orig = static_cast<double>(rs.original_max_position);
    const auto correction_dim = [&](double rotations) {
      return static_cast<double>(dim) * std::log(orig / (rotations * 2.0 * M_PI)) / (2.0 * std::log(base));
    };
    double low = correction_dim(rs.beta_fast), high = correction_dim(rs.beta_slow);
    if (rs.truncate) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    if (low == high) high += 0.001;  // as transformers: no division by zero
    for (int64_t i = 0; i < half; ++i) {
      const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
      const double extrapolation = 1.0 - ramp;
      inv[i] = inv[i] / rs.factor * (1.0 - extrapolation) + inv[i] * extrapolation;
    }
  }
  // dynamic: transformers rescales only once a sequence passes max_position_embeddings, the
  // longest sequence kvpipe serves, so its frequencies are the default ones.
  if (static_cast<int64_t>(rs.freq_factors.size()) == half)
    for (int64_t i = 0; i < half; ++i) inv[i] /= rs.freq_factors[i];
  return inv;
}

ModelConfig load_hf_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  // A missing file is most often a path that is not a model directory at all.
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0 && (errno == ENOENT || errno == ENOTDIR))
    fail(path, "cannot open (a model directory needs config.json)");
  const std::string text = read_regular_file(path, kMaxConfigJsonBytes);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {  // out_of_range too: a number such as 1e999
    // nlohmann's "[json.exception.parse_error.101] " prefix means nothing to a user.
    const std::string what = e.what();
    const size_t tag_end = what.find("] ");
    fail(path, "not valid JSON: " + (tag_end == std::string::npos ? what : what.substr(tag_end + 2)));
  }
  if (!j.is_object()) fail(path, "top level is not a JSON object");

  ModelConfig c;
  const json* arch = find(j, "architectures");
  if (arch == nullptr) fail(path, "missing key 'architectures'");
  if (!arch->is_array() || arch->empty() || !(*arch)[0].is_string())
    wrong_type(path, "architectures", "a list of names", *arch);
  c.architecture = (*arch)[0].get<std::string>();
  const Architecture* traits = find_architecture(c.architecture);
  if (traits == nullptr)
    fail(path, "unsupported architecture '" + c.architecture + "' (supported: " + supported_architecture_names() + ")");
  c.qkv_bias = traits->qkv_bias;
  c.qk_norm = traits->qk_norm;
  if (get_bool(j, "attention_bias", false, path)) {
    if (c.architecture != "LlamaForCausalLM" && c.architecture != "Qwen2ForCausalLM" &&
        c.architecture != "Qwen3ForCausalLM")
      fail(path, "'attention_bias' is not supported for " + c.architecture);
    // Llama's and Qwen3's attention_bias also put a bias on o_proj, which the engine does not have.
    if (c.architecture != "Qwen2ForCausalLM") fail(path, "'attention_bias: true' is not supported");
  }
  if (get_bool(j, "mlp_bias", false, path)) fail(path, "'mlp_bias: true' is not supported");

  c.vocab_size = get_int(j, "vocab_size", path);
  c.hidden_size = get_int(j, "hidden_size", path);
  c.num_layers = get_int(j, "num_hidden_layers", path);
  c.num_heads = get_int(j, "num_attention_heads", path);
  c.num_kv_heads = get_int(j, "num_key_value_heads", c.num_heads, path);
  c.intermediate_size = get_int(j, "intermediate_size", path);
  c.max_position = get_int(j, "max_position_embeddings", 2048, path);
  const int64_t default_head_dim = traits->default_head_dim > 0 ? traits->default_head_dim
                                   : c.num_heads > 0             ? c.hidden_size / c.num_heads
                                                                 : 0;
  c.head_dim = get_int(j, "head_dim", default_head_dim, path);
  c.rms_eps = get_number(j, "rms_norm_eps", 1e-6, path);
  c.tie_embeddings = get_bool(j, "tie_word_embeddings", traits->default_tied, path);

  if (traits->gemma) {
    // Gemma2Config's activation key; gelu_pytorch_tanh is gelu with the tanh approximation.
    const std::string act = get_string(j, "hidden_activation", "gelu_pytorch_tanh", path);
    if (act != "gelu_pytorch_tanh") fail(path, "unsupported 'hidden_activation' '" + act + "' (only gelu_pytorch_tanh)");
    c.gelu_tanh = true;
    c.embedding_scale = std::sqrt(static_cast<double>(c.hidden_size));
  } else {
    const std::string act = get_string(j, "hidden_act", "silu", path);
    if (act != "silu") fail(path, "unsupported 'hidden_act' '" + act + "' (only silu)");
  }
  if (traits->local_rope) take_local_rope(j, path, c);
  read_rope(j, path, c);
  read_attention_layers(j, path, c);
  if (const json* e = find(j, "eos_token_id")) {
    if (e->is_array()) {
      for (const json& x : *e) c.eos_token_ids.push_back(as_int(x, "eos_token_id", path));
    } else if (e->is_number_integer()) {
      c.eos_token_ids.push_back(as_int(*e, "eos_token_id", path));
    } else {
      wrong_type(path, "eos_token_id", "an integer or a list of integers", *e);
    }
  }
  c.bos_token_id = get_int(j, "bos_token_id", -1, path);
  c.validate(path);
  return c;
}

namespace {

json hf_rope_parameters(const ModelConfig& c) {
  const RopeScaling& rs = c.rope_scaling;
  if (!rs.freq_factors.empty())
    throw std::invalid_argument("per-frequency RoPE divisors (rope_freqs.weight) have no config.json form");
  json p = {{"rope_type", rs.type}, {"rope_theta", c.rope_theta}};
  if (rs.type != "default") p["factor"] = rs.factor;
  if (rs.type == "llama3") {
    p["low_freq_factor"] = rs.low_freq_factor;
    p["high_freq_factor"] = rs.high_freq_factor;
  }
  if (rs.type == "llama3" || rs.type == "yarn") p["original_max_position_embeddings"] = rs.original_max_position;
  if (rs.type == "yarn") {
    p["beta_fast"] = rs.beta_fast;
    p["beta_slow"] = rs.beta_slow;
    p["truncate"] = rs.truncate;
    p["attention_factor"] = rs.attention_factor;
  } else if (rs.attention_factor != 1.0) {
    throw std::invalid_argument("a RoPE attention factor needs RoPE type yarn in config.json");
  }
  if (c.rotary_dim > 0 && c.rotary_dim != c.head_dim)
    p["partial_rotary_factor"] = static_cast<double>(c.rotary_dim) / static_cast<double>(c.head_dim);
  return p;
}

}  // namespace

void write_hf_config(const ModelConfig& c, const std::string& dir, const std::string& torch_dtype) {
  json j;
  j["architectures"] = {c.architecture};
  j["model_type"] = architecture(c.architecture).model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["intermediate_size"] = c.intermediate_size;
  j["max_position_embeddings"] = c.max_position;
  j["rms_norm_eps"] = c.rms_eps;
  j["tie_word_embeddings"] = c.tie_embeddings;
  j["hidden_act"] = "silu";
  // transformers 5's layout: theta and scaling in one object.
  j["rope_parameters"] = hf_rope_parameters(c);
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
  } else if (name == "llama3-8b") {
    // Meta-Llama-3-8B's shape (its config.json), for GPU benchmarks without the weights.
    c.vocab_size = 128256, c.hidden_size = 4096, c.num_layers = 32, c.num_heads = 32, c.num_kv_heads = 8;
    c.intermediate_size = 14336, c.max_position = 8192;
  } else {
    throw std::invalid_argument("unknown preset '" + name + "' (known: tiny, small, llama3-8b)");
  }
  c.head_dim = c.hidden_size / c.num_heads;
  const bool llama3 = name == "llama3-8b";
  c.rope_theta = llama3 ? 500000.0 : 10000.0;
  c.rms_eps = 1e-5;
  c.bos_token_id = llama3 ? 128000 : 1;
  c.eos_token_ids = llama3 ? std::vector<int64_t>{128001} : std::vector<int64_t>{2};
  return c;
}

std::vector<std::string> preset_names() { return {"tiny", "small", "llama3-8b"}; }

}  // namespace kvpipe
