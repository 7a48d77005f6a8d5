#include "engine/model/architecture.h"

#include <stdexcept>
#include <vector>

namespace kvpipe {
namespace {

Architecture entry(const char* hf, const char* model_type, const char* gguf) {
  Architecture a{};
  a.hf_name = hf;
  a.model_type = model_type;
  a.gguf_name = gguf;
  return a;
}

// Llama first: GGUF's `llama` names Llama and Mistral alike and reads back as Llama.
const std::vector<Architecture>& table() {
  static const std::vector<Architecture> archs = [] {
    Architecture llama = entry("LlamaForCausalLM", "llama", "llama");
    llama.gguf_permuted_qk = true;
    Architecture mistral = entry("MistralForCausalLM", "mistral", "llama");
    mistral.gguf_permuted_qk = true;
    Architecture qwen2 = entry("Qwen2ForCausalLM", "qwen2", "qwen2");
    qwen2.qkv_bias = true;
    Architecture qwen3 = entry("Qwen3ForCausalLM", "qwen3", "qwen3");
    qwen3.qk_norm = true;
    qwen3.default_head_dim = 128;
    Architecture phi3 = entry("Phi3ForCausalLM", "phi3", "phi3");
    phi3.fused_qkv = true;
    phi3.fused_gate_up = true;
    phi3.partial_rotary = true;
    Architecture gemma2 = entry("Gemma2ForCausalLM", "gemma2", "gemma2");
    gemma2.default_head_dim = 256;
    gemma2.norm_plus_one = true;
    gemma2.sandwich_norms = true;
    gemma2.gemma = true;
    gemma2.default_tied = true;
    gemma2.gguf_head_is_embedding = true;
    gemma2.sliding_pattern = 2;
    gemma2.default_attn_softcap = 50.0;
    gemma2.default_final_softcap = 30.0;
    // Gemma 3's text model: Gemma 2's layer without soft-capping, with Qwen3-style q/k norms
    // (of 1 + weight) and a local RoPE base on its sliding layers.
    Architecture gemma3 = gemma2;
    gemma3.hf_name = "Gemma3ForCausalLM";
    gemma3.model_type = "gemma3_text";
    gemma3.gguf_name = "gemma3";
    gemma3.qk_norm = true;
    gemma3.sliding_pattern = 6;
    gemma3.default_attn_softcap = 0.0;
    gemma3.default_final_softcap = 0.0;
    gemma3.local_rope = true;
    gemma3.gguf_head_is_embedding = false;
    return std::vector<Architecture>{llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3};
  }();
  return archs;
}

}  // namespace

const Architecture* find_architecture(const std::string& hf_name) {
  for (const Architecture& a : table())
    if (hf_name == a.hf_name) return &a;
  return nullptr;
}

const Architecture* find_gguf_architecture(const std::string& gguf_name) {
  for (const Architecture& a : table())
    if (gguf_name == a.gguf_name) return &a;
  return nullptr;
}

const Architecture& architecture(const std::string& hf_name) {
  const Architecture* a = find_architecture(hf_name);
  if (a == nullptr)
    throw std::invalid_argument("unsupported architecture '" + hf_name + "' (supported: " +
                                supported_architecture_names() + ")");
  return *a;
}

std::string supported_architecture_names() {
  std::string out;
  for (const Architecture& a : table()) out += (out.empty() ? "" : ", ") + std::string(a.hf_name);
  return out;
}

std::string supported_gguf_architecture_names() {
  std::string out;
  for (const Architecture& a : table())
    if (find_gguf_architecture(a.gguf_name) == &a) out += (out.empty() ? "" : ", ") + std::string(a.gguf_name);
  return out;
}

}  // namespace kvpipe
