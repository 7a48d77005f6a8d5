#include "engine/model/huge_pages.h"

#include "engine/model/model_weights.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1's value; glibc's headers on Debian 12 predate it
#endif

namespace kvpipe {
namespace {

constexpr uintptr_t kHugePage = uintptr_t{2} << 20;

using Range = std::pair<uintptr_t, uintptr_t>;

// Asks for every 2 MiB page [lo, hi) touches; "" or the first refusal where every page was
// refused. Ends included: a huge page under a neighbouring allocation holds the same bytes, and
// a matrix of a few MiB would otherwise lose most of itself to its unaligned ends. One page at
// a time, so that an end page running past the mapping (ENOMEM) costs only itself.
std::string ask(uintptr_t lo, uintptr_t hi) {
  std::string refused;
  bool any = false;
  for (uintptr_t page = lo & ~(kHugePage - 1); page < hi; page += kHugePage) {
    void* start = reinterpret_cast<void*>(page);
    // MADV_HUGEPAGE keeps the page eligible (khugepaged, later faults); MADV_COLLAPSE makes it
    // huge now.
    const char* step = "madvise(MADV_HUGEPAGE)";
    bool ok = ::madvise(start, kHugePage, MADV_HUGEPAGE) == 0;
    if (ok) step = "madvise(MADV_COLLAPSE)", ok = ::madvise(start, kHugePage, MADV_COLLAPSE) == 0;
    if (ok) any = true;
    else if (refused.empty()) refused = std::string(step) + ": " + std::strerror(errno);
  }
  return any ? std::string() : refused;
}

// Bytes of `ranges` (sorted, disjoint) in anonymous huge pages by /proc/self/smaps; -1 where it
// cannot be read. A mapping's AnonHugePages is a total, so it is clipped to each range's overlap.
int64_t huge_bytes(const std::vector<Range>& ranges) {
  std::ifstream smaps("/proc/self/smaps");
  if (!smaps) return -1;
  int64_t total = 0;
  uintptr_t map_lo = 0, map_hi = 0;
  std::string line;
  while (std::getline(smaps, line)) {
    unsigned long a = 0, b = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &a, &b) == 2 && line.find(':') > line.find(' ')) {
      map_lo = a, map_hi = b;
      continue;
    }
    if (line.rfind("AnonHugePages:", 0) != 0) continue;
    std::istringstream fields(line.substr(14));
    int64_t kib = 0;
    fields >> kib;
    if (kib == 0) continue;
    int64_t overlap = 0;
    for (const auto& [lo, hi] : ranges)
      if (lo < map_hi && map_lo < hi) overlap += static_cast<int64_t>(std::min(hi, map_hi) - std::max(lo, map_lo));
    total += std::min<int64_t>(kib << 10, overlap);
  }
  return total;
}

HugePageOutcome back_ranges(std::vector<Range> ranges) {
  HugePageOutcome out;
  std::sort(ranges.begin(), ranges.end());
  std::vector<Range> merged;  // each page asked for once
  for (const Range& r : ranges) {
    if (!merged.empty() && r.first <= merged.back().second) merged.back().second = std::max(merged.back().second, r.second);
    else merged.push_back(r);
  }
  bool any = false;
  for (const auto& [lo, hi] : merged) {
    const std::string refused = ask(lo, hi);
    if (refused.empty()) any = true;
    else if (out.refused.empty()) out.refused = refused;
  }
  if (any) out.refused.clear();
  // What the kernel did, not what it was asked: a page it accepted may still not be huge (one
  // that spans several small mappings, say).
  out.bytes = std::max<int64_t>(0, huge_bytes(merged));
  return out;
}

}  // namespace

HugePageOutcome back_with_huge_pages(const void* data, int64_t bytes) {
  if (data == nullptr || bytes <= 0) return {};
  const auto lo = reinterpret_cast<uintptr_t>(data);
  return back_ranges({{lo, lo + static_cast<uintptr_t>(bytes)}});
}

HugePageOutcome back_weights_with_huge_pages(const ModelWeights& weights) {
  if (!weights.device.is_cpu()) return {};
  std::vector<Range> ranges;
  auto matrix = [&](const WeightMatrix& m) {
    if (!m.defined()) return;
    for (const WeightMatrix::Part& p : m.parts()) {
      if (!p.data.defined() || p.data.nbytes() == 0) continue;
      const auto lo = reinterpret_cast<uintptr_t>(p.data.data_ptr());
      ranges.emplace_back(lo, lo + p.data.nbytes());
    }
  };
  for (const LayerWeights& l : weights.layer) {
    matrix(l.qkv);
    matrix(l.o);
    matrix(l.gate_up);
    matrix(l.down);
  }
  matrix(weights.lm_head);  // the embedding's table where tied
  return back_ranges(std::move(ranges));
}

int64_t huge_page_bytes_in(const void* data, int64_t bytes) {
  const auto lo = reinterpret_cast<uintptr_t>(data);
  return huge_bytes({{lo, lo + static_cast<uintptr_t>(bytes)}});
}

}  // namespace kvpipe
