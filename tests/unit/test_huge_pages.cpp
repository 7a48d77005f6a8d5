// back_with_huge_pages: a buffer moved onto 2 MiB pages keeps every byte, the pages are really
// huge afterwards (smaps), an end page outside any mapping is skipped rather than failing the
// buffer, and a model's matrices compute the same products after the move.
#include "engine/model/huge_pages.h"

#include "engine/model/model_config.h"
#include "engine/model/model_weights.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstring>

namespace kvpipe {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// An anonymous mapping of `bytes`, unmapped on destruction.
struct Mapping {
  explicit Mapping(int64_t bytes) : size(bytes) {
    void* p = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
  }
  ~Mapping() {
    if (data != nullptr) ::munmap(data, static_cast<size_t>(size));
  }
  uint8_t* data = nullptr;
  int64_t size = 0;
};

TEST(HugePages, ABufferKeepsItsBytesOnHugePages) {
  Mapping map(12 * kMiB);
  ASSERT_NE(map.data, nullptr);
  for (int64_t i = 0; i < map.size; ++i) map.data[i] = static_cast<uint8_t>((i * 131) >> 3);
  // Not on a page boundary, as a matrix inside the heap: its end pages hold other bytes too.
  uint8_t* buffer = map.data + 3 * kMiB + 12345;
  const int64_t bytes = 5 * kMiB;
  const HugePageOutcome out = back_with_huge_pages(buffer, bytes);
  if (!out.refused.empty()) GTEST_SKIP() << "this kernel keeps anonymous memory on 4 KiB pages: " << out.refused;
  EXPECT_GE(out.bytes, 4 * kMiB);  // the two pages wholly inside, at least
  EXPECT_LE(out.bytes, bytes);     // counted within the buffer
  for (int64_t i = 0; i < map.size; ++i)
    ASSERT_EQ(map.data[i], static_cast<uint8_t>((i * 131) >> 3)) << "byte " << i << " changed";
  const int64_t huge = huge_page_bytes_in(buffer, bytes);
  if (huge < 0) GTEST_SKIP() << "/proc/self/smaps cannot be read here";
  EXPECT_GE(huge, 4 * kMiB);
}

TEST(HugePages, AnEndPagePastTheMappingIsSkipped) {
  // A 2 MiB-aligned page inside a mapping whose next page is unmapped: the buffer's last page
  // reaches past it.
  Mapping map(8 * kMiB);
  ASSERT_NE(map.data, nullptr);
  const auto base = (reinterpret_cast<uintptr_t>(map.data) + 2 * kMiB - 1) & ~uintptr_t(2 * kMiB - 1);
  auto* page = reinterpret_cast<uint8_t*>(base);
  ASSERT_LE(page + 4 * kMiB, map.data + map.size);
  ASSERT_EQ(::munmap(page + 2 * kMiB, 2 * kMiB), 0);
  std::memset(page, 7, 2 * kMiB);
  const HugePageOutcome out = back_with_huge_pages(page + kMiB, 2 * kMiB);  // half in the hole
  if (!out.refused.empty()) GTEST_SKIP() << "this kernel keeps anonymous memory on 4 KiB pages: " << out.refused;
  EXPECT_EQ(out.bytes, kMiB);  // the buffer's half on the page that is there
  EXPECT_EQ(page[2 * kMiB - 1], 7);
  // The tail of the original mapping is still ours to unmap.
  ASSERT_EQ(::mmap(page + 2 * kMiB, 2 * kMiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0),
            page + 2 * kMiB);
}

TEST(HugePages, AModelsMatricesComputeTheSameOnHugePages) {
  // As the kvpipe executable allocates (launch/main.cpp): blocks below 32 MiB on the heap,
  // not in mappings of their own too small for a huge page.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  ModelConfig cfg = preset_config("tiny");
  const ModelWeights w = random_weights(cfg, {{0, cfg.num_layers}, true, true, {}}, 5, 0.1, at::kFloat);
  const at::Tensor x = at::randn({3, cfg.hidden_size});
  const at::Tensor before_head = w.lm_head.matmul(x);
  const at::Tensor before_up = w.layer[1].gate_up.matmul(x);
  const HugePageOutcome out = back_weights_with_huge_pages(w);
  if (!out.refused.empty()) {
    mallopt(M_MMAP_THRESHOLD, 128 << 10);
    GTEST_SKIP() << "this kernel keeps anonymous memory on 4 KiB pages: " << out.refused;
  }
  // The tiny preset's matrices: a few MiB in all, most of them on huge pages.
  EXPECT_GE(out.bytes, 2 * kMiB);
  EXPECT_TRUE(at::equal(w.lm_head.matmul(x), before_head));
  EXPECT_TRUE(at::equal(w.layer[1].gate_up.matmul(x), before_up));
  const auto& part = w.layer[0].qkv.parts().front().data;
  const int64_t huge = huge_page_bytes_in(part.data_ptr(), static_cast<int64_t>(part.nbytes()));
  if (huge >= 0) EXPECT_GT(huge, 0);
  mallopt(M_MMAP_THRESHOLD, 128 << 10);  // glibc's default, for the tests after this one
}

}  // namespace
}  // namespace kvpipe
