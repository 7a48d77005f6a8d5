// The 256-value super-block types' portable half (quant_impl.h): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
// and IQ4_XS super-blocks in ggml's layout, their Q8_K activations, and dot kernels in plain C++ that are correct on
// any processor and are what the AVX2 kernels (quant_k_avx2.cpp) are tested against.
#include "engine/kernels/cpu/half_convert.h"
#include "engine/kernels/cpu/quant_impl.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kvpipe::quant_impl {

#if defined(__x86_64__)
// quant_k_avx2.cpp: the same rounding as the portable loop below, eight values at a time.
void k_quantize_activation_row_avx2(const float* x, void* dst, int64_t cols);
#endif

namespace {

constexpr int64_t kSuperBlock = 256;
constexpr int64_t kQ4KBytes = 144;
constexpr int64_t kQ5KBytes = 176;
constexpr int64_t kQ6KBytes = 210;
constexpr int64_t kQ2KBytes = 84;
constexpr int64_t kQ3KBytes = 110;
constexpr int64_t kIQ4XSBytes = 136;
constexpr int64_t kQ8KBytes = 292;
// Offsets inside a block_q8_K.
constexpr int64_t kQ8KQs = 4;
constexpr int64_t kQ8KBsums = 4 + kSuperBlock;

float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return fp16_to_fp32(h);
}

float load_float(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof f);
  return f;
}

// a * b rounded to float by itself. ggml's C build computes the product so; a compiler allowed
// to contract (C++ with FMA at hand) would fuse it into nearest_int's addition and round the
// exact product instead, which differs where the product lands next to a half.
float rounded_product(float a, float b) {
  volatile float p = a * b;
  return p;
}

// ggml's nearest_int: adding 1.5 * 2^23 leaves the rounded integer in the low mantissa bits
// (ties to even), which is what the activation quantiser must reproduce bit for bit.
int nearest_int(float v) {
  const float shifted = v + 12582912.f;
  int32_t i;
  std::memcpy(&i, &shifted, sizeof i);
  return (i & 0x007fffff) - 0x00400000;
}

// The eight 6-bit scales and eight 6-bit mins packed in the 12 bytes of a Q4_K/Q5_K block
// (ggml's get_scale_min_k4): the first four of each in the low 6 bits of bytes 0-7, the last
// four split into a low nibble in bytes 8-11 and two high bits on top of bytes 0-7.
void unpack_scales_mins(const uint8_t* q, int* sc, int* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    mn[j] = q[j + 4] & 63;
  }
  for (int j = 4; j < 8; ++j) {
    sc[j] = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
    mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_K: d, dmin, scales[12], qs[128]; values in sub-block order, each 0..15.
void unpack_q4k(const uint8_t* b, uint8_t* q) {
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      q[64 * j + l] = qs[32 * j + l] & 0xf;
      q[64 * j + 32 + l] = qs[32 * j + l] >> 4;
    }
}

// Q5_K: d, dmin, scales[12], qh[32], qs[128]; bit s of qh[l] is the fifth bit of value l of
// sub-block s. Values 0..31.
void unpack_q5k(const uint8_t* b, uint8_t* q) {
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      q[64 * j + l] = static_cast<uint8_t>((qs[32 * j + l] & 0xf) | (((qh[l] >> (2 * j)) & 1) << 4));
      q[64 * j + 32 + l] = static_cast<uint8_t>((qs[32 * j + l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4));
    }
}

// Q6_K: ql[128], qh[64], scales[16], d. Each half of 128 values takes 64 bytes of ql (low
// nibbles, then high nibbles) and 32 of qh (two bits per value, four values a byte). Values
// -32..31.
void unpack_q6k(const uint8_t* b, int8_t* q) {
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    int8_t* out = q + 128 * h;
    for (int l = 0; l < 32; ++l) {
      out[l] = static_cast<int8_t>(((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32);
      out[l + 32] = static_cast<int8_t>(((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32);
      out[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      out[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
  }
}

// Q2_K: scales[16], qs[64], d, dmin. Value 128h + 32k + l (l < 32) is bits 2k, 2k+1 of
// qs[32h + l]; values 0..3 in sixteen sub-blocks of 16.
void unpack_q2k(const uint8_t* b, uint8_t* q) {
  const uint8_t* qs = b + 16;
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 32; ++l) q[128 * h + 32 * k + l] = (qs[32 * h + l] >> (2 * k)) & 3;
}

// Q3_K: hmask[32], qs[64], scales[12], d. The low two bits as Q2_K's; the third is bit 4h + k
// of hmask[l], and a clear bit means 4 below (values -4..3).
void unpack_q3k(const uint8_t* b, int8_t* q) {
  const uint8_t* hm = b;
  const uint8_t* qs = b + 32;
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 32; ++l)
        q[128 * h + 32 * k + l] = static_cast<int8_t>(((qs[32 * h + l] >> (2 * k)) & 3) -
                                                      (((hm[l] >> (4 * h + k)) & 1) ? 0 : 4));
}

// Q3_K's sixteen 6-bit scales, less their offset of 32: the low nibbles of bytes 0-7 are
// scales 0-7 and their high nibbles scales 8-15; bits 2j, 2j+1 of byte 8 + i % 4 are the top
// bits of scale i with j = i / 4.
void unpack_q3k_scales(const uint8_t* s, int* sc) {
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? s[i] & 0xf : s[i - 8] >> 4;
    const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    sc[i] = (low | (high << 4)) - 32;
  }
}

// IQ4_XS: d, scales_h (16 bits), scales_l[4], qs[128]. Eight sub-blocks of 32 with 6-bit
// scales less 32 (low nibble in scales_l, top two bits in scales_h); each sub-block's 16 bytes
// of nibbles index the IQ4_NL grid, low nibbles first.
void unpack_iq4xs(const uint8_t* b, int8_t* q, int* sc) {
  uint16_t high;
  std::memcpy(&high, b + 2, sizeof high);
  const uint8_t* low = b + 4;
  const uint8_t* qs = b + 8;
  for (int ib = 0; ib < 8; ++ib) {
    sc[ib] = (((low[ib / 2] >> (4 * (ib % 2))) & 0xf) | (((high >> (2 * ib)) & 3) << 4)) - 32;
    for (int j = 0; j < 16; ++j) {
      q[32 * ib + j] = kIq4NlValues[qs[16 * ib + j] & 0xf];
      q[32 * ib + 16 + j] = kIq4NlValues[qs[16 * ib + j] >> 4];
    }
  }
}

template <typename Q>
int32_t dot_i8(const Q* q, const int8_t* a, int n) {
  int32_t s = 0;
  for (int l = 0; l < n; ++l) s += static_cast<int32_t>(q[l]) * a[l];
  return s;
}

int32_t bsum_of(const uint8_t* xb, int k) {
  int16_t s;
  std::memcpy(&s, xb + kQ8KBsums + 2 * k, sizeof s);
  return s;
}

// Q4_K and Q5_K: value = d * sc * q - dmin * m. As ggml's generic kernel: the scaled integer
// products summed per super-block in int32, the mins through the activation block sums, and
// the two scales applied in float.
template <bool kFiveBit>
void dot_q45k(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, int inputs, float* y,
              int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  const int64_t blocks = cols / kSuperBlock;
  const int64_t block_bytes = kFiveBit ? kQ5KBytes : kQ4KBytes;
  uint8_t q[kSuperBlock];
  int sc[8], mn[8];
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w + r * w_stride;
    float acc[kMaxKernelInputs] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = row + b * block_bytes;
      const float d = load_half(wb);
      const float dmin = load_half(wb + 2);
      unpack_scales_mins(wb + 4, sc, mn);
      if (kFiveBit)
        unpack_q5k(wb, q);
      else
        unpack_q4k(wb, q);
      for (int i = 0; i < inputs; ++i) {
        const uint8_t* xb = x + i * x_stride + b * kQ8KBytes;
        const int8_t* a = reinterpret_cast<const int8_t*>(xb + kQ8KQs);
        int32_t sumi = 0, summ = 0;
        for (int s = 0; s < 8; ++s) {
          sumi += sc[s] * dot_i8(q + 32 * s, a + 32 * s, 32);
          summ += mn[s] * (bsum_of(xb, 2 * s) + bsum_of(xb, 2 * s + 1));
        }
        const float xd = load_float(xb);
        acc[i] += xd * d * static_cast<float>(sumi) - xd * dmin * static_cast<float>(summ);
      }
    }
    for (int i = 0; i < inputs; ++i) y[i * ldy + r] = acc[i];
  }
}

// The types whose values are d * sc[s] * q with a signed integer scale per sub-block of kSub
// values and no min: Q3_K and Q6_K (16 sub-blocks of 16) and IQ4_XS (8 of 32). `unpack` gives
// a super-block's signed values and scales, and returns its d.
using UnpackScaled = float (*)(const uint8_t* block, int8_t* q, int* sc);

float unpack_q3k_block(const uint8_t* b, int8_t* q, int* sc) {
  unpack_q3k(b, q);
  unpack_q3k_scales(b + 96, sc);
  return load_half(b + 108);
}

float unpack_q6k_block(const uint8_t* b, int8_t* q, int* sc) {
  unpack_q6k(b, q);
  for (int s = 0; s < 16; ++s) sc[s] = static_cast<int8_t>(b[192 + s]);
  return load_half(b + 208);
}

float unpack_iq4xs_block(const uint8_t* b, int8_t* q, int* sc) {
  unpack_iq4xs(b, q, sc);
  return load_half(b);
}

template <int kSub, int64_t kBlockBytes, UnpackScaled kUnpack>
void dot_scaled(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, int inputs, float* y,
                int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  const int64_t blocks = cols / kSuperBlock;
  int8_t q[kSuperBlock];
  int sc[kSuperBlock / kSub];
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w + r * w_stride;
    float acc[kMaxKernelInputs] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const float d = kUnpack(row + b * kBlockBytes, q, sc);
      for (int i = 0; i < inputs; ++i) {
        const uint8_t* xb = x + i * x_stride + b * kQ8KBytes;
        const int8_t* a = reinterpret_cast<const int8_t*>(xb + kQ8KQs);
        int32_t sumi = 0;
        for (int s = 0; s < kSuperBlock / kSub; ++s) sumi += sc[s] * dot_i8(q + kSub * s, a + kSub * s, kSub);
        acc[i] += load_float(xb) * d * static_cast<float>(sumi);
      }
    }
    for (int i = 0; i < inputs; ++i) y[i * ldy + r] = acc[i];
  }
}

// ggml's order of operations: the sub-block scale d * sc first, then times q.
template <int kSub, int64_t kBlockBytes, UnpackScaled kUnpack>
void dequantize_scaled(const uint8_t* src, float* dst, int64_t cols) {
  int8_t q[kSuperBlock];
  int sc[kSuperBlock / kSub];
  for (int64_t b = 0; b < cols / kSuperBlock; ++b) {
    const float d = kUnpack(src + b * kBlockBytes, q, sc);
    float* out = dst + b * kSuperBlock;
    for (int s = 0; s < kSuperBlock / kSub; ++s) {
      const float ds = d * static_cast<float>(sc[s]);
      for (int l = 0; l < kSub; ++l) out[kSub * s + l] = ds * static_cast<float>(q[kSub * s + l]);
    }
  }
}

// Q2_K: value = d * (sc & 15) * q - dmin * (sc >> 4), the mins through the activation sums.
void dot_q2k(const uint8_t* w, int64_t w_stride, const uint8_t* x, int64_t x_stride, int inputs, float* y,
             int64_t ldy, int64_t row_begin, int64_t row_end, int64_t cols) {
  const int64_t blocks = cols / kSuperBlock;
  uint8_t q[kSuperBlock];
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w + r * w_stride;
    float acc[kMaxKernelInputs] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = row + b * kQ2KBytes;
      const float d = load_half(wb + 80);
      const float dmin = load_half(wb + 82);
      unpack_q2k(wb, q);
      for (int i = 0; i < inputs; ++i) {
        const uint8_t* xb = x + i * x_stride + b * kQ8KBytes;
        const int8_t* a = reinterpret_cast<const int8_t*>(xb + kQ8KQs);
        int32_t sumi = 0, summ = 0;
        for (int s = 0; s < 16; ++s) {
          sumi += (wb[s] & 0xf) * dot_i8(q + 16 * s, a + 16 * s, 16);
          summ += (wb[s] >> 4) * bsum_of(xb, s);
        }
        const float xd = load_float(xb);
        acc[i] += xd * d * static_cast<float>(sumi) - xd * dmin * static_cast<float>(summ);
      }
    }
    for (int i = 0; i < inputs; ++i) y[i * ldy + r] = acc[i];
  }
}

// ggml's order of operations: the sub-block scale d * sc first, then times q, less dmin * m.
void dequantize_q2k(const uint8_t* src, float* dst, int64_t cols) {
  uint8_t q[kSuperBlock];
  for (int64_t b = 0; b < cols / kSuperBlock; ++b) {
    const uint8_t* wb = src + b * kQ2KBytes;
    const float d = load_half(wb + 80);
    const float dmin = load_half(wb + 82);
    unpack_q2k(wb, q);
    float* out = dst + b * kSuperBlock;
    for (int s = 0; s < 16; ++s) {
      const float dl = d * static_cast<float>(wb[s] & 0xf);
      const float ml = dmin * static_cast<float>(wb[s] >> 4);
      for (int l = 0; l < 16; ++l) out[16 * s + l] = dl * static_cast<float>(q[16 * s + l]) - ml;
    }
  }
}

void dequantize_q45k(const uint8_t* src, float* dst, int64_t cols, bool five_bit) {
  const int64_t block_bytes = five_bit ? kQ5KBytes : kQ4KBytes;
  uint8_t q[kSuperBlock];
  int sc[8], mn[8];
  for (int64_t b = 0; b < cols / kSuperBlock; ++b) {
    const uint8_t* wb = src + b * block_bytes;
    const float d = load_half(wb);
    const float dmin = load_half(wb + 2);
    unpack_scales_mins(wb + 4, sc, mn);
    if (five_bit)
      unpack_q5k(wb, q);
    else
      unpack_q4k(wb, q);
    float* out = dst + b * kSuperBlock;
    for (int s = 0; s < 8; ++s) {
      // ggml's order of operations: (d * sc) * q - dmin * m.
      const float ds = d * static_cast<float>(sc[s]);
      const float ms = dmin * static_cast<float>(mn[s]);
      for (int l = 0; l < 32; ++l) out[32 * s + l] = ds * static_cast<float>(q[32 * s + l]) - ms;
    }
  }
}

}  // namespace

bool k_unpack_row_u8(QuantType type, const uint8_t* row, int64_t cols, uint8_t* u, float* d, float* m) {
  const int64_t blocks = cols / kSuperBlock;
  switch (type) {
    case QuantType::Q4_K:
    case QuantType::Q5_K:
      for (int64_t b = 0; b < blocks; ++b, u += kSuperBlock, d += 8, m += 8) {
        const bool five = type == QuantType::Q5_K;
        const uint8_t* wb = row + b * (five ? kQ5KBytes : kQ4KBytes);
        int sc[8], mn[8];
        unpack_scales_mins(wb + 4, sc, mn);
        if (five)
          unpack_q5k(wb, u);
        else
          unpack_q4k(wb, u);
        const float scale = load_half(wb), min_scale = load_half(wb + 2);
        for (int s = 0; s < 8; ++s) {
          d[s] = scale * static_cast<float>(sc[s]);
          m[s] = -(min_scale * static_cast<float>(mn[s]));
        }
      }
      return true;
    case QuantType::Q2_K:
      for (int64_t b = 0; b < blocks; ++b, u += kSuperBlock, d += 16, m += 16) {
        const uint8_t* wb = row + b * kQ2KBytes;
        unpack_q2k(wb, u);
        const float scale = load_half(wb + 80), min_scale = load_half(wb + 82);
        for (int s = 0; s < 16; ++s) {
          d[s] = scale * static_cast<float>(wb[s] & 0xf);
          m[s] = -(min_scale * static_cast<float>(wb[s] >> 4));
        }
      }
      return true;
    case QuantType::Q3_K:
    case QuantType::Q6_K:
    case QuantType::IQ4_XS: {
      // Signed values d * sc * q: shifted up by `offset` into bytes, m takes it back.
      const int offset = type == QuantType::Q3_K ? 4 : type == QuantType::Q6_K ? 32 : 128;
      const int sub = type == QuantType::IQ4_XS ? 8 : 16;
      const int64_t block_bytes = type == QuantType::Q3_K ? kQ3KBytes : type == QuantType::Q6_K ? kQ6KBytes : kIQ4XSBytes;
      const UnpackScaled unpack =
          type == QuantType::Q3_K ? unpack_q3k_block : type == QuantType::Q6_K ? unpack_q6k_block : unpack_iq4xs_block;
      for (int64_t b = 0; b < blocks; ++b, u += kSuperBlock, d += sub, m += sub) {
        int8_t q[kSuperBlock];
        int sc[16];
        const float scale = unpack(row + b * block_bytes, q, sc);
        for (int l = 0; l < kSuperBlock; ++l) u[l] = static_cast<uint8_t>(q[l] + offset);
        for (int s = 0; s < sub; ++s) {
          d[s] = scale * static_cast<float>(sc[s]);
          m[s] = -static_cast<float>(offset) * d[s];
        }
      }
      return true;
    }
    default: return false;
  }
}

void k_dequantize_row(QuantType type, const void* src, float* dst, int64_t cols) {
  const auto* s = static_cast<const uint8_t*>(src);
  switch (type) {
    case QuantType::Q4_K: return dequantize_q45k(s, dst, cols, false);
    case QuantType::Q5_K: return dequantize_q45k(s, dst, cols, true);
    case QuantType::Q6_K: return dequantize_scaled<16, kQ6KBytes, unpack_q6k_block>(s, dst, cols);
    case QuantType::Q2_K: return dequantize_q2k(s, dst, cols);
    case QuantType::Q3_K: return dequantize_scaled<16, kQ3KBytes, unpack_q3k_block>(s, dst, cols);
    case QuantType::IQ4_XS: return dequantize_scaled<32, kIQ4XSBytes, unpack_iq4xs_block>(s, dst, cols);
    default: break;
  }
  throw std::invalid_argument(std::string("k_dequantize_row: ") + quant_name(type) + " is not a 256-value super-block type");
}

void k_quantize_activation_row(const float* x, void* dst, int64_t cols) {
#if defined(__x86_64__)
  if (use_avx2()) return k_quantize_activation_row_avx2(x, dst, cols);
#endif
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t b = 0; b < cols / kSuperBlock; ++b, x += kSuperBlock) {
    uint8_t* yb = out + b * kQ8KBytes;
    int8_t qs[kSuperBlock];
    int16_t bsums[16];
    // The signed value of largest magnitude, the first one on ties, as ggml picks it.
    float max = 0, amax = 0;
    for (int j = 0; j < kSuperBlock; ++j) {
      const float ax = std::fabs(x[j]);
      if (ax > amax) {
        amax = ax;
        max = x[j];
      }
    }
    float d = 0;
    if (amax == 0) {
      std::memset(qs, 0, sizeof qs);
    } else {
      const float iscale = -127.f / max;
      for (int j = 0; j < kSuperBlock; ++j) {
        const int v = nearest_int(rounded_product(iscale, x[j]));
        qs[j] = static_cast<int8_t>(v < 127 ? v : 127);
      }
      d = 1 / iscale;
    }
    for (int k = 0; k < 16; ++k) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) sum += qs[16 * k + l];
      bsums[k] = static_cast<int16_t>(sum);
    }
    std::memcpy(yb, &d, sizeof d);
    std::memcpy(yb + kQ8KQs, qs, sizeof qs);
    std::memcpy(yb + kQ8KBsums, bsums, sizeof bsums);
  }
}

void k_dequantize_activation_row(const void* src, float* dst, int64_t cols) {
  const auto* s = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < cols / kSuperBlock; ++b) {
    const uint8_t* xb = s + b * kQ8KBytes;
    const float d = load_float(xb);
    const int8_t* qs = reinterpret_cast<const int8_t*>(xb + kQ8KQs);
    for (int j = 0; j < kSuperBlock; ++j) dst[b * kSuperBlock + j] = d * static_cast<float>(qs[j]);
  }
}

DotKernel k_portable_kernel(QuantType type) {
  switch (type) {
    case QuantType::Q4_K: return dot_q45k<false>;
    case QuantType::Q5_K: return dot_q45k<true>;
    case QuantType::Q6_K: return dot_scaled<16, kQ6KBytes, unpack_q6k_block>;
    case QuantType::Q2_K: return dot_q2k;
    case QuantType::Q3_K: return dot_scaled<16, kQ3KBytes, unpack_q3k_block>;
    case QuantType::IQ4_XS: return dot_scaled<32, kIQ4XSBytes, unpack_iq4xs_block>;
    default: break;
  }
  throw std::invalid_argument(std::string("k_portable_kernel: ") + quant_name(type) + " is not a 256-value super-block type");
}

}  // namespace kvpipe::quant_impl
