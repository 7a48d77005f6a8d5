// Random weight rows of every stored type, and y = x W^T in float64 from the dequantised
// weights and the activations as the kernels see them: what the CPU matmul tests check against.
#pragma once

#include "engine/kernels/cpu/quant_types.h"

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace kvpipe::test {

inline uint16_t half_bits(float f) {
  const at::Half h(f);
  return h.x;
}

// Random rows of `type` with modest finite scales.
inline std::vector<uint8_t> random_rows(QuantType type, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const QuantTraits& t = quant_traits(type);
  const int64_t row_bytes = quant_row_bytes(type, cols);
  std::vector<uint8_t> w(static_cast<size_t>(rows * row_bytes));
  if (type == QuantType::F32) {
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float v = 0.1f * normal(gen);
      std::memcpy(&w[4 * i], &v, 4);
    }
    return w;
  }
  if (type == QuantType::F16 || type == QuantType::BF16) {
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float v = 0.1f * normal(gen);
      uint16_t bits = half_bits(v);
      if (type == QuantType::BF16) {
        uint32_t f;
        std::memcpy(&f, &v, 4);
        bits = static_cast<uint16_t>(f >> 16);
      }
      std::memcpy(&w[2 * i], &bits, 2);
    }
    return w;
  }
  for (auto& b : w) b = static_cast<uint8_t>(byte(gen));
  const int64_t blocks = rows * cols / t.block_values;
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* p = w.data() + b * t.block_bytes;
    const uint16_t d = half_bits(0.01f + 0.01f * std::abs(normal(gen)));
    const uint16_t m = half_bits(-0.02f * std::abs(normal(gen)));
    if (type == QuantType::Q6_K) {
      std::memcpy(p + 208, &d, 2);
    } else if (type == QuantType::Q3_K) {
      std::memcpy(p + 108, &d, 2);
    } else if (type == QuantType::Q2_K) {
      std::memcpy(p + 80, &d, 2);
      std::memcpy(p + 82, &m, 2);
    } else {
      std::memcpy(p, &d, 2);
      if (type == QuantType::Q4_1 || type == QuantType::Q5_1 || type == QuantType::Q4_K || type == QuantType::Q5_K)
        std::memcpy(p + 2, &m, 2);
    }
  }
  return w;
}

// y = x W^T in float64 from the dequantised weights and the activations as the kernels see them;
// `magnitude` gets sum |w x| per output, the scale of float32 rounding in any summation order.
inline std::vector<double> reference(QuantType type, const std::vector<uint8_t>& w, const std::vector<float>& x, int64_t n,
                              int64_t rows, int64_t cols, std::vector<double>* magnitude = nullptr) {
  const ActivationType at = quant_traits(type).activation;
  std::vector<float> wf(static_cast<size_t>(cols)), xf(static_cast<size_t>(n * cols));
  std::vector<uint8_t> xq(static_cast<size_t>(activation_row_bytes(at, cols)));
  for (int64_t i = 0; i < n; ++i) {
    quantize_activation_row(at, x.data() + i * cols, xq.data(), cols);
    dequantize_activation_row(at, xq.data(), xf.data() + i * cols, cols);
  }
  std::vector<double> y(static_cast<size_t>(n * rows));
  if (magnitude) magnitude->assign(static_cast<size_t>(n * rows), 0.0);
  const int64_t row_bytes = quant_row_bytes(type, cols);
  for (int64_t r = 0; r < rows; ++r) {
    dequantize_row(type, w.data() + r * row_bytes, wf.data(), cols);
    for (int64_t i = 0; i < n; ++i) {
      double s = 0, a = 0;
      for (int64_t c = 0; c < cols; ++c) {
        s += static_cast<double>(wf[c]) * xf[i * cols + c];
        a += std::abs(static_cast<double>(wf[c]) * xf[i * cols + c]);
      }
      y[i * rows + r] = s;
      if (magnitude) (*magnitude)[i * rows + r] = a;
    }
  }
  return y;
}

}  // namespace kvpipe::test
