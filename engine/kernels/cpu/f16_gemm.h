// f16_gemm: prompt-sized products y = x W^T for F16 weights on processors with AVX-512, in place
// of widening weight tiles to float32 for sgemm (which then copies them again into its own
// packed panels): each thread repacks its rows once per call into groups of 16 rows, value c of
// all 16 rows side by side in float16, and the tile kernel widens 16 rows' value c with one
// vcvtph2ps, then multiplies it by each input's value c, broadcast, in float32.
//
// BF16 weights can take the same tiles (bf16_widened_gemm), widened by a shift instead.
//
// Owns the per-call repack (a panel of scratch per thread, rebuilt at every call: no second copy
// of the weights stays in memory) and the tile kernels: AVX-512 and portable C++.
//
// Guarantees: every float16 weight widens to float32 exactly; each row's sum over its values is
// fma(w, x, acc) in column order, in float32, from zero. The portable tile does exactly that and
// the vector tile does it in each lane, so they agree bit for bit. A row's result depends
// neither on the other inputs of the call nor on the thread split. The activations stay float32
// (llama.cpp rounds them to float16 for its F16 products).
#pragma once

#include <cstdint>
#include <optional>

namespace kvpipe {

enum class F16GemmIsa { kPortable, kAvx512 };

// "portable" or "avx512".
const char* f16_gemm_isa_name(F16GemmIsa isa);

// Whether `isa` runs here: the AVX-512 probe passed and KVPIPE_CPU_KERNELS allows AVX-512.
bool f16_gemm_runs(F16GemmIsa isa);

// The vector ISA that serves F16 prompts here, or nothing (they then go through BLAS).
std::optional<F16GemmIsa> f16_gemm_choice();

// y[j * ldy + r] = sum_c W[r, c] x[j * ldx + c] for j < n, r < rows: W's F16 rows at w, cols
// values each. On the rank's thread pool. Throws std::invalid_argument where `isa` does not run.
void f16_gemm(F16GemmIsa isa, const float* x, int64_t n, int64_t ldx, const uint16_t* w, int64_t rows, int64_t cols,
              float* y, int64_t ldy);

// The same product for BF16 weights: each bfloat16 value widens to float32 exactly (a 16-bit
// shift), then the same tiles, order of operations and guarantees as f16_gemm; the activations
// stay float32. Which processors take it over bf16_gemm's vdpbf16ps: quant_matmul.cpp
// (bf16_prompt_path).
void bf16_widened_gemm(F16GemmIsa isa, const float* x, int64_t n, int64_t ldx, const uint16_t* w, int64_t rows,
                       int64_t cols, float* y, int64_t ldy);

}  // namespace kvpipe
