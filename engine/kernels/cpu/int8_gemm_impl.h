// int8_gemm's halves (int8_gemm.h): the packed group and activation panel both read, and the
// tile kernels, portable (int8_gemm.cpp) and x86 (int8_gemm_x86.cpp, compiled with target
// attributes and called only where the processor runs them).
#pragma once

#include <cstdint>

namespace kvpipe::int8_gemm_impl {

constexpr int kGroupRows = 8;
constexpr int64_t kRun = 32;  // values of one packed run

// 32 values of 8 rows: q[32 k + 4 i + t] is value 4 k + t of row i, so one 32-byte load gives
// every row's next four values, one row to each 32-bit lane. d[0] and m[0] are the rows'
// scales and offsets; types whose scales cover 16 values ("split" runs: Q2_K, Q3_K, Q6_K) have
// the second half's in d[1] and m[1].
struct alignas(64) PackedRun {
  uint8_t q[kGroupRows * kRun];
  float d[2][kGroupRows];
  float m[2][kGroupRows];
};

// The activations of a call: n rows of 8-bit runs. Run b of row j has its 32 values at
// x + j * x_stride + qs_offset[b], its scale at da[j * runs + b] and scale times value sum at
// s[j * runs + b]; for split runs, the sum of half h at s[(j * runs + b) * 2 + h] instead.
struct Panel {
  const uint8_t* x = nullptr;
  int64_t x_stride = 0;
  const int64_t* qs_offset = nullptr;
  const float* da = nullptr;
  const float* s = nullptr;
  int64_t runs = 0;
};

// One group (runs PackedRuns) times every input j < n: y[j * ldy + i] for rows i < valid.
void tile_portable(const PackedRun* group, const Panel& p, bool split, int64_t n, float* y, int64_t ldy, int valid);
void tile_avx2(const PackedRun* group, const Panel& p, bool split, int64_t n, float* y, int64_t ldy, int valid);
void tile_avx512vnni(const PackedRun* group, const Panel& p, bool split, int64_t n, float* y, int64_t ldy,
                     int valid);
// Two groups, g0's rows then g1's, as 16 rows: y[j * ldy + i] for rows i < valid (9 to 16).
void tile_pair_avx512vnni(const PackedRun* g0, const PackedRun* g1, const Panel& p, bool split, int64_t n, float* y,
                          int64_t ldy, int valid);

}  // namespace kvpipe::int8_gemm_impl
