#include "engine/kernels/cpu/fused_ops.h"

#include "engine/kernels/cpu/fused_ops_impl.h"
#include "engine/kernels/cpu/quant_impl.h"
#include "engine/kernels/cpu/thread_pool.h"

#include <cmath>
#include <cstring>
#include <functional>

namespace kvpipe {
namespace {

// Values below which a call stays on the calling thread: waking the pool costs more.
constexpr int64_t kMinValuesPerThread = 16 << 10;

void for_rows(int64_t rows, int64_t values_per_row, const std::function<void(int64_t, int64_t)>& fn) {
  if (rows * values_per_row < 2 * kMinValuesPerThread || rows < 2) return fn(0, rows);
  parallel_rows(rows, 1, fn);
}

float sum_of_squares(const float* x, int64_t n) {
  // Eight partial sums, so that the loop vectorises without reassociation by the compiler.
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += x[i + j] * x[i + j];
  float total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

}  // namespace

void rms_norm_rows(const float* x, int64_t ldx, const float* weight, int64_t rows, int64_t dim, float eps, float* out,
                   int64_t ldo) {
  for_rows(rows, dim, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * ldx;
      float* o = out + r * ldo;
      // As transformers does: the mean of squares in float32, its reciprocal square root,
      // then x times it times the weight.
      const float inv = 1.0f / std::sqrt(sum_of_squares(xr, dim) / static_cast<float>(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) o[i] = xr[i] * inv * weight[i];
    }
  });
}

void add_rms_norm_rows(const float* x, int64_t ldx, const float* delta, int64_t ldd, const float* weight, int64_t rows,
                       int64_t dim, float eps, float* sum, float* out) {
  for_rows(rows, dim, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * ldx;
      const float* dr = delta + r * ldd;
      float* sr = sum + r * dim;
      for (int64_t i = 0; i < dim; ++i) sr[i] = xr[i] + dr[i];
      // The row is still in cache: its norm costs no second trip to memory.
      const float inv = 1.0f / std::sqrt(sum_of_squares(sr, dim) / static_cast<float>(dim) + eps);
      float* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] = sr[i] * inv * weight[i];
    }
  });
}

namespace {

// Rotates each head of x's rows into out_of(r, h), which may be the head itself (each pair is
// read before either half is written); a head written elsewhere gets the dimensions past
// `rotated` copied.
template <class Out>
void rotate_rows(const float* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride, int64_t head_stride,
                 const int64_t* positions, const float* cos, const float* sin, int64_t rotated, Out out_of) {
  const int64_t half = rotated / 2;
  for_rows(rows, heads * head_dim, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos + positions[r] * rotated;
      const float* s = sin + positions[r] * rotated;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xh = x + r * row_stride + h * head_stride;
        float* o = out_of(r, h);
        for (int64_t i = 0; i < half; ++i) {
          const float a = xh[i], b = xh[i + half];
          o[i] = a * c[i] - b * s[i];
          o[i + half] = b * c[i + half] + a * s[i + half];
        }
        if (o != xh && rotated < head_dim) std::memcpy(o + rotated, xh + rotated, (head_dim - rotated) * sizeof(float));
      }
    }
  });
}

}  // namespace

void rope_rows(const float* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride, int64_t head_stride,
               const int64_t* positions, const float* cos, const float* sin, int64_t rotated, float* out) {
  rotate_rows(x, rows, heads, head_dim, row_stride, head_stride, positions, cos, sin, rotated,
              [&](int64_t r, int64_t h) { return out + (r * heads + h) * head_dim; });
}

void rope_rows_in_place(float* x, int64_t rows, int64_t heads, int64_t row_stride, int64_t head_stride,
                        const int64_t* positions, const float* cos, const float* sin, int64_t rotated) {
  rotate_rows(x, rows, heads, rotated, row_stride, head_stride, positions, cos, sin, rotated,
              [&](int64_t r, int64_t h) { return x + r * row_stride + h * head_stride; });
}

void gated_activation_rows(const float* gate_up, int64_t rows, int64_t ff, int64_t ld, bool gelu_tanh, float* out) {
  // SiLU in vectors where the processor has them: the scalar expf took about 2.4 ns a value,
  // 4% of a prompt's time.
  void (*silu)(const float*, const float*, float*, int64_t) = nullptr;
#if defined(__x86_64__)
  if (quant_impl::use_avx512()) silu = fused_impl::silu_mul_avx512;
  else if (quant_impl::use_avx2()) silu = fused_impl::silu_mul_avx2;
#endif
  for_rows(rows, ff, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate_up + r * ld;
      const float* u = g + ff;
      float* o = out + r * ff;
      if (gelu_tanh) {
        // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as at::gelu(x, "tanh").
        constexpr float kAlpha = 0.7978845608028654f, kBeta = 0.044715f;
        for (int64_t i = 0; i < ff; ++i) {
          const float x = g[i];
          o[i] = 0.5f * x * (1.0f + std::tanh(kAlpha * (x + kBeta * x * x * x))) * u[i];
        }
      } else if (silu) {
        silu(g, u, o, ff);
      } else {
        for (int64_t i = 0; i < ff; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
      }
    }
  });
}

}  // namespace kvpipe
