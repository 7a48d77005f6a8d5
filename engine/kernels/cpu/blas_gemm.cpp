#include "engine/kernels/cpu/blas_gemm.h"

#include "engine/kernels/cpu/cpu_features.h"
#include "engine/kernels/cpu/thread_pool.h"

#include <ATen/ATen.h>
#include <cblas.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <strings.h>
#include <stdexcept>

extern "C" void openblas_set_num_threads(int);
extern "C" char* openblas_get_corename(void);
// LibTorch's MKL and OpenMP, weak so that a LibTorch without them still links. MKL's C entry
// point (mkl_service.h maps mkl_set_num_threads_local to it; the lowercase symbol is the
// Fortran one, which takes a pointer).
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
extern "C" void omp_set_num_threads(int) __attribute__((weak));

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

// OpenBLAS's core names for kernel sets without AVX2 (its fallbacks for processors it does
// not know): a BLAS that would run them loses to MKL by 5-8x.
bool openblas_core_lacks_avx2() {
  const std::string core = openblas_get_corename();
  for (const char* old : {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Sandybridge", "Atom",
                          "Barcelona", "Bobcat", "Bulldozer", "Piledriver", "Steamroller", "Unknown"})
    if (strcasecmp(core.c_str(), old) == 0) return true;
  return false;
}

bool use_openblas() {
  switch (blas_choice()) {
    case BlasChoice::kOpenBlas: return true;
    case BlasChoice::kTorch: return false;
    case BlasChoice::kByProcessor: break;
  }
  static const bool openblas = [] {
    if (cpu_is_intel()) return false;
    __builtin_cpu_init();
    return !(__builtin_cpu_supports("avx2") && openblas_core_lacks_avx2());
  }();
  return openblas;
}

constexpr int64_t kMinBmmRows = 32;
// Output columns below which splitting a product over threads costs more than it saves.
constexpr int64_t kMinColumnsPerThread = 128;

// A row-major float32 matrix whose rows are `ld` apart (the inner dimension contiguous).
bool row_major(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.is_cpu() && t.dim() == 2 && t.stride(1) == 1 &&
         t.stride(0) >= t.size(1);
}

}  // namespace

void sgemm_on_this_thread(bool trans_a, bool trans_b, int64_t n, int64_t m, int64_t k, const float* a, int64_t lda,
                          const float* b, int64_t ldb, bool accumulate, float* c, int64_t ldc) {
  if (n <= 0 || m <= 0) return;
  if (use_openblas()) {
    // The threads are the pool's: OpenBLAS's own would nest inside them.
    static std::once_flag single;
    std::call_once(single, [] { openblas_set_num_threads(1); });
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), 1.0f, a, static_cast<int>(lda), b,
                static_cast<int>(ldb), accumulate ? 1.0f : 0.0f, c, static_cast<int>(ldc));
    return;
  }
  // LibTorch's MKL through views of the caller's memory: at::mm hands MKL the leading
  // dimensions as they are. MKL's thread count is per calling thread here: at::set_num_threads
  // (job_runner keeps it at one) reaches only the thread that calls it, and a pool thread would
  // otherwise start an OpenMP team of OMP_NUM_THREADS (or of every core) inside each slice.
  thread_local const bool single = [] {
    if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(1);
    if (omp_set_num_threads != nullptr) omp_set_num_threads(1);
    return true;
  }();
  (void)single;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const auto view = [&](const float* p, int64_t rows, int64_t cols, int64_t ld, bool transposed) {
    float* data = const_cast<float*>(p);
    return transposed ? at::from_blob(data, {cols, rows}, {ld, 1}, f32).t() : at::from_blob(data, {rows, cols}, {ld, 1}, f32);
  };
  const at::Tensor av = view(a, n, k, lda, trans_a), bv = view(b, k, m, ldb, trans_b);
  at::Tensor cv = at::from_blob(c, {n, m}, {ldc, 1}, f32);
  if (k <= 0) {
    if (!accumulate) cv.zero_();
    return;
  }
  if (accumulate) cv.addmm_(av, bv);
  else at::mm_out(cv, av, bv);
}

std::string cpu_blas_name() { return use_openblas() ? "openblas" : "torch"; }

void set_cpu_blas_threads(int /*threads*/) {
  // The threads are kvpipe's pool's, whatever their number: OpenBLAS's own pool would compete
  // with it, so OpenBLAS runs single-threaded on each pool thread's slice.
  if (blas_choice() != BlasChoice::kTorch) openblas_set_num_threads(1);
}

at::Tensor cpu_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  const bool bias_ok = !bias.defined() || (bias.scalar_type() == at::kFloat && bias.is_cpu() &&
                                           bias.dim() == 1 && bias.size(0) == w.size(0));
  if (!row_major(x) || !row_major(w) || x.size(1) != w.size(1) || !bias_ok ||
      x.size(0) == 0 || w.size(0) == 0 || x.size(1) == 0)
    return bias.defined() ? at::addmm(bias, x, w.t()) : at::mm(x, w.t());
  const int64_t n = x.size(0), m = w.size(0), k = x.size(1);
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
  const int64_t ldx = x.stride(0), ldw = w.stride(0);
  // Each of the pool's threads computes a slice of the output columns (rows of w) with a
  // single-threaded library call, so that one pool of threads runs everything.
  parallel_rows(m, kMinColumnsPerThread, [&](int64_t begin, int64_t end) {
    sgemm_on_this_thread(false, true, n, end - begin, k, xp, ldx, wp + begin * ldw, ldw, beta != 0.0f, yp + begin, m);
  });
  return y;
}

at::Tensor cpu_bmm(const at::Tensor& a, const at::Tensor& c) {
  // Decode's products (a few query rows per KV head) are call overhead more than arithmetic:
  // LibTorch's batched kernel serves them in one call.
  if (a.dim() != 3 || c.dim() != 3 || a.size(1) < kMinBmmRows ||
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
      sgemm_on_this_thread(a_t, c_t, n, m, k, ap + i * sa, lda, cp + i * sc, ldc, false, yp + i * n * m, m);
  });
  return y;
}

}  // namespace kvpipe
