// int8_gemm: prompt-sized products y = x W^T for the quantised types in 8-bit integers, as
// llama.cpp and ik_llama.cpp multiply a prompt on the CPU, instead of dequantising weight tiles
// to float32 for sgemm.
//
// Owns the per-call repack of each thread's weight rows into interleaved groups of 8 rows
// (each row's values as unsigned bytes with a float scale d and offset m per run of 32, laid
// out so that one 32-byte load holds four consecutive values of all 8 rows; two scales and
// offsets per run for the types whose scales cover 16 values), and the tile
// kernels that multiply a group by the activations' 8-bit blocks: AVX-512 VNNI (one vpdpbusd
// per four values of 8 rows), AVX2 (vpmaddubsw + vpmaddwd) and portable C++. The repack lives
// in one group's scratch per thread, rebuilt at every call: no second copy of the weights
// stays in memory.
//
// Guarantees: a run's integer dot product is exact and enters the row's float sum as
// fma(sum(u a), d_w d_a, acc) then fma(m_w, d_a sum(a), acc), in run order; every ISA does
// exactly these operations, so they agree bit for bit, and a row's result depends neither on
// the other inputs of the call nor on how rows are split among threads. Results equal the dot
// kernels' (quant_types.h) up to float32 rounding.
#pragma once

#include "engine/kernels/cpu/quant_types.h"

#include <cstdint>
#include <optional>

namespace kvpipe {

enum class Int8GemmIsa { kPortable, kAvx2, kAvx512Vnni };

// "portable", "avx2" or "avx512-vnni".
const char* int8_gemm_isa_name(Int8GemmIsa isa);

// Whether `type`'s rows have the unsigned 8-bit form: every block type (Q2_K, Q3_K and Q6_K,
// whose scales cover 16 values, with two scales per run of 32), not the float types.
bool int8_gemm_supports(QuantType type);

// Whether `isa` computes `type` on this processor: the probe passed (and KVPIPE_CPU_KERNELS
// allows it), and for AVX2 the type's bytes stay below 128 (vpmaddubsw saturates past that:
// Q8_0, IQ4_NL and IQ4_XS need VNNI). kPortable runs every supported type everywhere.
bool int8_gemm_runs(Int8GemmIsa isa, QuantType type);

// The vector ISA that serves `type` here, or nothing (prompts then go through BLAS).
std::optional<Int8GemmIsa> int8_gemm_choice(QuantType type);

// y[j * ldy + r] = sum_c W[r, c] X[j, c] for j < n, r < rows: W rows of `type` at w,
// quant_row_bytes(type, cols) apart; X the n activation rows of quant_traits(type).activation
// at x, x_stride bytes apart. On the rank's thread pool. Throws std::invalid_argument where
// `isa` does not run `type` here.
void int8_gemm(Int8GemmIsa isa, const uint8_t* x, int64_t x_stride, int64_t n, QuantType type, const uint8_t* w,
               int64_t rows, int64_t cols, float* y, int64_t ldy);

}  // namespace kvpipe
