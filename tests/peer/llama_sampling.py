"""Greedy decoding through llama.cpp's own samplers: logit bias, then repetition, frequency and
presence penalties, as llama-server chains them (common/sampling.cpp: logit_bias first, then
"penalties"), on a GGUF model through llama-cpp-python.

    python tests/peer/llama_sampling.py --model M.gguf --prompt 1,17,42 [--steps 32]
        [--repetition-penalty 1.3] [--frequency-penalty 0.4] [--presence-penalty 0.3]
        [--logit-bias 42:-5,7:1.5] [--threads 1] [--tokens 5,9,...]

Which tokens a penalty counts is vLLM's, as kvpipe documents it (engine/logits_processor.h):
repetition over the prompt and the output, frequency and presence over the output alone. So
two of llama.cpp's penalty samplers run one after the other, the first (repetition) told the
prompt and every output token, the second (frequency and presence) the output tokens alone;
their windows hold the whole context. llama-server itself tells one penalty sampler the
prompt too and keeps the last 64 tokens (repeat_last_n), which counts prompt tokens in the
frequency and presence penalties.

--tokens feeds those tokens (to the model and to the penalties) instead of llama.cpp's own
choices, one step each (--steps is then their count), so that llama.cpp's processed logits are
those of another engine's sequence at every step.

Prints one JSON line per step: {"step", "token", "raw_token", "gap", "fed_gap", "logits_top"}:
the token llama.cpp chooses (the argmax of the processed logits), the argmax of the raw
logits, the gap between the chosen token's processed logit and the runner-up's, the gap
between it and the fed token's (0 without --tokens), and the processed logits of the five
best. Exit 3 when llama-cpp-python is missing.
"""
import argparse
import ctypes
import json
import sys

import numpy as np


def parse_bias(text):
    bias = []
    for item in filter(None, (text or "").split(",")):
        token, value = item.split(":")
        bias.append((int(token), float(value)))
    return bias


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt", required=True, help="comma-separated token ids")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--logit-bias", help="comma-separated token:bias pairs")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", help="comma-separated token ids to feed instead of llama.cpp's choices")
    args = parser.parse_args()
    fed = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    if fed is not None:
        args.steps = len(fed)
    try:
        import llama_cpp
    except ImportError as e:
        print(f"llama_sampling: llama-cpp-python is not installed ({e}): run scripts/setup.sh --references",
              file=sys.stderr)
        return 3
    prompt = [int(t) for t in args.prompt.split(",")]
    f32 = llama_cpp.GGML_TYPE_F32
    n_ctx = max(256, len(prompt) + args.steps + 8)
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                          n_threads=args.threads, n_threads_batch=args.threads, logits_all=True,
                          flash_attn=False, type_k=f32, type_v=f32, n_gpu_layers=0, verbose=False)
    n_vocab = llm.n_vocab()
    bias = parse_bias(args.logit_bias)
    lib = llama_cpp
    samplers = []
    if bias:
        entries = (lib.llama_logit_bias * len(bias))(*[lib.llama_logit_bias(t, b) for t, b in bias])
        samplers.append(lib.llama_sampler_init_logit_bias(n_vocab, len(bias), entries))
    repetition = lib.llama_sampler_init_penalties(n_vocab, n_ctx, args.repetition_penalty, 0.0, 0.0)
    occurrence = lib.llama_sampler_init_penalties(n_vocab, n_ctx, 1.0, args.frequency_penalty, args.presence_penalty)
    samplers += [repetition, occurrence]
    for t in prompt:
        lib.llama_sampler_accept(repetition, t)

    data = (lib.llama_token_data * n_vocab)()
    view = np.ctypeslib.as_array(data)  # the same memory, as a structured array
    out = sys.stdout
    tokens = prompt
    for step in range(args.steps):
        llm.eval(tokens)
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        view["id"] = np.arange(n_vocab, dtype=np.int32)
        view["logit"] = logits
        view["p"] = 0.0
        array = lib.llama_token_data_array(data=data, size=n_vocab, selected=-1, sorted=False)
        for s in samplers:
            lib.llama_sampler_apply(s, ctypes.byref(array))
        processed = view["logit"][:array.size].astype(np.float64)
        ids = view["id"][:array.size].copy()
        order = np.argsort(-processed, kind="stable")
        token = int(ids[order[0]])
        by_id = np.full(n_vocab, -np.inf)
        by_id[ids] = processed
        next_token = fed[step] if fed is not None else token
        out.write(json.dumps({"step": step, "token": token, "raw_token": int(np.argmax(logits)),
                              "gap": float(processed[order[0]] - processed[order[1]]),
                              "fed_gap": float(processed[order[0]] - by_id[next_token]),
                              "logits_top": [[int(ids[k]), float(processed[k])] for k in order[:5]]}) + "\n")
        lib.llama_sampler_accept(repetition, next_token)
        lib.llama_sampler_accept(occurrence, next_token)
        tokens = [next_token]
    for s in samplers:
        lib.llama_sampler_free(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
