// The float types' AVX-512 dot kernels (quant_impl.h): F32, F16 and BF16 rows against float32
// inputs, sixteen columns a register. The structure is the AVX2 kernels' (quant_legacy_avx2.cpp):
// chunks of 64 columns summed into a temporary and added into each input's accumulator, wide
// inputs taken in slices of about 8 KiB over four rows at a time, so that an input's sums are
// formed the same way whatever the group size and a row's result does not depend on its batch.
// The file is built for baseline x86-64; the functions carry target attributes and are called
// only where the AVX-512 probe (cpu_features.h) passed.
#include "engine/kernels/cpu/quant_impl.h"

#if defined(__x86_64__)

#include "engine/kernels/cpu/half_convert.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#define KVPIPE_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")))

namespace kvpipe::quant_impl {
namespace {

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

KVPIPE_AVX512 inline __m512 load_x(const uint8_t* p) { return _mm512_loadu_ps(reinterpret_cast<const float*>(p)); }

struct LoadF32 {
  static constexpr int64_t kBytes = 4;
  KVPIPE_AVX512 static __m512 load16(const uint8_t* p) { return load_x(p); }
  static float load1(const uint8_t* p) {
    float v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
};

struct LoadF16 {
  static constexpr int64_t kBytes = 2;
  KVPIPE_AVX512 static __m512 load16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static float load1(const uint8_t* p) { return fp16_to_fp32(load_u16(p)); }
};

struct LoadBF16 {
  static constexpr int64_t kBytes = 2;
  KVPIPE_AVX512 static __m512 load16(const uint8_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static float load1(const uint8_t* p) { return bf16_to_fp32(load_u16(p)); }
};

template <int M, typename Load>
KVPIPE_AVX512 inline void chunks(const uint8_t* row, const uint8_t* x, int64_t x_stride, __m512* acc, int64_t c_begin,
                                 int64_t c_end) {
  constexpr int64_t kB = Load::kBytes;
  for (int64_t c = c_begin; c < c_end; c += 64) {
    const __m512 w0 = Load::load16(row + c * kB);
    const __m512 w1 = Load::load16(row + (c + 16) * kB);
    const __m512 w2 = Load::load16(row + (c + 32) * kB);
    const __m512 w3 = Load::load16(row + (c + 48) * kB);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const uint8_t* xm = x + m * x_stride + c * 4;
      __m512 t = _mm512_mul_ps(w0, load_x(xm));
      t = _mm512_fmadd_ps(w1, load_x(xm + 64), t);
      t = _mm512_fmadd_ps(w2, load_x(xm + 128), t);
      t = _mm512_fmadd_ps(w3, load_x(xm + 192), t);
      acc[m] = _mm512_add_ps(acc[m], t);
    }
  }
}

template <int M, typename Load>
KVPIPE_AVX512 inline void finish(const uint8_t* row, const uint8_t* x, int64_t x_stride, __m512* acc, int64_t c,
                                 int64_t cols, float* y, int64_t ldy, int64_t r) {
  constexpr int64_t kB = Load::kBytes;
  for (; c + 16 <= cols; c += 16) {
    const __m512 w0 = Load::load16(row + c * kB);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(w0, load_x(x + m * x_stride + c * 4), acc[m]);
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    __m128 s = _mm_set_ss(_mm512_reduce_add_ps(acc[m]));
    const uint8_t* xm = x + m * x_stride;
    for (int64_t k = c; k < cols; ++k) {
      float xv;
      std::memcpy(&xv, xm + 4 * k, sizeof xv);
      s = _mm_fmadd_ss(_mm_set_ss(Load::load1(row + k * kB)), _mm_set_ss(xv), s);
    }
    y[m * ldy + r] = _mm_cvtss_f32(s);
  }
}

constexpr int64_t kSliceBytes = 8 << 10;
constexpr int64_t kRowTile = 4;

template <int M, typename Load>
KVPIPE_AVX512 void dot_float(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, float* y,
                             int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  const int64_t full = cols / 64 * 64;
  if (M * cols * 4 <= 2 * kSliceBytes) {
    // Two rows at a time, one from each half of the range, their chunks in turn: two streams
    // through memory keep more of the core's reads in flight than one. Each row's sums are
    // formed exactly as alone.
    const int64_t half = (row_end - row_begin) / 2;
    for (int64_t r = row_begin; r < row_begin + half; ++r) {
      const uint8_t* row_a = w + r * w_stride;
      const uint8_t* row_b = w + (r + half) * w_stride;
      __m512 acc_a[M], acc_b[M];
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) acc_a[m] = acc_b[m] = _mm512_setzero_ps();
      for (int64_t c = 0; c < full; c += 64) {
        chunks<M, Load>(row_a, x, x_stride, acc_a, c, c + 64);
        chunks<M, Load>(row_b, x, x_stride, acc_b, c, c + 64);
      }
      finish<M, Load>(row_a, x, x_stride, acc_a, full, cols, y, ldy, r);
      finish<M, Load>(row_b, x, x_stride, acc_b, full, cols, y, ldy, r + half);
    }
    for (int64_t r = row_begin + 2 * half; r < row_end; ++r) {
      const uint8_t* row = w + r * w_stride;
      __m512 acc[M];
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
      chunks<M, Load>(row, x, x_stride, acc, 0, full);
      finish<M, Load>(row, x, x_stride, acc, full, cols, y, ldy, r);
    }
    return;
  }
  const int64_t slice = std::max<int64_t>(64, kSliceBytes / (4 * M) / 64 * 64);
  for (int64_t r0 = row_begin; r0 < row_end; r0 += kRowTile) {
    const int64_t nr = std::min(kRowTile, row_end - r0);
    __m512 acc[kRowTile][M];
    for (int64_t i = 0; i < nr; ++i)
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) acc[i][m] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < full; c0 += slice) {
      const int64_t c1 = std::min(full, c0 + slice);
      for (int64_t i = 0; i < nr; ++i) {
        __m512 a[M];
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) a[m] = acc[i][m];
        chunks<M, Load>(w + (r0 + i) * w_stride, x, x_stride, a, c0, c1);
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) acc[i][m] = a[m];
      }
    }
    for (int64_t i = 0; i < nr; ++i)
      finish<M, Load>(w + (r0 + i) * w_stride, x, x_stride, acc[i], full, cols, y, ldy, r0 + i);
  }
}

template <typename Load>
void dispatch(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, int inputs, float* y,
              int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  static_assert(kMaxKernelInputs == 4, "one instantiation per input count");
  switch (inputs) {
    case 1: return dot_float<1, Load>(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
    case 2: return dot_float<2, Load>(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
    case 3: return dot_float<3, Load>(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
    case 4: return dot_float<4, Load>(w, w_stride, x, x_stride, y, ldy, row_begin, row_end, cols);
    default: break;
  }
  throw std::invalid_argument("float AVX-512 kernel: inputs must be 1.." + std::to_string(kMaxKernelInputs));
}

// Batches past kMaxKernelInputs, where the multiplies rather than the weights' stream bound
// the time: kRows rows' chunk widened once and held in registers against kMaxKernelInputs
// inputs at a time, each (row, input) sum formed as chunks() and finish() form it (so a row
// gets the same bits at any batch size), the next block's lines prefetched as this block's
// are consumed. Three rows by four inputs: 12 weight, 12 sum and 4 input registers of 32.
constexpr int kBlockRows = 3;

template <int R, int M, typename Load>
KVPIPE_AVX512 void block_rows(const uint8_t* rows, int64_t w_stride, const uint8_t* x, int64_t x_stride,
                              const uint8_t* next, int64_t cols, float* y, int64_t ldy, int64_t r0) {
  constexpr int64_t kB = Load::kBytes;
  const int64_t full = cols / 64 * 64;
  __m512 acc[R][M];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) acc[i][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < full; c += 64) {
    __m512 wv[R][4];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) wv[i][k] = Load::load16(rows + i * w_stride + (c + 16 * k) * kB);
    if (next != nullptr)
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
        for (int64_t line = 0; line < kB; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(next + i * w_stride + c * kB + 64 * line), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const uint8_t* xm = x + m * x_stride + c * 4;
      __m512 x0 = load_x(xm), x1 = load_x(xm + 64), x2 = load_x(xm + 128), x3 = load_x(xm + 192);
      // In registers for every row: left to itself, GCC folds the loads into each row's
      // multiplies, and the loads, not the multiplies, then bound the loop.
      __asm__("" : "+v"(x0), "+v"(x1), "+v"(x2), "+v"(x3));
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        __m512 t = _mm512_mul_ps(wv[i][0], x0);
        t = _mm512_fmadd_ps(wv[i][1], x1, t);
        t = _mm512_fmadd_ps(wv[i][2], x2, t);
        t = _mm512_fmadd_ps(wv[i][3], x3, t);
        acc[i][m] = _mm512_add_ps(acc[i][m], t);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) finish<M, Load>(rows + i * w_stride, x, x_stride, acc[i], full, cols, y, ldy, r0 + i);
}

template <int R, typename Load>
void block_inputs(const uint8_t* rows, int64_t w_stride, const uint8_t* x, int64_t x_stride, int64_t inputs,
                  const uint8_t* next, int64_t cols, float* y, int64_t ldy, int64_t r0) {
  static_assert(kMaxKernelInputs == 4, "one instantiation per remainder");
  int64_t g = 0;
  for (; g + 4 <= inputs; g += 4)
    block_rows<R, 4, Load>(rows, w_stride, x + g * x_stride, x_stride, next, cols, y + g * ldy, ldy, r0);
  switch (inputs - g) {
    case 3: return block_rows<R, 3, Load>(rows, w_stride, x + g * x_stride, x_stride, next, cols, y + g * ldy, ldy, r0);
    case 2: return block_rows<R, 2, Load>(rows, w_stride, x + g * x_stride, x_stride, next, cols, y + g * ldy, ldy, r0);
    case 1: return block_rows<R, 1, Load>(rows, w_stride, x + g * x_stride, x_stride, next, cols, y + g * ldy, ldy, r0);
    default: return;
  }
}

template <typename Load>
void batch(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, int64_t inputs, float* y,
           int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  int64_t r = row_begin;
  for (; r + kBlockRows <= row_end; r += kBlockRows) {
    const uint8_t* next = r + 2 * kBlockRows <= row_end ? w + (r + kBlockRows) * w_stride : nullptr;
    block_inputs<kBlockRows, Load>(w + r * w_stride, w_stride, x, x_stride, inputs, next, cols, y, ldy, r);
  }
  for (; r < row_end; ++r) block_inputs<1, Load>(w + r * w_stride, w_stride, x, x_stride, inputs, nullptr, cols, y, ldy, r);
}

}  // namespace

BatchKernel float_avx512_batch_kernel(QuantType type) {
  switch (type) {
    case QuantType::F32: return batch<LoadF32>;
    case QuantType::F16: return batch<LoadF16>;
    case QuantType::BF16: return batch<LoadBF16>;
    default: return nullptr;
  }
}

DotKernel float_avx512_kernel(QuantType type) {
  switch (type) {
    case QuantType::F32: return dispatch<LoadF32>;
    case QuantType::F16: return dispatch<LoadF16>;
    case QuantType::BF16: return dispatch<LoadBF16>;
    default: return nullptr;
  }
}

}  // namespace kvpipe::quant_impl

#else  // no x86 vector code in this build

namespace kvpipe::quant_impl {
DotKernel float_avx512_kernel(QuantType) { return nullptr; }
BatchKernel float_avx512_batch_kernel(QuantType) { return nullptr; }
}  // namespace kvpipe::quant_impl

#endif
