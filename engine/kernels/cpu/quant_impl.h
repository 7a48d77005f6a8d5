// The per-family halves of quant_types.h, behind its dispatch (quant_types.cpp): the float and
// 32-value block types (quant_legacy*.cpp) and the 256-value K types (quant_k*.cpp). Each
// family has a portable version and an AVX2 + FMA version compiled with target attributes, so
// the binary runs on any x86-64 and picks the vector code where the processor has it.
#pragma once

#include "engine/kernels/cpu/quant_types.h"

namespace kvpipe::quant_impl {

// Whether the vector code (kernels, activation quantisers, dequantisers) runs: AVX2 + FMA (and
// F16C) are usable on this processor (cpu_features.h: advertised, enabled by the OS, and a
// trial ran) and KVPIPE_CPU_KERNELS is not "portable". Decided once.
bool use_avx2();

// F32, F16, BF16, Q8_0, Q4_0, Q4_1; activations F32, Q8_0, Q8_1.
void legacy_dequantize_row(QuantType type, const void* src, float* dst, int64_t cols);
void legacy_quantize_activation_row(ActivationType type, const float* x, void* dst, int64_t cols);
void legacy_dequantize_activation_row(ActivationType type, const void* src, float* dst, int64_t cols);
DotKernel legacy_portable_kernel(QuantType type);
DotKernel legacy_avx2_kernel(QuantType type);  // nullptr where the build has no x86 vector code

// Q4_K, Q5_K, Q6_K; activations Q8_K.
void k_dequantize_row(QuantType type, const void* src, float* dst, int64_t cols);
void k_quantize_activation_row(const float* x, void* dst, int64_t cols);
void k_dequantize_activation_row(const void* src, float* dst, int64_t cols);
DotKernel k_portable_kernel(QuantType type);
DotKernel k_avx2_kernel(QuantType type);  // nullptr where the build has no x86 vector code

}  // namespace kvpipe::quant_impl
