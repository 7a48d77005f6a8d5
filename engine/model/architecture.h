// Architecture: what sets each supported decoder-only architecture apart, in one table.
//
// One entry per HF architecture name (config.json's `architectures[0]`) says what its files
// look like (config.json's model_type, GGUF's general.architecture, whether HF stores q/k/v
// and gate/up fused, whether llama.cpp's converter permutes q/k rows) and what its layers
// compute beyond a Llama layer (q/k/v biases, RMSNorm over each q and k head, Gemma's norms,
// GeGLU, scaled embeddings and soft-capping, sliding-window layers). Readers and
// writers of both formats, and the forward pass, ask this table instead of comparing names,
// so adding an architecture is one entry here plus whatever new math it brings.
#pragma once

#include <cstdint>
#include <string>

namespace kvpipe {

struct Architecture {
  const char* hf_name;       // config.json architectures[0]: "Qwen3ForCausalLM"
  const char* model_type;    // config.json model_type: "qwen3"
  const char* gguf_name;     // GGUF general.architecture: "qwen3"
  bool qkv_bias = false;     // q/k/v projections carry biases (Qwen2)
  bool qk_norm = false;      // RMSNorm over each q and k head before RoPE (Qwen3)
  bool fused_qkv = false;    // HF stores one self_attn.qkv_proj (Phi-3)
  bool fused_gate_up = false;  // HF stores one mlp.gate_up_proj, gate rows first (Phi-3)
  // llama.cpp's `llama` architecture rotates adjacent pairs, so its converter permutes q/k
  // rows per head; the NeoX-style ones (qwen2, qwen3, phi3) keep HF's rotate-half rows.
  bool gguf_permuted_qk = false;
  // transformers rotates only the first partial_rotary_factor of each head (Phi-3); the others
  // build cos and sin over the whole head and cannot.
  bool partial_rotary = false;
  // transformers' head_dim when config.json has none; 0: hidden_size / num_attention_heads.
  int64_t default_head_dim = 0;
  // Gemma: each norm multiplies by (1 + weight); HF stores the weight, llama.cpp's converter
  // stores 1 + weight (so GGUF norms load as they are, HF ones get 1 added at load).
  bool norm_plus_one = false;
  // Gemma 2: a norm after attention and one after the MLP (post_attention_layernorm, then
  // pre_ and post_feedforward_layernorm; GGUF post_attention_norm, ffn_norm, post_ffw_norm).
  bool sandwich_norms = false;
  // Gemma 2 and 3: layers interleave a sliding window with full attention, GeGLU replaces
  // SwiGLU, the embedding is scaled by sqrt(hidden_size), and logits may be soft-capped.
  bool gemma = false;
  bool default_tied = false;  // tie_word_embeddings when config.json does not say
  bool gguf_head_is_embedding = false;  // llama.cpp reads token_embd as the LM head (Gemma 2)
  // Gemma: without layer_types, layer i slides unless (i + 1) is a multiple of this (2: Gemma
  // 2's alternation, 6: Gemma 3's five local layers per global one); and the soft caps
  // transformers' config defaults to (0: none; Gemma 3 has none).
  int64_t sliding_pattern = 0;
  double default_attn_softcap = 0.0;
  double default_final_softcap = 0.0;
  // Gemma 3: the sliding layers rotate with a RoPE base of their own (rope_local_base_freq).
  bool local_rope = false;
};

// The entry for an HF architecture name, or nullptr when kvpipe does not run it.
const Architecture* find_architecture(const std::string& hf_name);
// The entry llama.cpp's general.architecture `gguf_name` reads as (`llama`: Llama, which
// also covers Mistral's files), or nullptr.
const Architecture* find_gguf_architecture(const std::string& gguf_name);
// The entry for `hf_name`; std::invalid_argument naming it and the supported ones otherwise.
const Architecture& architecture(const std::string& hf_name);

// "LlamaForCausalLM, MistralForCausalLM, ..." and "llama, qwen2, ...", for messages.
std::string supported_architecture_names();
std::string supported_gguf_architecture_names();

}  // namespace kvpipe
