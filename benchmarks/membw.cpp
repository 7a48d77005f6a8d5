// kvpipe_membw: memory read bandwidth of this machine, the floor of batch-1 decode.
//
// Sums a buffer far larger than the last-level cache, with `threads` OpenMP threads, and
// prints the median read bandwidth of several passes in GB/s (10^9 bytes per second). The
// buffer sits on 2 MiB pages where the kernel gives them (MADV_HUGEPAGE before the first touch),
// as kvpipe's weights do (model.huge_pages): on 4 KiB pages the same loop reads about a fifth
// slower on the AMD EPYC machines, a floor below what the decode kernels reach.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <sys/mman.h>
#ifdef _OPENMP
#include <omp.h>
#endif

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024;
  const int passes = argc > 2 ? std::atoi(argv[2]) : 9;
  const size_t n = mib * (1 << 20) / sizeof(float);
  const size_t huge = size_t{2} << 20;
  auto* buf = static_cast<float*>(std::aligned_alloc(huge, (n * sizeof(float) + huge - 1) / huge * huge));
  if (buf == nullptr) return 1;
  madvise(buf, n * sizeof(float), MADV_HUGEPAGE);  // a refusal leaves 4 KiB pages
  std::fill(buf, buf + n, 1.0f);
  std::vector<double> gbps;
  volatile float sink = 0;
  for (int p = 0; p < passes; ++p) {
    const auto t0 = std::chrono::steady_clock::now();
    float total = 0;
    // Sixteen independent lanes: the compiler turns them into vector adds without
    // reassociating, so the loop is bound by memory, not by add latency.
#pragma omp parallel reduction(+ : total)
    {
      float acc[16] = {};
#pragma omp for schedule(static)
      for (size_t i = 0; i < n / 16; ++i)
        for (int j = 0; j < 16; ++j) acc[j] += buf[i * 16 + j];
      for (float a : acc) total += a;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sink = sink + total;
    gbps.push_back(static_cast<double>(n / 16 * 16 * sizeof(float)) / s / 1e9);
  }
  std::sort(gbps.begin(), gbps.end());
  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  std::printf("{\"threads\": %d, \"buffer_mib\": %zu, \"read_gbps_median\": %.2f, \"read_gbps_max\": %.2f}\n",
              threads, mib, gbps[gbps.size() / 2], gbps.back());
  std::free(buf);
  return 0;
}
