// quant_matmul: y = x W^T for a weight matrix in its stored type (quant_types.h), on the
// rank's thread pool.
//
// Several ways to compute it, all over the same numbers (activations quantised as the type's
// kernel wants them, so they differ only in float rounding; the bfloat16 products alone also
// round BF16's activations to bfloat16):
//   - the dot kernels, which stream each weight row once for up to kMaxKernelInputs inputs and
//     revisit a slice of rows small enough to stay in the core's cache for the next group of
//     inputs, so that a batch of up to 64 reads the weights from memory about once;
//   - the 8-bit products (int8_gemm.h: weight rows repacked into interleaved bytes, multiplied
//     by the 8-bit activations in the integer units) for the quantised types that have them
//     on this processor: what prefill's long inputs want;
//   - the bfloat16 products (bf16_gemm.h: activations rounded to bfloat16, multiplied by BF16
//     rows with AVX512-BF16) for BF16 weights where the processor has them: packed tiles for
//     prompts, and in place of the dot kernels the stored rows for decode (bf16_decode), so
//     that a BF16 model's decode rounds its activations as its prompt does;
//   - the interleaved kernels (interleaved_blocks.h) for matrices repacked at load, at every
//     input count;
//   - BLAS (single-threaded sgemm on each thread's slice of rows, after dequantising a tile of
//     rows into a scratch buffer): prefill for the other types.
// Which one serves a product follows from its input count and the processor alone (the
// kernels up to 64 inputs, the 8-bit or bfloat16 products or BLAS beyond; KVPIPE_CPU_MATMUL=kernel|blas
// pins one for every count), so that the same job on the same machine gives the same numbers
// however busy it is.
#pragma once

#include "engine/kernels/cpu/quant_types.h"

#include <cstdint>
#include <string>

namespace kvpipe {

// y[i * ldy + r] = sum_c W[r, c] x[i * ldx + c] for i < n, r < rows; W rows of `type` at w,
// quant_row_bytes(type, cols) apart.
void quant_matmul(const float* x, int64_t n, int64_t ldx, QuantType type, const uint8_t* w, int64_t rows,
                  int64_t cols, float* y, int64_t ldy);

enum class MatmulPath { kKernel, kBlas, kInt8, kBf16, kF16, kBf16Widened };
// quant_matmul on a given path (tests and benchmarks compare the two).
void quant_matmul_on(MatmulPath path, const float* x, int64_t n, int64_t ldx, QuantType type, const uint8_t* w,
                     int64_t rows, int64_t cols, float* y, int64_t ldy);
// quant_matmul for W interleaved at load (interleaved_blocks.h): every input count runs the
// interleaved kernels (KVPIPE_CPU_MATMUL does not apply), rows a multiple of 8.
void quant_matmul_interleaved(const float* x, int64_t n, int64_t ldx, QuantType type, const uint8_t* w, int64_t rows,
                              int64_t cols, float* y, int64_t ldy);
// "kernel" | "blas" | "int8" | "bf16" | "f16" | "bf16-widened".
std::string matmul_path_name(MatmulPath path);
// The path of a product past the kernels' input count for `type` on this processor.
MatmulPath prompt_matmul_path(QuantType type);
// What prompts run on here, for reports: the block types' ("int8 avx512-vnni", "int8 avx2
// (Q8_0, IQ4_NL, IQ4_XS: blas)" or "blas"), then BF16's and F16's:
// "int8 avx512-vnni; BF16: avx512-bf16; F16: avx512" (BF16: "avx512 widened" on Intel's cores).
std::string prompt_kernels_description();

}  // namespace kvpipe
