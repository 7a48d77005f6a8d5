"""Writes an HF model directory (config.json + model.safetensors) as one GGUF file with the
`gguf` package, llama.cpp's own writer, following llama.cpp's convert_hf_to_gguf.py: llama.cpp's
tensor-name map, q/k rows permuted per head for the llama architecture (not for qwen2, qwen3
and phi3, which llama.cpp rotates NeoX-style; Qwen3's q/k norms become attn_q_norm and
attn_k_norm, Phi-3's fused qkv_proj and gate_up_proj become attn_qkv and ffn_up, Gemma 2's
and Gemma 3's norms are stored as 1 + weight with their soft caps and windows as metadata),
the
embedding reused as the LM head when the model ties them, RoPE from `rope_parameters`
(transformers 5) or `rope_theta` + `rope_scaling` (earlier), linear and yarn scaling as
metadata (TextModel.set_gguf_parameters) and llama3 scaling as the rope_freqs.weight divisors
its LlamaModel.generate_extra_tensors writes.
F32 and F16 tensors are kept as they are; BF16 is written as F32.

    python tests/peer/gguf_from_hf.py --model DIR --out FILE.gguf [--placeholder-vocab]

--placeholder-vocab adds a SentencePiece-shaped vocabulary of placeholder tokens (<unk>, <s>,
</s>, tok3, ...), which llama.cpp needs to load the file; prompts are token ids.

kvpipe must read what this writes exactly as it reads the HF directory.
"""
import argparse
import json
import math
import os
import sys


def permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute: llama.cpp rotates adjacent pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--placeholder-vocab", action="store_true")
    args = parser.parse_args()
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    hf_arch = cfg["architectures"][0]
    arch = {"LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA, "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
            "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2, "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
            "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3, "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
            "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3}[hf_arch]
    n_head, n_layer = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    n_kv = cfg.get("num_key_value_heads", n_head)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head

    writer = gguf.GGUFWriter(args.out, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name("kvpipe gguf-py twin")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope_all = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = rope_all.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    # convert_hf_to_gguf.py's Phi3MiniModel: n_rot = int(partial_rotary_factor * head_dim).
    writer.add_rope_dimension_count(int(partial * head_dim))
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    local_rope = None
    if "sliding_attention" in rope:  # Gemma 3: one object per layer type
        local_rope, rope = rope["sliding_attention"], rope.get("full_attention", {})
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    writer.add_rope_freq_base(theta)
    if arch == gguf.MODEL_ARCH.PHI3:
        # What convert_hf_to_gguf.py's Phi3MiniModel adds (0: no window).
        writer.add_rope_scaling_orig_ctx_len(
            rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings",
                                                                 cfg["max_position_embeddings"])))
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
    if arch == gguf.MODEL_ARCH.GEMMA3:
        # What convert_hf_to_gguf.py's Gemma3Model adds (no attention soft cap in Gemma 3), and
        # the local layers' RoPE base, which llama.cpp otherwise takes as 10000.
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        writer.add_sliding_window(cfg["sliding_window"])
        writer.add_rope_freq_base_swa((local_rope or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
    if arch == gguf.MODEL_ARCH.GEMMA2:
        # What convert_hf_to_gguf.py's Gemma2Model adds; its norms are stored as 1 + weight.
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        writer.add_sliding_window(cfg["sliding_window"])
    rope_freqs = None
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "llama3":
        factor = rope.get("factor", 8.0)
        low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        old_len = rope.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        rope_freqs = []
        for i in range(0, head_dim, 2):
            wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
            if wavelen < high_wavelen:
                rope_freqs.append(1.0)
            elif wavelen > low_wavelen:
                rope_freqs.append(factor)
            else:
                smooth = (old_len / wavelen - low) / (high - low)
                rope_freqs.append(1 / ((1 - smooth) / factor + smooth))
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    elif rope_type != "default":
        print(f"gguf_from_hf: RoPE type {rope_type} is not written here", file=sys.stderr)
        return 2
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if args.placeholder_vocab:
        n = cfg["vocab_size"]
        tokens = ["<unk>", "<s>", "</s>"] + [f"tok{i}" for i in range(3, n)]
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(3, n)])
        writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] +
                               [gguf.TokenType.NORMAL] * (n - 3))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_add_eos_token(False)

    names = gguf.get_tensor_name_map(arch, n_layer)
    tensors = load_file(os.path.join(args.model, "model.safetensors"))
    for hf_name in sorted(tensors):
        data = tensors[hf_name]
        if data.dtype not in (np.float32, np.float16):
            data = data.astype(np.float32)
        if arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3) and hf_name.endswith("norm.weight"):
            data = data.astype(np.float32) + 1
        if arch == gguf.MODEL_ARCH.GEMMA2 and hf_name == "lm_head.weight":
            print("gguf_from_hf: llama.cpp's Gemma 2 takes token_embd as its output: an untied lm_head "
                  "is not written", file=sys.stderr)
            return 2
        if arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("q_proj.weight"):
            data = permute(data, n_head)
        elif arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("k_proj.weight"):
            data = permute(data, n_kv)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            print(f"gguf_from_hf: no GGUF name for tensor {hf_name}", file=sys.stderr)
            return 2
        writer.add_tensor(name, np.ascontiguousarray(data))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.array(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
