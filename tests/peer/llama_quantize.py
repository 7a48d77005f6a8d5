"""Quantises a GGUF model with llama.cpp's own quantiser (llama_model_quantize, through
llama-cpp-python), as the llama-quantize tool does:

    python tests/peer/llama_quantize.py IN.gguf OUT.gguf Q4_K_M [--allow-requantize]

--allow-requantize lets IN be a quantised file itself (llama-quantize's flag of that name).

Types: the FTYPES below, llama.cpp's standard mixes (llama.h's LLAMA_FTYPE_MOSTLY_* ids) and
TQ1_0, a ternary type kvpipe refuses. Exit 3 when llama-cpp-python is missing, 1 when
quantisation fails.
"""
import ctypes
import sys

FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12,
          "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18,
          "IQ4_NL": 25, "IQ4_XS": 30, "TQ1_0": 36}


def main() -> int:
    requantize = len(sys.argv) == 5 and sys.argv[4] == "--allow-requantize"
    if len(sys.argv) not in (4, 5) or sys.argv[3] not in FTYPES or (len(sys.argv) == 5 and not requantize):
        print(f"usage: llama_quantize.py IN OUT {{{','.join(FTYPES)}}}", file=sys.stderr)
        return 2
    try:
        import llama_cpp
    except ImportError as e:
        print(f"llama_quantize: llama-cpp-python is not installed ({e})", file=sys.stderr)
        return 3
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[sys.argv[3]]
    params.allow_requantize = requantize
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
    if rc != 0:
        print(f"llama_quantize: llama_model_quantize returned {rc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
