// bf16_gemm's AVX512-BF16 tile (bf16_gemm_impl.h), compiled with its own target attributes so
// the binary runs on any x86-64 and calls it only where the probe passed.
#include "engine/kernels/cpu/bf16_gemm_impl.h"

#if defined(__x86_64__)
#include <immintrin.h>

namespace kvpipe::bf16_gemm_impl {
namespace {

#define KVPIPE_BF16_ATTR __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512dq,avx512bf16")))

// kInputs inputs from j0 times one group: an accumulator of 16 rows per input, each 64-byte
// load of the group's next pair shared by the inputs, the input's pair broadcast from memory.
// kInputs = 8 keeps eight independent accumulations in flight, past vdpbf16ps's latency.
template <int kInputs>
KVPIPE_BF16_ATTR void tile_inputs(const uint32_t* group, const uint32_t* xb, int64_t pairs, int64_t j0, float* y,
                                  int64_t ldy, __mmask16 rows) {
  __m512 acc[kInputs];
  const uint32_t* xr[kInputs];
  for (int j = 0; j < kInputs; ++j) {
    acc[j] = _mm512_setzero_ps();
    xr[j] = xb + (j0 + j) * pairs;
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh w = reinterpret_cast<__m512bh>(_mm512_load_si512(group + kGroupRows * p));
    for (int j = 0; j < kInputs; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], w, reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(xr[j][p]))));
  }
  for (int j = 0; j < kInputs; ++j) _mm512_mask_storeu_ps(y + (j0 + j) * ldy, rows, acc[j]);
}

// One row's next 32 values (or the `tail` left, zero-padded: a zero product adds nothing).
KVPIPE_BF16_ATTR inline __m512bh load_chunk(const uint16_t* p, __mmask32 mask) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, p));
}

// Columns [c, c + 32) of row_a (and row_b where kPaired), `mask` of them present, into the
// inputs' accumulators.
template <int kInputs, bool kPaired>
KVPIPE_BF16_ATTR inline void decode_chunk(const uint16_t* row_a, const uint16_t* row_b, const uint16_t* xb,
                                          int64_t ldx, int64_t c, __mmask32 mask, __m512* acc_a, __m512* acc_b) {
  const __m512bh wa = load_chunk(row_a + c, mask);
  const __m512bh wb = kPaired ? load_chunk(row_b + c, mask) : wa;
  for (int m = 0; m < kInputs; ++m) {
    const __m512bh xm = load_chunk(xb + m * ldx + c, mask);
    acc_a[m] = _mm512_dpbf16_ps(acc_a[m], wa, xm);
    if constexpr (kPaired) acc_b[m] = _mm512_dpbf16_ps(acc_b[m], wb, xm);
  }
}

// Row r_a (and r_b where kPaired) times the inputs, the two rows' chunks in turn.
template <int kInputs, bool kPaired>
KVPIPE_BF16_ATTR inline void decode_row(const uint16_t* w, int64_t cols, const uint16_t* xb, int64_t ldx, int64_t r_a,
                                        int64_t r_b, float* y, int64_t ldy) {
  const int64_t full = cols / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (cols - full)) - 1u);
  const uint16_t* row_a = w + r_a * cols;
  const uint16_t* row_b = w + r_b * cols;
  __m512 acc_a[kInputs], acc_b[kInputs];
  for (int m = 0; m < kInputs; ++m) acc_a[m] = acc_b[m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < full; c += 32)
    decode_chunk<kInputs, kPaired>(row_a, row_b, xb, ldx, c, ~__mmask32{0}, acc_a, acc_b);
  if (tail != 0) decode_chunk<kInputs, kPaired>(row_a, row_b, xb, ldx, full, tail, acc_a, acc_b);
  for (int m = 0; m < kInputs; ++m) {
    y[m * ldy + r_a] = _mm512_reduce_add_ps(acc_a[m]);
    if constexpr (kPaired) y[m * ldy + r_b] = _mm512_reduce_add_ps(acc_b[m]);
  }
}

template <int kInputs>
KVPIPE_BF16_ATTR void decode_rows(const uint16_t* w, int64_t cols, const uint16_t* xb, int64_t ldx, int64_t r_begin,
                                  int64_t r_end, float* y, int64_t ldy) {
  const int64_t half = (r_end - r_begin) / 2;
  for (int64_t r = r_begin; r < r_begin + half; ++r) decode_row<kInputs, true>(w, cols, xb, ldx, r, r + half, y, ldy);
  for (int64_t r = r_begin + 2 * half; r < r_end; ++r) decode_row<kInputs, false>(w, cols, xb, ldx, r, r, y, ldy);
}

// kRows rows from r0 times kInputs inputs, all of their columns: one load of each row's chunk
// serves every input, one load of each input's chunk every row. `next` (or null) is the block
// after this one; its lines are prefetched one chunk a row as this block's are consumed, so
// that memory streams while the block computes.
template <int kRows, int kInputs>
KVPIPE_BF16_ATTR void decode_block(const uint16_t* w, int64_t cols, const uint16_t* xb, int64_t ldx, int64_t r0,
                                   const uint16_t* next, float* y, int64_t ldy) {
  const int64_t full = cols / 32 * 32;
  const uint16_t* rows = w + r0 * cols;
  __m512 acc[kRows][kInputs];
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int m = 0; m < kInputs; ++m) acc[i][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < full; c += 32) {
    __m512bh wr[kRows];
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i)
      wr[i] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(rows + i * cols + c));
    if (next != nullptr)
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) _mm_prefetch(reinterpret_cast<const char*>(next + i * cols + c), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int m = 0; m < kInputs; ++m) {
      const __m512bh xm = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xb + m * ldx + c));
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) acc[i][m] = _mm512_dpbf16_ps(acc[i][m], wr[i], xm);
    }
  }
  if (full < cols) {
    const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (cols - full)) - 1u);
    __m512bh wr[kRows];
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) wr[i] = load_chunk(rows + i * cols + full, tail);
#pragma GCC unroll 4
    for (int m = 0; m < kInputs; ++m) {
      const __m512bh xm = load_chunk(xb + m * ldx + full, tail);
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) acc[i][m] = _mm512_dpbf16_ps(acc[i][m], wr[i], xm);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int m = 0; m < kInputs; ++m) y[m * ldy + r0 + i] = _mm512_reduce_add_ps(acc[i][m]);
}

template <int kRows>
KVPIPE_BF16_ATTR void decode_block_inputs(const uint16_t* w, int64_t cols, const uint16_t* xb, int64_t ldx,
                                          int64_t inputs, int64_t r0, const uint16_t* next, float* y, int64_t ldy) {
  int64_t g = 0;
  for (; g + kDecodeInputs <= inputs; g += kDecodeInputs)
    decode_block<kRows, kDecodeInputs>(w, cols, xb + g * ldx, ldx, r0, next, y + g * ldy, ldy);
  static_assert(kDecodeInputs == 4, "one case per remainder");
  switch (inputs - g) {
    case 3: return decode_block<kRows, 3>(w, cols, xb + g * ldx, ldx, r0, next, y + g * ldy, ldy);
    case 2: return decode_block<kRows, 2>(w, cols, xb + g * ldx, ldx, r0, next, y + g * ldy, ldy);
    case 1: return decode_block<kRows, 1>(w, cols, xb + g * ldx, ldx, r0, next, y + g * ldy, ldy);
    default: return;
  }
}

}  // namespace

KVPIPE_BF16_ATTR void decode_blocks_avx512bf16(const uint16_t* w, int64_t cols, const uint16_t* xb, int64_t ldx,
                                               int64_t inputs, int64_t r_begin, int64_t r_end, float* y,
                                               int64_t ldy) {
  constexpr int64_t kRows = kDecodeBlockRows;
  int64_t r = r_begin;
  for (; r + kRows <= r_end; r += kRows) {
    const uint16_t* next = r + 2 * kRows <= r_end ? w + (r + kRows) * cols : nullptr;
    decode_block_inputs<kRows>(w, cols, xb, ldx, inputs, r, next, y, ldy);
  }
  for (; r < r_end; ++r) decode_block_inputs<1>(w, cols, xb, ldx, inputs, r, nullptr, y, ldy);
}

KVPIPE_BF16_ATTR void decode_rows_avx512bf16(const uint16_t* w, int64_t cols, const uint16_t* xb, int64_t ldx,
                                             int inputs, int64_t r_begin, int64_t r_end, float* y, int64_t ldy) {
  switch (inputs) {
    case 1: return decode_rows<1>(w, cols, xb, ldx, r_begin, r_end, y, ldy);
    case 2: return decode_rows<2>(w, cols, xb, ldx, r_begin, r_end, y, ldy);
    case 3: return decode_rows<3>(w, cols, xb, ldx, r_begin, r_end, y, ldy);
    case 4: return decode_rows<4>(w, cols, xb, ldx, r_begin, r_end, y, ldy);
    default: return;
  }
}

KVPIPE_BF16_ATTR void tile_avx512bf16(const uint32_t* group, const uint32_t* xb, int64_t pairs, int64_t j0,
                                      int64_t count, float* y, int64_t ldy, int valid) {
  const __mmask16 rows = static_cast<__mmask16>((1u << valid) - 1u);
  int64_t j = j0;
  const int64_t end = j0 + count;
  for (; j + 8 <= end; j += 8) tile_inputs<8>(group, xb, pairs, j, y, ldy, rows);
  switch (end - j) {
    case 7: return tile_inputs<7>(group, xb, pairs, j, y, ldy, rows);
    case 6: return tile_inputs<6>(group, xb, pairs, j, y, ldy, rows);
    case 5: return tile_inputs<5>(group, xb, pairs, j, y, ldy, rows);
    case 4: return tile_inputs<4>(group, xb, pairs, j, y, ldy, rows);
    case 3: return tile_inputs<3>(group, xb, pairs, j, y, ldy, rows);
    case 2: return tile_inputs<2>(group, xb, pairs, j, y, ldy, rows);
    case 1: return tile_inputs<1>(group, xb, pairs, j, y, ldy, rows);
    default: return;
  }
}

}  // namespace kvpipe::bf16_gemm_impl

#endif
