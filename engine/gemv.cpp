#include "engine/gemv.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvpipe {
namespace {

#if defined(__x86_64__)
// Four independent accumulators hide the FMA latency; one row at a time keeps a single
// sequential stream per thread, which the hardware prefetcher follows best.
__attribute__((target("avx2,fma"))) void gemv_rows_avx2(const float* w, const float* x, float* y,
                                                        int64_t begin, int64_t end, int64_t cols) {
  for (int64_t r = begin; r < end; ++r) {
    const float* wr = w + r * cols;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + c), _mm256_loadu_ps(x + c), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + c + 8), _mm256_loadu_ps(x + c + 8), a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + c + 16), _mm256_loadu_ps(x + c + 16), a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + c + 24), _mm256_loadu_ps(x + c + 24), a3);
    }
    for (; c + 8 <= cols; c += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + c), _mm256_loadu_ps(x + c), a0);
    const __m256 sum8 = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(sum8), _mm256_extractf128_ps(sum8, 1));
    sum4 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
    sum4 = _mm_add_ss(sum4, _mm_shuffle_ps(sum4, sum4, 1));
    float s = _mm_cvtss_f32(sum4);
    for (; c < cols; ++c) s += wr[c] * x[c];
    y[r] = s;
  }
}

// y[m] = W x[m] for a few inputs m at once: each weight row is read once for all of them,
// so a decode step of a small batch costs about what one of batch 1 does. Measured on a
// 2-core EPYC (5632 x 1024 weights, one thread): up to 4 inputs take about as long as one
// (0.9 ms, 3x faster than gemm); from 5 on, the loads of the inputs (one per FMA) become the
// limit, hence groups of kGemvMaxRows. Tiles of several weight rows were slower: one
// sequential stream per thread is what the prefetcher follows best.
template <int M>
__attribute__((target("avx2,fma"))) void gemm_rows_avx2(const float* w, const float* x, int64_t ldx, float* y,
                                                        int64_t ldy, int64_t begin, int64_t end, int64_t cols) {
  for (int64_t r = begin; r < end; ++r) {
    const float* wr = w + r * cols;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
      const __m256 wv = _mm256_loadu_ps(wr + c);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + c), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
      sum4 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
      sum4 = _mm_add_ss(sum4, _mm_shuffle_ps(sum4, sum4, 1));
      float s = _mm_cvtss_f32(sum4);
      for (int64_t k = c; k < cols; ++k) s += wr[k] * x[m * ldx + k];
      y[m * ldy + r] = s;
    }
  }
}

using GemmRowsKernel = void (*)(const float*, const float*, int64_t, float*, int64_t, int64_t, int64_t, int64_t);

// A group of one input takes gemv's kernel, so a row gets the same sums in a batch of 5 as
// alone.
void gemv_rows_one(const float* w, const float* x, int64_t, float* y, int64_t, int64_t begin, int64_t end,
                   int64_t cols) {
  gemv_rows_avx2(w, x, y, begin, end, cols);
}

GemmRowsKernel gemm_rows_kernel(int64_t m) {
  static_assert(kGemvMaxRows == 4, "one kernel per group size");
  switch (m) {
    case 1: return gemv_rows_one;
    case 2: return gemm_rows_avx2<2>;
    case 3: return gemm_rows_avx2<3>;
    default: return gemm_rows_avx2<4>;
  }
}

bool detect_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
bool detect_avx2() { return false; }
#endif

const bool kHasAvx2 = detect_avx2();

}  // namespace

bool gemv_has_fast_kernel() { return kHasAvx2; }

at::Tensor gemv(const at::Tensor& w, const at::Tensor& x, const at::Tensor& bias) {
  at::Tensor y;
#if defined(__x86_64__)
  if (kHasAvx2 && w.is_cpu() && w.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
      w.is_contiguous()) {
    const at::Tensor xc = x.contiguous();
    const int64_t rows = w.size(0), cols = w.size(1);
    y = at::empty({rows}, w.options());
    const float* wp = w.data_ptr<float>();
    const float* xp = xc.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    // Grain of 64 rows: enough work per task to amortise the hand-off between threads.
    at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) { gemv_rows_avx2(wp, xp, yp, b, e, cols); });
  }
#endif
  if (!y.defined()) y = at::mv(w, x);
  if (bias.defined()) y.add_(bias);
  return y;
}

at::Tensor gemv_rows(const at::Tensor& w, const at::Tensor& x, const at::Tensor& bias) {
  at::Tensor y;
#if defined(__x86_64__)
  if (kHasAvx2 && w.is_cpu() && w.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
      w.is_contiguous() && x.size(0) >= 1) {
    const at::Tensor xc = x.contiguous();
    const int64_t n = xc.size(0), rows = w.size(0), cols = w.size(1);
    y = at::empty({n, rows}, w.options());
    const float* wp = w.data_ptr<float>();
    const float* xp = xc.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    // Groups of up to kGemvMaxRows inputs, each streaming W once.
    for (int64_t g = 0; g < n; g += kGemvMaxRows) {
      const int64_t m = std::min<int64_t>(kGemvMaxRows, n - g);
      const GemmRowsKernel kernel = gemm_rows_kernel(m);
      at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
        kernel(wp, xp + g * cols, cols, yp + g * rows, rows, b, e, cols);
      });
    }
  }
#endif
  if (!y.defined()) y = at::mm(x, w.t());
  if (bias.defined()) y.add_(bias);
  return y;
}

}  // namespace kvpipe
