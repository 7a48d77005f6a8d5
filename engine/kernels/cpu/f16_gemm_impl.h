// f16_gemm's halves (f16_gemm.h): the packed group layout both read, and the tile kernels,
// portable (f16_gemm.cpp) and x86 (f16_gemm_x86.cpp, compiled with target attributes and called
// only where the processor runs them).
#pragma once

#include <cstdint>

namespace kvpipe::f16_gemm_impl {

constexpr int kGroupRows = 16;
// Inputs of one tile: their accumulators and the group's widened value fill 13 of AVX-512's 32
// registers, and each widening is shared by 12 multiply-adds.
constexpr int kTileInputs = 12;

// One group of 16 rows: group[16 c + i] is value c of row i, as float16 (or bfloat16) bits.
// xt holds a tile of `count` (1 .. kTileInputs) inputs interleaved: value c of input j at
// xt[kTileInputs c + j]. Writes y[j * ldy + i] for j < count and rows i < valid.
using TileFn = void (*)(const uint16_t* group, int64_t cols, const float* xt, int count, float* y, int64_t ldy,
                        int valid);

void tile_portable(const uint16_t* group, int64_t cols, const float* xt, int count, float* y, int64_t ldy, int valid);
void tile_avx512(const uint16_t* group, int64_t cols, const float* xt, int count, float* y, int64_t ldy, int valid);

// The same tiles over bfloat16 bits (bf16_widened_gemm): each value widens by a 16-bit shift.
void tile_portable_bf16(const uint16_t* group, int64_t cols, const float* xt, int count, float* y, int64_t ldy,
                        int valid);
void tile_avx512_bf16(const uint16_t* group, int64_t cols, const float* xt, int count, float* y, int64_t ldy,
                      int valid);

}  // namespace kvpipe::f16_gemm_impl
