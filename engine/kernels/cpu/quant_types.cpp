#include "engine/kernels/cpu/quant_types.h"

#include "engine/kernels/cpu/cpu_features.h"
#include "engine/kernels/cpu/quant_impl.h"

#include <cstdlib>
#include <stdexcept>

namespace kvpipe {
namespace {

// The 256-value super-block types (quant_k*.cpp); the rest are float or 32-value block types.
bool is_k_type(QuantType t) { return quant_traits(t).block_values == 256; }

constexpr QuantType kAllTypes[] = {QuantType::F32,  QuantType::F16,  QuantType::BF16,   QuantType::Q8_0,
                                   QuantType::Q4_0, QuantType::Q4_1, QuantType::Q4_K,   QuantType::Q5_K,
                                   QuantType::Q6_K, QuantType::Q5_0, QuantType::Q5_1,   QuantType::IQ4_NL,
                                   QuantType::Q2_K, QuantType::Q3_K, QuantType::IQ4_XS};

}  // namespace

// KVPIPE_CPU_KERNELS=portable forces the portable kernels (to compare, or to rule the vector
// code out when a result looks wrong); =avx2 keeps the float types off AVX-512.
namespace {
std::string kernels_env() {
  const char* env = std::getenv("KVPIPE_CPU_KERNELS");
  return env == nullptr ? "" : env;
}
}  // namespace

bool quant_impl::use_avx2() {
  static const bool use = [] {
    const bool force_portable = kernels_env() == "portable";
    return std::string(choose_kernel_isa(probe_cpu_feature(CpuFeature::kAvx2Fma), force_portable)) == "avx2";
  }();
  return use;
}

bool quant_impl::use_avx512() {
  static const bool use =
      use_avx2() && kernels_env() != "avx2" && probe_cpu_feature(CpuFeature::kAvx512).usable();
  return use;
}

bool quant_impl::use_avx512_vnni() {
  static const bool use = use_avx512() && probe_cpu_feature(CpuFeature::kAvx512Vnni).usable();
  return use;
}

const QuantTraits& quant_traits(QuantType type) {
  // Block sizes and byte counts are ggml's (ggml-common.h), which the files are written in.
  static const QuantTraits traits[] = {
      {"F32", 0, 1, 4, ActivationType::F32},          {"F16", 1, 1, 2, ActivationType::F32},
      {"BF16", 30, 1, 2, ActivationType::F32},        {"Q8_0", 8, 32, 34, ActivationType::Q8_0},
      {"Q4_0", 2, 32, 18, ActivationType::Q8_0},      {"Q4_1", 3, 32, 20, ActivationType::Q8_1},
      {"Q4_K", 12, 256, 144, ActivationType::Q8_K},   {"Q5_K", 13, 256, 176, ActivationType::Q8_K},
      {"Q6_K", 14, 256, 210, ActivationType::Q8_K},   {"Q5_0", 6, 32, 22, ActivationType::Q8_0},
      {"Q5_1", 7, 32, 24, ActivationType::Q8_1},      {"IQ4_NL", 20, 32, 18, ActivationType::Q8_0},
      {"Q2_K", 10, 256, 84, ActivationType::Q8_K},    {"Q3_K", 11, 256, 110, ActivationType::Q8_K},
      {"IQ4_XS", 23, 256, 136, ActivationType::Q8_K},
  };
  return traits[static_cast<int>(type)];
}

std::optional<QuantType> quant_type_from_ggml(uint32_t ggml_type) {
  for (QuantType t : kAllTypes)
    if (quant_traits(t).ggml_type == ggml_type) return t;
  return std::nullopt;
}

bool quant_row_fits(QuantType type, int64_t cols) { return cols > 0 && cols % quant_traits(type).block_values == 0; }

int64_t quant_row_bytes(QuantType type, int64_t cols) {
  const QuantTraits& t = quant_traits(type);
  return cols / t.block_values * t.block_bytes;
}

int64_t activation_row_bytes(ActivationType type, int64_t cols) {
  switch (type) {
    case ActivationType::F32: return 4 * cols;
    case ActivationType::Q8_0: return cols / 32 * 34;
    case ActivationType::Q8_1: return cols / 32 * 36;
    case ActivationType::Q8_K: return cols / 256 * 292;
  }
  return 0;
}

void quantize_activation_row(ActivationType type, const float* x, void* dst, int64_t cols) {
  if (type == ActivationType::Q8_K) return quant_impl::k_quantize_activation_row(x, dst, cols);
  quant_impl::legacy_quantize_activation_row(type, x, dst, cols);
}

void dequantize_activation_row(ActivationType type, const void* src, float* dst, int64_t cols) {
  if (type == ActivationType::Q8_K) return quant_impl::k_dequantize_activation_row(src, dst, cols);
  quant_impl::legacy_dequantize_activation_row(type, src, dst, cols);
}

void dequantize_row(QuantType type, const void* src, float* dst, int64_t cols) {
  if (is_k_type(type)) return quant_impl::k_dequantize_row(type, src, dst, cols);
  quant_impl::legacy_dequantize_row(type, src, dst, cols);
}

DotKernel portable_dot_kernel(QuantType type) {
  return is_k_type(type) ? quant_impl::k_portable_kernel(type) : quant_impl::legacy_portable_kernel(type);
}

DotKernel dot_kernel(QuantType type) {
  if (quant_impl::use_avx512())
    if (const DotKernel k = quant_impl::float_avx512_kernel(type)) return k;
  if (quant_impl::use_avx512_vnni()) {
    if (const DotKernel k = quant_impl::legacy_vnni_kernel(type)) return k;
    if (const DotKernel k = quant_impl::k_vnni_kernel(type)) return k;
  }
  if (quant_impl::use_avx2()) {
    const DotKernel k = is_k_type(type) ? quant_impl::k_avx2_kernel(type) : quant_impl::legacy_avx2_kernel(type);
    if (k != nullptr) return k;
  }
  return portable_dot_kernel(type);
}

BatchKernel batch_kernel(QuantType type) {
  if (quant_impl::use_avx512_vnni())
    if (const BatchKernel k = quant_impl::k_vnni_batch_kernel(type)) return k;
  return quant_impl::use_avx512() ? quant_impl::float_avx512_batch_kernel(type) : nullptr;
}

const char* dot_kernel_isa() { return quant_impl::use_avx2() ? "avx2" : "portable"; }

const char* block_kernel_isa() {
  return quant_impl::use_avx512_vnni() ? "avx512-vnni" : quant_impl::use_avx2() ? "avx2" : "portable";
}

const char* float_kernel_isa() {
  return quant_impl::use_avx512() ? "avx512" : quant_impl::use_avx2() ? "avx2" : "portable";
}

}  // namespace kvpipe
