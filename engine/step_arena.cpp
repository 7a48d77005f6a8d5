#include "engine/step_arena.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace kvpipe {
namespace {

// Each block starts with this header, 64 bytes before the tensor's data, so that the data
// pointer alone (LibTorch's raw_deleter takes nothing else) finds its block's size and owner.
constexpr size_t kHeaderBytes = 64;
constexpr size_t kAlignment = 64;  // LibTorch's CPU alignment

struct BlockHeader {
  size_t capacity;  // bytes after the header
  bool pooled;      // goes back to the free lists when freed
};
static_assert(sizeof(BlockHeader) <= kHeaderBytes);

BlockHeader* header_of(void* data) {
  return reinterpret_cast<BlockHeader*>(static_cast<char*>(data) - kHeaderBytes);
}

void* data_of(BlockHeader* h) {
  return reinterpret_cast<char*>(h) + kHeaderBytes;
}

void* system_block(size_t capacity, bool pooled) {
  void* raw = nullptr;
  if (posix_memalign(&raw, kAlignment, kHeaderBytes + capacity) != 0 || raw == nullptr)
    TORCH_CHECK_WITH(OutOfMemoryError, false, "kvpipe step arena: could not allocate ", capacity,
                     " bytes");
  auto* h = static_cast<BlockHeader*>(raw);
  h->capacity = capacity;
  h->pooled = pooled;
  return data_of(h);
}

// Sizes round up to quarter steps between powers of two (at least 256 bytes), so that the
// tensors of steps whose shapes differ a little (a block table one entry longer) share blocks,
// and no block is more than a quarter larger than its request.
size_t size_class(size_t n) {
  if (n <= 256) return 256;
  const size_t top = size_t{1} << (63 - __builtin_clzll(static_cast<unsigned long long>(n)));
  const size_t step = top / 4;
  return (n + step - 1) / step * step;
}

class FreeLists {
 public:
  void* take(size_t n) {
    const size_t capacity = size_class(n);
    if (capacity > StepArena::kMaxBlockBytes) return system_block(n, false);
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      std::vector<void*>& list = idle_[capacity];
      if (!list.empty()) {
        void* data = list.back();
        list.pop_back();
        idle_bytes_ -= capacity;
        ++reused_;
        return data;
      }
      ++fresh_;
    }
    return system_block(capacity, true);
  }

  // False when the block should go back to the system instead.
  bool keep(void* data) {
    const size_t capacity = header_of(data)->capacity;
    const std::lock_guard<std::mutex> lock(mutex_);
    if (idle_bytes_ + capacity > StepArena::kMaxIdleBytes) return false;
    idle_[capacity].push_back(data);
    idle_bytes_ += capacity;
    return true;
  }

  StepArena::Stats stats() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return {fresh_, reused_, static_cast<int64_t>(idle_bytes_)};
  }

 private:
  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> idle_;  // by capacity
  size_t idle_bytes_ = 0;
  int64_t fresh_ = 0, reused_ = 0;
};

// Never destroyed: tensors may be freed while the process's static objects are torn down.
FreeLists& free_lists() {
  static FreeLists* lists = new FreeLists;
  return *lists;
}

thread_local int open_scopes = 0;

void release(void* data) {
  if (data == nullptr) return;
  BlockHeader* h = header_of(data);
  if (h->pooled && free_lists().keep(data)) return;
  std::free(h);
}

class ArenaAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* data = open_scopes > 0
                     ? free_lists().take(n)
                     : system_block((n + kAlignment - 1) / kAlignment * kAlignment, false);
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

void install_once() {
  static const bool installed = [] {
    // Never destroyed: LibTorch may allocate while the process's static objects are torn down.
    // Above the default allocator's priority (0), so that it is the one LibTorch uses.
    c10::SetCPUAllocator(new ArenaAllocator, /*priority=*/1);
    return true;
  }();
  (void)installed;
}

}  // namespace

StepArena::Scope::Scope() {
  install_once();
  ++open_scopes;
}

StepArena::Scope::~Scope() {
  --open_scopes;
}

StepArena::Stats StepArena::stats() {
  return free_lists().stats();
}

}  // namespace kvpipe
