"""The gguf package's conversions for the float types and Q8_0, the reference
test_quant_legacy.cpp compares kvpipe's with.

    python tests/peer/gguf_legacy_reference.py dequantize TYPE IN OUT
        IN: raw values of ggml type TYPE (F32, F16 or BF16); OUT: them as float32
        (gguf.quants.dequantize).
    python tests/peer/gguf_legacy_reference.py quantize Q8_0 IN OUT
        IN: float32 values (a multiple of 32); OUT: Q8_0 blocks from gguf.quants.quantize,
        bit for bit ggml's quantize_row_q8_0_ref, which kvpipe's Q8_0 activations follow.
"""
import sys

import numpy as np


def main():
    import gguf

    mode, type_name, src, dst = sys.argv[1:5]
    qtype = gguf.GGMLQuantizationType[type_name]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if mode == "dequantize":
        data = np.fromfile(src, dtype=np.uint8).reshape(-1, block_bytes)
        out = gguf.quants.dequantize(data, qtype)
        np.ascontiguousarray(out, dtype=np.float32).tofile(dst)
    elif mode == "quantize":
        data = np.fromfile(src, dtype=np.float32).reshape(-1, block_values)
        np.ascontiguousarray(gguf.quants.quantize(data, qtype)).tofile(dst)
    else:
        raise SystemExit(f"unknown mode {mode}: dequantize or quantize")


if __name__ == "__main__":
    main()
