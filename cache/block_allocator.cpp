#include "cache/block_allocator.h"

#include <stdexcept>
#include <string>

namespace kvpipe {

BlockAllocator::BlockAllocator(int64_t num_blocks) : ref_counts_(num_blocks, 0) {
  free_.reserve(num_blocks);
  // Reversed so that blocks are handed out in ascending order, which keeps traces readable.
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

int32_t BlockAllocator::allocate() {
  if (free_.empty()) return -1;
  const int32_t b = free_.back();
  free_.pop_back();
  ref_counts_[b] = 1;
  return b;
}

void BlockAllocator::add_ref(int32_t block) {
  if (ref_counts_.at(block) <= 0) throw std::logic_error("add_ref of free block " + std::to_string(block));
  ++ref_counts_[block];
}

void BlockAllocator::release(int32_t block) {
  if (ref_counts_.at(block) <= 0) throw std::logic_error("release of free block " + std::to_string(block));
  if (--ref_counts_[block] == 0) free_.push_back(block);
}

int32_t BlockAllocator::ref_count(int32_t block) const { return ref_counts_.at(block); }

}  // namespace kvpipe
