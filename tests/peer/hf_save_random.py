"""Makes a random model with Hugging Face transformers itself and saves it with
save_pretrained, so that config.json is in the layout transformers writes today
(`rope_parameters`), or, with --legacy, rewritten in the layout of transformers before 5
(`rope_theta` and `rope_scaling` at the top level):

    python tests/peer/hf_save_random.py --out DIR [--architecture llama|qwen3|phi3|gemma2|gemma3]
        [--rope '{"rope_type": "llama3", ...}'] [--legacy] [--tie-embeddings]

The model is small (vocabulary 512, hidden 128, 2 layers, 4 heads of 32, 2 KV heads; Qwen3's
heads are 48 wide, unlike hidden / heads; Gemma 2's 4 layers alternate a sliding window of 8
positions with full attention, its soft caps are small enough to bite on random weights, and
its query_pre_attn_scalar is the head size, which is the scale llama.cpp takes for it;
Gemma 3's 6 layers are five sliding ones of 8 positions (RoPE base 10000) and a full one (base
1000000, its default), and --rope does not apply to it) and its weights are drawn by transformers' own
initialisation from --seed, in float32. transformers starts every norm at 1, where a norm
weight read from the wrong tensor would go unnoticed; for the architectures other than
Llama every norm weight is drawn as 1 + N(0, 0.1) instead.
"""
import argparse
import json
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--architecture", choices=["llama", "qwen3", "phi3", "gemma2", "gemma3"], default="llama")
    parser.add_argument("--rope", default='{"rope_type": "default", "rope_theta": 10000.0}',
                        help="the rope_parameters object, as JSON")
    parser.add_argument("--tie-embeddings", action="store_true")
    parser.add_argument("--legacy", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-position", type=int, default=256)
    args = parser.parse_args()
    import torch
    import transformers

    torch.manual_seed(args.seed)
    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=args.max_position, rms_norm_eps=1e-5,
                 initializer_range=0.05, rope_parameters=json.loads(args.rope), bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=args.tie_embeddings)
    if args.architecture == "llama":
        config = transformers.LlamaConfig(head_dim=32, **shape)
        model = transformers.LlamaForCausalLM(config)
    elif args.architecture == "qwen3":
        config = transformers.Qwen3Config(head_dim=48, **shape)
        model = transformers.Qwen3ForCausalLM(config)
    elif args.architecture == "gemma2":
        shape.update(num_hidden_layers=4, pad_token_id=0)
        config = transformers.Gemma2Config(head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                                           attn_logit_softcapping=2.0, final_logit_softcapping=3.0, **shape)
        model = transformers.Gemma2ForCausalLM(config)
    elif args.architecture == "gemma3":
        shape.update(num_hidden_layers=6, pad_token_id=0)
        del shape["rope_parameters"]
        config = transformers.Gemma3TextConfig(head_dim=32, query_pre_attn_scalar=32, sliding_window=8, **shape)
        model = transformers.Gemma3ForCausalLM(config)
    else:
        config = transformers.Phi3Config(pad_token_id=0, original_max_position_embeddings=args.max_position, **shape)
        model = transformers.Phi3ForCausalLM(config)
    model = model.to(torch.float32)
    if args.architecture != "llama":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    # Gemma's norms multiply by 1 + weight, transformers starts them at 0.
                    p.copy_((0 if args.architecture.startswith("gemma") else 1) + 0.1 * torch.randn_like(p))
    model.save_pretrained(args.out, safe_serialization=True)
    path = os.path.join(args.out, "config.json")
    with open(path) as f:
        saved = json.load(f)
    if "rope_parameters" not in saved:
        print("hf_save_random: transformers wrote no rope_parameters", file=sys.stderr)
        return 1
    if args.legacy:
        rope = saved.pop("rope_parameters")
        saved["rope_theta"] = rope.pop("rope_theta")
        saved["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        with open(path, "w") as f:
            json.dump(saved, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
