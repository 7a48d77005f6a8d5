#include "engine/gemv.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

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

}  // namespace kvpipe
