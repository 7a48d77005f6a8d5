#include "engine/kernels/cpu/bf16_gemm.h"

#include "engine/kernels/cpu/bf16_gemm_impl.h"
#include "engine/kernels/cpu/cpu_features.h"
#include "engine/kernels/cpu/half_convert.h"
#include "engine/kernels/cpu/quant_impl.h"
#include "engine/kernels/cpu/thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {

using bf16_gemm_impl::kGroupRows;

namespace bf16_gemm_impl {

// The reference order of operations (bf16_gemm.h): per pair, the odd product then the even one,
// each exact and added with one rounding.
void tile_portable(const uint32_t* group, const uint32_t* xb, int64_t pairs, int64_t j0, int64_t count, float* y,
                   int64_t ldy, int valid) {
  for (int64_t j = j0; j < j0 + count; ++j) {
    const uint32_t* xr = xb + j * pairs;
    float acc[kGroupRows] = {};
    for (int64_t p = 0; p < pairs; ++p) {
      const float x_even = quant_impl::bf16_to_fp32(static_cast<uint16_t>(xr[p]));
      const float x_odd = quant_impl::bf16_to_fp32(static_cast<uint16_t>(xr[p] >> 16));
      const uint32_t* wp = group + kGroupRows * p;
      for (int i = 0; i < kGroupRows; ++i) {
        acc[i] = std::fma(quant_impl::bf16_to_fp32(static_cast<uint16_t>(wp[i] >> 16)), x_odd, acc[i]);
        acc[i] = std::fma(quant_impl::bf16_to_fp32(static_cast<uint16_t>(wp[i])), x_even, acc[i]);
      }
    }
    std::memcpy(y + j * ldy, acc, sizeof(float) * static_cast<size_t>(valid));
  }
}

}  // namespace bf16_gemm_impl

namespace {

// Rows a thread repacks at once, and inputs it runs them over before the next slice of inputs:
// a panel (64 rows) and a slice of activations (64 inputs) of up to 8192 values each take
// 1 MiB apiece; at the model shapes kvpipe serves (up to 2048-4096 values) both stay in L2.
constexpr int64_t kPanelRows = 64;
constexpr int64_t kInputSlice = 64;

bf16_gemm_impl::TileFn tile_for(Bf16GemmIsa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case Bf16GemmIsa::kAvx512Bf16: return bf16_gemm_impl::tile_avx512bf16;
#else
    case Bf16GemmIsa::kAvx512Bf16: return nullptr;
#endif
    case Bf16GemmIsa::kPortable: return bf16_gemm_impl::tile_portable;
  }
  return nullptr;
}

// Rows r0 .. r0 + valid of W interleaved into group (missing rows as zeros).
void pack_group(const uint16_t* w, int64_t cols, int64_t r0, int valid, uint32_t* group) {
  const int64_t pairs = cols / 2;
  for (int i = 0; i < kGroupRows; ++i) {
    if (i >= valid) {
      for (int64_t p = 0; p < pairs; ++p) group[kGroupRows * p + i] = 0;
      continue;
    }
    const uint16_t* row = w + (r0 + i) * cols;
    for (int64_t p = 0; p < pairs; ++p) {
      uint32_t pair;
      std::memcpy(&pair, row + 2 * p, sizeof pair);
      group[kGroupRows * p + i] = pair;
    }
  }
}

}  // namespace

const char* bf16_gemm_isa_name(Bf16GemmIsa isa) {
  switch (isa) {
    case Bf16GemmIsa::kPortable: return "portable";
    case Bf16GemmIsa::kAvx512Bf16: return "avx512-bf16";
  }
  return "?";
}

bool bf16_gemm_runs(Bf16GemmIsa isa) {
  switch (isa) {
    case Bf16GemmIsa::kPortable: return true;
    case Bf16GemmIsa::kAvx512Bf16:
      // use_avx512: KVPIPE_CPU_KERNELS=avx2 keeps every kernel at AVX2.
      return quant_impl::use_avx512() && probe_cpu_feature(CpuFeature::kAvx512Bf16).usable();
  }
  return false;
}

std::optional<Bf16GemmIsa> bf16_gemm_choice() {
  if (bf16_gemm_runs(Bf16GemmIsa::kAvx512Bf16)) return Bf16GemmIsa::kAvx512Bf16;
  return std::nullopt;
}

void bf16_gemm(Bf16GemmIsa isa, const float* x, int64_t n, int64_t ldx, const uint16_t* w, int64_t rows,
               int64_t cols, float* y, int64_t ldy) {
  if (!bf16_gemm_runs(isa))
    throw std::invalid_argument(std::string("bf16_gemm: ") + bf16_gemm_isa_name(isa) + " does not run on this processor");
  if (cols % 2 != 0)
    throw std::invalid_argument("bf16_gemm: rows of " + std::to_string(cols) + " values are not whole pairs");
  if (n <= 0 || rows <= 0) return;
  const bf16_gemm_impl::TileFn tile = tile_for(isa);
  const int64_t pairs = cols / 2;

  // The activations as bfloat16 pairs, in the caller's buffer (the pool's threads reach it
  // through the pointer).
  thread_local std::vector<uint32_t> xb;
  xb.resize(static_cast<size_t>(n * pairs));
  uint32_t* xb_data = xb.data();
  parallel_rows(n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const float* xr = x + j * ldx;
      uint32_t* dst = xb_data + j * pairs;
      for (int64_t p = 0; p < pairs; ++p)
        dst[p] = quant_impl::fp32_to_bf16(xr[2 * p]) | static_cast<uint32_t>(quant_impl::fp32_to_bf16(xr[2 * p + 1])) << 16;
    }
  });

  // Panels handed out in turn past each thread's own run, as int8_gemm's groups: no row's
  // result depends on which thread computes it.
  parallel_chunks(rows, kPanelRows, [&](int64_t begin, int64_t end) {
    struct alignas(64) Line {
      uint32_t words[kGroupRows];
    };
    thread_local std::vector<Line> panel;  // 64-byte aligned for the tiles' loads
    const int64_t groups_per_panel = kPanelRows / kGroupRows;
    panel.resize(static_cast<size_t>(groups_per_panel * pairs));
    for (int64_t r = begin; r < end; r += kPanelRows) {
      const int64_t panel_rows = std::min(kPanelRows, end - r);
      const int64_t groups = (panel_rows + kGroupRows - 1) / kGroupRows;
      for (int64_t g = 0; g < groups; ++g) {
        const int valid = static_cast<int>(std::min<int64_t>(kGroupRows, panel_rows - g * kGroupRows));
        pack_group(w, cols, r + g * kGroupRows, valid, panel[g * pairs].words);
      }
      for (int64_t j = 0; j < n; j += kInputSlice) {
        const int64_t count = std::min(kInputSlice, n - j);
        for (int64_t g = 0; g < groups; ++g) {
          const int valid = static_cast<int>(std::min<int64_t>(kGroupRows, panel_rows - g * kGroupRows));
          tile(panel[g * pairs].words, xb_data, pairs, j, count, y + r + g * kGroupRows, ldy, valid);
        }
      }
    }
  });
}

void bf16_decode(Bf16GemmIsa isa, const float* x, int64_t n, int64_t ldx, const uint16_t* w, int64_t rows,
                 int64_t cols, float* y, int64_t ldy) {
  if (isa != Bf16GemmIsa::kAvx512Bf16 || !bf16_gemm_runs(isa))
    throw std::invalid_argument(std::string("bf16_decode: ") + bf16_gemm_isa_name(isa) + " does not run on this processor");
  if (cols % 2 != 0)
    throw std::invalid_argument("bf16_decode: rows of " + std::to_string(cols) + " values are not whole pairs");
  if (n <= 0 || rows <= 0) return;
  // The activations in bfloat16, in the caller's buffer (the pool's threads reach it through the
  // pointer).
  thread_local std::vector<uint16_t> xb;
  xb.resize(static_cast<size_t>(n * cols));
  uint16_t* xb_data = xb.data();
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < cols; ++c) xb_data[j * cols + c] = quant_impl::fp32_to_bf16(x[j * ldx + c]);
#if defined(__x86_64__)
  // Up to kDecodeInputs inputs the weights' stream bounds the time: rows in pairs from two
  // streams. Past it the multiplies do: blocks of rows held in registers.
  parallel_rows(rows, bf16_gemm_impl::kDecodeBlockRows, [&](int64_t begin, int64_t end) {
    if (n <= bf16_gemm_impl::kDecodeInputs)
      bf16_gemm_impl::decode_rows_avx512bf16(w, cols, xb_data, cols, static_cast<int>(n), begin, end, y, ldy);
    else
      bf16_gemm_impl::decode_blocks_avx512bf16(w, cols, xb_data, cols, n, begin, end, y, ldy);
  });
#else
  (void)w, (void)y, (void)ldy;
#endif
}

}  // namespace kvpipe
