"""Makes a random Llama with Hugging Face transformers itself and saves it with
save_pretrained, so that config.json is in the layout transformers writes today
(`rope_parameters`), or, with --legacy, rewritten in the layout of transformers before 5
(`rope_theta` and `rope_scaling` at the top level):

    python tests/peer/hf_save_random.py --out DIR --rope '{"rope_type": "llama3", ...}' [--legacy]

The model is small (vocabulary 512, hidden 128, 2 layers, 4 heads of 32, 2 KV heads) and its
weights are drawn by transformers' own initialisation from --seed, in float32.
"""
import argparse
import json
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rope", required=True, help="the rope_parameters object, as JSON")
    parser.add_argument("--legacy", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-position", type=int, default=256)
    args = parser.parse_args()
    import torch
    import transformers

    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=args.max_position, rms_norm_eps=1e-5,
        initializer_range=0.05, rope_parameters=json.loads(args.rope), bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
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
