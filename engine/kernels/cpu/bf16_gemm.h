// bf16_gemm: products y = x W^T for BF16 weights on processors with AVX512-BF16, as llama.cpp
// multiplies a BF16 model (prompt and decode alike): the activations rounded to bfloat16 once
// per call, then vdpbf16ps (twice float32's multiply-adds per instruction) instead of widening
// the weights to float32. Prompts take packed tiles of 16 rows (bf16_gemm), except on Intel's
// cores, which gain nothing from vdpbf16ps and widen the weights instead (bf16_widened_gemm,
// f16_gemm.h; the choice is quant_matmul's); decode batches the stored rows as they are
// (bf16_decode).
//
// Owns the per-call repack of each thread's weight rows into interleaved groups of 16 (pair p
// of row i at word 16 p + i, so that one 64-byte load holds the next pair of all 16 rows) in a
// panel of scratch per thread, rebuilt at every call (no second copy of the weights), and the
// tile kernels: AVX512-BF16 and portable C++.
//
// Guarantees: every product of two bfloat16 values is exact in float32; each row's sum over
// its pairs is accumulated in float32 in pair order, the odd value of a pair before the even
// one (vdpbf16ps's order). The portable tile does exactly that; the vector tile is the
// processor's instruction, which the tests hold to the portable one within float32 rounding.
// A row's result depends neither on the other inputs of the call nor on the thread split. The
// activations' rounding to bfloat16 (relative error up to 2^-9 each) is what the path costs
// against the float32 one; KVPIPE_CPU_MATMUL=blas keeps prompts on sgemm.
#pragma once

#include <cstdint>
#include <optional>

namespace kvpipe {

enum class Bf16GemmIsa { kPortable, kAvx512Bf16 };

// "portable" or "avx512-bf16".
const char* bf16_gemm_isa_name(Bf16GemmIsa isa);

// Whether `isa` runs here: the AVX512-BF16 probe passed and KVPIPE_CPU_KERNELS allows AVX-512.
bool bf16_gemm_runs(Bf16GemmIsa isa);

// The vector ISA that serves BF16 prompts here, or nothing (they then go through BLAS).
std::optional<Bf16GemmIsa> bf16_gemm_choice();

// y[j * ldy + r] = sum_c W[r, c] bf16(x[j * ldx + c]) for j < n, r < rows: W's BF16 rows at w,
// cols values each (cols even). On the rank's thread pool. Throws std::invalid_argument where
// `isa` does not run here or cols is odd.
void bf16_gemm(Bf16GemmIsa isa, const float* x, int64_t n, int64_t ldx, const uint16_t* w, int64_t rows,
               int64_t cols, float* y, int64_t ldy);

// The same product for decode-sized inputs (up to 64; any count works) without the per-call
// repack: the activations rounded to bfloat16 once, then each stored row's dot with vdpbf16ps
// (32 values an instruction), each row's 16 lanes summed at its end. Up to 4 inputs, rows in
// pairs from two streams; past 4, blocks of 6 rows held in registers against 4 inputs at a
// time (the multiplies bound a batch, not the weights' stream), the next block prefetched. A row's result depends neither
// on the other inputs nor on how rows are split (into threads, slices, or the pairs of rows
// read as two streams), so a sequence gets the same numbers alone and in a batch. AVX512-BF16
// only: throws std::invalid_argument for kPortable, where it does not run, or for odd cols.
void bf16_decode(Bf16GemmIsa isa, const float* x, int64_t n, int64_t ldx, const uint16_t* w, int64_t rows,
                 int64_t cols, float* y, int64_t ldy);

}  // namespace kvpipe
