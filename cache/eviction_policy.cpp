#include "cache/eviction_policy.h"

namespace kvpipe {

void LruEvictionPolicy::add(int32_t block) {
  remove(block);
  order_.push_back(block);
  where_[block] = std::prev(order_.end());
}

void LruEvictionPolicy::remove(int32_t block) {
  const auto it = where_.find(block);
  if (it == where_.end()) return;
  order_.erase(it->second);
  where_.erase(it);
}

int32_t LruEvictionPolicy::pop_victim() {
  if (order_.empty()) return -1;
  const int32_t b = order_.front();
  order_.pop_front();
  where_.erase(b);
  return b;
}

}  // namespace kvpipe
