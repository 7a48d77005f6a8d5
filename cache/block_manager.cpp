#include "cache/block_manager.h"

#include <algorithm>
#include <stdexcept>

namespace kvpipe {

BlockManager::BlockManager(int64_t num_blocks, int64_t block_size, bool prefix_reuse,
                           std::unique_ptr<EvictionPolicy> policy)
    : allocator_(num_blocks),
      block_size_(block_size),
      prefix_reuse_(prefix_reuse),
      policy_(std::move(policy)),
      evictable_(num_blocks, false) {}

int32_t BlockManager::allocate() {
  const int32_t b = allocator_.allocate();
  if (b >= 0) return b;
  const int32_t victim = policy_->pop_victim();
  if (victim < 0) return -1;
  // The victim's one reference was the cache's; it passes to the new user along with the
  // block, whose old prefix is forgotten.
  evictable_[victim] = false;
  cached_.erase(block_hash_.at(victim));
  block_hash_.erase(victim);
  ++stats_.evictions;
  return victim;
}

void BlockManager::release(int32_t block) {
  if (is_cached(block) && allocator_.ref_count(block) == 1) {
    // The cache keeps the last reference; the policy decides when the block goes.
    evictable_[block] = true;
    policy_->add(block);
    return;
  }
  allocator_.release(block);
}

uint64_t BlockManager::chain_hash(uint64_t parent, const int64_t* tokens, int64_t count) {
  uint64_t h = parent ^ 0x9E3779B97F4A7C15ULL;
  for (int64_t i = 0; i < count; ++i) {
    h ^= static_cast<uint64_t>(tokens[i]) + 0x9E3779B97F4A7C15ULL + (h << 6) + (h >> 2);
    h *= 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 31;
  }
  return h;
}

std::vector<int32_t> BlockManager::match_prefix(const std::vector<int64_t>& tokens, int64_t max_blocks,
                                                int64_t lookup_tokens) {
  std::vector<int32_t> out;
  if (!prefix_reuse_) return out;
  stats_.lookup_tokens += lookup_tokens;
  uint64_t parent = 0;
  const int64_t full = std::min<int64_t>(static_cast<int64_t>(tokens.size()) / block_size_, max_blocks);
  for (int64_t k = 0; k < full; ++k) {
    const int64_t* t = tokens.data() + k * block_size_;
    parent = chain_hash(parent, t, block_size_);
    const auto it = cached_.find(parent);
    if (it == cached_.end() || !std::equal(t, t + block_size_, it->second.tokens.begin())) break;
    const int32_t b = it->second.block;
    if (evictable_[b]) {
      // Held by the cache alone: its reference passes to the new user.
      evictable_[b] = false;
      policy_->remove(b);
    } else {
      allocator_.add_ref(b);
    }
    out.push_back(b);
  }
  stats_.hit_tokens += static_cast<int64_t>(out.size()) * block_size_;
  return out;
}

void BlockManager::insert(uint64_t hash, int32_t block, const int64_t* tokens) {
  if (!prefix_reuse_ || cached_.count(hash) || is_cached(block)) return;
  cached_.emplace(hash, Entry{block, std::vector<int64_t>(tokens, tokens + block_size_)});
  block_hash_.emplace(block, hash);
}

}  // namespace kvpipe
