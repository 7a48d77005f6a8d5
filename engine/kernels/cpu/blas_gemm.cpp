#include "engine/kernels/cpu/blas_gemm.h"

#include <ATen/ATen.h>
#include <cblas.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>

extern "C" void openblas_set_num_threads(int);

namespace kvpipe {
namespace {

bool use_openblas() {
  static const bool use = [] {
    const char* forced = std::getenv("KVPIPE_CPU_BLAS");
    if (forced && *forced) {
      if (std::strcmp(forced, "openblas") == 0) return true;
      if (std::strcmp(forced, "torch") == 0) return false;
      throw std::invalid_argument(std::string("KVPIPE_CPU_BLAS: '") + forced +
                                  "' is not openblas or torch");
    }
    __builtin_cpu_init();
    return !__builtin_cpu_is("intel");
  }();
  return use;
}

constexpr int64_t kMinBmmRowsForOpenBlas = 32;

// A row-major float32 matrix whose rows are `ld` apart (the inner dimension contiguous).
bool row_major(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.is_cpu() && t.dim() == 2 && t.stride(1) == 1 &&
         t.stride(0) >= t.size(1);
}

}  // namespace

const std::string& cpu_blas_name() {
  static const std::string name = use_openblas() ? "openblas" : "torch";
  return name;
}

void set_cpu_blas_threads(int threads) {
  if (use_openblas()) openblas_set_num_threads(threads);
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
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, k, 1.0f, x.data_ptr<float>(),
              static_cast<int>(x.stride(0)), w.data_ptr<float>(), static_cast<int>(w.stride(0)), beta,
              y.data_ptr<float>(), m);
  return y;
}

at::Tensor cpu_bmm(const at::Tensor& a, const at::Tensor& c) {
  // Decode's products (a few query rows per KV head) are call overhead more than arithmetic:
  // LibTorch's batched kernel serves them in one call.
  if (!use_openblas() || a.dim() != 3 || a.size(1) < kMinBmmRowsForOpenBlas || a.scalar_type() != at::kFloat || c.scalar_type() != at::kFloat || !a.is_cpu() ||
      !c.is_cpu() || a.dim() != 3 || c.dim() != 3 || a.size(0) != c.size(0) || a.size(2) != c.size(1))
    return at::bmm(a, c);
  const int64_t batch = a.size(0), n = a.size(1), k = a.size(2), m = c.size(2);
  at::Tensor y = at::empty({batch, n, m}, a.options());
  if (batch == 0 || n == 0 || m == 0) return y;
  if (k == 0) return y.zero_();
  for (int64_t b = 0; b < batch; ++b) {
    const at::Tensor ab = a[b], cb = c[b];
    // Either operand may be transposed in memory (K^T is a view of K): tell BLAS so.
    const bool a_rows = ab.stride(1) == 1, c_rows = cb.stride(1) == 1;
    const at::Tensor ac = a_rows || ab.stride(0) == 1 ? ab : ab.contiguous();
    const at::Tensor cc = c_rows || cb.stride(0) == 1 ? cb : cb.contiguous();
    const bool at_ = ac.stride(1) != 1, ct = cc.stride(1) != 1;
    const int lda = static_cast<int>(at_ ? ac.stride(1) : ac.stride(0));
    const int ldc = static_cast<int>(ct ? cc.stride(1) : cc.stride(0));
    if (lda < (at_ ? n : k) || ldc < (ct ? k : m) || lda < 1 || ldc < 1)
      return at::bmm(a, c);  // a layout BLAS cannot express: let LibTorch copy as it likes
    cblas_sgemm(CblasRowMajor, at_ ? CblasTrans : CblasNoTrans, ct ? CblasTrans : CblasNoTrans,
                static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), 1.0f, ac.data_ptr<float>(), lda,
                cc.data_ptr<float>(), ldc, 0.0f, y[b].data_ptr<float>(), static_cast<int>(m));
  }
  return y;
}

}  // namespace kvpipe
