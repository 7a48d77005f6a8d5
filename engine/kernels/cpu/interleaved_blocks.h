// interleaved_blocks: weight rows repacked once, at load, into groups of 8 rows whose blocks
// interleave (ik_llama.cpp's "_R8" idea), and the kernels that multiply them (Q4_0, Q8_0, Q4_K,
// Q6_K).
//
// Owns the layouts and every product over them, for decode and prompts alike. A row-at-a-time
// kernel converts and scales each row's block sums on its own and sums the row's lanes at the
// end; over interleaved rows one 32-byte load holds four values of each of 8 rows, one
// vpdpbusd (or vpmaddubsw) per input forms all 8 rows' partial sums, and every block's scale
// and accumulation is one vector operation for the 8 rows. Nothing is expanded: Q4_0, Q8_0 and
// Q6_K groups have exactly the bytes of their 8 stored rows, a Q4_K group 2.8% more (its 6-bit
// scales and mins one byte each), so decode reads about the memory it read before.
//
// Q4_0, group g of rows 8g .. 8g + 7, block b (values 32b .. 32b + 31) at byte b * 144 of the
// group: the 8 rows' fp16 scales d[0..7] (16 bytes), then 128 bytes q where
// q[32 k + 4 i + t] is byte 4 k + t of row i's block nibbles (low nibble value 4 k + t, high
// nibble value 16 + 4 k + t).
// Q8_0, block b at byte b * 272: d[0..7], then 256 bytes q where q[32 k + 4 i + t] is byte
// 4 k + t of row i's block (value 4 k + t). VNNI reads them as unsigned (each byte plus 128)
// and takes 128 times the activations' sum back out; AVX2 multiplies |w| by x with w's sign.
// Q4_K, super-block b (values 256b .. 256b + 255) at byte b * 1184: d[0..7] and dmin[0..7]
// (fp16), sc[s][i] (the scale of row i's sub-block s of 32 values, a byte each, 64 bytes),
// mn[p][i][h] (the min of row i's sub-block 2p + h, 64 bytes), then 1024 bytes q where
// q[256 j + 32 k + 4 i + t] is byte 32 j + 4 k + t of row i's nibbles (low nibble: value
// 4 k + t of sub-block 2 j; high nibble: of sub-block 2 j + 1).
// Q6_K, super-block b at byte b * 1680 (exactly the 8 stored blocks' bytes): d[0..7] (fp16),
// the int8 scales in pairs, byte 16 + 16 p + 2 i + h the scale of row i's sub-block 2 p + h
// (16 values), then per sub-block s 96 bytes at 144 + 96 s: with u the 6-bit value
// (stored value + 32) of row i at 16 s + 4 m + t, byte 4 i + t of the first 32 holds the low
// nibbles of m = 0 (low) and m = 1 (high), of the second 32 those of m = 2 and 3, and of the
// last 32 the four values' top two bits (bits 2 m, 2 m + 1).
//
// Guarantees: each block's (sub-block's) integer sums are exact and enter row i's float sum
// in block order by the operations the portable kernel spells out; every ISA does exactly
// these operations, so they agree bit for bit and a row's result depends neither on the other
// inputs of the call nor on how groups are split among threads. Results equal the row kernels'
// (quant_types.h) up to float32 rounding.
#pragma once

#include "engine/kernels/cpu/quant_types.h"

#include <cstdint>

namespace kvpipe {

constexpr int64_t kInterleavedRows = 8;

enum class InterleaveIsa { kPortable, kAvx2, kAvx512Vnni };

// "portable", "avx2" or "avx512-vnni".
const char* interleave_isa_name(InterleaveIsa isa);
// Whether `type` has an interleaved layout and its kernels (Q4_0, Q8_0, Q4_K, Q6_K).
bool interleave_supports(QuantType type);
// Bytes an interleaved matrix takes per row of `cols` values (a group is 8 of them).
int64_t interleaved_row_bytes(QuantType type, int64_t cols);
// Whether `isa` runs on this processor (and KVPIPE_CPU_KERNELS allows it); kPortable always.
bool interleave_runs(InterleaveIsa isa);
// The fastest ISA that runs here.
InterleaveIsa interleave_choice();

// `rows` rows (a multiple of 8) of `type` at src, quant_row_bytes apart, into the layout above
// at dst (rows * interleaved_row_bytes bytes; src and dst must not overlap).
void interleave_rows(QuantType type, const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst);
// Row r of an interleaved matrix back in the stored layout: quant_row_bytes(type, cols) bytes.
void deinterleave_row(QuantType type, const uint8_t* src, int64_t r, int64_t cols, uint8_t* row);

// y[j * ldy + r] = sum_c W[r, c] x[j, c] for j < n, r < rows (a multiple of 8): W interleaved
// at w, x the n activation rows in the type's activation format (Q8_0 for Q4_0 and Q8_0) at x,
// x_stride bytes apart. Splits the groups over the rank's thread pool.
void interleaved_matmul(InterleaveIsa isa, const uint8_t* x, int64_t x_stride, int64_t n, QuantType type,
                        const uint8_t* w, int64_t rows, int64_t cols, float* y, int64_t ldy);

}  // namespace kvpipe
