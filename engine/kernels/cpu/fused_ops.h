// fused_ops: a layer's row-wise float32 operations on the CPU, each one pass over memory.
//
// LibTorch runs RMSNorm as six kernels (square, mean, add, rsqrt, two products), RoPE as ten
// (two row gathers of the tables, narrows, a negation, a concatenation, products and a sum)
// and SwiGLU as two, each allocating its output; at decode's one row per sequence every one of
// them costs more in dispatch and allocation than in arithmetic, and on one thread. These do
// the same arithmetic in a single pass per row, split over the rank's thread pool by rows where
// there are enough of them. engine/layers.cpp calls them for float32 tensors on the CPU and
// keeps LibTorch's composition for everything else; the tests hold each to that composition
// and to a float64 recompute.
#pragma once

#include <cstdint>

namespace kvpipe {

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for rows r < rows of `dim` values (x and
// out rows ldx and ldo floats apart; out may be x).
void rms_norm_rows(const float* x, int64_t ldx, const float* weight, int64_t rows, int64_t dim, float eps, float* out,
                   int64_t ldo);

// The residual add and the next norm in one pass: sum[r] = x[r] + delta[r], then out[r] =
// rms_norm(sum[r]) as above, for rows r < rows of `dim` values (x, delta, sum and out rows ldx,
// ldd, dim and dim floats apart). The sum is rounded once per value as a separate add would be,
// so both outputs equal the unfused add followed by rms_norm_rows bit for bit.
void add_rms_norm_rows(const float* x, int64_t ldx, const float* delta, int64_t ldd, const float* weight, int64_t rows,
                       int64_t dim, float eps, float* sum, float* out);

// RoPE in the rotate-half layout on x [rows, heads, head_dim] (rows row_stride floats apart,
// heads head_stride apart, values contiguous): row r at positions[r] rotates its first
// `rotated` dimensions by tables cos/sin [*, rotated] (cos and sin of position p at p *
// rotated) and passes the rest through. out is contiguous [rows, heads, head_dim].
void rope_rows(const float* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride, int64_t head_stride,
               const int64_t* positions, const float* cos, const float* sin, int64_t rotated, float* out);
// The same rotation written back into x (its dimensions past `rotated` untouched), bit for bit
// rope_rows' values.
void rope_rows_in_place(float* x, int64_t rows, int64_t heads, int64_t row_stride, int64_t head_stride,
                        const int64_t* positions, const float* cos, const float* sin, int64_t rotated);

// out[r, i] = act(gate_up[r, i]) * gate_up[r, ff + i] for rows r < rows (gate_up rows ld floats
// apart, out contiguous [rows, ff]); act is SiLU, or with `gelu_tanh` GELU's tanh approximation.
void gated_activation_rows(const float* gate_up, int64_t rows, int64_t ff, int64_t ld, bool gelu_tanh, float* out);

}  // namespace kvpipe
