#include "engine/kernels/cpu/int8_gemm.h"

#include "engine/kernels/cpu/cpu_features.h"
#include "engine/kernels/cpu/half_convert.h"
#include "engine/kernels/cpu/int8_gemm_impl.h"
#include "engine/kernels/cpu/quant_impl.h"
#include "engine/kernels/cpu/thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {

using int8_gemm_impl::kGroupRows;
using int8_gemm_impl::kRun;
using int8_gemm_impl::PackedRun;
using int8_gemm_impl::Panel;

namespace int8_gemm_impl {

// The reference order of operations every vector tile reproduces (int8_gemm.h).
void tile_portable(const PackedRun* group, const Panel& p, bool split, int64_t n, float* y, int64_t ldy,
                   int valid) {
  const int halves = split ? 2 : 1;
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* xr = p.x + j * p.x_stride;
    float acc[kGroupRows] = {};
    for (int64_t b = 0; b < p.runs; ++b) {
      const PackedRun& run = group[b];
      const auto* a = reinterpret_cast<const int8_t*>(xr + p.qs_offset[b]);
      const float da = p.da[j * p.runs + b];
      for (int h = 0; h < halves; ++h) {
        const int k_begin = split ? 4 * h : 0, k_end = split ? 4 * h + 4 : 8;
        const float s = p.s[(j * p.runs + b) * halves + h];
        for (int i = 0; i < kGroupRows; ++i) {
          int32_t sum = 0;
          for (int k = k_begin; k < k_end; ++k)
            for (int t = 0; t < 4; ++t) sum += static_cast<int32_t>(run.q[32 * k + 4 * i + t]) * a[4 * k + t];
          const float scale = run.d[h][i] * da;
          acc[i] = std::fma(static_cast<float>(sum), scale, acc[i]);
          acc[i] = std::fma(run.m[h][i], s, acc[i]);
        }
      }
    }
    std::memcpy(y + j * ldy, acc, sizeof(float) * static_cast<size_t>(valid));
  }
}

}  // namespace int8_gemm_impl

namespace {

bool unpack_row_u8(QuantType type, const uint8_t* row, int64_t cols, uint8_t* u, float* d, float* m) {
  return quant_impl::legacy_unpack_row_u8(type, row, cols, u, d, m) ||
         quant_impl::k_unpack_row_u8(type, row, cols, u, d, m);
}

// Whether the type's scales cover 16 values: its runs carry two scales and offsets.
bool split_runs(QuantType type) {
  return type == QuantType::Q2_K || type == QuantType::Q3_K || type == QuantType::Q6_K;
}

// The largest unsigned byte a type's rows hold (vpmaddubsw needs it below 128).
int max_byte(QuantType type) {
  switch (type) {
    case QuantType::Q2_K: return 3;
    case QuantType::Q3_K: return 7;
    case QuantType::Q6_K: return 63;
    case QuantType::Q4_0:
    case QuantType::Q4_1:
    case QuantType::Q4_K: return 15;
    case QuantType::Q5_0:
    case QuantType::Q5_1:
    case QuantType::Q5_K: return 31;
    default: return 255;  // Q8_0 and the IQ4 grids, shifted by 128
  }
}

// Rows r0 .. r0 + valid of W, interleaved into out[0, runs) (missing rows as zeros).
void pack_group(QuantType type, const uint8_t* w, int64_t row_bytes, int64_t r0, int valid, int64_t cols,
                PackedRun* out, std::vector<uint8_t>& u, std::vector<float>& d, std::vector<float>& m) {
  const int64_t runs = cols / kRun;
  const int halves = split_runs(type) ? 2 : 1;
  for (int i = 0; i < kGroupRows; ++i) {
    if (i < valid) {
      unpack_row_u8(type, w + (r0 + i) * row_bytes, cols, u.data(), d.data(), m.data());
    } else {
      std::fill(u.begin(), u.end(), 0);
      std::fill(d.begin(), d.end(), 0.0f);
      std::fill(m.begin(), m.end(), 0.0f);
    }
    for (int64_t b = 0; b < runs; ++b) {
      PackedRun& run = out[b];
      const uint8_t* src = u.data() + b * kRun;
      for (int k = 0; k < 8; ++k) std::memcpy(run.q + 32 * k + 4 * i, src + 4 * k, 4);
      for (int h = 0; h < 2; ++h) {
        run.d[h][i] = h < halves ? d[b * halves + h] : 0.0f;
        run.m[h][i] = h < halves ? m[b * halves + h] : 0.0f;
      }
    }
  }
}

// Where run b's 32 values start in an activation row, and its scale.
struct ActivationLayout {
  int64_t block_bytes;     // bytes of one activation block
  int64_t runs_per_block;  // 1, or 8 for Q8_K's 256 values
  int64_t qs;              // offset of the values in a block
  bool float_scale;        // Q8_K: a float32 d; Q8_0 / Q8_1: float16
};

ActivationLayout activation_layout(ActivationType at) {
  switch (at) {
    case ActivationType::Q8_0: return {34, 1, 2, false};
    case ActivationType::Q8_1: return {36, 1, 4, false};
    case ActivationType::Q8_K: return {292, 8, 4, true};
    case ActivationType::F32: break;
  }
  throw std::logic_error("int8_gemm: float activations");
}

using TileFn = void (*)(const PackedRun*, const Panel&, bool, int64_t, float*, int64_t, int);

TileFn tile_for(Int8GemmIsa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case Int8GemmIsa::kAvx2: return int8_gemm_impl::tile_avx2;
    case Int8GemmIsa::kAvx512Vnni: return int8_gemm_impl::tile_avx512vnni;
#else
    case Int8GemmIsa::kAvx2:
    case Int8GemmIsa::kAvx512Vnni: return nullptr;
#endif
    case Int8GemmIsa::kPortable: return int8_gemm_impl::tile_portable;
  }
  return nullptr;
}

using PairTileFn = void (*)(const PackedRun*, const PackedRun*, const Panel&, bool, int64_t, float*, int64_t, int);

// The 16-row tile where the ISA has one (AVX-512's 32 registers of 16 lanes), else null.
PairTileFn pair_tile_for(Int8GemmIsa isa) {
#if defined(__x86_64__)
  if (isa == Int8GemmIsa::kAvx512Vnni) return int8_gemm_impl::tile_pair_avx512vnni;
#endif
  (void)isa;
  return nullptr;
}

}  // namespace

const char* int8_gemm_isa_name(Int8GemmIsa isa) {
  switch (isa) {
    case Int8GemmIsa::kPortable: return "portable";
    case Int8GemmIsa::kAvx2: return "avx2";
    case Int8GemmIsa::kAvx512Vnni: return "avx512-vnni";
  }
  return "?";
}

bool int8_gemm_supports(QuantType type) {
  // Every block type unpacks to the unsigned form; the float types take float activations.
  return quant_traits(type).activation != ActivationType::F32;
}

bool int8_gemm_runs(Int8GemmIsa isa, QuantType type) {
  if (!int8_gemm_supports(type)) return false;
  switch (isa) {
    case Int8GemmIsa::kPortable: return true;
    case Int8GemmIsa::kAvx2: return quant_impl::use_avx2() && max_byte(type) < 128;
    case Int8GemmIsa::kAvx512Vnni:
      // use_avx512: KVPIPE_CPU_KERNELS=avx2 keeps every kernel at AVX2.
      return quant_impl::use_avx512() && probe_cpu_feature(CpuFeature::kAvx512Vnni).usable();
  }
  return false;
}

std::optional<Int8GemmIsa> int8_gemm_choice(QuantType type) {
  for (Int8GemmIsa isa : {Int8GemmIsa::kAvx512Vnni, Int8GemmIsa::kAvx2})
    if (int8_gemm_runs(isa, type)) return isa;
  return std::nullopt;
}

void int8_gemm(Int8GemmIsa isa, const uint8_t* x, int64_t x_stride, int64_t n, QuantType type, const uint8_t* w,
               int64_t rows, int64_t cols, float* y, int64_t ldy) {
  if (!int8_gemm_runs(isa, type))
    throw std::invalid_argument(std::string("int8_gemm: ") + int8_gemm_isa_name(isa) + " does not compute " +
                                quant_name(type) + " on this processor");
  if (n <= 0 || rows <= 0) return;
  if (!quant_row_fits(type, cols))
    throw std::invalid_argument("int8_gemm: rows of " + std::to_string(cols) + " values do not fit " +
                                quant_name(type) + " blocks");
  const TileFn tile = tile_for(isa);
  const int64_t runs = cols / kRun;
  const bool split = split_runs(type);
  const int halves = split ? 2 : 1;
  const ActivationLayout layout = activation_layout(quant_traits(type).activation);

  // The panel of this call, in the caller's buffers (the pool's threads reach them through
  // the pointers).
  thread_local std::vector<int64_t> qs_offset;
  thread_local std::vector<float> da, sums;
  qs_offset.resize(static_cast<size_t>(runs));
  for (int64_t b = 0; b < runs; ++b)
    qs_offset[b] = b / layout.runs_per_block * layout.block_bytes + layout.qs + b % layout.runs_per_block * kRun;
  da.resize(static_cast<size_t>(n * runs));
  sums.resize(static_cast<size_t>(n * runs * halves));
  float* da_data = da.data();
  float* sum_data = sums.data();
  const int64_t* offsets = qs_offset.data();
  parallel_rows(n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* row = x + j * x_stride;
      for (int64_t b = 0; b < runs; ++b) {
        const uint8_t* block = row + b / layout.runs_per_block * layout.block_bytes;
        float scale;
        if (layout.float_scale) {
          std::memcpy(&scale, block, sizeof scale);
        } else {
          uint16_t h;
          std::memcpy(&h, block, sizeof h);
          scale = quant_impl::fp16_to_fp32(h);
        }
        const auto* a = reinterpret_cast<const int8_t*>(row + offsets[b]);
        da_data[j * runs + b] = scale;
        for (int h = 0; h < halves; ++h) {
          int32_t total = 0;
          for (int64_t t = h * kRun / halves; t < (h + 1) * kRun / halves; ++t) total += a[t];
          sum_data[(j * runs + b) * halves + h] = scale * static_cast<float>(total);
        }
      }
    }
  });
  Panel panel;
  panel.x = x;
  panel.x_stride = x_stride;
  panel.qs_offset = offsets;
  panel.da = da_data;
  panel.s = sum_data;
  panel.runs = runs;

  const int64_t row_bytes = quant_row_bytes(type, cols);
  // Groups handed out in turn past each thread's own run: a prompt's product is long enough
  // for one core running slower than the other (a guest's cores share their host) to show,
  // and no group's result depends on which thread computes it.
  // Two groups at a time: AVX-512 multiplies them together, 16 rows to a vector.
  const PairTileFn pair_tile = pair_tile_for(isa);
  parallel_chunks(rows, 2 * kGroupRows, [&](int64_t begin, int64_t end) {
    thread_local std::vector<PackedRun> groups;
    thread_local std::vector<uint8_t> u;
    thread_local std::vector<float> d, m;
    groups.resize(static_cast<size_t>(2 * runs));
    u.resize(static_cast<size_t>(cols));
    d.resize(static_cast<size_t>(runs * halves));
    m.resize(static_cast<size_t>(runs * halves));
    PackedRun* const first = groups.data();
    PackedRun* const second = first + runs;
    for (int64_t r0 = begin; r0 < end; r0 += 2 * kGroupRows) {
      const int valid = static_cast<int>(std::min<int64_t>(2 * kGroupRows, end - r0));
      pack_group(type, w, row_bytes, r0, std::min(valid, kGroupRows), cols, first, u, d, m);
      if (valid <= kGroupRows) {
        tile(first, panel, split, n, y + r0, ldy, valid);
        continue;
      }
      pack_group(type, w, row_bytes, r0 + kGroupRows, valid - kGroupRows, cols, second, u, d, m);
      if (pair_tile) {
        pair_tile(first, second, panel, split, n, y + r0, ldy, valid);
      } else {
        tile(first, panel, split, n, y + r0, ldy, kGroupRows);
        tile(second, panel, split, n, y + r0 + kGroupRows, ldy, valid - kGroupRows);
      }
    }
  });
}

}  // namespace kvpipe
