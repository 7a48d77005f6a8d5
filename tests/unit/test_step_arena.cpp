// The step arena (engine/step_arena.h): blocks recycled within scopes, nothing kept outside
// them, large and surplus blocks returned, tensors that outlive their scope.
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "engine/step_arena.h"

namespace kvpipe {
namespace {

TEST(StepArena, AScopeReusesTheBlocksOfTheStepBefore) {
  const StepArena::Scope scope;
  const void* first = nullptr;
  {
    const at::Tensor t = at::empty({1000});
    first = t.data_ptr();
  }
  // 4004 bytes share the class of 4000 (quarter steps between powers of two).
  const StepArena::Stats before = StepArena::stats();
  at::Tensor t = at::empty({1001});
  const StepArena::Stats after = StepArena::stats();
  EXPECT_EQ(t.data_ptr(), first);
  EXPECT_EQ(after.fresh_blocks, before.fresh_blocks);
  EXPECT_EQ(after.reused_blocks, before.reused_blocks + 1);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 64, 0u);
  t.fill_(1.0f);  // the whole request is usable
  EXPECT_EQ(t.sum().item<float>(), 1001.0f);
}

TEST(StepArena, NothingIsKeptOutsideAScope) {
  {
    const StepArena::Scope scope;  // installs the allocator
  }
  const StepArena::Stats before = StepArena::stats();
  for (int i = 0; i < 10; ++i) at::empty({4096}).fill_(static_cast<float>(i));
  const StepArena::Stats after = StepArena::stats();
  EXPECT_EQ(after.fresh_blocks, before.fresh_blocks);
  EXPECT_EQ(after.reused_blocks, before.reused_blocks);
  EXPECT_EQ(after.idle_bytes, before.idle_bytes);
}

TEST(StepArena, LargeAndSurplusBlocksGoBackToTheSystem) {
  const StepArena::Scope scope;
  const StepArena::Stats before = StepArena::stats();
  {
    const at::Tensor large = at::empty({static_cast<int64_t>(StepArena::kMaxBlockBytes / 4) + 1});
    large.zero_();
  }
  EXPECT_EQ(StepArena::stats().idle_bytes, before.idle_bytes);
  EXPECT_EQ(StepArena::stats().fresh_blocks, before.fresh_blocks);
  {
    // Twenty blocks of 4 MiB alive at once, then freed: no more than the idle bound is kept.
    std::vector<at::Tensor> held;
    for (int i = 0; i < 20; ++i)
      held.push_back(at::empty({static_cast<int64_t>(StepArena::kMaxBlockBytes / 4)}));
  }
  EXPECT_LE(StepArena::stats().idle_bytes, static_cast<int64_t>(StepArena::kMaxIdleBytes));
  EXPECT_GT(StepArena::stats().idle_bytes, before.idle_bytes);
}

TEST(StepArena, ATensorMayOutliveItsScopeAndBeFreedOnAnotherThread) {
  at::Tensor kept;
  {
    const StepArena::Scope scope;
    kept = at::arange(777, at::kFloat);
  }
  const void* block = kept.data_ptr();
  EXPECT_EQ(kept[776].item<float>(), 776.0f);
  const int64_t idle = StepArena::stats().idle_bytes;
  std::thread([t = std::move(kept)]() mutable { t = at::Tensor(); }).join();
  EXPECT_GT(StepArena::stats().idle_bytes, idle);
  const StepArena::Scope scope;
  EXPECT_EQ(at::empty({777}).data_ptr(), block);
}

TEST(StepArena, RawAllocationsRoundTrip) {
  const StepArena::Scope scope;
  c10::Allocator* allocator = c10::GetCPUAllocator();
  ASSERT_NE(allocator->raw_deleter(), nullptr);
  for (size_t n : {size_t{0}, size_t{1}, size_t{300}, StepArena::kMaxBlockBytes + 1}) {
    void* p = allocator->raw_allocate(n);
    ASSERT_NE(p, nullptr);
    if (n > 0) static_cast<char*>(p)[n - 1] = 1;
    allocator->raw_deallocate(p);
  }
}

}  // namespace
}  // namespace kvpipe
