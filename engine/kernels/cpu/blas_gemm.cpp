#include "engine/kernels/cpu/blas_gemm.h"

#include "engine/kernels/cpu/thread_pool.h"

#include <ATen/ATen.h>
#include <cblas.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

extern "C" void openblas_set_num_threads(int);

namespace kvpipe {
namespace {

enum class BlasChoice { kByProcessor, kOpenBlas, kTorch };

BlasChoice blas_choice() {
  static const BlasChoice choice = [] {
    const char* forced = std::getenv("KVPIPE_CPU_BLAS");
    if (!forced || !*forced) return BlasChoice::kByProcessor;
    if (std::strcmp(forced, "openblas") == 0) return BlasChoice::kOpenBlas;
    if (std::strcmp(forced, "torch") == 0) return BlasChoice::kTorch;
    throw std::invalid_argument(std::string("KVPIPE_CPU_BLAS: '") + forced + "' is not openblas or torch");
  }();
  return choice;
}

bool use_openblas() {
  switch (blas_choice()) {
    case BlasChoice::kOpenBlas: return true;
    case BlasChoice::kTorch: return false;
    case BlasChoice::kByProcessor: break;
  }
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return !intel;
}

constexpr int64_t kMinBmmRowsForOpenBlas = 32;
// Output columns below which splitting a product over threads costs more than it saves.
constexpr int64_t kMinColumnsPerThread = 128;

// A row-major float32 matrix whose rows are `ld` apart (the inner dimension contiguous).
bool row_major(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.is_cpu() && t.dim() == 2 && t.stride(1) == 1 &&
         t.stride(0) >= t.size(1);
}

}  // namespace

std::string cpu_blas_name() { return use_openblas() ? "openblas" : "torch"; }

void set_cpu_blas_threads(int /*threads*/) {
  // The threads are kvpipe's pool's, whatever their number: OpenBLAS's own pool would compete
  // with it, so OpenBLAS runs single-threaded on each pool thread's slice.
  if (blas_choice() != BlasChoice::kTorch) openblas_set_num_threads(1);
}

at::Tensor cpu_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  const bool bias_ok = !bias.defined() || (bias.scalar_type() == at::kFloat && bias.is_cpu() &&
                                           bias.dim() == 1 && bias.size(0) == w.size(0));
  if (!use_openblas() || !row_major(x) || !row_major(w) || x.size(1) != w.size(1) || !bias_ok ||
      x.size(0) == 0 || w.size(0) == 0 || x.size(1) == 0)
    return bias.defined() ? at::addmm(bias, x, w.t()) : at::mm(x, w.t());
  const int n = static_cast<int>(x.size(0)), m = static_cast<int>(w.size(0)), k = static_cast<int>(x.size(1));
  at::Tensor y;
  float beta = 0.0f;
  if (bias.defined()) {
    y = bias.contiguous().unsqueeze(0).expand({n, m}).contiguous();
    beta = 1.0f;
  } else {
    y = at::empty({n, m}, x.options());
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int ldx = static_cast<int>(x.stride(0)), ldw = static_cast<int>(w.stride(0));
  // Each of LibTorch's intra-op threads computes a slice of the output columns (rows of w)
  // with a single-threaded OpenBLAS call, so that one pool of threads runs everything.
  parallel_rows(m, kMinColumnsPerThread, [&](int64_t begin, int64_t end) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, static_cast<int>(end - begin), k, 1.0f, xp, ldx,
                wp + begin * ldw, ldw, beta, yp + begin, m);
  });
  return y;
}

at::Tensor cpu_bmm(const at::Tensor& a, const at::Tensor& c) {
  // Decode's products (a few query rows per KV head) are call overhead more than arithmetic:
  // LibTorch's batched kernel serves them in one call.
  if (!use_openblas() || a.dim() != 3 || c.dim() != 3 || a.size(1) < kMinBmmRowsForOpenBlas ||
      a.scalar_type() != at::kFloat || c.scalar_type() != at::kFloat || !a.is_cpu() || !c.is_cpu() ||
      a.size(0) != c.size(0) || a.size(2) != c.size(1))
    return at::bmm(a, c);
  const int64_t batch = a.size(0), n = a.size(1), k = a.size(2), m = c.size(2);
  at::Tensor y = at::empty({batch, n, m}, a.options());
  if (batch == 0 || n == 0 || m == 0) return y;
  if (k == 0) return y.zero_();
  // Each matrix is either row-major or transposed in memory (K^T is a view of K): tell BLAS
  // which, and copy only a layout that is neither. Every batch entry shares the layout.
  const auto layout = [](const at::Tensor& t, at::Tensor& use, bool& transposed) {
    use = t;
    transposed = false;
    if (t.stride(2) == 1) return t.stride(1);
    if (t.stride(1) == 1) return transposed = true, t.stride(2);
    use = t.contiguous();
    return use.stride(1);
  };
  at::Tensor ac, cc;
  bool a_t = false, c_t = false;
  const int64_t lda = layout(a, ac, a_t), ldc = layout(c, cc, c_t);
  if (lda < std::max<int64_t>(1, a_t ? n : k) || ldc < std::max<int64_t>(1, c_t ? k : m))
    return at::bmm(a, c);  // overlapping rows: a layout BLAS cannot express
  const float* ap = ac.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t sa = ac.stride(0), sc = cc.stride(0);
  parallel_rows(batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      cblas_sgemm(CblasRowMajor, a_t ? CblasTrans : CblasNoTrans, c_t ? CblasTrans : CblasNoTrans,
                  static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), 1.0f, ap + i * sa,
                  static_cast<int>(lda), cp + i * sc, static_cast<int>(ldc), 0.0f, yp + i * n * m,
                  static_cast<int>(m));
  });
  return y;
}

}  // namespace kvpipe
