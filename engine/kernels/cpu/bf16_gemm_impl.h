// bf16_gemm's halves (bf16_gemm.h): the packed group layout both read, and the tile kernels,
// portable (bf16_gemm.cpp) and x86 (bf16_gemm_x86.cpp, compiled with target attributes and
// called only where the processor runs them).
#pragma once

#include <cstdint>

namespace kvpipe::bf16_gemm_impl {

constexpr int kGroupRows = 16;

// One group of 16 rows: group[16 p + i] holds values 2p (low half) and 2p + 1 (high half) of
// row i. xb holds the activations as bfloat16 pairs, row j's pair p at xb[j * pairs + p].
// Writes y[j * ldy + i] for j0 <= j < j0 + count and rows i < valid.
using TileFn = void (*)(const uint32_t* group, const uint32_t* xb, int64_t pairs, int64_t j0, int64_t count,
                        float* y, int64_t ldy, int valid);

void tile_portable(const uint32_t* group, const uint32_t* xb, int64_t pairs, int64_t j0, int64_t count, float* y,
                   int64_t ldy, int valid);
void tile_avx512bf16(const uint32_t* group, const uint32_t* xb, int64_t pairs, int64_t j0, int64_t count, float* y,
                     int64_t ldy, int valid);

// Decode: rows [r_begin, r_end) of the stored BF16 matrix w (cols values a row, cols even)
// times `inputs` (1..kDecodeInputs) activation rows in bfloat16 at xb, ldx values apart:
// y[m * ldy + r]. Each row's 16 lanes take vdpbf16ps over its 32-value chunks in column order
// (the last one zero-padded), then _mm512_reduce_add_ps; the rows go in pairs, one from each
// half of the range, so that two streams of weights are in flight.
constexpr int kDecodeInputs = 4;
void decode_rows_avx512bf16(const uint16_t* w, int64_t cols, const uint16_t* xb, int64_t ldx, int inputs,
                            int64_t r_begin, int64_t r_end, float* y, int64_t ldy);

// The same products for batches past kDecodeInputs, where the multiplies rather than the
// weights' stream bound the time: blocks of kDecodeBlockRows rows held in registers against
// each group of up to kDecodeInputs inputs (24 accumulators), the next block's rows prefetched
// while this one is multiplied. Each row's sums are formed exactly as decode_rows_avx512bf16
// forms them, so a row gets the same bits at any batch size.
constexpr int kDecodeBlockRows = 6;
void decode_blocks_avx512bf16(const uint16_t* w, int64_t cols, const uint16_t* xb, int64_t ldx, int64_t inputs,
                              int64_t r_begin, int64_t r_end, float* y, int64_t ldy);

}  // namespace kvpipe::bf16_gemm_impl
