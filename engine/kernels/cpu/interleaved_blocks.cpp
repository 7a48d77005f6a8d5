#include "engine/kernels/cpu/interleaved_blocks.h"

#include "engine/kernels/cpu/half_convert.h"
#include "engine/kernels/cpu/interleaved_blocks_impl.h"
#include "engine/kernels/cpu/quant_impl.h"
#include "engine/kernels/cpu/thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {

using interleaved_impl::Activations;
using interleaved_impl::kGroupRows;
using interleaved_impl::kQ4_0GroupBlockBytes;
using interleaved_impl::kQ4KGroupBlockBytes;
using interleaved_impl::kQ4KMins;
using interleaved_impl::kQ4KQs;
using interleaved_impl::kQ4KScales;
using interleaved_impl::kQ6KGroupBlockBytes;
using interleaved_impl::kQ6KQs;
using interleaved_impl::kQ6KScales;
using interleaved_impl::kQ6KSubBlockBytes;
using interleaved_impl::kQ8_0ActivationBytes;
using interleaved_impl::kQ8_0GroupBlockBytes;
using interleaved_impl::kQ8KActivationBytes;
using interleaved_impl::SuperActivations;

namespace {

constexpr int64_t kQ4_0Bytes = 18;  // fp16 d, then 16 bytes of nibbles
constexpr int64_t kQ8_0Bytes = 34;  // fp16 d, then 32 signed bytes
constexpr int64_t kQ4KBytes = 144;  // fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
constexpr int64_t kQ6KBytes = 210;  // ql[128], qh[64], int8 scales[16], fp16 d

int64_t block_values(QuantType type) { return type == QuantType::Q4_0 || type == QuantType::Q8_0 ? 32 : 256; }

// A stored Q6_K block's 256 values as 6-bit unsigned u = value + 32 (ggml's layout: each half
// of 128 values takes 64 bytes of ql, low nibbles then high, and 32 of qh, two bits a value),
// and back: the bits are the same, only their places differ.
void unpack_q6k_values(const uint8_t* block, uint8_t* u) {
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = block + 64 * h;
    const uint8_t* qh = block + 128 + 32 * h;
    uint8_t* out = u + 128 * h;
    for (int l = 0; l < 32; ++l) {
      out[l] = static_cast<uint8_t>((ql[l] & 0xf) | ((qh[l] & 3) << 4));
      out[l + 32] = static_cast<uint8_t>((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4));
      out[l + 64] = static_cast<uint8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
      out[l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
    }
  }
}

void pack_q6k_values(const uint8_t* u, uint8_t* block) {
  for (int h = 0; h < 2; ++h) {
    uint8_t* ql = block + 64 * h;
    uint8_t* qh = block + 128 + 32 * h;
    const uint8_t* in = u + 128 * h;
    for (int l = 0; l < 32; ++l) {
      ql[l] = static_cast<uint8_t>((in[l] & 0xf) | ((in[l + 64] & 0xf) << 4));
      ql[l + 32] = static_cast<uint8_t>((in[l + 32] & 0xf) | ((in[l + 96] & 0xf) << 4));
      qh[l] = static_cast<uint8_t>((in[l] >> 4) | ((in[l + 32] >> 4) << 2) | ((in[l + 64] >> 4) << 4) |
                                   ((in[l + 96] >> 4) << 6));
    }
  }
}

// Value 16 s + 4 m + t of row i in a group super-block's sub-block bytes c (interleaved_blocks.h).
uint8_t q6k_group_value(const uint8_t* c, int64_t i, int m, int t) {
  const uint8_t nibbles = c[32 * (m / 2) + 4 * i + t];
  const uint8_t low = m % 2 == 0 ? nibbles & 0x0f : nibbles >> 4;
  return static_cast<uint8_t>(low | (((c[64 + 4 * i + t] >> (2 * m)) & 3) << 4));
}

// A Q4_K block's eight 6-bit scales and mins (ggml's get_scale_min_k4), and back: the 12 bytes
// hold exactly these 96 bits, so the round trip gives the stored bytes.
void unpack_q4k_scales(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    mn[j] = q[j + 4] & 63;
    sc[j + 4] = static_cast<uint8_t>((q[j + 8] & 0xf) | ((q[j] >> 6) << 4));
    mn[j + 4] = static_cast<uint8_t>((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
  }
}

void pack_q4k_scales(const uint8_t* sc, const uint8_t* mn, uint8_t* q) {
  for (int j = 0; j < 4; ++j) {
    q[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    q[j + 4] = static_cast<uint8_t>((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
    q[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xf) | ((mn[j + 4] & 0xf) << 4));
  }
}

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

void require_supported(QuantType type, const char* what) {
  if (!interleave_supports(type))
    throw std::invalid_argument(std::string(what) + ": no interleaved layout for " + quant_name(type));
}

void require_groups(QuantType type, int64_t rows, int64_t cols, const char* what) {
  if (rows % kGroupRows != 0 || cols % block_values(type) != 0)
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(rows) + " rows of " + std::to_string(cols) +
                                " values are not whole groups of 8 rows and " + std::to_string(block_values(type)) +
                                " values");
}

}  // namespace

namespace interleaved_impl {

namespace {

// The portable kernels' loops: for each group and input, the 8 rows' float sums over the
// blocks, block(wb, j, b, acc) adding block b of the group (at wb) for input j.
template <typename Block>
void portable_groups(const uint8_t* w, int64_t g_begin, int64_t g_end, int64_t group_block_bytes, int64_t blocks,
                     int64_t n, float* y, int64_t ldy, const Block& block) {
  for (int64_t g = g_begin; g < g_end; ++g) {
    const uint8_t* wg = w + g * blocks * group_block_bytes;
    for (int64_t j = 0; j < n; ++j) {
      float acc[kGroupRows] = {};
      for (int64_t b = 0; b < blocks; ++b) block(wg + b * group_block_bytes, j, b, acc);
      std::memcpy(y + j * ldy + g * kGroupRows, acc, sizeof acc);
    }
  }
}

// Sub-block s's int16 activation sum from a pair (low half even s, high half odd).
int32_t pair_half(int32_t pair, int s) {
  return s % 2 == 0 ? static_cast<int16_t>(pair & 0xffff) : static_cast<int16_t>(pair >> 16);
}

}  // namespace

// The reference order of operations every vector kernel reproduces (interleaved_blocks.h).
void q4_0_portable(const uint8_t* w, int64_t g_begin, int64_t g_end, const Activations& a, int64_t n, float* y,
                   int64_t ldy) {
  portable_groups(w, g_begin, g_end, kQ4_0GroupBlockBytes, a.blocks, n, y, ldy,
                  [&](const uint8_t* wb, int64_t j, int64_t b, float* acc) {
                    const uint8_t* q = wb + 2 * kGroupRows;
                    const auto* xq = reinterpret_cast<const int8_t*>(a.x + j * a.x_stride + b * kQ8_0ActivationBytes + 2);
                    const float da = a.da[j * a.blocks + b];
                    for (int64_t i = 0; i < kGroupRows; ++i) {
                      int32_t sum = 0;
                      for (int k = 0; k < 4; ++k)
                        for (int t = 0; t < 4; ++t) {
                          const uint8_t byte = q[32 * k + 4 * i + t];
                          sum += static_cast<int32_t>(byte & 0x0f) * xq[4 * k + t] +
                                 static_cast<int32_t>(byte >> 4) * xq[16 + 4 * k + t];
                        }
                      sum -= a.offset[j * a.blocks + b];
                      const float scale = quant_impl::fp16_to_fp32(load_u16(wb + 2 * i)) * da;
                      acc[i] = std::fma(static_cast<float>(sum), scale, acc[i]);
                    }
                  });
}

void q8_0_portable(const uint8_t* w, int64_t g_begin, int64_t g_end, const Activations& a, int64_t n, float* y,
                   int64_t ldy) {
  portable_groups(w, g_begin, g_end, kQ8_0GroupBlockBytes, a.blocks, n, y, ldy,
                  [&](const uint8_t* wb, int64_t j, int64_t b, float* acc) {
                    const auto* q = reinterpret_cast<const int8_t*>(wb + 2 * kGroupRows);
                    const auto* xq = reinterpret_cast<const int8_t*>(a.x + j * a.x_stride + b * kQ8_0ActivationBytes + 2);
                    const float da = a.da[j * a.blocks + b];
                    for (int64_t i = 0; i < kGroupRows; ++i) {
                      int32_t sum = 0;
                      for (int k = 0; k < 8; ++k)
                        for (int t = 0; t < 4; ++t) sum += static_cast<int32_t>(q[32 * k + 4 * i + t]) * xq[4 * k + t];
                      const float scale = quant_impl::fp16_to_fp32(load_u16(wb + 2 * i)) * da;
                      acc[i] = std::fma(static_cast<float>(sum), scale, acc[i]);
                    }
                  });
}

void q4_k_portable(const uint8_t* w, int64_t g_begin, int64_t g_end, const SuperActivations& a, int64_t n, float* y,
                   int64_t ldy) {
  portable_groups(w, g_begin, g_end, kQ4KGroupBlockBytes, a.blocks, n, y, ldy,
                  [&](const uint8_t* wb, int64_t j, int64_t b, float* acc) {
                    const auto* xq = reinterpret_cast<const int8_t*>(a.x + j * a.x_stride + b * kQ8KActivationBytes + 4);
                    const int32_t* pairs = a.sum_pairs + (j * a.blocks + b) * 4;
                    const float da = a.da[j * a.blocks + b];
                    for (int64_t i = 0; i < kGroupRows; ++i) {
                      int32_t sumi = 0, summ = 0;
                      for (int s = 0; s < 8; ++s) {
                        int32_t isum = 0;
                        const int jj = s / 2, shift = 4 * (s % 2);
                        for (int k = 0; k < 8; ++k)
                          for (int t = 0; t < 4; ++t)
                            isum += static_cast<int32_t>((wb[kQ4KQs + 256 * jj + 32 * k + 4 * i + t] >> shift) & 0x0f) *
                                    xq[32 * s + 4 * k + t];
                        sumi += static_cast<int32_t>(wb[kQ4KScales + 8 * s + i]) * isum;
                        summ += static_cast<int32_t>(wb[kQ4KMins + 16 * (s / 2) + 2 * i + s % 2]) * pair_half(pairs[s / 2], s);
                      }
                      const float scale_d = quant_impl::fp16_to_fp32(load_u16(wb + 2 * i)) * da;
                      const float scale_m = quant_impl::fp16_to_fp32(load_u16(wb + 16 + 2 * i)) * da;
                      acc[i] = std::fma(static_cast<float>(sumi), scale_d, acc[i]);
                      acc[i] = std::fma(-static_cast<float>(summ), scale_m, acc[i]);
                    }
                  });
}

// Per row and super-block: the integer sum over the 16 sub-blocks of scale * (u . x), less 32
// times the sum of scale * (the sub-block's activation sum), exact in 32 bits (at most
// 16 * 128 * 16 * 63 * 128 + 32 * 16 * 128 * 16 * 128), then one float term.
void q6_k_portable(const uint8_t* w, int64_t g_begin, int64_t g_end, const SuperActivations& a, int64_t n, float* y,
                   int64_t ldy) {
  portable_groups(w, g_begin, g_end, kQ6KGroupBlockBytes, a.blocks, n, y, ldy,
                  [&](const uint8_t* wb, int64_t j, int64_t b, float* acc) {
                    const auto* xq = reinterpret_cast<const int8_t*>(a.x + j * a.x_stride + b * kQ8KActivationBytes + 4);
                    const int32_t* pairs = a.sum_pairs + (j * a.blocks + b) * 8;
                    const float da = a.da[j * a.blocks + b];
                    for (int64_t i = 0; i < kGroupRows; ++i) {
                      int32_t sumi = 0, summ = 0;
                      for (int s = 0; s < 16; ++s) {
                        const uint8_t* c = wb + kQ6KQs + kQ6KSubBlockBytes * s;
                        int32_t isum = 0;
                        for (int m = 0; m < 4; ++m)
                          for (int t = 0; t < 4; ++t)
                            isum += static_cast<int32_t>(q6k_group_value(c, i, m, t)) * xq[16 * s + 4 * m + t];
                        const int32_t scale = static_cast<int8_t>(wb[kQ6KScales + 16 * (s / 2) + 2 * i + s % 2]);
                        sumi += scale * isum;
                        summ += scale * pair_half(pairs[s / 2], s);
                      }
                      const float scale_d = quant_impl::fp16_to_fp32(load_u16(wb + 2 * i)) * da;
                      acc[i] = std::fma(static_cast<float>(sumi - 32 * summ), scale_d, acc[i]);
                    }
                  });
}

}  // namespace interleaved_impl

const char* interleave_isa_name(InterleaveIsa isa) {
  switch (isa) {
    case InterleaveIsa::kPortable: return "portable";
    case InterleaveIsa::kAvx2: return "avx2";
    case InterleaveIsa::kAvx512Vnni: return "avx512-vnni";
  }
  return "?";
}

bool interleave_supports(QuantType type) {
  return type == QuantType::Q4_0 || type == QuantType::Q8_0 || type == QuantType::Q4_K || type == QuantType::Q6_K;
}

int64_t interleaved_row_bytes(QuantType type, int64_t cols) {
  // Q4_K's 12 bytes of packed 6-bit scales and mins become 16, one byte each.
  return type == QuantType::Q4_K ? cols / 256 * (kQ4KBytes + 4) : quant_row_bytes(type, cols);
}

bool interleave_runs(InterleaveIsa isa) {
  switch (isa) {
    case InterleaveIsa::kPortable: return true;
#if defined(__x86_64__)
    case InterleaveIsa::kAvx2: return quant_impl::use_avx2();
    case InterleaveIsa::kAvx512Vnni: return quant_impl::use_avx512_vnni();
#else
    default: return false;
#endif
  }
  return false;
}

InterleaveIsa interleave_choice() {
  static const InterleaveIsa isa = [] {
    for (InterleaveIsa i : {InterleaveIsa::kAvx512Vnni, InterleaveIsa::kAvx2})
      if (interleave_runs(i)) return i;
    return InterleaveIsa::kPortable;
  }();
  return isa;
}

void interleave_rows(QuantType type, const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst) {
  require_supported(type, "interleave_rows");
  require_groups(type, rows, cols, "interleave_rows");
  const int64_t row_bytes = quant_row_bytes(type, cols), blocks = cols / block_values(type);
  const int64_t group_bytes = kGroupRows * interleaved_row_bytes(type, cols);
  for (int64_t g = 0; g < rows / kGroupRows; ++g) {
    uint8_t* group = dst + g * group_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t i = 0; i < kGroupRows; ++i) {
        const uint8_t* row = src + (g * kGroupRows + i) * row_bytes;
        if (type == QuantType::Q4_0) {
          const uint8_t* block = row + b * kQ4_0Bytes;
          uint8_t* out = group + b * kQ4_0GroupBlockBytes;
          std::memcpy(out + 2 * i, block, 2);
          for (int k = 0; k < 4; ++k) std::memcpy(out + 2 * kGroupRows + 32 * k + 4 * i, block + 2 + 4 * k, 4);
        } else if (type == QuantType::Q8_0) {
          const uint8_t* block = row + b * kQ8_0Bytes;
          uint8_t* out = group + b * kQ8_0GroupBlockBytes;
          std::memcpy(out + 2 * i, block, 2);
          for (int k = 0; k < 8; ++k) std::memcpy(out + 2 * kGroupRows + 32 * k + 4 * i, block + 2 + 4 * k, 4);
        } else if (type == QuantType::Q6_K) {
          const uint8_t* block = row + b * kQ6KBytes;
          uint8_t* out = group + b * kQ6KGroupBlockBytes;
          std::memcpy(out + 2 * i, block + 208, 2);
          for (int s = 0; s < 16; ++s) out[kQ6KScales + 16 * (s / 2) + 2 * i + s % 2] = block[192 + s];
          uint8_t u[256];
          unpack_q6k_values(block, u);
          for (int s = 0; s < 16; ++s) {
            uint8_t* c = out + kQ6KQs + kQ6KSubBlockBytes * s;
            const uint8_t* v = u + 16 * s;
            for (int t = 0; t < 4; ++t) {
              c[4 * i + t] = static_cast<uint8_t>((v[t] & 0xf) | ((v[4 + t] & 0xf) << 4));
              c[32 + 4 * i + t] = static_cast<uint8_t>((v[8 + t] & 0xf) | ((v[12 + t] & 0xf) << 4));
              c[64 + 4 * i + t] = static_cast<uint8_t>((v[t] >> 4) | ((v[4 + t] >> 4) << 2) | ((v[8 + t] >> 4) << 4) |
                                                       ((v[12 + t] >> 4) << 6));
            }
          }
        } else {
          const uint8_t* block = row + b * kQ4KBytes;
          uint8_t* out = group + b * kQ4KGroupBlockBytes;
          std::memcpy(out + 2 * i, block, 2);
          std::memcpy(out + 16 + 2 * i, block + 2, 2);
          uint8_t sc[8], mn[8];
          unpack_q4k_scales(block + 4, sc, mn);
          for (int s = 0; s < 8; ++s) {
            out[kQ4KScales + 8 * s + i] = sc[s];
            out[kQ4KMins + 16 * (s / 2) + 2 * i + s % 2] = mn[s];
          }
          for (int j = 0; j < 4; ++j)
            for (int k = 0; k < 8; ++k)
              std::memcpy(out + kQ4KQs + 256 * j + 32 * k + 4 * i, block + 16 + 32 * j + 4 * k, 4);
        }
      }
    }
  }
}

void deinterleave_row(QuantType type, const uint8_t* src, int64_t r, int64_t cols, uint8_t* row) {
  require_supported(type, "deinterleave_row");
  const int64_t blocks = cols / block_values(type);
  const int64_t i = r % kGroupRows;
  const uint8_t* group = src + (r / kGroupRows) * kGroupRows * interleaved_row_bytes(type, cols);
  for (int64_t b = 0; b < blocks; ++b) {
    if (type == QuantType::Q4_0) {
      const uint8_t* in = group + b * kQ4_0GroupBlockBytes;
      uint8_t* block = row + b * kQ4_0Bytes;
      std::memcpy(block, in + 2 * i, 2);
      for (int k = 0; k < 4; ++k) std::memcpy(block + 2 + 4 * k, in + 2 * kGroupRows + 32 * k + 4 * i, 4);
    } else if (type == QuantType::Q8_0) {
      const uint8_t* in = group + b * kQ8_0GroupBlockBytes;
      uint8_t* block = row + b * kQ8_0Bytes;
      std::memcpy(block, in + 2 * i, 2);
      for (int k = 0; k < 8; ++k) std::memcpy(block + 2 + 4 * k, in + 2 * kGroupRows + 32 * k + 4 * i, 4);
    } else if (type == QuantType::Q6_K) {
      const uint8_t* in = group + b * kQ6KGroupBlockBytes;
      uint8_t* block = row + b * kQ6KBytes;
      std::memcpy(block + 208, in + 2 * i, 2);
      for (int s = 0; s < 16; ++s) block[192 + s] = in[kQ6KScales + 16 * (s / 2) + 2 * i + s % 2];
      uint8_t u[256];
      for (int s = 0; s < 16; ++s)
        for (int m = 0; m < 4; ++m)
          for (int t = 0; t < 4; ++t) u[16 * s + 4 * m + t] = q6k_group_value(in + kQ6KQs + kQ6KSubBlockBytes * s, i, m, t);
      pack_q6k_values(u, block);
    } else {
      const uint8_t* in = group + b * kQ4KGroupBlockBytes;
      uint8_t* block = row + b * kQ4KBytes;
      std::memcpy(block, in + 2 * i, 2);
      std::memcpy(block + 2, in + 16 + 2 * i, 2);
      uint8_t sc[8], mn[8];
      for (int s = 0; s < 8; ++s) {
        sc[s] = in[kQ4KScales + 8 * s + i];
        mn[s] = in[kQ4KMins + 16 * (s / 2) + 2 * i + s % 2];
      }
      pack_q4k_scales(sc, mn, block + 4);
      for (int j = 0; j < 4; ++j)
        for (int k = 0; k < 8; ++k)
          std::memcpy(block + 16 + 32 * j + 4 * k, in + kQ4KQs + 256 * j + 32 * k + 4 * i, 4);
    }
  }
}

namespace {

// One type's group kernels, by ISA.
template <typename Acts>
struct GroupKernels {
  using Fn = void (*)(const uint8_t*, int64_t, int64_t, const Acts&, int64_t, float*, int64_t);
  Fn portable, avx2, vnni;
};

// Fills the activations' per-block terms (prepare(j_begin, j_end), once per call for every
// group), then runs the groups over the rank's thread pool.
template <typename Acts, typename Prepare>
void run_groups(InterleaveIsa isa, const GroupKernels<Acts>& kernels, const Acts& a, const Prepare& prepare,
                const uint8_t* w, int64_t rows, int64_t n, float* y, int64_t ldy) {
  if (n == 1) prepare(0, 1);
  else parallel_rows(n, 1, prepare);
  auto kernel = kernels.portable;
#if defined(__x86_64__)
  if (isa == InterleaveIsa::kAvx2) kernel = kernels.avx2;
  if (isa == InterleaveIsa::kAvx512Vnni) kernel = kernels.vnni;
#endif
  // Groups in chunks taken in turn (a row's result does not depend on the split): about eight a
  // thread, so that a slower core takes fewer of them.
  const int64_t groups = rows / kGroupRows;
  // Even, so that the AVX-512 kernels find their groups in pairs.
  const int64_t chunk = 2 * std::max<int64_t>(1, groups / (16 * ThreadPool::instance().threads()));
  parallel_chunks(groups, chunk, [&](int64_t g_begin, int64_t g_end) { kernel(w, g_begin, g_end, a, n, y, ldy); });
}

#if defined(__x86_64__)
const GroupKernels<Activations> kQ4_0Kernels = {interleaved_impl::q4_0_portable, interleaved_impl::q4_0_avx2,
                                                interleaved_impl::q4_0_avx512vnni};
const GroupKernels<Activations> kQ8_0Kernels = {interleaved_impl::q8_0_portable, interleaved_impl::q8_0_avx2,
                                                interleaved_impl::q8_0_avx512vnni};
const GroupKernels<SuperActivations> kQ4KKernels = {interleaved_impl::q4_k_portable, interleaved_impl::q4_k_avx2,
                                                    interleaved_impl::q4_k_avx512vnni};
const GroupKernels<SuperActivations> kQ6KKernels = {interleaved_impl::q6_k_portable, interleaved_impl::q6_k_avx2,
                                                    interleaved_impl::q6_k_avx512vnni};
#else
const GroupKernels<Activations> kQ4_0Kernels = {interleaved_impl::q4_0_portable, nullptr, nullptr};
const GroupKernels<Activations> kQ8_0Kernels = {interleaved_impl::q8_0_portable, nullptr, nullptr};
const GroupKernels<SuperActivations> kQ4KKernels = {interleaved_impl::q4_k_portable, nullptr, nullptr};
const GroupKernels<SuperActivations> kQ6KKernels = {interleaved_impl::q6_k_portable, nullptr, nullptr};
#endif

// The activations' per-block terms live in buffers of the calling thread, reached by the
// pool's threads through the pointers.
// Q8_0 activations for the 32-value block types: each block's scale, and its value sum times
// `offset` (the weights' unsigned offset the kernels take back out; 0: the kernels read none and
// the sums are not formed).
void matmul_blocks(InterleaveIsa isa, const GroupKernels<Activations>& kernels, int32_t offset, const uint8_t* x,
                   int64_t x_stride, int64_t n, const uint8_t* w, int64_t rows, int64_t cols, float* y, int64_t ldy) {
  const int64_t blocks = cols / 32;
  thread_local std::vector<float> da;
  thread_local std::vector<int32_t> offsets;
  da.resize(static_cast<size_t>(n * blocks));
  offsets.resize(da.size());
  Activations a;
  a.x = x;
  a.x_stride = x_stride;
  a.da = da.data();
  a.offset = offsets.data();
  a.blocks = blocks;
  float* da_data = da.data();
  int32_t* offset_data = offsets.data();
  auto prepare = [&](int64_t j_begin, int64_t j_end) {
    for (int64_t j = j_begin; j < j_end; ++j)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = x + j * x_stride + b * kQ8_0ActivationBytes;
        da_data[j * blocks + b] = quant_impl::fp16_to_fp32(load_u16(block));
        if (offset == 0) continue;
        const auto* q = reinterpret_cast<const int8_t*>(block + 2);
        int32_t sum = 0;
        for (int t = 0; t < 32; ++t) sum += q[t];
        offset_data[j * blocks + b] = offset * sum;
      }
  };
  run_groups(isa, kernels, a, prepare, w, rows, n, y, ldy);
}

// Q8_K activations for the super-block types: each block's scale, and `pairs` int32 of its
// sub-blocks' value sums, written by fill_pairs(block, out) (Q4_K: 4 pairs of 32-value sums,
// Q6_K: 8 pairs of 16-value ones).
template <typename FillPairs>
void matmul_super(InterleaveIsa isa, const GroupKernels<SuperActivations>& kernels, int64_t pairs,
                  const FillPairs& fill_pairs, const uint8_t* x, int64_t x_stride, int64_t n, const uint8_t* w,
                  int64_t rows, int64_t cols, float* y, int64_t ldy) {
  const int64_t blocks = cols / 256;
  thread_local std::vector<float> da;
  thread_local std::vector<int32_t> sum_pairs;
  da.resize(static_cast<size_t>(n * blocks));
  sum_pairs.resize(da.size() * static_cast<size_t>(pairs));
  SuperActivations a;
  a.x = x;
  a.x_stride = x_stride;
  a.da = da.data();
  a.sum_pairs = sum_pairs.data();
  a.blocks = blocks;
  float* da_data = da.data();
  int32_t* pair_data = sum_pairs.data();
  auto prepare = [&](int64_t j_begin, int64_t j_end) {
    for (int64_t j = j_begin; j < j_end; ++j)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = x + j * x_stride + b * kQ8KActivationBytes;
        std::memcpy(&da_data[j * blocks + b], block, sizeof(float));
        fill_pairs(block, &pair_data[(j * blocks + b) * pairs]);
      }
  };
  run_groups(isa, kernels, a, prepare, w, rows, n, y, ldy);
}

void matmul_q4_k(InterleaveIsa isa, const uint8_t* x, int64_t x_stride, int64_t n, const uint8_t* w, int64_t rows,
                 int64_t cols, float* y, int64_t ldy) {
  const auto fill = [](const uint8_t* block, int32_t* out) {
    int16_t bsums[16];
    std::memcpy(bsums, block + 4 + 256, sizeof bsums);
    for (int p = 0; p < 4; ++p) {
      // Sub-blocks 2p and 2p + 1, each the sum of two 16-value sums (at most 32 * 127).
      const int32_t lo = bsums[4 * p] + bsums[4 * p + 1], hi = bsums[4 * p + 2] + bsums[4 * p + 3];
      out[p] = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(lo)) |
                                    static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16);
    }
  };
  matmul_super(isa, kQ4KKernels, 4, fill, x, x_stride, n, w, rows, cols, y, ldy);
}

void matmul_q6_k(InterleaveIsa isa, const uint8_t* x, int64_t x_stride, int64_t n, const uint8_t* w, int64_t rows,
                 int64_t cols, float* y, int64_t ldy) {
  // The 16-value sums as they are: two int16 side by side make one pair.
  const auto fill = [](const uint8_t* block, int32_t* out) { std::memcpy(out, block + 4 + 256, 32); };
  matmul_super(isa, kQ6KKernels, 8, fill, x, x_stride, n, w, rows, cols, y, ldy);
}

}  // namespace

void interleaved_matmul(InterleaveIsa isa, const uint8_t* x, int64_t x_stride, int64_t n, QuantType type,
                        const uint8_t* w, int64_t rows, int64_t cols, float* y, int64_t ldy) {
  require_supported(type, "interleaved_matmul");
  if (!interleave_runs(isa))
    throw std::invalid_argument(std::string("interleaved_matmul: ") + interleave_isa_name(isa) +
                                " does not run on this processor");
  require_groups(type, rows, cols, "interleaved_matmul");
  if (n <= 0 || rows == 0) return;
  if (type == QuantType::Q4_0) return matmul_blocks(isa, kQ4_0Kernels, 8, x, x_stride, n, w, rows, cols, y, ldy);
  // Only VNNI reads Q8_0's bytes offset (as unsigned); AVX2 and the portable kernel multiply them signed.
  if (type == QuantType::Q8_0)
    return matmul_blocks(isa, kQ8_0Kernels, isa == InterleaveIsa::kAvx512Vnni ? 128 : 0, x, x_stride, n, w, rows,
                         cols, y, ldy);
  if (type == QuantType::Q6_K) return matmul_q6_k(isa, x, x_stride, n, w, rows, cols, y, ldy);
  matmul_q4_k(isa, x, x_stride, n, w, rows, cols, y, ldy);
}

}  // namespace kvpipe
