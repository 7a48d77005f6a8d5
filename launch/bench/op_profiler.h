// OpProfiler: LibTorch's operator profiler around a stretch of this thread's work.
//
// Writes the profiler's Chrome trace (every ATen operator with its inclusive duration) to a
// file when stopped, and sums it per operator. Builds whose LibTorch lacks the profiler
// header refuse to start with std::invalid_argument; the heavy profiler headers stay in
// op_profiler.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvpipe {

struct OpTotal {
  std::string name;
  int64_t calls = 0;
  double total_ms = 0;  // inclusive: an operator's time includes the operators it calls
};

class OpProfiler {
 public:
  explicit OpProfiler(std::string path);
  ~OpProfiler();
  void stop();  // writes the file; idempotent
  const std::string& path() const { return path_; }

 private:
  struct Impl;
  std::string path_;
  std::unique_ptr<Impl> impl_;
};

// The `top` operators of a profiler trace file by total time, largest first.
std::vector<OpTotal> top_operators(const std::string& trace_path, size_t top);

}  // namespace kvpipe
