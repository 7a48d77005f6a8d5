"""Greedy decoding with llama.cpp (through llama-cpp-python) on a GGUF model.

Prints each step's chosen token and its full-vocabulary log-probabilities (log-softmax of
llama.cpp's raw logits, computed in float64) as one JSON line, in the shape of
`kvpipe generate --logprobs-out`, so that the two can be compared value by value:

    python tests/peer/llama_logprobs.py --model M.gguf --prompt 1,17,42 [--steps 32] [--threads 1]
                                        [--tokens 5,9,...]

--tokens feeds those tokens instead of llama.cpp's own choices (one step each; --steps is then
their count), so that llama.cpp's distributions are those of another engine's sequence.

The KV cache is F32 (llama.cpp's default F16 alone moves log-probabilities by more than the
comparisons' tolerance) and flash attention is off. Exit 3 when llama-cpp-python is missing.
"""
import argparse
import json
import sys

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt", required=True, help="comma-separated token ids")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", help="comma-separated token ids to feed instead of the greedy ones")
    args = parser.parse_args()
    forced = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    if forced is not None:
        args.steps = len(forced)
    try:
        import llama_cpp
    except ImportError as e:
        print(f"llama_logprobs: llama-cpp-python is not installed ({e}): run scripts/setup.sh --references",
              file=sys.stderr)
        return 3
    prompt = [int(t) for t in args.prompt.split(",")]
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=max(256, len(prompt) + args.steps + 8),
                          n_batch=512, n_ubatch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, logits_all=True, flash_attn=False,
                          type_k=f32, type_v=f32, n_gpu_layers=0, verbose=False)
    out = sys.stdout
    tokens = prompt
    for step in range(args.steps):
        llm.eval(tokens)
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        shifted = logits - logits.max()
        logprobs = shifted - np.log(np.exp(shifted).sum())
        token = forced[step] if forced is not None else int(np.argmax(logits))
        out.write(json.dumps({"id": 0, "step": step, "token": token,
                              "logprobs": logprobs.tolist()}) + "\n")
        tokens = [token]
    return 0


if __name__ == "__main__":
    sys.exit(main())
