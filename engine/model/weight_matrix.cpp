#include "engine/model/weight_matrix.h"

#include "engine/kernels/cpu/interleaved_blocks.h"
#include "engine/kernels/cpu/quant_matmul.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

namespace kvpipe {
namespace {

bool is_float_type(QuantType t) { return t == QuantType::F32 || t == QuantType::F16 || t == QuantType::BF16; }

const uint8_t* bytes_of(const WeightMatrix::Part& p) { return static_cast<const uint8_t*>(p.data.data_ptr()); }

// Row r of a block part in its stored layout: in place, or rebuilt into `scratch` from its group.
const uint8_t* stored_row(const WeightMatrix::Part& p, int64_t r, int64_t cols, std::vector<uint8_t>& scratch) {
  const int64_t row_bytes = quant_row_bytes(p.type, cols);
  if (!p.interleaved) return bytes_of(p) + r * row_bytes;
  scratch.resize(static_cast<size_t>(row_bytes));
  deinterleave_row(p.type, bytes_of(p), r, cols, scratch.data());
  return scratch.data();
}

void refuse_interleaved(const std::vector<WeightMatrix::Part>& parts, const char* what) {
  for (const WeightMatrix::Part& p : parts)
    if (p.interleaved)
      throw std::invalid_argument(std::string("WeightMatrix::") + what +
                                  ": the matrix is interleaved; select or slice rows before repacking");
}

}  // namespace

QuantType quant_type_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return QuantType::F32;
    case at::kHalf: return QuantType::F16;
    case at::kBFloat16: return QuantType::BF16;
    default: throw std::invalid_argument(std::string("weight dtype ") + c10::toString(dtype) + " is not stored");
  }
}

WeightMatrix WeightMatrix::from_tensor(const at::Tensor& t) {
  if (t.dim() != 2) throw std::invalid_argument("WeightMatrix: a matrix must have 2 dimensions");
  WeightMatrix m;
  m.parts_.push_back({quant_type_of(t.scalar_type()), t.contiguous(), t.size(0)});
  m.rows_ = t.size(0);
  m.cols_ = t.size(1);
  return m;
}

WeightMatrix WeightMatrix::from_blocks(QuantType type, const at::Tensor& bytes, int64_t cols) {
  if (!quant_row_fits(type, cols))
    throw std::invalid_argument(std::string("WeightMatrix: rows of ") + std::to_string(cols) + " values are not whole " +
                                quant_name(type) + " blocks");
  if (bytes.dim() != 2 || bytes.scalar_type() != at::kByte || bytes.size(1) != quant_row_bytes(type, cols))
    throw std::invalid_argument(std::string("WeightMatrix: ") + quant_name(type) + " rows must be uint8 [rows, " +
                                std::to_string(quant_row_bytes(type, cols)) + "]");
  WeightMatrix m;
  m.parts_.push_back({type, bytes.contiguous(), bytes.size(0)});
  m.rows_ = bytes.size(0);
  m.cols_ = cols;
  return m;
}

WeightMatrix WeightMatrix::concat(const std::vector<WeightMatrix>& pieces) {
  WeightMatrix m;
  std::vector<at::Tensor> run;
  QuantType run_type = QuantType::F32;
  bool run_interleaved = false;
  auto flush = [&] {
    if (run.empty()) return;
    at::Tensor data = run.size() == 1 ? run[0] : at::cat(run);
    m.parts_.push_back({run_type, data, data.size(0), run_interleaved});
    run.clear();
  };
  for (const WeightMatrix& p : pieces) {
    if (!p.defined()) throw std::invalid_argument("WeightMatrix::concat: undefined piece");
    if (m.cols_ == 0) m.cols_ = p.cols_;
    if (p.cols_ != m.cols_) throw std::invalid_argument("WeightMatrix::concat: pieces differ in columns");
    for (const Part& part : p.parts_) {
      // Interleaved parts are whole groups of 8 rows, so two of them follow each other as one.
      const bool same = !run.empty() && part.type == run_type && part.data.scalar_type() == run[0].scalar_type() &&
                        part.interleaved == run_interleaved;
      if (!same) flush();
      run_type = part.type;
      run_interleaved = part.interleaved;
      run.push_back(part.data);
    }
    m.rows_ += p.rows_;
  }
  flush();
  return m;
}

int64_t WeightMatrix::bytes() const {
  int64_t total = 0;
  for (const Part& p : parts_) total += p.data.numel() * static_cast<int64_t>(p.data.element_size());
  return total;
}

std::string WeightMatrix::type_name() const {
  std::string name;
  for (const Part& p : parts_) {
    const std::string t = quant_name(p.type);
    if (name.empty()) name = t;
    else if (name.rfind(t) == std::string::npos) name += "+" + t;
  }
  return name;
}

bool WeightMatrix::is_dense(at::ScalarType dtype) const {
  if (parts_.empty()) return false;
  for (const Part& p : parts_)
    if (!is_float_type(p.type) || p.data.scalar_type() != dtype) return false;
  return true;
}

const void* WeightMatrix::storage_id() const { return parts_.empty() ? nullptr : parts_[0].data.data_ptr(); }

at::Tensor WeightMatrix::matmul(const at::Tensor& x, const at::Tensor& bias) const {
  if (parts_.empty()) throw std::invalid_argument("WeightMatrix::matmul: no weights");
  if (x.dim() != 2 || x.size(1) != cols_)
    throw std::invalid_argument("WeightMatrix::matmul: input of " + std::to_string(x.size(-1)) + " columns for a [" +
                                std::to_string(rows_) + ", " + std::to_string(cols_) + "] matrix");
  const at::ScalarType dtype = x.scalar_type();
  if (!x.is_cpu() || (dtype != at::kFloat && is_dense(dtype))) {
    const at::Tensor w = parts_.size() == 1 ? parts_[0].data : dequantize(dtype);
    return bias.defined() ? at::addmm(bias, x, w.t()) : at::mm(x, w.t());
  }
  // 16-bit inputs against blocks compute with float32 activations, as the kernels take them.
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t n = xf.size(0);
  at::Tensor y = at::empty({n, rows_}, xf.options());
  int64_t row0 = 0;
  for (const Part& p : parts_) {
    if (p.interleaved)
      quant_matmul_interleaved(xf.data_ptr<float>(), n, cols_, p.type, bytes_of(p), p.rows, cols_,
                               y.data_ptr<float>() + row0, rows_);
    else
      quant_matmul(xf.data_ptr<float>(), n, cols_, p.type, bytes_of(p), p.rows, cols_, y.data_ptr<float>() + row0,
                   rows_);
    row0 += p.rows;
  }
  if (bias.defined()) y.add_(bias);
  return dtype == at::kFloat ? y : y.to(dtype);
}

at::Tensor WeightMatrix::gather_rows(const at::Tensor& ids, at::ScalarType dtype) const {
  if (parts_.empty()) throw std::invalid_argument("WeightMatrix::gather_rows: no weights");
  if (!parts_[0].data.is_cpu()) {
    // Device matrices are one dense part (load_weights); the ids follow them there.
    const at::Tensor& data = parts_[0].data;
    return data.index_select(0, ids.to(data.device(), at::kLong)).to(dtype);
  }
  const at::Tensor idx = ids.to(at::kCPU).to(at::kLong).contiguous();
  const int64_t k = idx.numel();
  const int64_t* id = idx.data_ptr<int64_t>();
  if (parts_.size() == 1 && is_float_type(parts_[0].type)) return parts_[0].data.index_select(0, idx).to(dtype);
  at::Tensor out = at::empty({k, cols_}, at::TensorOptions().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  std::vector<uint8_t> scratch;
  for (int64_t i = 0; i < k; ++i) {
    int64_t r = id[i];
    if (r < 0 || r >= rows_) throw std::out_of_range("WeightMatrix::gather_rows: row " + std::to_string(r) + " of " +
                                                     std::to_string(rows_));
    for (const Part& p : parts_) {
      if (r < p.rows) {
        dequantize_row(p.type, stored_row(p, r, cols_, scratch), dst + i * cols_, cols_);
        break;
      }
      r -= p.rows;
    }
  }
  return dtype == at::kFloat ? out : out.to(dtype);
}

at::Tensor WeightMatrix::dequantize(at::ScalarType dtype) const {
  std::vector<at::Tensor> pieces;
  for (const Part& p : parts_) {
    if (is_float_type(p.type)) {
      pieces.push_back(p.data.to(dtype));
      continue;
    }
    at::Tensor f = at::empty({p.rows, cols_}, at::TensorOptions().dtype(at::kFloat));
    std::vector<uint8_t> scratch;
    for (int64_t r = 0; r < p.rows; ++r)
      dequantize_row(p.type, stored_row(p, r, cols_, scratch), f.data_ptr<float>() + r * cols_, cols_);
    pieces.push_back(f.to(dtype));
  }
  return pieces.size() == 1 ? pieces[0] : at::cat(pieces);
}

WeightMatrix WeightMatrix::select_rows(const at::Tensor& perm) const {
  if (parts_.size() != 1) throw std::invalid_argument("WeightMatrix::select_rows: only for single-part matrices");
  refuse_interleaved(parts_, "select_rows");
  WeightMatrix m = *this;
  m.parts_[0].data = parts_[0].data.index_select(0, perm.to(at::kLong)).contiguous();
  m.parts_[0].rows = perm.numel();
  m.rows_ = perm.numel();
  return m;
}

at::Tensor slice_stored(const at::Tensor& stored, QuantType type, int64_t cols, const MatrixSlice& s) {
  const int64_t rows = stored.size(0);
  const int64_t nrows = s.rows < 0 ? rows - s.row_begin : s.rows;
  const int64_t ncols = s.cols < 0 ? cols - s.col_begin : s.cols;
  if (s.row_begin < 0 || nrows < 0 || s.row_begin + nrows > rows || s.col_begin < 0 || ncols < 0 ||
      s.col_begin + ncols > cols)
    throw std::invalid_argument("slice rows [" + std::to_string(s.row_begin) + ", " + std::to_string(s.row_begin + nrows) +
                                "), columns [" + std::to_string(s.col_begin) + ", " +
                                std::to_string(s.col_begin + ncols) + ") of a [" + std::to_string(rows) + ", " +
                                std::to_string(cols) + "] matrix");
  at::Tensor view = stored.narrow(0, s.row_begin, nrows);
  if (ncols == cols) return view;
  if (is_float_type(type)) return view.narrow(1, s.col_begin, ncols);
  const QuantTraits& q = quant_traits(type);
  if (s.col_begin % q.block_values != 0 || ncols % q.block_values != 0)
    throw std::invalid_argument("columns [" + std::to_string(s.col_begin) + ", " + std::to_string(s.col_begin + ncols) +
                                ") do not fall on " + q.name + " blocks of " + std::to_string(q.block_values) +
                                " values");
  return view.narrow(1, s.col_begin / q.block_values * q.block_bytes, ncols / q.block_values * q.block_bytes);
}

WeightMatrix WeightMatrix::slice(const MatrixSlice& s) const {
  if (s.whole()) return *this;
  refuse_interleaved(parts_, "slice");
  const int64_t nrows = s.rows < 0 ? rows_ - s.row_begin : s.rows;
  const int64_t ncols = s.cols < 0 ? cols_ - s.col_begin : s.cols;
  if (s.row_begin < 0 || nrows < 0 || s.row_begin + nrows > rows_)
    throw std::invalid_argument("slice of rows [" + std::to_string(s.row_begin) + ", " +
                                std::to_string(s.row_begin + nrows) + ") of " + std::to_string(rows_));
  WeightMatrix m;
  m.cols_ = ncols;
  int64_t part_begin = 0;
  for (const Part& p : parts_) {
    const int64_t lo = std::max(s.row_begin, part_begin), hi = std::min(s.row_begin + nrows, part_begin + p.rows);
    if (lo < hi) {
      MatrixSlice local{lo - part_begin, hi - lo, s.col_begin, ncols};
      const at::Tensor data = slice_stored(p.data, p.type, cols_, local).contiguous().clone();
      m.parts_.push_back({p.type, data, hi - lo});
      m.rows_ += hi - lo;
    }
    part_begin += p.rows;
  }
  return m;
}

WeightMatrix WeightMatrix::interleaved() const {
  WeightMatrix m;
  m.rows_ = rows_;
  m.cols_ = cols_;
  for (const Part& p : parts_) {
    const int64_t grouped = p.rows / kInterleavedRows * kInterleavedRows;
    if (p.interleaved || !interleave_supports(p.type) || !p.data.is_cpu() || grouped == 0) {
      m.parts_.push_back(p);
      continue;
    }
    const at::Tensor src = p.data.contiguous();
    at::Tensor dst = at::empty({grouped, interleaved_row_bytes(p.type, cols_)}, src.options());
    interleave_rows(p.type, src.data_ptr<uint8_t>(), grouped, cols_, dst.data_ptr<uint8_t>());
    m.parts_.push_back({p.type, dst, grouped, true});
    if (grouped < p.rows) m.parts_.push_back({p.type, src.narrow(0, grouped, p.rows - grouped), p.rows - grouped});
  }
  return m;
}

int64_t WeightMatrix::interleaved_bytes() const {
  int64_t total = 0;
  for (const Part& p : parts_)
    if (p.interleaved) total += p.data.numel() * static_cast<int64_t>(p.data.element_size());
  return total;
}

WeightMatrix WeightMatrix::with_float_dtype(at::ScalarType dtype) const {
  WeightMatrix m = *this;
  for (Part& p : m.parts_) {
    if (!is_float_type(p.type) || p.data.scalar_type() == dtype) continue;
    p.data = p.data.to(dtype).contiguous();
    p.type = quant_type_of(dtype);
  }
  return m;
}

}  // namespace kvpipe
