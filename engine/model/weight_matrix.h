// WeightMatrix: one projection matrix [rows, cols] in the type its file stores it in.
//
// A matrix is one or more parts whose rows follow each other (the fused q/k/v and gate/up
// projections, whose pieces a quantised file may store in different types: Q4_K_M keeps some
// v and down projections in Q6_K). Each part is either a float32/float16/bfloat16 tensor
// [rows, cols] or ggml blocks, a uint8 tensor [rows, quant_row_bytes(type, cols)], and is
// never expanded to float32 for the whole run: `matmul` computes with the stored bytes
// (engine/kernels/cpu/quant_matmul.h) and `gather_rows` dequantises just the rows it is given
// (the embedding lookup). `interleaved` repacks the parts whose type has an interleaved layout
// (engine/kernels/cpu/interleaved_blocks.h) in groups of 8 rows, once, for the CPU kernels
// that read 8 rows at a time: the same values in another order (Q4_K's scales a byte each),
// which every reader here (products, row lookups, dequantisation) understands.
#pragma once

#include "engine/kernels/cpu/quant_types.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvpipe {

// Rows [row_begin, row_begin + rows) and columns [col_begin, col_begin + cols) of a matrix
// (rows or cols -1: all of them): a tensor rank's slice (engine/model/tensor_split.h).
struct MatrixSlice {
  int64_t row_begin = 0, rows = -1;
  int64_t col_begin = 0, cols = -1;
  bool whole() const { return row_begin == 0 && rows < 0 && col_begin == 0 && cols < 0; }
};

// The slice of `stored` (float [rows, cols] or ggml block rows uint8 [rows, row bytes] of
// `type` over `cols` values) as a view: no byte is copied. Columns must start and end on the
// type's blocks (std::invalid_argument otherwise).
at::Tensor slice_stored(const at::Tensor& stored, QuantType type, int64_t cols, const MatrixSlice& slice);

class WeightMatrix {
 public:
  struct Part {
    QuantType type = QuantType::F32;
    at::Tensor data;   // float [rows, cols], or uint8 [rows, row bytes] for the block types
    int64_t rows = 0;
    // Rows in groups of 8 (interleaved_blocks.h): data uint8 [rows, interleaved_row_bytes], rows
    // a multiple of 8.
    bool interleaved = false;
  };

  WeightMatrix() = default;
  // A 2-D float32, float16 or bfloat16 tensor (made contiguous).
  static WeightMatrix from_tensor(const at::Tensor& t);
  // Rows of ggml blocks: `bytes` uint8 [rows, quant_row_bytes(type, cols)] on the CPU.
  static WeightMatrix from_blocks(QuantType type, const at::Tensor& bytes, int64_t cols);
  // The rows of `pieces` one after the other (all with the same cols); adjacent parts of one
  // type are merged into one buffer.
  static WeightMatrix concat(const std::vector<WeightMatrix>& pieces);

  bool defined() const { return !parts_.empty(); }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  const std::vector<Part>& parts() const { return parts_; }
  // Bytes held (what a rank's memory pays for this matrix).
  int64_t bytes() const;
  // "Q4_K", or the parts' types joined with '+' ("Q4_K+Q6_K").
  std::string type_name() const;
  // Whether every part is a float tensor of `dtype`.
  bool is_dense(at::ScalarType dtype) const;
  // Identity of the first part's storage (a tied LM head shares the embedding's).
  const void* storage_id() const;

  // x [n, cols] -> [n, rows] = x W^T (+ bias), in x's dtype. Float32 inputs on the CPU run the
  // stored-type kernels; 16-bit inputs against dense weights of the same dtype run LibTorch.
  at::Tensor matmul(const at::Tensor& x, const at::Tensor& bias = {}) const;
  // Rows `ids` (int64) dequantised to `dtype`: [ids, cols].
  at::Tensor gather_rows(const at::Tensor& ids, at::ScalarType dtype) const;
  // The whole matrix as `dtype` [rows, cols] (references and tests).
  at::Tensor dequantize(at::ScalarType dtype = c10::ScalarType::Float) const;
  // Rows `perm` of this matrix, in that order (GGUF's per-head q/k row permutation); only
  // for single-part matrices, not interleaved (as `slice`).
  WeightMatrix select_rows(const at::Tensor& perm) const;
  // A copy of `slice` of this matrix (columns on block boundaries).
  WeightMatrix slice(const MatrixSlice& slice) const;
  // A copy with every part of a type that has an interleaved layout repacked: its rows up to
  // the last whole group of 8 become an interleaved part, the rest (fewer than 8) stay as
  // stored. Parts already interleaved, and other types, are shared as they are.
  WeightMatrix interleaved() const;
  // Bytes held in interleaved parts.
  int64_t interleaved_bytes() const;
  // Float parts converted to `dtype` (block parts stay as they are).
  WeightMatrix with_float_dtype(at::ScalarType dtype) const;

 private:
  std::vector<Part> parts_;
  int64_t rows_ = 0;
  int64_t cols_ = 0;
};

// The stored type of a float tensor's dtype (float32, float16, bfloat16).
QuantType quant_type_of(at::ScalarType dtype);

}  // namespace kvpipe
