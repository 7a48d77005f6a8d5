// fused_ops' vector halves (fused_ops_x86.cpp, compiled with target attributes and called only
// where the processor runs them): SiLU-gated products over a row.
#pragma once

#include <cstdint>

namespace kvpipe::fused_impl {

// o[i] = g[i] / (1 + exp(-g[i])) * u[i] for i < n, exp from vector_exp.h (about 1 ulp), whose
// AVX2 and AVX-512 versions do the same operations: the two agree bit for bit.
void silu_mul_avx2(const float* g, const float* u, float* o, int64_t n);
void silu_mul_avx512(const float* g, const float* u, float* o, int64_t n);

}  // namespace kvpipe::fused_impl
