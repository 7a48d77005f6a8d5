// The float and 32-value block types' portable half (quant_impl.h): F32, F16 and BF16 rows,
// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL blocks in ggml's layout, their F32 / Q8_0 / Q8_1
// activations, and dot
// kernels in plain C++ that are correct on any processor and are what the AVX2 kernels
// (quant_legacy_avx2.cpp) are tested against.
#include "engine/kernels/cpu/quant_impl.h"

#include "engine/kernels/cpu/half_convert.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kvpipe::quant_impl {

#if defined(__x86_64__)
// quant_legacy_avx2.cpp: Q8_0 / Q8_1 activations with the same rounding as the loop below, and
// the same exact values as legacy_dequantize_row's loops (false: a type it leaves to them).
void legacy_quantize_activation_row_avx2(ActivationType type, const float* x, void* dst,
                                         int64_t cols);
bool legacy_dequantize_row_avx2(QuantType type, const void* src, float* dst, int64_t cols);
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ8_0Bytes = 34;  // fp16 d; int8 qs[32]
constexpr int64_t kQ4_0Bytes = 18;  // fp16 d; uint8 qs[16]
constexpr int64_t kQ4_1Bytes = 20;  // fp16 d; fp16 m; uint8 qs[16]
constexpr int64_t kQ8_1Bytes = 36;  // fp16 d; fp16 s; int8 qs[32]
constexpr int64_t kQ5_0Bytes = 22;  // fp16 d; uint8 qh[4]; uint8 qs[16]
constexpr int64_t kQ5_1Bytes = 24;  // fp16 d; fp16 m; uint8 qh[4]; uint8 qs[16]
constexpr int64_t kIQ4NLBytes = 18; // fp16 d; uint8 qs[16]

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float load_half(const uint8_t* p) {
  return fp16_to_fp32(load_u16(p));
}

inline void store_half(uint8_t* p, float v) {
  const uint16_t h = fp32_to_fp16(v);
  std::memcpy(p, &h, sizeof h);
}

// The 32 values of a Q4_0 / Q4_1 block as integers: low nibbles are values 0..15, high
// nibbles values 16..31; `offset` is 8 for Q4_0 and 0 for Q4_1.
inline void unpack_nibbles(const uint8_t* qs, int offset, int8_t* q) {
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>((qs[j] & 0x0f) - offset);
    q[j + 16] = static_cast<int8_t>((qs[j] >> 4) - offset);
  }
}

// The 32 values of a Q5_0 / Q5_1 block (`qh` the four bytes of fifth bits, value i's at bit
// i of the little-endian word) as integers; `offset` 16 for Q5_0, 0 for Q5_1.
inline void unpack_five_bits(const uint8_t* qh_bytes, const uint8_t* qs, int offset, int8_t* q) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, sizeof qh);
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>(((qs[j] & 0x0f) | (((qh >> j) & 1) << 4)) - offset);
    q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - offset);
  }
}

// IQ4_NL: each nibble indexes the non-uniform grid, low nibbles values 0..15.
inline void unpack_iq4nl(const uint8_t* qs, int8_t* q) {
  for (int j = 0; j < 16; ++j) {
    q[j] = kIq4NlValues[qs[j] & 0x0f];
    q[j + 16] = kIq4NlValues[qs[j] >> 4];
  }
}

inline int32_t dot32(const int8_t* a, const int8_t* b) {
  int32_t s = 0;
  for (int i = 0; i < kBlock; ++i) s += static_cast<int32_t>(a[i]) * static_cast<int32_t>(b[i]);
  return s;
}

// ggml's quantize_row_q8_0_ref / quantize_row_q8_1_ref: d = amax / 127 and q = roundf(x / d)
// through the float reciprocal, d (and Q8_1's s = d * sum q) stored as fp16.
void quantize_q8_blocks(const float* x, uint8_t* out, int64_t cols, bool with_sum) {
  const int64_t block_bytes = with_sum ? kQ8_1Bytes : kQ8_0Bytes;
  const int64_t qs_offset = with_sum ? 4 : 2;
  for (int64_t b = 0; b < cols / kBlock; ++b, x += kBlock) {
    uint8_t* yb = out + b * block_bytes;
    float amax = 0.0f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const int q = static_cast<int>(std::roundf(x[i] * id));
      sum += q;
      yb[qs_offset + i] = static_cast<uint8_t>(static_cast<int8_t>(q));
    }
    store_half(yb, d);
    if (with_sum) store_half(yb + 2, static_cast<float>(sum) * d);
  }
}

void dequantize_q8_blocks(const uint8_t* src, float* dst, int64_t cols, int64_t block_bytes,
                          int64_t qs_offset) {
  for (int64_t b = 0; b < cols / kBlock; ++b, dst += kBlock) {
    const uint8_t* blk = src + b * block_bytes;
    const float d = load_half(blk);
    for (int64_t i = 0; i < kBlock; ++i)
      dst[i] = d * static_cast<float>(static_cast<int8_t>(blk[qs_offset + i]));
  }
}

// ---- dot kernels ----------------------------------------------------------------------
// The sums below live in arrays of kMaxKernelInputs.
void check_inputs(int inputs) {
  if (inputs < 1 || inputs > kMaxKernelInputs)
    throw std::invalid_argument("legacy portable kernel: inputs must be 1.." +
                                std::to_string(kMaxKernelInputs));
}

// Float rows: eight running sums per input (one per column mod 8) in float32, added pairwise
// at the end, so the compiler can keep them in vector registers and the error grows with
// cols / 8 rather than cols.
template <typename Load>
void dot_float_rows(const uint8_t* w, int64_t w_stride, int64_t elem_bytes, Load load,
                    const uint8_t* x, int64_t x_stride, int inputs, float* y, int64_t ldy,
                    int64_t row_begin, int64_t row_end, int64_t cols) {
  check_inputs(inputs);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w + r * w_stride;
    float acc[kMaxKernelInputs][8] = {};
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
      float wv[8];
      for (int l = 0; l < 8; ++l) wv[l] = load(row + (c + l) * elem_bytes);
      for (int j = 0; j < inputs; ++j) {
        const uint8_t* xj = x + j * x_stride + c * 4;
        for (int l = 0; l < 8; ++l) acc[j][l] += wv[l] * load_f32(xj + 4 * l);
      }
    }
    for (; c < cols; ++c) {
      const float wv = load(row + c * elem_bytes);
      for (int j = 0; j < inputs; ++j) acc[j][c & 7] += wv * load_f32(x + j * x_stride + c * 4);
    }
    for (int j = 0; j < inputs; ++j) {
      const float* a = acc[j];
      y[j * ldy + r] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    }
  }
}

void dot_f32(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, int inputs,
             float* y, int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  dot_float_rows(w, w_stride, 4, load_f32, x, x_stride, inputs, y, ldy, row_begin, row_end, cols);
}

void dot_f16(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, int inputs,
             float* y, int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  dot_float_rows(w, w_stride, 2, load_half, x, x_stride, inputs, y, ldy, row_begin, row_end, cols);
}

void dot_bf16(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, int inputs,
              float* y, int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  const auto load = [](const uint8_t* p) { return bf16_to_fp32(load_u16(p)); };
  dot_float_rows(w, w_stride, 2, load, x, x_stride, inputs, y, ldy, row_begin, row_end, cols);
}

// Block rows against 8-bit activations, as ggml's scalar vec_dot: each block's products
// summed exactly in int32, then scaled by d_w * d_x into a float32 running sum. Each weight
// block is unpacked once for all inputs.
enum class BlockKind { kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kIQ4_NL };

template <BlockKind kKind>
void dot_blocks(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, int inputs,
                float* y, int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  // Q4_1 and Q5_1 carry an offset m and take Q8_1 activations.
  constexpr bool kMin = kKind == BlockKind::kQ4_1 || kKind == BlockKind::kQ5_1;
  constexpr int64_t kWBytes = kKind == BlockKind::kQ8_0   ? kQ8_0Bytes
                              : kKind == BlockKind::kQ4_0 ? kQ4_0Bytes
                              : kKind == BlockKind::kQ4_1 ? kQ4_1Bytes
                              : kKind == BlockKind::kQ5_0 ? kQ5_0Bytes
                              : kKind == BlockKind::kQ5_1 ? kQ5_1Bytes
                                                          : kIQ4NLBytes;
  constexpr int64_t kXBytes = kMin ? kQ8_1Bytes : kQ8_0Bytes;
  constexpr int64_t kXQs = kMin ? 4 : 2;
  check_inputs(inputs);
  const int64_t blocks = cols / kBlock;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w + r * w_stride;
    float sum[kMaxKernelInputs] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = row + b * kWBytes;
      int8_t q[kBlock];
      if (kKind == BlockKind::kQ8_0)
        std::memcpy(q, wb + 2, kBlock);
      else if (kKind == BlockKind::kQ4_0)
        unpack_nibbles(wb + 2, 8, q);
      else if (kKind == BlockKind::kQ4_1)
        unpack_nibbles(wb + 4, 0, q);
      else if (kKind == BlockKind::kQ5_0)
        unpack_five_bits(wb + 2, wb + 6, 16, q);
      else if (kKind == BlockKind::kQ5_1)
        unpack_five_bits(wb + 4, wb + 8, 0, q);
      else
        unpack_iq4nl(wb + 2, q);
      const float dw = load_half(wb);
      const float mw = kMin ? load_half(wb + 2) : 0.0f;
      for (int j = 0; j < inputs; ++j) {
        const uint8_t* xb = x + j * x_stride + b * kXBytes;
        const float sumi = static_cast<float>(dot32(q, reinterpret_cast<const int8_t*>(xb + kXQs)));
        if (kMin) {
          // The offset m times the activation block's stored sum s (fp16), as ggml does: s
          // carries at most 2^-11 relative error, well under the 8-bit activations' own.
          sum[j] += (dw * load_half(xb)) * sumi + mw * load_half(xb + 2);
        } else {
          sum[j] += (dw * load_half(xb)) * sumi;
        }
      }
    }
    for (int j = 0; j < inputs; ++j) y[j * ldy + r] = sum[j];
  }
}

[[noreturn]] void unsupported(const char* what, QuantType type) {
  throw std::invalid_argument(std::string(what) + ": " + quant_name(type) +
                              " is not a float or 32-value block type");
}

}  // namespace

void legacy_dequantize_row(QuantType type, const void* src, float* dst, int64_t cols) {
#if defined(__x86_64__)
  if (use_avx2() && legacy_dequantize_row_avx2(type, src, dst, cols)) return;
#endif
  const auto* s = static_cast<const uint8_t*>(src);
  switch (type) {
    case QuantType::F32:
      std::memcpy(dst, s, static_cast<size_t>(cols) * sizeof(float));
      return;
    case QuantType::F16:
      for (int64_t i = 0; i < cols; ++i) dst[i] = fp16_to_fp32(load_u16(s + 2 * i));
      return;
    case QuantType::BF16:
      for (int64_t i = 0; i < cols; ++i) dst[i] = bf16_to_fp32(load_u16(s + 2 * i));
      return;
    case QuantType::Q8_0:
      return dequantize_q8_blocks(s, dst, cols, kQ8_0Bytes, 2);
    case QuantType::Q5_0:
    case QuantType::Q5_1: {
      const bool q5_1 = type == QuantType::Q5_1;
      const int64_t block_bytes = q5_1 ? kQ5_1Bytes : kQ5_0Bytes;
      const int64_t qh_offset = q5_1 ? 4 : 2;
      for (int64_t b = 0; b < cols / kBlock; ++b, dst += kBlock) {
        const uint8_t* blk = s + b * block_bytes;
        const float d = load_half(blk);
        int8_t q[kBlock];
        unpack_five_bits(blk + qh_offset, blk + qh_offset + 4, q5_1 ? 0 : 16, q);
        if (q5_1) {
          const float m = load_half(blk + 2);
          for (int i = 0; i < kBlock; ++i) dst[i] = d * static_cast<float>(q[i]) + m;
        } else {
          for (int i = 0; i < kBlock; ++i) dst[i] = d * static_cast<float>(q[i]);
        }
      }
      return;
    }
    case QuantType::IQ4_NL:
      for (int64_t b = 0; b < cols / kBlock; ++b, dst += kBlock) {
        const uint8_t* blk = s + b * kIQ4NLBytes;
        const float d = load_half(blk);
        int8_t q[kBlock];
        unpack_iq4nl(blk + 2, q);
        for (int i = 0; i < kBlock; ++i) dst[i] = d * static_cast<float>(q[i]);
      }
      return;
    case QuantType::Q4_0:
    case QuantType::Q4_1: {
      const bool q4_1 = type == QuantType::Q4_1;
      const int64_t block_bytes = q4_1 ? kQ4_1Bytes : kQ4_0Bytes;
      for (int64_t b = 0; b < cols / kBlock; ++b, dst += kBlock) {
        const uint8_t* blk = s + b * block_bytes;
        const float d = load_half(blk);
        int8_t q[kBlock];
        unpack_nibbles(blk + (q4_1 ? 4 : 2), q4_1 ? 0 : 8, q);
        if (q4_1) {
          const float m = load_half(blk + 2);
          for (int i = 0; i < kBlock; ++i) dst[i] = d * static_cast<float>(q[i]) + m;
        } else {
          for (int i = 0; i < kBlock; ++i) dst[i] = d * static_cast<float>(q[i]);
        }
      }
      return;
    }
    default:
      unsupported("legacy_dequantize_row", type);
  }
}

void legacy_quantize_activation_row(ActivationType type, const float* x, void* dst, int64_t cols) {
  if (type == ActivationType::F32) {
    std::memcpy(dst, x, static_cast<size_t>(cols) * sizeof(float));
    return;
  }
  if (type != ActivationType::Q8_0 && type != ActivationType::Q8_1)
    throw std::invalid_argument(
        "legacy_quantize_activation_row: not an F32, Q8_0 or Q8_1 activation");
#if defined(__x86_64__)
  if (use_avx2()) return legacy_quantize_activation_row_avx2(type, x, dst, cols);
#endif
  quantize_q8_blocks(x, static_cast<uint8_t*>(dst), cols, type == ActivationType::Q8_1);
}

void legacy_dequantize_activation_row(ActivationType type, const void* src, float* dst,
                                      int64_t cols) {
  const auto* s = static_cast<const uint8_t*>(src);
  switch (type) {
    case ActivationType::F32:
      std::memcpy(dst, s, static_cast<size_t>(cols) * sizeof(float));
      return;
    case ActivationType::Q8_0:
      return dequantize_q8_blocks(s, dst, cols, kQ8_0Bytes, 2);
    case ActivationType::Q8_1:
      return dequantize_q8_blocks(s, dst, cols, kQ8_1Bytes, 4);
    default:
      break;
  }
  throw std::invalid_argument(
      "legacy_dequantize_activation_row: not an F32, Q8_0 or Q8_1 activation");
}

bool legacy_unpack_row_u8(QuantType type, const uint8_t* row, int64_t cols, uint8_t* u, float* d, float* m) {
  int64_t block_bytes = 0;
  switch (type) {
    case QuantType::Q8_0: block_bytes = kQ8_0Bytes; break;
    case QuantType::Q4_0: block_bytes = kQ4_0Bytes; break;
    case QuantType::Q4_1: block_bytes = kQ4_1Bytes; break;
    case QuantType::Q5_0: block_bytes = kQ5_0Bytes; break;
    case QuantType::Q5_1: block_bytes = kQ5_1Bytes; break;
    case QuantType::IQ4_NL: block_bytes = kIQ4NLBytes; break;
    default: return false;
  }
  for (int64_t b = 0; b < cols / kBlock; ++b, u += kBlock) {
    const uint8_t* blk = row + b * block_bytes;
    const float scale = load_half(blk);
    int8_t q[kBlock];
    // Signed values move up into bytes by their offset, which m takes back; Q4_1's and Q5_1's
    // are unsigned already and m is their block minimum.
    int offset = 0;
    float min = 0;
    switch (type) {
      case QuantType::Q8_0: std::memcpy(q, blk + 2, kBlock), offset = 128; break;
      case QuantType::Q4_0: unpack_nibbles(blk + 2, 8, q), offset = 8; break;
      case QuantType::Q4_1: unpack_nibbles(blk + 4, 0, q), min = load_half(blk + 2); break;
      case QuantType::Q5_0: unpack_five_bits(blk + 2, blk + 6, 16, q), offset = 16; break;
      case QuantType::Q5_1: unpack_five_bits(blk + 4, blk + 8, 0, q), min = load_half(blk + 2); break;
      default: unpack_iq4nl(blk + 2, q), offset = 128; break;  // IQ4_NL
    }
    for (int64_t i = 0; i < kBlock; ++i) u[i] = static_cast<uint8_t>(q[i] + offset);
    d[b] = scale;
    m[b] = offset != 0 ? -static_cast<float>(offset) * scale : min;
  }
  return true;
}

DotKernel legacy_portable_kernel(QuantType type) {
  switch (type) {
    case QuantType::F32:
      return dot_f32;
    case QuantType::F16:
      return dot_f16;
    case QuantType::BF16:
      return dot_bf16;
    case QuantType::Q8_0:
      return dot_blocks<BlockKind::kQ8_0>;
    case QuantType::Q4_0:
      return dot_blocks<BlockKind::kQ4_0>;
    case QuantType::Q4_1:
      return dot_blocks<BlockKind::kQ4_1>;
    case QuantType::Q5_0:
      return dot_blocks<BlockKind::kQ5_0>;
    case QuantType::Q5_1:
      return dot_blocks<BlockKind::kQ5_1>;
    case QuantType::IQ4_NL:
      return dot_blocks<BlockKind::kIQ4_NL>;
    default:
      unsupported("legacy_portable_kernel", type);
  }
}

}  // namespace kvpipe::quant_impl
