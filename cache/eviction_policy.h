// EvictionPolicy: which unreferenced cached block to give up when the pool runs dry.
//
// The prefix cache keeps blocks whose last user has finished, so that a later request with
// the same prefix can reuse them; they are evictable, not free. The policy orders them. A
// block becomes a candidate when its reference count drops to zero and stops being one when
// a new request references it again, so a block in use is never evicted.
#pragma once

#include <cstdint>
#include <list>
#include <unordered_map>

namespace kvpipe {

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual void add(int32_t block) = 0;     // became unreferenced
  virtual void remove(int32_t block) = 0;  // referenced again
  virtual int32_t pop_victim() = 0;        // -1 when there is none
  virtual int64_t size() const = 0;
};

// Least recently used first: the block that became unreferenced longest ago goes first.
class LruEvictionPolicy : public EvictionPolicy {
 public:
  void add(int32_t block) override;
  void remove(int32_t block) override;
  int32_t pop_victim() override;
  int64_t size() const override { return static_cast<int64_t>(order_.size()); }

 private:
  std::list<int32_t> order_;  // front: least recently used
  std::unordered_map<int32_t, std::list<int32_t>::iterator> where_;
};

}  // namespace kvpipe
