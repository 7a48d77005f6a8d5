#include "engine/kernels/cpu/quant_matmul.h"

#include "engine/kernels/cpu/thread_pool.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <vector>

extern "C" void openblas_set_num_threads(int);

namespace kvpipe {
namespace {

// Weight rows a thread runs every group of inputs over before moving on: small enough that
// the slice (up to 64 rows of 8192 F32 values = 2 MiB; far less for the quantised types)
// is still in the core's cache when the next group reads it.
int64_t rows_per_slice(int64_t row_bytes) {
  return std::clamp<int64_t>((256 << 10) / std::max<int64_t>(row_bytes, 1), 4, 64);
}

// Rows of a dequantised tile on the BLAS path: large enough for sgemm to run near its peak.
constexpr int64_t kBlasTileRows = 128;

enum class Forced { kAuto, kKernel, kBlas };

Forced forced_path() {
  static const Forced f = [] {
    const char* env = std::getenv("KVPIPE_CPU_MATMUL");
    if (env == nullptr || !*env || std::strcmp(env, "auto") == 0) return Forced::kAuto;
    if (std::strcmp(env, "kernel") == 0) return Forced::kKernel;
    if (std::strcmp(env, "blas") == 0) return Forced::kBlas;
    throw std::invalid_argument(std::string("KVPIPE_CPU_MATMUL: '") + env + "' is not auto, kernel or blas");
  }();
  return f;
}

// The activations of one call, in the form the type's kernel reads them. The quantised rows
// live in a buffer of the calling thread, reused by its next call (no allocation per step).
struct Activations {
  const uint8_t* data = nullptr;
  int64_t stride = 0;  // bytes between rows
};

void prepare_activations(const float* x, int64_t n, int64_t ldx, QuantType type, int64_t cols, Activations& a) {
  const ActivationType at = quant_traits(type).activation;
  if (at == ActivationType::F32) {
    a.data = reinterpret_cast<const uint8_t*>(x);
    a.stride = ldx * static_cast<int64_t>(sizeof(float));
    return;
  }
  a.stride = activation_row_bytes(at, cols);
  thread_local std::vector<uint8_t> storage;
  storage.resize(static_cast<size_t>(a.stride * n));
  uint8_t* dst = storage.data();
  parallel_rows(n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) quantize_activation_row(at, x + i * ldx, dst + i * a.stride, cols);
  });
  a.data = dst;
}

void run_kernels(const Activations& a, int64_t n, QuantType type, const uint8_t* w, int64_t rows, int64_t cols,
                 float* y, int64_t ldy) {
  const DotKernel kernel = dot_kernel(type);
  const int64_t row_bytes = quant_row_bytes(type, cols);
  const int64_t slice = rows_per_slice(row_bytes);
  parallel_rows(rows, 4, [&](int64_t begin, int64_t end) {
    if (n <= kMaxKernelInputs) {
      kernel(w, row_bytes, a.data, a.stride, static_cast<int>(n), y, ldy, begin, end, cols);
      return;
    }
    for (int64_t r = begin; r < end; r += slice) {
      const int64_t r_end = std::min(end, r + slice);
      for (int64_t g = 0; g < n; g += kMaxKernelInputs) {
        const int m = static_cast<int>(std::min<int64_t>(kMaxKernelInputs, n - g));
        kernel(w, row_bytes, a.data + g * a.stride, a.stride, m, y + g * ldy, ldy, r, r_end, cols);
      }
    }
  });
}

void run_blas(const float* x, int64_t n, int64_t ldx, const Activations& a, QuantType type, const uint8_t* w,
              int64_t rows, int64_t cols, float* y, int64_t ldy) {
  static std::once_flag single;
  std::call_once(single, [] { openblas_set_num_threads(1); });  // threads come from the pool
  const ActivationType at = quant_traits(type).activation;
  // The quantised types multiply by what their kernels see: the activations' 8-bit values.
  // The caller's buffer; the pool's threads reach it through the pointer (a lambda naming a
  // thread_local would see each thread's own).
  thread_local std::vector<float> xq;
  const float* xs = x;
  int64_t ldxs = ldx;
  if (at != ActivationType::F32) {
    xq.resize(static_cast<size_t>(n * cols));
    float* xq_data = xq.data();
    parallel_rows(n, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) dequantize_activation_row(at, a.data + i * a.stride, xq_data + i * cols, cols);
    });
    xs = xq_data, ldxs = cols;
  }
  const int64_t row_bytes = quant_row_bytes(type, cols);
  parallel_rows(rows, 16, [&](int64_t begin, int64_t end) {
    if (type == QuantType::F32) {
      const float* wf = reinterpret_cast<const float*>(w);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n), static_cast<int>(end - begin),
                  static_cast<int>(cols), 1.0f, xs, static_cast<int>(ldxs), wf + begin * cols, static_cast<int>(cols),
                  0.0f, y + begin, static_cast<int>(ldy));
      return;
    }
    thread_local std::vector<float> tile;
    tile.resize(static_cast<size_t>(std::min(kBlasTileRows, end - begin) * cols));
    for (int64_t r = begin; r < end; r += kBlasTileRows) {
      const int64_t m = std::min(kBlasTileRows, end - r);
      for (int64_t i = 0; i < m; ++i) dequantize_row(type, w + (r + i) * row_bytes, tile.data() + i * cols, cols);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n), static_cast<int>(m),
                  static_cast<int>(cols), 1.0f, xs, static_cast<int>(ldxs), tile.data(), static_cast<int>(cols), 0.0f,
                  y + r, static_cast<int>(ldy));
    }
  });
}

using ShapeKey = std::tuple<int, int64_t, int64_t, int64_t>;

int64_t bucket(int64_t n) {
  int64_t b = 1;
  while (b < n) b <<= 1;
  return b;
}

std::mutex g_paths_mutex;
std::map<ShapeKey, MatmulPath> g_paths;

double seconds_of(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

std::string matmul_path_name(MatmulPath path) { return path == MatmulPath::kKernel ? "kernel" : "blas"; }

void quant_matmul(const float* x, int64_t n, int64_t ldx, QuantType type, const uint8_t* w, int64_t rows,
                  int64_t cols, float* y, int64_t ldy) {
  if (n <= 0 || rows <= 0) return;
  if (!quant_row_fits(type, cols))
    throw std::invalid_argument(std::string("quant_matmul: rows of ") + std::to_string(cols) + " values do not fit " +
                                quant_name(type) + " blocks");
  Activations a;
  prepare_activations(x, n, ldx, type, cols, a);
  const Forced forced = forced_path();
  if (n <= kMaxKernelInputs || forced == Forced::kKernel) return run_kernels(a, n, type, w, rows, cols, y, ldy);
  if (forced == Forced::kBlas) return run_blas(x, n, ldx, a, type, w, rows, cols, y, ldy);
  const ShapeKey key{static_cast<int>(type), rows, cols, bucket(n)};
  {
    std::lock_guard<std::mutex> lock(g_paths_mutex);
    const auto it = g_paths.find(key);
    if (it != g_paths.end()) {
      if (it->second == MatmulPath::kKernel) return run_kernels(a, n, type, w, rows, cols, y, ldy);
      return run_blas(x, n, ldx, a, type, w, rows, cols, y, ldy);
    }
  }
  // First product of this shape: both ways on a sample of the rows (an eighth, at least 64:
  // a full second product would cost prefill's first layer several times its own time), then
  // every row the faster way, so that all rows of the result come from one path.
  const int64_t sample = std::min(rows, std::max<int64_t>(64, rows / 8 / 16 * 16));
  const double t_kernel = seconds_of([&] { run_kernels(a, n, type, w, sample, cols, y, ldy); });
  const double t_blas = seconds_of([&] { run_blas(x, n, ldx, a, type, w, sample, cols, y, ldy); });
  const MatmulPath path = t_kernel <= t_blas ? MatmulPath::kKernel : MatmulPath::kBlas;
  if (path == MatmulPath::kKernel) run_kernels(a, n, type, w, rows, cols, y, ldy);
  else run_blas(x, n, ldx, a, type, w, rows, cols, y, ldy);
  std::lock_guard<std::mutex> lock(g_paths_mutex);
  g_paths.emplace(key, path);
}

void quant_matmul_on(MatmulPath path, const float* x, int64_t n, int64_t ldx, QuantType type, const uint8_t* w,
                     int64_t rows, int64_t cols, float* y, int64_t ldy) {
  if (n <= 0 || rows <= 0) return;
  Activations a;
  prepare_activations(x, n, ldx, type, cols, a);
  if (path == MatmulPath::kKernel) run_kernels(a, n, type, w, rows, cols, y, ldy);
  else run_blas(x, n, ldx, a, type, w, rows, cols, y, ldy);
}

}  // namespace kvpipe
