// Scalar float16 / bfloat16 <-> float32 conversions in plain C++ for the portable kernels and
// the block scales: bit for bit what F16C's vcvtph2ps / vcvtps2ph (round to nearest even) give,
// so the portable and the vector paths quantise activations to the same bytes.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvpipe::quant_impl {

inline float bits_to_fp32(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t fp32_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// Without branches, so loops over rows of halves can vectorise.
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t magnitude = h & 0x7fffu;
  // Normal: rebias the exponent from 15 to 127; inf / NaN (exponent 31) once more to 255.
  const uint32_t normal =
      (magnitude << 13) + (112u << 23) + (magnitude >= 0x7c00u ? 112u << 23 : 0u);
  // Subnormal: the count times 2^-24, both exact in float32. Integer arithmetic rather than
  // scaling a float32 subnormal, which a flush-to-zero mode would zero.
  const uint32_t subnormal = fp32_to_bits(static_cast<float>(magnitude) * 0x1p-24f);
  return bits_to_fp32(sign | (magnitude < 0x0400u ? subnormal : normal));
}

inline uint16_t fp32_to_fp16(float f) {
  const uint32_t x = fp32_to_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u)
    return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // quiet NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);     // rounds past 65504: inf
  if (a < 0x38800000u) {
    // Below the smallest normal half: a multiple of 2^-24, rounded to nearest even.
    if (a <= 0x33000000u) return static_cast<uint16_t>(sign);  // at most half of 2^-24
    const uint32_t exponent = a >> 23;
    const uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // 14..24
    const uint32_t q = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    const uint32_t rounded = q + ((rest > half || (rest == half && (q & 1u))) ? 1u : 0u);
    return static_cast<uint16_t>(sign | rounded);
  }
  uint32_t out = (a >> 13) - (112u << 10);
  const uint32_t rest = a & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (out & 1u))) ++out;  // a carry rolls into the exponent
  return static_cast<uint16_t>(sign | out);
}

inline float bf16_to_fp32(uint16_t b) {
  return bits_to_fp32(static_cast<uint32_t>(b) << 16);
}

// Round to nearest even, as llama.cpp's GGML_FP32_TO_BF16 (NaN stays a quiet NaN; subnormals
// are kept, unlike vcvtneps2bf16, which flushes them).
inline uint16_t fp32_to_bf16(float f) {
  const uint32_t x = fp32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace kvpipe::quant_impl
