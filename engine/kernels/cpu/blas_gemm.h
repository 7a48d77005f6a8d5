// blas_gemm: float32 matrix products of many rows (prefill and large-batch projections,
// attention's score and value products) on the CPU, through the BLAS that is fastest on this
// processor.
//
// LibTorch's PyPI wheels send float32 GEMM to Intel MKL, which on AMD processors runs 20-40%
// below OpenBLAS on one thread for the shapes of a transformer's prefill (measured: 45-65 vs
// 70-80 GFLOP/s on one AMD EPYC (Zen 3) core for 512 x 1024 x 1024..8192). So these products
// go to OpenBLAS (Debian's pthread build, called single-threaded on each thread of kvpipe's
// pool, engine/kernels/cpu/thread_pool.h, for its slice of the output) on processors that are
// not Intel's, and to LibTorch (MKL) otherwise. The choice depends only on the processor's
// vendor, so every rank of a job on one machine computes with the same library (the same
// rounding); KVPIPE_CPU_BLAS=openblas|torch overrides it. OpenBLAS is also passed over where
// its own processor detection fell back to a kernel set without AVX2 (0.3.21 knows no processor
// newer than Cooper Lake and runs its SSE3 "Prescott" sgemm there, at 17 GFLOP/s against MKL's
// 110-147 on one Sapphire Rapids core).
//
// Every product is split over kvpipe's pool (one slice of output columns per thread, each a
// single-threaded call of the chosen library), so prefill uses every compute thread whichever
// library runs.
#pragma once

#include <ATen/Tensor.h>

#include <string>

namespace kvpipe {

// x [n, k] and w [m, k] float32 on the CPU; returns [n, m] = x w^T (+ bias [m] when defined).
// Other dtypes, devices or layouts go to LibTorch.
at::Tensor cpu_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias = {});

// a [b, n, k] and c [b, k, m] (any strides LibTorch's bmm accepts); returns [b, n, m] = a c.
// Products of fewer than 32 rows (decode's) stay with LibTorch.
at::Tensor cpu_bmm(const at::Tensor& a, const at::Tensor& c);

// C[n, m] = op(A)[n, k] op(B)[k, m] (+ C when `accumulate`), row-major with leading dimensions
// lda, ldb, ldc; op(A) = A [n, k], or A^T of A stored [k, n] when `trans_a` (likewise B: [k, m],
// or stored [m, k] when `trans_b`). On the calling thread alone, with the library cpu_blas_name
// says: the building block of every float32 product here, quant_matmul's BLAS path included.
void sgemm_on_this_thread(bool trans_a, bool trans_b, int64_t n, int64_t m, int64_t k, const float* a, int64_t lda,
                          const float* b, int64_t ldb, bool accumulate, float* c, int64_t ldc);

// The library cpu_linear, cpu_bmm and sgemm_on_this_thread use now: "openblas" or "torch".
std::string cpu_blas_name();

// Called with the rank's compute threads: keeps OpenBLAS's own pool out of the way (the
// threads are kvpipe's pool's, and the library choice does not depend on their number).
void set_cpu_blas_threads(int threads);

}  // namespace kvpipe
