#include "engine/kernels/cpu/f16_gemm.h"

#include "engine/kernels/cpu/f16_gemm_impl.h"
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

using f16_gemm_impl::kGroupRows;
using f16_gemm_impl::kTileInputs;

namespace f16_gemm_impl {

namespace {

// The reference order of operations (f16_gemm.h), values widened by `widen`.
template <float (*widen)(uint16_t)>
void tile_reference(const uint16_t* group, int64_t cols, const float* xt, int count, float* y, int64_t ldy,
                    int valid) {
  for (int j = 0; j < count; ++j) {
    float acc[kGroupRows] = {};
    for (int64_t c = 0; c < cols; ++c)
      for (int i = 0; i < kGroupRows; ++i)
        acc[i] = std::fma(widen(group[kGroupRows * c + i]), xt[kTileInputs * c + j], acc[i]);
    std::memcpy(y + j * ldy, acc, sizeof(float) * static_cast<size_t>(valid));
  }
}

}  // namespace

void tile_portable(const uint16_t* group, int64_t cols, const float* xt, int count, float* y, int64_t ldy,
                   int valid) {
  tile_reference<quant_impl::fp16_to_fp32>(group, cols, xt, count, y, ldy, valid);
}

void tile_portable_bf16(const uint16_t* group, int64_t cols, const float* xt, int count, float* y, int64_t ldy,
                        int valid) {
  tile_reference<quant_impl::bf16_to_fp32>(group, cols, xt, count, y, ldy, valid);
}

}  // namespace f16_gemm_impl

namespace {

// Rows a thread repacks at once: a panel of 64 rows of up to 4096 values is 512 KiB of float16.
constexpr int64_t kPanelRows = 64;

// Input tiles a panel is run over before the next slice: about 256 KiB of float32 activations,
// so that the slice and the panel stay in L2 together (two tiles at least).
int64_t tiles_per_slice(int64_t cols) {
  return std::max<int64_t>(2, (256 << 10) / (4 * kTileInputs * std::max<int64_t>(cols, 1)));
}

f16_gemm_impl::TileFn tile_for(F16GemmIsa isa, bool bf16) {
  switch (isa) {
#if defined(__x86_64__)
    case F16GemmIsa::kAvx512: return bf16 ? f16_gemm_impl::tile_avx512_bf16 : f16_gemm_impl::tile_avx512;
#else
    case F16GemmIsa::kAvx512: return nullptr;
#endif
    case F16GemmIsa::kPortable: return bf16 ? f16_gemm_impl::tile_portable_bf16 : f16_gemm_impl::tile_portable;
  }
  return nullptr;
}

// Rows r0 .. r0 + valid of W into group, value c of row i at 16 c + i (missing rows as zeros).
void pack_group(const uint16_t* w, int64_t cols, int64_t r0, int valid, uint16_t* group) {
  if (valid < kGroupRows) std::fill(group, group + kGroupRows * cols, uint16_t{0});
  for (int i = 0; i < valid; ++i) {
    const uint16_t* row = w + (r0 + i) * cols;
    for (int64_t c = 0; c < cols; ++c) group[kGroupRows * c + i] = row[c];
  }
}

}  // namespace

const char* f16_gemm_isa_name(F16GemmIsa isa) {
  switch (isa) {
    case F16GemmIsa::kPortable: return "portable";
    case F16GemmIsa::kAvx512: return "avx512";
  }
  return "?";
}

bool f16_gemm_runs(F16GemmIsa isa) {
  switch (isa) {
    case F16GemmIsa::kPortable: return true;
    // use_avx512: the AVX-512 probe passed (F16C is part of use_avx2's) and KVPIPE_CPU_KERNELS
    // does not keep kernels at AVX2.
    case F16GemmIsa::kAvx512: return quant_impl::use_avx512();
  }
  return false;
}

std::optional<F16GemmIsa> f16_gemm_choice() {
  if (f16_gemm_runs(F16GemmIsa::kAvx512)) return F16GemmIsa::kAvx512;
  return std::nullopt;
}

namespace {

// f16_gemm and bf16_widened_gemm: the same packing, tiles and split, only the widening differs.
void half_gemm(F16GemmIsa isa, bool bf16, const float* x, int64_t n, int64_t ldx, const uint16_t* w, int64_t rows,
               int64_t cols, float* y, int64_t ldy) {
  if (!f16_gemm_runs(isa))
    throw std::invalid_argument(std::string(bf16 ? "bf16_widened_gemm: " : "f16_gemm: ") + f16_gemm_isa_name(isa) +
                                " does not run on this processor");
  if (n <= 0 || rows <= 0) return;
  const f16_gemm_impl::TileFn tile = tile_for(isa, bf16);
  // The activations in tiles of kTileInputs inputs, interleaved (value c of the tile's input j at
  // kTileInputs c + j), in the caller's buffer (the pool's threads reach it through the pointer).
  const int64_t tiles = (n + kTileInputs - 1) / kTileInputs;
  thread_local std::vector<float> xt;
  xt.resize(static_cast<size_t>(tiles * kTileInputs * cols));
  float* const xt_data = xt.data();
  parallel_rows(tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int count = static_cast<int>(std::min<int64_t>(kTileInputs, n - t * kTileInputs));
      float* dst = xt_data + t * kTileInputs * cols;
      for (int j = 0; j < count; ++j) {
        const float* src = x + (t * kTileInputs + j) * ldx;
        for (int64_t c = 0; c < cols; ++c) dst[kTileInputs * c + j] = src[c];
      }
    }
  });
  const int64_t slice = tiles_per_slice(cols);
  // Panels handed out in turn past each thread's own run, as bf16_gemm's: no row's result
  // depends on which thread computes it.
  parallel_chunks(rows, kPanelRows, [&](int64_t begin, int64_t end) {
    struct alignas(64) Line {
      uint16_t values[2 * kGroupRows];  // two columns of a group
    };
    thread_local std::vector<Line> panel;  // 64-byte aligned for the tiles' loads
    const int64_t group_lines = (cols + 1) / 2;
    const int64_t groups_per_panel = kPanelRows / kGroupRows;
    panel.resize(static_cast<size_t>(groups_per_panel * group_lines));
    for (int64_t r = begin; r < end; r += kPanelRows) {
      const int64_t panel_rows = std::min(kPanelRows, end - r);
      const int64_t groups = (panel_rows + kGroupRows - 1) / kGroupRows;
      for (int64_t g = 0; g < groups; ++g) {
        const int valid = static_cast<int>(std::min<int64_t>(kGroupRows, panel_rows - g * kGroupRows));
        pack_group(w, cols, r + g * kGroupRows, valid, panel[g * group_lines].values);
      }
      for (int64_t t0 = 0; t0 < tiles; t0 += slice)
        for (int64_t g = 0; g < groups; ++g) {
          const int valid = static_cast<int>(std::min<int64_t>(kGroupRows, panel_rows - g * kGroupRows));
          for (int64_t t = t0; t < std::min(tiles, t0 + slice); ++t) {
            const int count = static_cast<int>(std::min<int64_t>(kTileInputs, n - t * kTileInputs));
            tile(panel[g * group_lines].values, cols, xt_data + t * kTileInputs * cols, count,
                 y + t * kTileInputs * ldy + r + g * kGroupRows, ldy, valid);
          }
        }
    }
  });
}

}  // namespace

void f16_gemm(F16GemmIsa isa, const float* x, int64_t n, int64_t ldx, const uint16_t* w, int64_t rows, int64_t cols,
              float* y, int64_t ldy) {
  half_gemm(isa, false, x, n, ldx, w, rows, cols, y, ldy);
}

void bf16_widened_gemm(F16GemmIsa isa, const float* x, int64_t n, int64_t ldx, const uint16_t* w, int64_t rows,
                       int64_t cols, float* y, int64_t ldy) {
  half_gemm(isa, true, x, n, ldx, w, rows, cols, y, ldy);
}

}  // namespace kvpipe
