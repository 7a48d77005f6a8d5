// Weight storage types and the CPU dot-product kernels that read them as stored.
//
// A weight matrix keeps the bytes of its file: float32, float16 and bfloat16 rows, or ggml's
// block formats, laid out bit for bit as ggml's block_* structs: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
// and IQ4_NL blocks of 32 values; Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS super-blocks of 256.
// These are every type llama-quantize's standard mixes write (Q2_K ... Q8_0, IQ4_NL, IQ4_XS),
// including the 32-value types it falls back to for rows that are not a multiple of 256
// values (hidden 576: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0,
// IQ4_XS -> IQ4_NL). The other IQ types and the ternary TQ types have no kernels and are
// refused by name where a file is read. A row of `cols` values is row_bytes(type, cols)
// bytes and rows follow each other, so a matrix is one uint8 buffer [rows, row_bytes].
//
// Decode reads every weight once per token, so these kernels dequantise in registers and never
// write a float copy of a weight. As in llama.cpp, the activations of the quantised types are
// themselves quantised once per call to the 8-bit block format the type's integer dot product
// wants (`activation_type`): Q8_0 for Q8_0, Q4_0, Q5_0 and IQ4_NL, Q8_1 (Q8_0 plus the block
// sum) for Q4_1 and Q5_1, Q8_K for the 256-value types; float weights take float32 activations. The kernel set is chosen once
// at run time by what the processor has (AVX2 + FMA, else a portable C++ version that is
// correct everywhere); every kernel computes the same sums as `dequantize_row` followed by a
// float64 dot product with the dequantised activations, up to float32 rounding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace kvpipe {

enum class QuantType : uint8_t {
  F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, IQ4_XS
};

// Activation formats (never weights here): 8-bit blocks the integer dot products consume.
enum class ActivationType : uint8_t { F32, Q8_0, Q8_1, Q8_K };

struct QuantTraits {
  const char* name;        // ggml's name: "Q4_K"
  uint32_t ggml_type;      // ggml's type id
  int64_t block_values;    // values per block (1 for the float types)
  int64_t block_bytes;     // bytes per block
  ActivationType activation;
};

const QuantTraits& quant_traits(QuantType type);
inline const char* quant_name(QuantType type) { return quant_traits(type).name; }
// The type with ggml id `ggml_type`, or nothing when kvpipe cannot compute with it.
std::optional<QuantType> quant_type_from_ggml(uint32_t ggml_type);
// Whether rows of `cols` values fit whole blocks of the type.
bool quant_row_fits(QuantType type, int64_t cols);
// Bytes of one row of `cols` values (cols a multiple of the block size).
int64_t quant_row_bytes(QuantType type, int64_t cols);

// Bytes of one activation row of `cols` values in `type` (F32: 4 * cols).
int64_t activation_row_bytes(ActivationType type, int64_t cols);
// x[0, cols) -> one activation row in `type`, rounded as ggml's quantize_row_q8_* does.
void quantize_activation_row(ActivationType type, const float* x, void* dst, int64_t cols);
// The values an activation row stands for (what the kernels multiply by), into dst[0, cols).
void dequantize_activation_row(ActivationType type, const void* src, float* dst, int64_t cols);

// One stored row -> float32 values, exactly (every stored type is a float16/float32 scale
// times small integers, so float32 holds each value without rounding).
void dequantize_row(QuantType type, const void* src, float* dst, int64_t cols);

// Inputs a kernel call serves while streaming each weight row once.
constexpr int kMaxKernelInputs = 4;

// y[j * ldy + r] = sum_c W[r, c] * X[j, c] for r in [row_begin, row_end), j in [0, inputs):
// W rows of `type` at w + r * w_stride, activation rows (activation_type of `type`) at
// x + j * x_stride, 1 <= inputs <= kMaxKernelInputs. Single-threaded: callers split rows.
using DotKernel = void (*)(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, int inputs,
                           float* y, int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols);

// The fastest kernel for `type` on this processor.
DotKernel dot_kernel(QuantType type);

// The same product over any number of inputs, for batches past kMaxKernelInputs, where the
// multiplies rather than the weights' stream bound the time: for the float types a block of rows
// held in registers across the inputs, for Q4_K and Q5_K (VNNI) each row's unpacked blocks
// shared by 8 inputs. Each result is dot_kernel(type)'s, bit for bit. nullptr where this
// processor's kernel set has none for `type` (callers then run dot_kernel over groups of
// kMaxKernelInputs).
using BatchKernel = void (*)(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride,
                             int64_t inputs, float* y, int64_t ldy, int64_t row_begin, int64_t row_end,
                             int64_t cols);
BatchKernel batch_kernel(QuantType type);

// The portable kernel for `type` (the reference the vector kernels are tested against).
DotKernel portable_dot_kernel(QuantType type);
// "avx2" or "portable": the kernel set dot_kernel chose for the block types.
const char* dot_kernel_isa();
// "avx512-vnni" (the 32-value block types' byte products, Q4_K's and Q5_K's scale products;
// the other K types stay at AVX2), "avx2" or "portable".
const char* block_kernel_isa();
// "avx512", "avx2" or "portable": the one it chose for the float types (F32, F16, BF16).
const char* float_kernel_isa();

}  // namespace kvpipe
