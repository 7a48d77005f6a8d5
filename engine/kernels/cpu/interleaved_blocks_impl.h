// interleaved_blocks' halves (interleaved_blocks.h): the activations of a call as every kernel
// reads them, and the group kernels, portable (interleaved_blocks.cpp) and x86
// (interleaved_blocks_x86.cpp, compiled with target attributes and called only where the
// processor runs them).
#pragma once

#include <cstdint>

namespace kvpipe::interleaved_impl {

constexpr int64_t kGroupRows = 8;
constexpr int64_t kQ4_0GroupBlockBytes = 8 * 18;  // 8 fp16 scales, then 8 rows' 16 nibble bytes
constexpr int64_t kQ8_0GroupBlockBytes = 8 * 34;  // 8 fp16 scales, then 8 rows' 32 signed bytes
constexpr int64_t kQ8_0ActivationBytes = 34;      // fp16 d_x, then 32 signed bytes
constexpr int64_t kQ4KGroupBlockBytes = 8 * 148;  // d, dmin, sc, mn, then 8 rows' 128 nibble bytes
constexpr int64_t kQ4KScales = 32, kQ4KMins = 96, kQ4KQs = 160;  // offsets in a group super-block
constexpr int64_t kQ8KActivationBytes = 292;      // float d_x, 256 signed bytes, 16 int16 sums
constexpr int64_t kQ6KGroupBlockBytes = 8 * 210;  // d, scales, then 16 sub-blocks of 96 bytes
constexpr int64_t kQ6KScales = 16, kQ6KQs = 144;  // offsets in a group super-block
constexpr int64_t kQ6KSubBlockBytes = 96;         // 8 rows' 16 values: 32 low-nibble pairs, 32, 32 high bits

// n activation rows of Q8_0 blocks: block b of input j has its 32 values at
// x + j * x_stride + b * 34 + 2, its scale at da[j * blocks + b] and its value sum times the
// weights' unsigned offset (8 for Q4_0's nibbles, 128 for Q8_0's bytes as VNNI reads them),
// taken out of the integer sum, at offset[j * blocks + b].
struct Activations {
  const uint8_t* x = nullptr;
  int64_t x_stride = 0;
  const float* da = nullptr;
  const int32_t* offset = nullptr;
  int64_t blocks = 0;
};

// n activation rows of Q8_K super-blocks: block b of input j has its 256 values at
// x + j * x_stride + b * 292 + 4, its scale at da[j * blocks + b], and its sub-blocks' value
// sums in pairs, sub-blocks 2p and 2p + 1 as the low and high int16 of
// sum_pairs[(j * blocks + b) * pairs + p]: for Q4_K 4 pairs of 32-value sub-blocks, for Q6_K
// 8 pairs of 16-value ones.
struct SuperActivations {
  const uint8_t* x = nullptr;
  int64_t x_stride = 0;
  const float* da = nullptr;
  const int32_t* sum_pairs = nullptr;
  int64_t blocks = 0;
};

// Groups [g_begin, g_end) of an interleaved Q4_0 matrix at w times inputs [0, n):
// y[j * ldy + 8 g + i].
void q4_0_portable(const uint8_t* w, int64_t g_begin, int64_t g_end, const Activations& a, int64_t n, float* y,
                   int64_t ldy);
void q4_0_avx2(const uint8_t* w, int64_t g_begin, int64_t g_end, const Activations& a, int64_t n, float* y,
               int64_t ldy);
void q4_0_avx512vnni(const uint8_t* w, int64_t g_begin, int64_t g_end, const Activations& a, int64_t n, float* y,
                     int64_t ldy);

// The same for Q8_0.
void q8_0_portable(const uint8_t* w, int64_t g_begin, int64_t g_end, const Activations& a, int64_t n, float* y,
                   int64_t ldy);
void q8_0_avx2(const uint8_t* w, int64_t g_begin, int64_t g_end, const Activations& a, int64_t n, float* y,
               int64_t ldy);
void q8_0_avx512vnni(const uint8_t* w, int64_t g_begin, int64_t g_end, const Activations& a, int64_t n, float* y,
                     int64_t ldy);

// The same for Q4_K.
void q4_k_portable(const uint8_t* w, int64_t g_begin, int64_t g_end, const SuperActivations& a, int64_t n, float* y,
                   int64_t ldy);
void q4_k_avx2(const uint8_t* w, int64_t g_begin, int64_t g_end, const SuperActivations& a, int64_t n, float* y,
               int64_t ldy);
void q4_k_avx512vnni(const uint8_t* w, int64_t g_begin, int64_t g_end, const SuperActivations& a, int64_t n,
                     float* y, int64_t ldy);

// The same for Q6_K.
void q6_k_portable(const uint8_t* w, int64_t g_begin, int64_t g_end, const SuperActivations& a, int64_t n, float* y,
                   int64_t ldy);
void q6_k_avx2(const uint8_t* w, int64_t g_begin, int64_t g_end, const SuperActivations& a, int64_t n, float* y,
               int64_t ldy);
void q6_k_avx512vnni(const uint8_t* w, int64_t g_begin, int64_t g_end, const SuperActivations& a, int64_t n,
                     float* y, int64_t ldy);

}  // namespace kvpipe::interleaved_impl
