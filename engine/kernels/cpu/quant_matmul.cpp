#include "engine/kernels/cpu/quant_matmul.h"

#include "engine/kernels/cpu/bf16_gemm.h"
#include "engine/kernels/cpu/blas_gemm.h"
#include "engine/kernels/cpu/cpu_features.h"
#include "engine/kernels/cpu/f16_gemm.h"
#include "engine/kernels/cpu/int8_gemm.h"
#include "engine/kernels/cpu/interleaved_blocks.h"
#include "engine/kernels/cpu/thread_pool.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <vector>

namespace kvpipe {
namespace {

// Weight rows a thread runs every group of inputs over before moving on: small enough that
// the slice (up to 64 rows of 8192 F32 values = 2 MiB; far less for the quantised types)
// is still in the core's cache when the next group reads it.
int64_t rows_per_slice(int64_t row_bytes) {
  return std::clamp<int64_t>((256 << 10) / std::max<int64_t>(row_bytes, 1), 4, 64);
}

// Rows of a dequantised tile on the BLAS path: large enough for sgemm to run near its peak.
constexpr int64_t kBlasTileRows = 128;

enum class Forced { kAuto, kKernel, kBlas };

Forced forced_path() {
  static const Forced f = [] {
    const char* env = std::getenv("KVPIPE_CPU_MATMUL");
    if (env == nullptr || !*env || std::strcmp(env, "auto") == 0) return Forced::kAuto;
    if (std::strcmp(env, "kernel") == 0) return Forced::kKernel;
    if (std::strcmp(env, "blas") == 0) return Forced::kBlas;
    throw std::invalid_argument(std::string("KVPIPE_CPU_MATMUL: '") + env + "' is not auto, kernel or blas");
  }();
  return f;
}

// The activations of one call, in the form the type's kernel reads them. The quantised rows
// live in a buffer of the calling thread, reused by its next call (no allocation per step).
struct Activations {
  const uint8_t* data = nullptr;
  int64_t stride = 0;  // bytes between rows
};

void prepare_activations(const float* x, int64_t n, int64_t ldx, QuantType type, int64_t cols, Activations& a) {
  const ActivationType at = quant_traits(type).activation;
  if (at == ActivationType::F32) {
    a.data = reinterpret_cast<const uint8_t*>(x);
    a.stride = ldx * static_cast<int64_t>(sizeof(float));
    return;
  }
  a.stride = activation_row_bytes(at, cols);
  thread_local std::vector<uint8_t> storage;
  storage.resize(static_cast<size_t>(a.stride * n));
  uint8_t* dst = storage.data();
  parallel_rows(n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) quantize_activation_row(at, x + i * ldx, dst + i * a.stride, cols);
  });
  a.data = dst;
}

void run_kernels(const Activations& a, int64_t n, QuantType type, const uint8_t* w, int64_t rows, int64_t cols,
                 float* y, int64_t ldy) {
  const DotKernel kernel = dot_kernel(type);
  const int64_t row_bytes = quant_row_bytes(type, cols);
  if (n > kMaxKernelInputs)
    if (const BatchKernel batch = batch_kernel(type)) {
      parallel_rows(rows, 4, [&](int64_t begin, int64_t end) {
        batch(w, row_bytes, a.data, a.stride, n, y, ldy, begin, end, cols);
      });
      return;
    }
  const int64_t slice = rows_per_slice(row_bytes);
  parallel_rows(rows, 4, [&](int64_t begin, int64_t end) {
    if (n <= kMaxKernelInputs) {
      kernel(w, row_bytes, a.data, a.stride, static_cast<int>(n), y, ldy, begin, end, cols);
      return;
    }
    for (int64_t r = begin; r < end; r += slice) {
      const int64_t r_end = std::min(end, r + slice);
      for (int64_t g = 0; g < n; g += kMaxKernelInputs) {
        const int m = static_cast<int>(std::min<int64_t>(kMaxKernelInputs, n - g));
        kernel(w, row_bytes, a.data + g * a.stride, a.stride, m, y + g * ldy, ldy, r, r_end, cols);
      }
    }
  });
}

void run_blas(const float* x, int64_t n, int64_t ldx, const Activations& a, QuantType type, const uint8_t* w,
              int64_t rows, int64_t cols, float* y, int64_t ldy) {
  const ActivationType at = quant_traits(type).activation;
  // The quantised types multiply by what their kernels see: the activations' 8-bit values.
  // The caller's buffer; the pool's threads reach it through the pointer (a lambda naming a
  // thread_local would see each thread's own).
  thread_local std::vector<float> xq;
  const float* xs = x;
  int64_t ldxs = ldx;
  if (at != ActivationType::F32) {
    xq.resize(static_cast<size_t>(n * cols));
    float* xq_data = xq.data();
    parallel_rows(n, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) dequantize_activation_row(at, a.data + i * a.stride, xq_data + i * cols, cols);
    });
    xs = xq_data, ldxs = cols;
  }
  const int64_t row_bytes = quant_row_bytes(type, cols);
  parallel_rows(rows, 16, [&](int64_t begin, int64_t end) {
    if (type == QuantType::F32) {
      const float* wf = reinterpret_cast<const float*>(w);
      sgemm_on_this_thread(false, true, n, end - begin, cols, xs, ldxs, wf + begin * cols, cols, false, y + begin,
                           ldy);
      return;
    }
    thread_local std::vector<float> tile;
    tile.resize(static_cast<size_t>(std::min(kBlasTileRows, end - begin) * cols));
    for (int64_t r = begin; r < end; r += kBlasTileRows) {
      const int64_t m = std::min(kBlasTileRows, end - r);
      for (int64_t i = 0; i < m; ++i) dequantize_row(type, w + (r + i) * row_bytes, tile.data() + i * cols, cols);
      sgemm_on_this_thread(false, true, n, m, cols, xs, ldxs, tile.data(), cols, false, y + r, ldy);
    }
  });
}

void run_path(MatmulPath path, const float* x, int64_t n, int64_t ldx, const Activations& a, QuantType type,
              const uint8_t* w, int64_t rows, int64_t cols, float* y, int64_t ldy) {
  switch (path) {
    case MatmulPath::kKernel:
      // BF16 rows multiply bfloat16 activations wherever the processor has the instruction, as
      // llama.cpp does: a batch gets twice float32's multiply-adds per instruction, and the
      // weights' stream bounds a decode step either way. Prompts do too, but on Intel's cores
      // (bf16_prompt_path).
      if (type == QuantType::BF16 && cols % 2 == 0)
        if (const std::optional<Bf16GemmIsa> isa = bf16_gemm_choice())
          return bf16_decode(*isa, x, n, ldx, reinterpret_cast<const uint16_t*>(w), rows, cols, y, ldy);
      return run_kernels(a, n, type, w, rows, cols, y, ldy);
    case MatmulPath::kBlas: return run_blas(x, n, ldx, a, type, w, rows, cols, y, ldy);
    case MatmulPath::kInt8: {
      const std::optional<Int8GemmIsa> isa = int8_gemm_choice(type);
      if (!isa)
        throw std::invalid_argument(std::string("quant_matmul: no 8-bit product for ") + quant_name(type) +
                                    " on this processor");
      return int8_gemm(*isa, a.data, a.stride, n, type, w, rows, cols, y, ldy);
    }
    case MatmulPath::kF16: {
      const std::optional<F16GemmIsa> isa = f16_gemm_choice();
      if (type != QuantType::F16 || !isa)
        throw std::invalid_argument(std::string("quant_matmul: no float16 product for ") + quant_name(type) +
                                    " on this processor");
      return f16_gemm(*isa, x, n, ldx, reinterpret_cast<const uint16_t*>(w), rows, cols, y, ldy);
    }
    case MatmulPath::kBf16Widened: {
      const std::optional<F16GemmIsa> isa = f16_gemm_choice();
      if (type != QuantType::BF16 || !isa)
        throw std::invalid_argument(std::string("quant_matmul: no widened bfloat16 product for ") + quant_name(type) +
                                    " on this processor");
      return bf16_widened_gemm(*isa, x, n, ldx, reinterpret_cast<const uint16_t*>(w), rows, cols, y, ldy);
    }
    case MatmulPath::kBf16: {
      const std::optional<Bf16GemmIsa> isa = bf16_gemm_choice();
      if (type != QuantType::BF16 || !isa)
        throw std::invalid_argument(std::string("quant_matmul: no bfloat16 product for ") + quant_name(type) +
                                    " on this processor");
      // Rows of an odd length have no whole pairs; no model kvpipe reads has them.
      if (cols % 2 != 0) return run_blas(x, n, ldx, a, type, w, rows, cols, y, ldy);
      return bf16_gemm(*isa, x, n, ldx, reinterpret_cast<const uint16_t*>(w), rows, cols, y, ldy);
    }
  }
}

// Inputs up to which the kernels serve a product; the 8-bit products or BLAS beyond (by type
// and processor). A fixed rule, not a timing: the paths round differently, and a choice made
// by the clock would make a job's tokens depend on how busy the machine was. The kernels are
// built for decode batches (a batch of up to 64 reads the weights about once); longer inputs
// are prefill, where a blocked product wins.
constexpr int64_t kMaxKernelBatch = 64;

}  // namespace

std::string matmul_path_name(MatmulPath path) {
  switch (path) {
    case MatmulPath::kKernel: return "kernel";
    case MatmulPath::kBlas: return "blas";
    case MatmulPath::kInt8: return "int8";
    case MatmulPath::kBf16: return "bf16";
    case MatmulPath::kF16: return "f16";
    case MatmulPath::kBf16Widened: return "bf16-widened";
  }
  return "?";
}

namespace {

// BF16 prompts: vdpbf16ps (bf16_gemm) where it doubles the multiply-adds of a cycle, the F16
// tiles with the weights widened to float32 (bf16_widened_gemm) where it does not. AMD's Zen 4
// issues a 512-bit FMA as two halves, and vdpbf16ps's 32 products an instruction double the
// rate; Intel's server cores issue 512-bit FMAs on two ports, where the widened tiles ran pp512
// 1.3x faster than vdpbf16ps on a Sapphire Rapids core (benchmarks/RESULTS.md), without
// rounding the activations. By vendor, as blas_gemm's choice of library: fixed for a machine,
// never timed, so a job's tokens do not depend on how busy the machine was.
MatmulPath bf16_prompt_path() {
  if (bf16_gemm_choice() && !cpu_is_intel()) return MatmulPath::kBf16;
  if (f16_gemm_choice()) return MatmulPath::kBf16Widened;
  return MatmulPath::kBlas;
}

}  // namespace

MatmulPath prompt_matmul_path(QuantType type) {
  switch (forced_path()) {
    case Forced::kKernel: return MatmulPath::kKernel;
    case Forced::kBlas: return MatmulPath::kBlas;
    case Forced::kAuto: break;
  }
  if (type == QuantType::BF16) return bf16_prompt_path();
  if (type == QuantType::F16) return f16_gemm_choice() ? MatmulPath::kF16 : MatmulPath::kBlas;
  return int8_gemm_choice(type) ? MatmulPath::kInt8 : MatmulPath::kBlas;
}

namespace {

std::string block_prompt_kernels() {
  const std::optional<Int8GemmIsa> widest = int8_gemm_choice(QuantType::Q8_0);
  if (widest) return std::string("int8 ") + int8_gemm_isa_name(*widest);
  const std::optional<Int8GemmIsa> narrow = int8_gemm_choice(QuantType::Q4_0);
  if (!narrow) return "blas";
  std::string refused;
  for (QuantType type : {QuantType::Q8_0, QuantType::IQ4_NL, QuantType::IQ4_XS})
    if (!int8_gemm_choice(type)) refused += std::string(refused.empty() ? "" : ", ") + quant_name(type);
  return std::string("int8 ") + int8_gemm_isa_name(*narrow) + " (" + refused + ": blas)";
}

}  // namespace

std::string prompt_kernels_description() {
  if (forced_path() != Forced::kAuto) return forced_path() == Forced::kBlas ? "blas" : "kernel";
  const std::optional<Bf16GemmIsa> bf16 = bf16_gemm_choice();
  const std::optional<F16GemmIsa> f16 = f16_gemm_choice();
  std::string bf16_prompts = "blas";
  switch (prompt_matmul_path(QuantType::BF16)) {
    case MatmulPath::kBf16: bf16_prompts = bf16_gemm_isa_name(*bf16); break;
    case MatmulPath::kBf16Widened: bf16_prompts = std::string(f16_gemm_isa_name(*f16)) + " widened"; break;
    default: break;
  }
  return block_prompt_kernels() + "; BF16: " + bf16_prompts + "; F16: " + (f16 ? f16_gemm_isa_name(*f16) : "blas");
}

void quant_matmul(const float* x, int64_t n, int64_t ldx, QuantType type, const uint8_t* w, int64_t rows,
                  int64_t cols, float* y, int64_t ldy) {
  if (n <= 0 || rows <= 0) return;
  if (!quant_row_fits(type, cols))
    throw std::invalid_argument(std::string("quant_matmul: rows of ") + std::to_string(cols) + " values do not fit " +
                                quant_name(type) + " blocks");
  Activations a;
  prepare_activations(x, n, ldx, type, cols, a);
  const Forced forced = forced_path();
  const MatmulPath path =
      forced == Forced::kAuto && n <= kMaxKernelBatch ? MatmulPath::kKernel : prompt_matmul_path(type);
  run_path(path, x, n, ldx, a, type, w, rows, cols, y, ldy);
}

void quant_matmul_interleaved(const float* x, int64_t n, int64_t ldx, QuantType type, const uint8_t* w, int64_t rows,
                              int64_t cols, float* y, int64_t ldy) {
  if (n <= 0 || rows <= 0) return;
  Activations a;
  prepare_activations(x, n, ldx, type, cols, a);
  interleaved_matmul(interleave_choice(), a.data, a.stride, n, type, w, rows, cols, y, ldy);
}

void quant_matmul_on(MatmulPath path, const float* x, int64_t n, int64_t ldx, QuantType type, const uint8_t* w,
                     int64_t rows, int64_t cols, float* y, int64_t ldy) {
  if (n <= 0 || rows <= 0) return;
  Activations a;
  prepare_activations(x, n, ldx, type, cols, a);
  run_path(path, x, n, ldx, a, type, w, rows, cols, y, ldy);
}

}  // namespace kvpipe
