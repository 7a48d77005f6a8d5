// huge_pages: 2 MiB pages under the buffers a CPU decode step streams through end to end (the
// model's matrices), asked of the kernel once they are written.
//
// A decode step reads every weight byte once; on 4 KiB pages that is a TLB miss and a page walk
// every 4 KiB, and the core's prefetchers stop at each page boundary. Linux hands out
// transparent huge pages only where a range asks for them (THP "madvise", Debian's default), so
// a loaded matrix is asked with MADV_HUGEPAGE and collapsed in place with MADV_COLLAPSE (Linux
// 6.1; the same bytes, copied once into huge pages). Where the kernel refuses (an older kernel,
// THP turned off) the buffers stay as they are: the pages change how fast they are read, never
// what is read.
#pragma once

#include <cstdint>
#include <string>

namespace kvpipe {

struct ModelWeights;

struct HugePageOutcome {
  int64_t bytes = 0;    // bytes of the buffers that /proc/self/smaps shows on huge pages afterwards
  std::string refused;  // why the kernel refused every page, where it did ("" otherwise)
};

// The 2 MiB pages [data, data + bytes) touches, each backed by a huge page where the kernel
// agrees (an end page that runs past the mapping is skipped; a mapping smaller than a page
// stays as it is).
HugePageOutcome back_with_huge_pages(const void* data, int64_t bytes);

// Every CPU matrix of `weights` (projections, the LM head, the embedding) through
// back_with_huge_pages; the totals.
HugePageOutcome back_weights_with_huge_pages(const ModelWeights& weights);

// Bytes of [data, data + bytes) that /proc/self/smaps reports as anonymous huge pages
// (AnonHugePages of the mappings the range overlaps, clipped to the range): what tests and
// reports check; -1 where smaps cannot be read.
int64_t huge_page_bytes_in(const void* data, int64_t bytes);

}  // namespace kvpipe
