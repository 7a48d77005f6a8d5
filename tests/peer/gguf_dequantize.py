"""The gguf package's dequantisation of raw ggml rows, the reference test_quant_gguf_reference.cpp
compares kvpipe's dequantize_row with.

    python tests/peer/gguf_dequantize.py TYPE ROWS COLS IN OUT

IN holds ROWS rows of COLS values of ggml type TYPE (its name: Q8_0, Q4_K, ...) in ggml's block
layout; OUT receives their ROWS * COLS float32 values (gguf.quants.dequantize), row by row.
"""
import sys

import numpy as np


def main():
    import gguf

    type_name, rows, cols, src, dst = sys.argv[1:6]
    rows, cols = int(rows), int(cols)
    qtype = gguf.GGMLQuantizationType[type_name]
    data = np.fromfile(src, dtype=np.uint8).reshape(rows, -1)
    values = gguf.quants.dequantize(data, qtype).reshape(rows, cols)
    np.ascontiguousarray(values, dtype=np.float32).tofile(dst)


if __name__ == "__main__":
    main()
