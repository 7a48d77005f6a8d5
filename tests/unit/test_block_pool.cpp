#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "cache/block_allocator.h"
#include "cache/block_pool.h"

namespace kvpipe {
namespace {

KvShape small_shape(int64_t layers = 2, int64_t block_size = 4, int64_t kv_heads = 2,
                    int64_t head_dim = 3, int64_t element_size = 4) {
  KvShape s;
  s.num_layers = layers;
  s.block_size = block_size;
  s.num_kv_heads = kv_heads;
  s.head_dim = head_dim;
  s.element_size = element_size;
  return s;
}

const at::Device kCpu(at::kCPU);

// ---------------------------------------------------------------------------------------------
// Budget arithmetic

TEST(BlockPoolBudget, bytes_per_block_counts_k_and_v_of_every_layer) {
  const KvShape s = small_shape(/*layers=*/4, /*block_size=*/16, /*kv_heads=*/2, /*head_dim=*/8,
                                /*element_size=*/2);
  EXPECT_EQ(s.bytes_per_block(), 2 * 4 * 16 * 2 * 8 * 2);
  EXPECT_EQ(s.bytes_per_block(), 4096);
}

// cache.dtype: every stored type gives back what was written, within its own rounding, and
// a block costs its stored bytes.
TEST(BlockPoolDtype, stored_types_round_trip_within_their_rounding) {
  KvShape s = small_shape(/*layers=*/2, /*block_size=*/4, /*kv_heads=*/2, /*head_dim=*/64);
  const at::Tensor k = at::randn({5, 2, 64}), v = at::randn({5, 2, 64});
  const at::Tensor slots = at::tensor({7, 0, 3, 12, 4}, at::kLong);
  for (const KvDtype dtype : {KvDtype::kFloat32, KvDtype::kFloat16, KvDtype::kBFloat16, KvDtype::kQ8_0}) {
    s.dtype = dtype;
    BlockPool pool(s, 4, at::kFloat, kCpu, dtype);
    EXPECT_EQ(pool.shape().row_bytes(), kv_row_bytes(dtype, 64));
    EXPECT_EQ(pool.bytes(), 4 * 2 * 2 * 4 * 2 * kv_row_bytes(dtype, 64));
    pool.write(1, slots, k, v);
    const at::Tensor k2 = pool.gather_keys(1, slots), v2 = pool.gather_values(1, slots);
    ASSERT_EQ(k2.scalar_type(), at::kFloat);
    ASSERT_EQ(k2.sizes(), k.sizes());
    // Per value: float16 keeps 11 significant bits, bfloat16 8, q8_0 half a step of max/127.
    const at::Tensor bound = dtype == KvDtype::kFloat32   ? at::zeros_like(k)
                             : dtype == KvDtype::kFloat16  ? k.abs() * (1.0 / 2048)
                             : dtype == KvDtype::kBFloat16 ? k.abs() * (1.0 / 256)
                                                           : k.view({5, 2, 2, 32}).abs().amax(-1, true).expand({5, 2, 2, 32})
                                                                 .reshape({5, 2, 64}) * (0.5 / 127 * 1.001);
    EXPECT_TRUE(((k2 - k).abs() <= bound + 1e-7).all().item<bool>()) << kv_dtype_name(dtype);
    EXPECT_FALSE(dtype != KvDtype::kFloat32 && at::equal(k2, k)) << kv_dtype_name(dtype) << " did not round";
    EXPECT_TRUE(at::allclose(v2, v, 0.02, 0.02)) << kv_dtype_name(dtype);
    // Other layers and slots are untouched.
    EXPECT_EQ(pool.gather_keys(0, slots).abs().sum().item<float>(), 0.0f);
  }
  // Q8_0 stores 34 bytes per 32 values: 1.9x the tokens of float16 in the same budget.
  EXPECT_EQ(kv_row_bytes(KvDtype::kQ8_0, 64), 68);
  EXPECT_EQ(kv_row_bytes(KvDtype::kFloat16, 64), 128);
  s.head_dim = 48;
  EXPECT_THROW((void)BlockPool(s, 1, at::kFloat, kCpu, KvDtype::kQ8_0), std::invalid_argument);
  EXPECT_EQ(parse_kv_dtype("q8_0", "k"), KvDtype::kQ8_0);
  EXPECT_THROW(parse_kv_dtype("int4", "cache.dtype"), std::invalid_argument);
}

TEST(BlockPoolBudget, blocks_for_budget_rounds_down) {
  const KvShape s = small_shape(4, 16, 2, 8, 2);  // 4096 bytes per block
  EXPECT_EQ(BlockPool::blocks_for_budget(s, 10 * 4096), 10);
  EXPECT_EQ(BlockPool::blocks_for_budget(s, 10 * 4096 + 4095), 10);
  EXPECT_EQ(BlockPool::blocks_for_budget(s, 10 * 4096 - 1), 9);
  EXPECT_EQ(BlockPool::blocks_for_budget(s, 4096), 1);
  EXPECT_EQ(BlockPool::blocks_for_budget(s, 4095), 0);
  EXPECT_EQ(BlockPool::blocks_for_budget(s, 0), 0);
  EXPECT_EQ(BlockPool::blocks_for_budget(s, -4096), 0);
  // Sizes of real GPU budgets must not overflow.
  EXPECT_EQ(BlockPool::blocks_for_budget(s, int64_t{80} << 30), (int64_t{80} << 30) / 4096);
}

TEST(BlockPoolBudget, no_layers_gives_no_blocks) {
  // A rank holding no layers must not divide by zero or claim unlimited blocks.
  const KvShape s = small_shape(/*layers=*/0);
  EXPECT_EQ(s.bytes_per_block(), 0);
  EXPECT_EQ(BlockPool::blocks_for_budget(s, std::numeric_limits<int64_t>::max()), 0);
  EXPECT_EQ(BlockPool::blocks_for_budget(s, 1 << 20), 0);
}

TEST(BlockPoolBudget, pool_bytes_match_its_storage) {
  const KvShape s = small_shape(2, 4, 2, 3, 4);
  const BlockPool pool(s, 5, at::kFloat, kCpu);
  EXPECT_EQ(pool.num_blocks(), 5);
  EXPECT_EQ(pool.block_size(), 4);
  EXPECT_EQ(pool.bytes(), 5 * s.bytes_per_block());
  int64_t storage_bytes = 0;
  for (int64_t l = 0; l < s.num_layers; ++l) {
    storage_bytes += pool.keys(l).nbytes() + pool.values(l).nbytes();
  }
  EXPECT_EQ(storage_bytes, pool.bytes());
}

// ---------------------------------------------------------------------------------------------
// Reads and writes

TEST(BlockPoolStorage, views_have_one_row_per_slot_and_start_zeroed) {
  const BlockPool pool(small_shape(2, 4, 2, 3), 3, at::kFloat, kCpu);
  for (int64_t l = 0; l < 2; ++l) {
    EXPECT_EQ(pool.keys(l).sizes(), at::IntArrayRef({12, 2, 3}));
    EXPECT_EQ(pool.values(l).sizes(), at::IntArrayRef({12, 2, 3}));
    EXPECT_EQ(pool.keys(l).count_nonzero().item<int64_t>(), 0);
    EXPECT_EQ(pool.values(l).count_nonzero().item<int64_t>(), 0);
  }
}

TEST(BlockPoolStorage, write_then_read_back_at_slots) {
  BlockPool pool(small_shape(2, 4, 2, 3), 3, at::kFloat, kCpu);
  const std::vector<int64_t> slot_list = {5, 0, 11};
  const at::Tensor slots = at::tensor(slot_list, at::kLong);
  // Offset so no written value is zero and untouched rows stay distinguishable.
  const at::Tensor k = at::rand({3, 2, 3}) + 1.0;
  const at::Tensor v = at::rand({3, 2, 3}) - 2.0;
  pool.write(1, slots, k, v);

  for (size_t i = 0; i < slot_list.size(); ++i) {
    EXPECT_TRUE(at::equal(pool.keys(1)[slot_list[i]], k[i])) << "slot " << slot_list[i];
    EXPECT_TRUE(at::equal(pool.values(1)[slot_list[i]], v[i])) << "slot " << slot_list[i];
  }
  for (int64_t s = 0; s < 12; ++s) {
    if (s == 5 || s == 0 || s == 11) continue;
    EXPECT_EQ(pool.keys(1)[s].count_nonzero().item<int64_t>(), 0) << "slot " << s;
    EXPECT_EQ(pool.values(1)[s].count_nonzero().item<int64_t>(), 0) << "slot " << s;
  }
  // The other layer shares the storage tensor but none of its rows.
  EXPECT_EQ(pool.keys(0).count_nonzero().item<int64_t>(), 0);
  EXPECT_EQ(pool.values(0).count_nonzero().item<int64_t>(), 0);
}

// The direct CPU write (float32 K/V with contiguous values) stores exactly what the tensor
// path (index_copy_ of the converted or encoded rows, taken here for a strided input) stores,
// for every stored type, on rows that are views of a wider projection output; and it refuses
// slots outside the pool rather than writing past it.
TEST(BlockPoolStorage, direct_write_stores_what_the_tensor_path_stores) {
  KvShape s = small_shape(/*layers=*/3, /*block_size=*/5, /*kv_heads=*/2, /*head_dim=*/64);
  at::manual_seed(7);
  // Values spanning magnitudes, ties for float16 / bfloat16 rounding and a zero group for q8_0.
  at::Tensor qkv = at::randn({6, 5 * 64}) * at::pow(10.0, at::randint(-3, 3, {6, 5 * 64}));
  qkv.narrow(1, 2 * 64, 32).zero_();
  const at::Tensor k = qkv.narrow(1, 2 * 64, 2 * 64).view({6, 2, 64});  // rows 320 floats apart
  const at::Tensor v = qkv.narrow(1, 3 * 64, 2 * 64).view({6, 2, 64});
  ASSERT_EQ(k.stride(2), 1);
  const at::Tensor slots = at::tensor({9, 0, 3, 14, 4, 10}, at::kLong);
  for (const KvDtype dtype : {KvDtype::kFloat32, KvDtype::kFloat16, KvDtype::kBFloat16, KvDtype::kQ8_0}) {
    s.dtype = dtype;
    BlockPool direct(s, 3, at::kFloat, kCpu, dtype), tensor_path(s, 3, at::kFloat, kCpu, dtype);
    direct.write(2, slots, k, v);
    // A stride-2 copy of the same values: not the direct path's layout.
    const at::Tensor ks = at::stack({k, k}, -1).select(-1, 0), vs = at::stack({v, v}, -1).select(-1, 0);
    ASSERT_NE(ks.stride(2), 1);
    tensor_path.write(2, slots, ks, vs);
    for (int which = 0; which < 2; ++which) {
      const auto bytes = static_cast<size_t>(s.num_layers * 15 * 2 * 64 *
                                             (dtype == KvDtype::kQ8_0 ? 1 : kv_row_bytes(dtype, 64) / 64));
      EXPECT_EQ(std::memcmp(direct.stored_data(which, 0), tensor_path.stored_data(which, 0), bytes), 0)
          << kv_dtype_name(dtype) << " " << which;
      if (dtype == KvDtype::kQ8_0) {
        EXPECT_EQ(std::memcmp(direct.stored_scales(which, 0), tensor_path.stored_scales(which, 0),
                              static_cast<size_t>(s.num_layers * 15 * 2 * 2 * 2)),
                  0);
      }
    }
    EXPECT_TRUE(at::equal(direct.gather_keys(2, slots), tensor_path.gather_keys(2, slots))) << kv_dtype_name(dtype);
    EXPECT_THROW(direct.write(0, at::tensor({15}, at::kLong), k.narrow(0, 0, 1), v.narrow(0, 0, 1)),
                 std::out_of_range);
    EXPECT_THROW(direct.write(0, at::tensor({-1}, at::kLong), k.narrow(0, 0, 1), v.narrow(0, 0, 1)),
                 std::out_of_range);
  }
}

TEST(BlockPoolStorage, views_taken_earlier_see_later_writes) {
  // The step loop holds keys()/values() views across writes; they must alias the pool.
  BlockPool pool(small_shape(1, 4, 1, 2), 2, at::kFloat, kCpu);
  const at::Tensor keys = pool.keys(0);
  const at::Tensor values = pool.values(0);
  pool.write(0, at::tensor(std::vector<int64_t>{6}, at::kLong), at::full({1, 1, 2}, 3.0),
             at::full({1, 1, 2}, 4.0));
  EXPECT_TRUE(at::equal(keys[6], at::full({1, 2}, 3.0)));
  EXPECT_TRUE(at::equal(values[6], at::full({1, 2}, 4.0)));
}

TEST(BlockPoolStorage, rewriting_a_slot_replaces_it) {
  BlockPool pool(small_shape(1, 4, 1, 2), 1, at::kFloat, kCpu);
  const at::Tensor slot = at::tensor(std::vector<int64_t>{2}, at::kLong);
  pool.write(0, slot, at::full({1, 1, 2}, 1.0), at::full({1, 1, 2}, 1.0));
  pool.write(0, slot, at::full({1, 1, 2}, -5.0), at::full({1, 1, 2}, 6.0));
  EXPECT_TRUE(at::equal(pool.keys(0)[2], at::full({1, 2}, -5.0)));
  EXPECT_TRUE(at::equal(pool.values(0)[2], at::full({1, 2}, 6.0)));
}

TEST(BlockPoolStorage, stores_the_requested_dtype) {
  const BlockPool pool(small_shape(1, 4, 1, 2, 2), 1, at::kBFloat16, kCpu);
  EXPECT_EQ(pool.keys(0).scalar_type(), at::kBFloat16);
  EXPECT_EQ(pool.values(0).scalar_type(), at::kBFloat16);
  EXPECT_EQ(pool.keys(0).nbytes() * 2, static_cast<size_t>(pool.bytes()));
}

TEST(BlockPoolStorage, rejects_bad_geometry) {
  EXPECT_THROW((void)BlockPool(small_shape(1, /*block_size=*/0), 1, at::kFloat, kCpu),
               std::invalid_argument);
  EXPECT_THROW((void)BlockPool(small_shape(1, 4), -1, at::kFloat, kCpu), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Allocation counter

TEST(BlockPoolAllocations, one_tensor_per_pool_and_none_per_step) {
  const int64_t before = BlockPool::tensors_allocated();
  BlockPool a(small_shape(2, 4, 2, 3), 3, at::kFloat, kCpu);
  EXPECT_EQ(BlockPool::tensors_allocated(), before + 1);
  BlockPool b(small_shape(1, 8, 1, 4), 2, at::kFloat, kCpu);
  EXPECT_EQ(BlockPool::tensors_allocated(), before + 2);

  const at::Tensor slots = at::tensor(std::vector<int64_t>{1, 7}, at::kLong);
  for (int step = 0; step < 10; ++step) {
    a.write(step % 2, slots, at::rand({2, 2, 3}), at::rand({2, 2, 3}));
    (void)a.keys(0).sum().item<float>();
    (void)a.values(1).index_select(0, slots);
  }
  EXPECT_EQ(BlockPool::tensors_allocated(), before + 2);
}

// ---------------------------------------------------------------------------------------------
// BlockAllocator

TEST(BlockAllocator, hands_out_every_block_once_in_ascending_order) {
  BlockAllocator alloc(5);
  EXPECT_EQ(alloc.num_blocks(), 5);
  EXPECT_EQ(alloc.num_free(), 5);
  for (int32_t expected = 0; expected < 5; ++expected) {
    EXPECT_EQ(alloc.allocate(), expected);
    EXPECT_EQ(alloc.ref_count(expected), 1);
    EXPECT_EQ(alloc.num_free(), 4 - expected);
  }
  EXPECT_EQ(alloc.allocate(), -1);
  EXPECT_EQ(alloc.allocate(), -1);
  EXPECT_EQ(alloc.num_free(), 0);
}

TEST(BlockAllocator, empty_pool_allocates_nothing) {
  BlockAllocator alloc(0);
  EXPECT_EQ(alloc.num_free(), 0);
  EXPECT_EQ(alloc.allocate(), -1);
}

TEST(BlockAllocator, released_block_is_reused) {
  BlockAllocator alloc(3);
  for (int i = 0; i < 3; ++i) alloc.allocate();
  alloc.release(1);
  EXPECT_EQ(alloc.ref_count(1), 0);
  EXPECT_EQ(alloc.num_free(), 1);
  EXPECT_EQ(alloc.allocate(), 1);
  EXPECT_EQ(alloc.ref_count(1), 1);
  EXPECT_EQ(alloc.allocate(), -1);
}

TEST(BlockAllocator, most_recently_released_is_reused_first) {
  BlockAllocator alloc(4);
  for (int i = 0; i < 4; ++i) alloc.allocate();
  alloc.release(0);
  alloc.release(2);
  EXPECT_EQ(alloc.allocate(), 2);
  EXPECT_EQ(alloc.allocate(), 0);
}

TEST(BlockAllocator, shared_block_is_freed_by_its_last_release) {
  BlockAllocator alloc(2);
  const int32_t b = alloc.allocate();
  alloc.add_ref(b);
  EXPECT_EQ(alloc.ref_count(b), 2);
  alloc.release(b);
  EXPECT_EQ(alloc.ref_count(b), 1);
  EXPECT_EQ(alloc.num_free(), 1);
  alloc.release(b);
  EXPECT_EQ(alloc.ref_count(b), 0);
  EXPECT_EQ(alloc.num_free(), 2);
}

TEST(BlockAllocator, misuse_of_free_blocks_throws_and_changes_nothing) {
  BlockAllocator alloc(3);
  EXPECT_THROW(alloc.release(0), std::logic_error);
  EXPECT_THROW(alloc.add_ref(0), std::logic_error);
  const int32_t b = alloc.allocate();
  alloc.release(b);
  EXPECT_THROW(alloc.release(b), std::logic_error);  // double release
  EXPECT_EQ(alloc.num_free(), 3);
  EXPECT_EQ(alloc.ref_count(b), 0);
  // Ids outside the pool: out_of_range, itself a logic_error.
  EXPECT_THROW(alloc.release(3), std::out_of_range);
  EXPECT_THROW(alloc.release(-1), std::out_of_range);
  EXPECT_THROW(alloc.add_ref(7), std::out_of_range);
  EXPECT_EQ(alloc.num_free(), 3);
}

TEST(BlockAllocatorTokens, blocks_for_tokens_rounds_up) {
  EXPECT_EQ(blocks_for_tokens(0, 16), 0);
  EXPECT_EQ(blocks_for_tokens(1, 16), 1);
  EXPECT_EQ(blocks_for_tokens(15, 16), 1);
  EXPECT_EQ(blocks_for_tokens(16, 16), 1);
  EXPECT_EQ(blocks_for_tokens(17, 16), 2);
  EXPECT_EQ(blocks_for_tokens(32, 16), 2);
  EXPECT_EQ(blocks_for_tokens(33, 16), 3);
  EXPECT_EQ(blocks_for_tokens(7, 1), 7);
  EXPECT_EQ(blocks_for_tokens(100000, 256), 391);
}

}  // namespace
}  // namespace kvpipe
