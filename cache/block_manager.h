// BlockManager: the coordinator's KV blocks, with token-level reuse across requests.
//
// Wraps the BlockAllocator with a prefix cache: a full block whose K/V has been computed is
// keyed by a hash chained over its token ids and its parent block's hash, so equal keys mean
// equal prefixes (the tokens are compared too, so a hash collision cannot alias two
// prefixes). A new request starts after the longest cached prefix, sharing those blocks by
// reference count. When the last reference to a cached block goes, the block stays cached
// and becomes evictable; allocation takes free blocks first, then evicts through the
// EvictionPolicy (least recently used). With reuse off it is a plain allocator.
#pragma once

#include "cache/block_allocator.h"
#include "cache/eviction_policy.h"

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

namespace kvpipe {

struct PrefixCacheStats {
  int64_t lookup_tokens = 0;  // prompt tokens looked up
  int64_t hit_tokens = 0;     // of which found in the cache
  int64_t evictions = 0;
  double hit_rate() const { return lookup_tokens ? static_cast<double>(hit_tokens) / lookup_tokens : 0.0; }
};

class BlockManager {
 public:
  BlockManager(int64_t num_blocks, int64_t block_size, bool prefix_reuse,
               std::unique_ptr<EvictionPolicy> policy = std::make_unique<LruEvictionPolicy>());

  int64_t num_blocks() const { return allocator_.num_blocks(); }
  int64_t block_size() const { return block_size_; }
  bool prefix_reuse() const { return prefix_reuse_; }
  // Blocks that an allocation can get: free ones and evictable cached ones.
  int64_t num_available() const { return allocator_.num_free() + policy_->size(); }
  int64_t num_used() const { return num_blocks() - num_available(); }
  int64_t num_cached() const { return static_cast<int64_t>(cached_.size()); }

  // A block with one reference, evicting a cached one if no block is free; -1 when none.
  int32_t allocate();
  // Drops one reference; cached blocks without references become evictable.
  void release(int32_t block);

  static uint64_t chain_hash(uint64_t parent, const int64_t* tokens, int64_t count);

  // The cached blocks of the longest prefix of `tokens` made of whole blocks, at most
  // `max_blocks` of them, each with a new reference. Counts `lookup_tokens` into the stats.
  std::vector<int32_t> match_prefix(const std::vector<int64_t>& tokens, int64_t max_blocks,
                                    int64_t lookup_tokens);
  // Records the computed block `block` holding `tokens` (block_size of them) under `hash`;
  // a hash already cached keeps its block.
  void insert(uint64_t hash, int32_t block, const int64_t* tokens);

  bool is_cached(int32_t block) const { return block_hash_.count(block) != 0; }
  // Sequences using `block` (an evictable cached block has none).
  int32_t users(int32_t block) const { return evictable_[block] ? 0 : allocator_.ref_count(block); }
  const PrefixCacheStats& stats() const { return stats_; }

 private:
  struct Entry {
    int32_t block;
    std::vector<int64_t> tokens;
  };

  BlockAllocator allocator_;
  int64_t block_size_;
  bool prefix_reuse_;
  std::unique_ptr<EvictionPolicy> policy_;
  std::unordered_map<uint64_t, Entry> cached_;      // hash -> block
  std::unordered_map<int32_t, uint64_t> block_hash_;  // cached block -> its hash
  std::vector<bool> evictable_;  // cached, unreferenced, in the policy (holding 1 count)
  PrefixCacheStats stats_;
};

}  // namespace kvpipe
