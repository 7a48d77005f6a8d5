// StepArena: the memory of a step's CPU tensors, recycled from one step to the next.
//
// Every layer of a step makes its outputs with at::empty (norms, projections, RoPE, attention,
// SwiGLU); without this, each of them is a malloc and a free, the larger ones an mmap, an
// munmap and fresh page faults, a few hundred system allocations per decode step. While a
// StepArena::Scope is open on a thread, LibTorch's CPU allocations on that thread take blocks
// from free lists kept by size class (quarter steps between powers of two), and a freed block
// goes back to its list; so once a step of some shape has run, the next step of that shape
// asks the system for nothing.
//
// Guarantees:
// - A block larger than kMaxBlockBytes (a long prompt's activations) is never kept, and idle
//   blocks past kMaxIdleBytes go back to the system: the arena holds at most what a step's
//   working set needs, within that bound.
// - A tensor may outlive its scope and be freed on any thread; its block then goes back to the
//   free lists (or to the system) as any other.
// - Outside a scope, and on other threads, CPU tensors are allocated as LibTorch's default
//   allocator does (64-byte aligned, one system allocation each).
// - The allocator is installed as LibTorch's CPU allocator when the first scope opens, and
//   stays installed for the life of the process.
//
// kvpipe's own: LibTorch's CPUCachingAllocator serves only its mobile builds' default
// allocator, and keeps every size it has seen, without a bound.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvpipe {

class StepArena {
 public:
  static constexpr size_t kMaxBlockBytes = size_t{4} << 20;
  static constexpr size_t kMaxIdleBytes = size_t{64} << 20;

  // Routes this thread's CPU tensor allocations to the arena while it lives; scopes nest.
  class Scope {
   public:
    Scope();
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
  };

  struct Stats {
    int64_t fresh_blocks = 0;   // blocks the arena asked the system for
    int64_t reused_blocks = 0;  // allocations served from the free lists
    int64_t idle_bytes = 0;     // held in the free lists now
  };
  // Process-wide counts since the process started.
  static Stats stats();
};

}  // namespace kvpipe
