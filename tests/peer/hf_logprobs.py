"""Greedy decoding with Hugging Face transformers, in float64, on an HF model directory.

Prints each step's chosen token and its full-vocabulary log-probabilities as one JSON line, in
the shape of `kvpipe generate --logprobs-out`, so that the two can be compared value by value:

    python tests/peer/hf_logprobs.py --model DIR --prompt 1,17,42 [--steps 32]

Every step recomputes the whole sequence (no KV cache), with eager attention in float64: the
reference shares no code and no rounding with kvpipe. Exit 3 when transformers is missing.
"""
import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt", required=True, help="comma-separated token ids")
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"hf_logprobs: transformers is not installed ({e}): run scripts/setup.sh --references",
              file=sys.stderr)
        return 3
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float64, attn_implementation="eager")
    model.eval()
    ids = [int(t) for t in args.prompt.split(",")]
    with torch.no_grad():
        for step in range(args.steps):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            logprobs = torch.log_softmax(logits.to(torch.float64), dim=-1)
            token = int(torch.argmax(logits))
            print(json.dumps({"id": 0, "step": step, "token": token,
                              "logprobs": logprobs.tolist()}), flush=False)
            ids.append(token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
