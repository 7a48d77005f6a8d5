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
// rounding); KVPIPE_CPU_BLAS=openblas|torch overrides it.
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

// The library cpu_linear and cpu_bmm use now: "openblas" or "torch".
std::string cpu_blas_name();

// Called with the rank's compute threads: keeps OpenBLAS's own pool out of the way (the
// threads are kvpipe's pool's, and the library choice does not depend on their number).
void set_cpu_blas_threads(int threads);

}  // namespace kvpipe
