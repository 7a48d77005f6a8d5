"""Writes an HF model directory (config.json + model.safetensors) as one GGUF file with the
`gguf` package, llama.cpp's own writer, following llama.cpp's convert_hf_to_gguf.py: llama.cpp's
tensor-name map, q/k rows permuted per head for the llama architecture (not for qwen2), the
embedding reused as the LM head when the model ties them. F32 and F16 tensors are kept as they
are; BF16 is written as F32.

    python tests/peer/gguf_from_hf.py --model DIR --out FILE.gguf

kvpipe must read what this writes exactly as it reads the HF directory.
"""
import argparse
import json
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
    args = parser.parse_args()
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    hf_arch = cfg["architectures"][0]
    arch = {"LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA, "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
            "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2}[hf_arch]
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
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    names = gguf.get_tensor_name_map(arch, n_layer)
    tensors = load_file(os.path.join(args.model, "model.safetensors"))
    for hf_name in sorted(tensors):
        data = tensors[hf_name]
        if data.dtype not in (np.float32, np.float16):
            data = data.astype(np.float32)
        if arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("q_proj.weight"):
            data = permute(data, n_head)
        elif arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("k_proj.weight"):
            data = permute(data, n_kv)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            print(f"gguf_from_hf: no GGUF name for tensor {hf_name}", file=sys.stderr)
            return 2
        writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
