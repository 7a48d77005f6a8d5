// The per-family halves of quant_types.h, behind its dispatch (quant_types.cpp): the float and
// 32-value block types (quant_legacy*.cpp) and the 256-value super-block types, the K types
// and IQ4_XS, which all take Q8_K activations (quant_k*.cpp). Each
// family has a portable version and an AVX2 + FMA version compiled with target attributes, so
// the binary runs on any x86-64 and picks the vector code where the processor has it.
#pragma once

#include "engine/kernels/cpu/quant_types.h"

namespace kvpipe::quant_impl {

// The 16 values an IQ4_NL / IQ4_XS nibble indexes (ggml's kvalues_iq4nl): a non-uniform grid,
// denser near zero, that a block scale multiplies.
inline constexpr int8_t kIq4NlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                            1,    13,   25,  38,  53,  69,  89,  113};

// Whether the vector code (kernels, activation quantisers, dequantisers) runs: AVX2 + FMA (and
// F16C) are usable on this processor (cpu_features.h: advertised, enabled by the OS, and a
// trial ran) and KVPIPE_CPU_KERNELS is not "portable". Decided once.
bool use_avx2();
// Whether the float types' AVX-512 kernels run: use_avx2(), the AVX-512 probe passed, and
// KVPIPE_CPU_KERNELS is not "avx2" (which keeps every kernel at AVX2). Decided once.
bool use_avx512();

// Whether the 32-value block types' AVX-512 VNNI kernels run: use_avx512() and the VNNI
// probe passed. Decided once.
bool use_avx512_vnni();

// F32, F16, BF16 rows on AVX-512 (quant_float_avx512.cpp); nullptr for other types or where
// the build has no x86 vector code.
DotKernel float_avx512_kernel(QuantType type);
// Their batch kernels (blocks of rows against every input; DotKernel's results bit for bit).
BatchKernel float_avx512_batch_kernel(QuantType type);

// F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL; activations F32, Q8_0, Q8_1.
void legacy_dequantize_row(QuantType type, const void* src, float* dst, int64_t cols);
void legacy_quantize_activation_row(ActivationType type, const float* x, void* dst, int64_t cols);
void legacy_dequantize_activation_row(ActivationType type, const void* src, float* dst, int64_t cols);
DotKernel legacy_portable_kernel(QuantType type);
DotKernel legacy_avx2_kernel(QuantType type);  // nullptr where the build has no x86 vector code
// The 32-value block types' AVX2 kernels with vpdpbusd for maddubs + madd: the same results,
// bit for bit. nullptr for the float types or where the build has no x86 vector code.
DotKernel legacy_vnni_kernel(QuantType type);

// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS; activations Q8_K.
void k_dequantize_row(QuantType type, const void* src, float* dst, int64_t cols);
void k_quantize_activation_row(const float* x, void* dst, int64_t cols);
void k_dequantize_activation_row(const void* src, float* dst, int64_t cols);
DotKernel k_portable_kernel(QuantType type);
DotKernel k_avx2_kernel(QuantType type);  // nullptr where the build has no x86 vector code
// Q4_K's and Q5_K's AVX2 kernels with vpdpwssd for the scales' madd + add: the same results,
// bit for bit. nullptr for the other types or where the build has no x86 vector code.
DotKernel k_vnni_kernel(QuantType type);
// Their batch kernels (8 inputs a pass over each row; k_vnni_kernel's results bit for bit).
BatchKernel k_vnni_batch_kernel(QuantType type);

// A row's values as unsigned 8-bit integers with a scale d and an offset m per run of 32
// values, or of 16 for Q2_K, Q3_K and Q6_K, whose scales cover 16 (value i of run b is
// d[b] * u[i] + m[b]: the signed types shifted up by their offset, which m takes back): what
// int8_gemm multiplies. false for the float types.
bool legacy_unpack_row_u8(QuantType type, const uint8_t* row, int64_t cols, uint8_t* u, float* d, float* m);
bool k_unpack_row_u8(QuantType type, const uint8_t* row, int64_t cols, uint8_t* u, float* d, float* m);

}  // namespace kvpipe::quant_impl
