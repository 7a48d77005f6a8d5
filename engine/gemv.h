// gemv: y = W x for float32 on the CPU, the kernel of batch-1 decode.
//
// Batch-1 decode reads every weight once per token, so its speed is the speed at which a
// matrix-vector product streams W from memory. BLAS gemm on one row reaches about a third
// of the read bandwidth; OpenBLAS gemv (at::mv) about 80%; this kernel streams one row at a
// time with AVX2 FMA lanes and gets closer to the probe's bandwidth. It is chosen at run
// time on processors with AVX2 and FMA; elsewhere, and for other dtypes, at::mv is used.
// Rows are split over the intra-op threads.
#pragma once

#include <ATen/Tensor.h>

namespace kvpipe {

// w [rows, cols] and x [cols], contiguous; returns [rows] (+ bias when defined).
at::Tensor gemv(const at::Tensor& w, const at::Tensor& x, const at::Tensor& bias = {});

// Inputs that gemv_rows streams the weights once for; more go in groups of this many.
constexpr int64_t kGemvMaxRows = 4;
// Up to this many inputs gemv_rows beats BLAS gemm (two passes over the weights still read
// them faster than gemm does on so few rows).
constexpr int64_t kGemvRowsLimit = 8;

// w [rows, cols] and x [n, cols]; returns [n, rows] = x W^T (+ bias), reading W once per
// kGemvMaxRows inputs: small-batch decode, which BLAS gemm serves at a fraction of the
// read bandwidth. Falls back to at::mm where gemv would fall back to at::mv.
at::Tensor gemv_rows(const at::Tensor& w, const at::Tensor& x, const at::Tensor& bias = {});

// Whether gemv uses its own vector kernel on this processor.
bool gemv_has_fast_kernel();

}  // namespace kvpipe
