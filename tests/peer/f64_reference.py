"""Float64 log-probabilities of a Llama-family GGUF model, from its dequantised weights.

The reference that kvpipe's and llama.cpp's quantised runs are both measured against: every
tensor is dequantised by the `gguf` package (gguf.quants, independent of both engines) and the
forward pass is computed in float64 with numpy (RMSNorm, RoPE on adjacent pairs as GGUF's
permuted q/k rows want it, grouped-query causal attention, SwiGLU). Reads JSON lines
{"prompt": [ids], "tokens": [ids]} from --runs FILE (tokens: the greedy tokens one engine chose) and
writes, per line, {"steps": [[logprob of every vocabulary entry] per generated token]}: step s
is the distribution that chose tokens[s], given prompt + tokens[:s].

    python tests/peer/f64_reference.py --model M.gguf --runs runs.jsonl
"""
import argparse
import json
import sys

import numpy as np


def load(path):
    import gguf

    reader = gguf.GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def meta(key, default=None):
        f = reader.fields.get(f"{arch}.{key}")
        return default if f is None else f.parts[f.data[0]][0].item()

    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        shape = [int(n) for n in reversed(t.shape.tolist())]
        tensors[t.name] = w.reshape(shape)
    cfg = {
        "layers": int(meta("block_count")),
        "heads": int(meta("attention.head_count")),
        "kv_heads": int(meta("attention.head_count_kv")),
        "eps": float(meta("attention.layer_norm_rms_epsilon")),
        "theta": float(meta("rope.freq_base", 10000.0)),
        "arch": arch,
    }
    return cfg, tensors


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, pos, theta, neox):
    # x [T, H, D]; GGUF llama q/k rows are permuted so that adjacent pairs rotate together;
    # qwen2 keeps HF's halves (NEOX style).
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = np.empty_like(x)
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2 :]
        out[..., : d // 2] = a * cos - b * sin
        out[..., d // 2 :] = a * sin + b * cos
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
    return out


def logprobs(cfg, w, ids):
    T = len(ids)
    h = w["token_embd.weight"][ids]
    pos = np.arange(T, dtype=np.float64)
    H, KV = cfg["heads"], cfg["kv_heads"]
    neox = cfg["arch"] == "qwen2"
    mask = np.triu(np.ones((T, T), dtype=bool), 1)
    for i in range(cfg["layers"]):
        p = f"blk.{i}."
        x = rms_norm(h, w[p + "attn_norm.weight"], cfg["eps"])
        q = x @ w[p + "attn_q.weight"].T
        k = x @ w[p + "attn_k.weight"].T
        v = x @ w[p + "attn_v.weight"].T
        if p + "attn_q.bias" in w:
            q, k, v = q + w[p + "attn_q.bias"], k + w[p + "attn_k.bias"], v + w[p + "attn_v.bias"]
        D = q.shape[1] // H
        q = rope(q.reshape(T, H, D), pos, cfg["theta"], neox)
        k = rope(k.reshape(T, KV, D), pos, cfg["theta"], neox)
        v = v.reshape(T, KV, D)
        k = np.repeat(k, H // KV, axis=1)
        v = np.repeat(v, H // KV, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D)
        s = np.where(mask[None], -np.inf, s)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        h = h + np.einsum("hqk,khd->qhd", s, v).reshape(T, H * D) @ w[p + "attn_output.weight"].T
        x = rms_norm(h, w[p + "ffn_norm.weight"], cfg["eps"])
        g = x @ w[p + "ffn_gate.weight"].T
        u = x @ w[p + "ffn_up.weight"].T
        h = h + (g / (1 + np.exp(-g)) * u) @ w[p + "ffn_down.weight"].T
    h = rms_norm(h, w["output_norm.weight"], cfg["eps"])
    logits = h @ w.get("output.weight", w["token_embd.weight"]).T
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--runs", required=True, help="JSON lines {prompt, tokens}")
    args = parser.parse_args()
    cfg, w = load(args.model)
    for line in open(args.runs):
        if not line.strip():
            continue
        run = json.loads(line)
        prompt, tokens = run["prompt"], run["tokens"]
        seq = prompt + tokens[:-1]
        lp = logprobs(cfg, w, np.array(seq, dtype=np.int64))
        steps = [lp[len(prompt) - 1 + s].tolist() for s in range(len(tokens))]
        sys.stdout.write(json.dumps({"steps": steps}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
