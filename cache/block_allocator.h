// BlockAllocator: the coordinator's accounting of KV blocks.
//
// Hands out block ids of a pool of `num_blocks` and takes them back; ids are reference
// counted so that blocks can later be shared between sequences (prefix caching). It owns no
// memory: every rank's BlockPool has the same number of blocks, so an id chosen here
// addresses the same block on every rank.
#pragma once

#include <cstdint>
#include <vector>

namespace kvpipe {

class BlockAllocator {
 public:
  explicit BlockAllocator(int64_t num_blocks);

  int64_t num_blocks() const { return static_cast<int64_t>(ref_counts_.size()); }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }

  // A free block with reference count 1, or -1 when none is free.
  int32_t allocate();
  void add_ref(int32_t block);
  // Drops one reference; the block is free again when none is left.
  void release(int32_t block);
  int32_t ref_count(int32_t block) const;

 private:
  std::vector<int32_t> free_;  // stack: the most recently freed block is reused first
  std::vector<int32_t> ref_counts_;
};

// Blocks needed to hold `tokens` tokens.
inline int64_t blocks_for_tokens(int64_t tokens, int64_t block_size) {
  return (tokens + block_size - 1) / block_size;
}

}  // namespace kvpipe
