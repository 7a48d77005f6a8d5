#!/usr/bin/env python3
"""Plain PyTorch as a batch-1 decode peer for kvpipe, and a device copy-bandwidth probe.

Decode: random weights of Llama-3-8B's shape (speed does not depend on the values) in
bfloat16, a static KV cache, and each decode step replayed from one CUDA graph (as the
fastest pure-PyTorch decoders do it: fused q/k/v and gate/up projections, SDPA over the
static cache under a position mask). The prompt is prefilled eagerly; the decode steps after
a few warm-up steps are timed one by one with CUDA events and the median is reported, the
figure kvpipe bench reports for its own decode steps.

Copy bandwidth: a large device-to-device copy (Tensor.copy_, which is at::copy_), timed
with CUDA events, counting the bytes read and the bytes written: the bandwidth a memory-bound
decode step can hope for on this device, measured, beside the datasheet's.

  torch_decode.py [--device cuda] [--tiny] [--prompt 128] [--tokens 128] [--no-graphs]
  torch_decode.py --copy-bandwidth [--device cuda] [--tiny]

--device cpu --tiny runs both on the CPU in seconds (no graphs there, perf_counter timing):
kvpipe's GPU check exercises the script that way in its dry run. One JSON object on stdout.
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

LLAMA3_8B = dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                 vocab=128256, rope_theta=500000.0, rms_eps=1e-5)
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
            vocab=512, rope_theta=10000.0, rms_eps=1e-5)


class Timer:
    """Elapsed milliseconds of a region: CUDA events on a GPU, the host clock on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def copy_bandwidth(device, nbytes, repeats=10):
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    with Timer(device) as t:
        for _ in range(repeats):
            dst.copy_(src)
    seconds = t.ms / 1e3
    return {"copy_bytes": nbytes, "repeats": repeats, "seconds": seconds,
            # Each copy reads and writes nbytes.
            "bandwidth_bytes_per_s": 2 * nbytes * repeats / seconds}


class Model:
    def __init__(self, c, device, dtype, max_len):
        self.c, self.device, self.dtype = c, device, dtype
        std = 0.02
        h, hd = c["hidden"], c["head_dim"]
        q, kv, ff = c["heads"] * hd, c["kv_heads"] * hd, c["intermediate"]

        def w(*shape):
            return (torch.randn(*shape, device=device, dtype=dtype) * std)

        self.embed = w(c["vocab"], h)
        self.lm_head = w(c["vocab"], h)
        self.final_norm = torch.ones(h, device=device, dtype=dtype)
        self.layers = []
        for _ in range(c["layers"]):
            self.layers.append(dict(
                in_norm=torch.ones(h, device=device, dtype=dtype), qkv=w(q + 2 * kv, h), o=w(h, q),
                post_norm=torch.ones(h, device=device, dtype=dtype), gate_up=w(2 * ff, h), down=w(h, ff)))
        # Static cache: [layers] of [1, kv_heads, max_len, head_dim].
        self.k_cache = [torch.zeros(1, c["kv_heads"], max_len, hd, device=device, dtype=dtype) for _ in self.layers]
        self.v_cache = [torch.zeros_like(k) for k in self.k_cache]
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv)
        self.cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
        self.sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
        self.max_len = max_len

    def weight_bytes_per_step(self):
        # Every layer, the final norm and the LM head; one row of the embedding.
        n = sum(t.numel() * t.element_size() for l in self.layers for t in l.values())
        n += self.lm_head.numel() * self.lm_head.element_size() + self.final_norm.numel() * self.final_norm.element_size()
        return n + self.embed.size(1) * self.embed.element_size()

    def rms(self, x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.c["rms_eps"])).to(self.dtype) * w

    @staticmethod
    def rotate(x, cos, sin):
        half = x.size(-1) // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def forward(self, tokens, positions, mask):
        """tokens, positions: [T]; mask: [T, max_len] bool (True: may attend). Returns logits of the last row."""
        c = self.c
        T, hd = tokens.size(0), c["head_dim"]
        nq, nkv = c["heads"], c["kv_heads"]
        x = self.embed[tokens]
        cos, sin = self.cos[positions][None, None], self.sin[positions][None, None]
        for i, l in enumerate(self.layers):
            qkv = F.linear(self.rms(x, l["in_norm"]), l["qkv"])
            q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], -1)
            q = self.rotate(q.view(T, nq, hd).transpose(0, 1)[None], cos, sin)
            k = self.rotate(k.view(T, nkv, hd).transpose(0, 1)[None], cos, sin)
            v = v.view(T, nkv, hd).transpose(0, 1)[None]
            self.k_cache[i].index_copy_(2, positions, k)
            self.v_cache[i].index_copy_(2, positions, v)
            a = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask[None, None],
                                               enable_gqa=True)
            x = x + F.linear(a[0].transpose(0, 1).reshape(T, nq * hd), l["o"])
            g, u = F.linear(self.rms(x, l["post_norm"]), l["gate_up"]).chunk(2, -1)
            x = x + F.linear(F.silu(g) * u, l["down"])
        return F.linear(self.rms(x[-1:], self.final_norm), self.lm_head).float()


def decode(args):
    device = torch.device(args.device)
    c = TINY if args.tiny else LLAMA3_8B
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    max_len = args.prompt + args.tokens + 1
    t0 = time.perf_counter()
    m = Model(c, device, dtype, max_len)
    if device.type == "cuda":
        torch.cuda.synchronize()
    init_s = time.perf_counter() - t0
    ar = torch.arange(max_len, device=device)

    with torch.inference_mode():
        prompt = (torch.arange(args.prompt, device=device) * 7919 + 13) % (c["vocab"] - 3) + 3
        pos = torch.arange(args.prompt, device=device)
        logits = m.forward(prompt, pos, ar[None, :] <= pos[:, None])
        # Static inputs of the decode step: the graph reads them, the host writes them.
        tok = logits.argmax(-1).view(1)
        p = torch.full((1,), args.prompt, device=device, dtype=torch.long)
        static_out = None

        def step():
            return m.forward(tok, p, (ar <= p)[None, :]).argmax(-1).view(1)

        use_graphs = device.type == "cuda" and not args.no_graphs
        if use_graphs:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    step()  # warm-up on the side stream: cuBLAS handles, allocator
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = step()
        ids, times = [int(tok.item())], []
        warmup = min(args.warmup, args.tokens - 1)
        for i in range(args.tokens - 1):
            with Timer(device) as t:
                if use_graphs:
                    graph.replay()
                    nxt = static_out
                else:
                    nxt = step()
            ids.append(int(nxt.item()))
            tok.copy_(nxt)
            p.add_(1)
            if i >= warmup:
                times.append(t.ms)
    median = statistics.median(times) if times else float("nan")
    out = {"peer": "pytorch", "torch": torch.__version__, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
           "shape": "tiny" if args.tiny else "llama3-8b", "cuda_graphs": use_graphs, "prompt": args.prompt,
           "tokens": args.tokens, "timed_steps": len(times), "decode_step_ms_median": median,
           "decode_tok_s": 1e3 / median if median > 0 else None, "weight_bytes_per_step": m.weight_bytes_per_step(),
           "init_s": init_s, "output_ids": ids}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (and a 64 MiB copy): seconds on a CPU")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=8, help="decode steps not timed")
    ap.add_argument("--no-graphs", action="store_true", help="launch each kernel (no CUDA graph)")
    ap.add_argument("--copy-bandwidth", action="store_true", help="measure device copy bandwidth instead")
    ap.add_argument("--copy-bytes", type=int, default=0, help="bytes per copy (default 4 GiB, 64 MiB with --tiny)")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("torch_decode.py: no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    if args.tokens < 2 or args.prompt < 1:
        print("torch_decode.py: --prompt >= 1 and --tokens >= 2", file=sys.stderr)
        return 2
    if args.copy_bandwidth:
        nbytes = args.copy_bytes or ((64 << 20) if args.tiny else (4 << 30))
        out = copy_bandwidth(torch.device(args.device), nbytes)
        out.update(device=args.device, torch=torch.__version__)
    else:
        out = decode(args)
    print(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
