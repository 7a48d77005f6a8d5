#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel/partitioner.h"

namespace kvpipe {
namespace {

constexpr int64_t kKiB = int64_t{1} << 10;
constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;

RankBudget fixed_budget(int64_t kv_bytes) {
  RankBudget b;
  b.share_of_memory = false;
  b.kv_bytes = kv_bytes;
  return b;
}

RankBudget share_budget(int64_t memory_bytes, double share = 0.9) {
  RankBudget b;
  b.share_of_memory = true;
  b.memory_bytes = memory_bytes;
  b.share = share;
  return b;
}

StageCost make_cost(int64_t layer_weight, int64_t first_extra, int64_t last_extra,
                    int64_t kv_per_block_layer) {
  StageCost c;
  c.layer_weight_bytes = layer_weight;
  c.first_extra_bytes = first_extra;
  c.last_extra_bytes = last_extra;
  c.kv_bytes_per_block_layer = kv_per_block_layer;
  return c;
}

// The cost model, restated here rather than taken from stage_blocks, so that the search is
// checked against an independent reading of the spec.
int64_t ref_weight(const StageCost& c, size_t rank, size_t ranks, int64_t layers) {
  int64_t w = layers * c.layer_weight_bytes;
  if (rank == 0) w += c.first_extra_bytes;
  if (rank + 1 == ranks) w += c.last_extra_bytes;
  return w;
}

// -1 when the rank cannot hold its weights.
int64_t ref_blocks(const StageCost& c, const RankBudget& b, size_t rank, size_t ranks,
                   int64_t layers) {
  const int64_t w = ref_weight(c, rank, ranks, layers);
  int64_t kv = b.kv_bytes;
  if (b.share_of_memory) {
    if (b.memory_bytes < w) return -1;
    kv = static_cast<int64_t>(static_cast<double>(b.memory_bytes - w) * b.share);
  }
  return kv / (layers * c.kv_bytes_per_block_layer);
}

// -1 when some rank cannot hold its weights.
int64_t ref_common(const StageCost& c, const std::vector<RankBudget>& budgets,
                   const std::vector<int64_t>& split) {
  int64_t common = std::numeric_limits<int64_t>::max();
  for (size_t r = 0; r < split.size(); ++r) {
    const int64_t b = ref_blocks(c, budgets[r], r, split.size(), split[r]);
    if (b < 0) return -1;
    common = std::min(common, b);
  }
  return common;
}

int64_t spread(const std::vector<int64_t>& split) {
  const auto mm = std::minmax_element(split.begin(), split.end());
  return *mm.second - *mm.first;
}

void for_each_composition(int64_t total, int64_t parts,
                          const std::function<void(const std::vector<int64_t>&)>& fn) {
  std::vector<int64_t> cur;
  std::function<void(int64_t)> rec = [&](int64_t left) {
    const int64_t still = parts - static_cast<int64_t>(cur.size());
    if (still == 1) {
      cur.push_back(left);
      fn(cur);
      cur.pop_back();
      return;
    }
    for (int64_t n = 1; n <= left - (still - 1); ++n) {
      cur.push_back(n);
      rec(left - n);
      cur.pop_back();
    }
  };
  rec(total);
}

struct BruteForce {
  bool feasible = false;
  int64_t best_common = -1;
  int64_t best_spread = std::numeric_limits<int64_t>::max();  // among optimal splits
};

BruteForce brute_force(int64_t num_layers, const StageCost& c,
                       const std::vector<RankBudget>& budgets) {
  BruteForce bf;
  for_each_composition(num_layers, static_cast<int64_t>(budgets.size()),
                       [&](const std::vector<int64_t>& split) {
                         const int64_t common = ref_common(c, budgets, split);
                         if (common < 0) return;
                         bf.feasible = true;
                         if (common > bf.best_common) {
                           bf.best_common = common;
                           bf.best_spread = spread(split);
                         } else if (common == bf.best_common) {
                           bf.best_spread = std::min(bf.best_spread, spread(split));
                         }
                       });
  return bf;
}

std::vector<int64_t> layers_of(const PartitionPlan& plan) {
  std::vector<int64_t> out;
  for (const StagePlan& s : plan.stages) out.push_back(s.num_layers);
  return out;
}

// Everything a plan must satisfy whatever the split: contiguous, covering, no empty rank,
// and per-stage numbers that agree with the cost model.
void expect_consistent_plan(const PartitionPlan& plan, int64_t num_layers, const StageCost& c,
                            const std::vector<RankBudget>& budgets) {
  ASSERT_EQ(plan.stages.size(), budgets.size());
  int64_t next = 0;
  int64_t common = std::numeric_limits<int64_t>::max();
  for (size_t r = 0; r < plan.stages.size(); ++r) {
    const StagePlan& s = plan.stages[r];
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_GE(s.num_layers, 1);
    EXPECT_EQ(s.first_layer, next);
    EXPECT_EQ(s.weight_bytes, ref_weight(c, r, budgets.size(), s.num_layers));
    EXPECT_EQ(s.max_blocks, ref_blocks(c, budgets[r], r, budgets.size(), s.num_layers));
    next += s.num_layers;
    common = std::min(common, s.max_blocks);
  }
  EXPECT_EQ(next, num_layers);
  EXPECT_EQ(plan.num_blocks, common);
}

template <typename Fn>
std::string invalid_argument_message(Fn&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected std::invalid_argument";
  return {};
}

// ---------------------------------------------------------------------------------------------
// Brute-force helper sanity: the tests below lean on it, so it must itself be right.

TEST(PartitionerBruteForce, enumerates_every_composition_once) {
  int count = 0;
  for_each_composition(7, 3, [&](const std::vector<int64_t>& s) {
    ASSERT_EQ(s.size(), 3u);
    EXPECT_EQ(s[0] + s[1] + s[2], 7);
    EXPECT_GE(*std::min_element(s.begin(), s.end()), 1);
    ++count;
  });
  EXPECT_EQ(count, 15);  // C(6, 2)
}

// ---------------------------------------------------------------------------------------------
// Automatic split

TEST(PartitionerAuto, equal_fixed_budgets_split_eight_layers_in_half) {
  const StageCost c = make_cost(100 * kMiB, 500 * kMiB, 600 * kMiB, 64 * kKiB);
  const std::vector<RankBudget> budgets = {fixed_budget(kGiB), fixed_budget(kGiB)};
  const PartitionPlan plan = partition_layers(8, c, budgets, {});
  EXPECT_EQ(layers_of(plan), (std::vector<int64_t>{4, 4}));
  expect_consistent_plan(plan, 8, c, budgets);
  EXPECT_EQ(plan.num_blocks, kGiB / (4 * 64 * kKiB));
  EXPECT_EQ(plan.num_blocks, brute_force(8, c, budgets).best_common);
}

TEST(PartitionerAuto, equal_fixed_budgets_seven_layers_three_ranks_is_optimal_and_even) {
  const StageCost c = make_cost(100 * kMiB, 500 * kMiB, 600 * kMiB, 64 * kKiB);
  const std::vector<RankBudget> budgets(3, fixed_budget(kGiB));
  const PartitionPlan plan = partition_layers(7, c, budgets, {});
  expect_consistent_plan(plan, 7, c, budgets);
  const BruteForce bf = brute_force(7, c, budgets);
  ASSERT_TRUE(bf.feasible);
  EXPECT_EQ(plan.num_blocks, bf.best_common);
  EXPECT_EQ(ref_common(c, budgets, layers_of(plan)), bf.best_common);
  EXPECT_EQ(spread(layers_of(plan)), bf.best_spread);
  EXPECT_EQ(bf.best_spread, 1);  // some permutation of {3, 2, 2}
}

TEST(PartitionerAuto, unequal_fixed_budgets_split_in_proportion) {
  const StageCost c = make_cost(100 * kMiB, 0, 0, kMiB);
  const std::vector<RankBudget> budgets = {fixed_budget(kGiB), fixed_budget(512 * kMiB)};
  const PartitionPlan plan = partition_layers(12, c, budgets, {});
  EXPECT_EQ(layers_of(plan), (std::vector<int64_t>{8, 4}));
  expect_consistent_plan(plan, 12, c, budgets);
  EXPECT_EQ(plan.num_blocks, 128);
  EXPECT_EQ(plan.num_blocks, brute_force(12, c, budgets).best_common);
}

TEST(PartitionerAuto, large_embedding_gives_first_rank_fewer_layers) {
  // Equal memory, but rank 0 also holds a big embedding, so it has less room for KV.
  const StageCost c = make_cost(100 * kMiB, 1200 * kMiB, 50 * kMiB, kMiB);
  const std::vector<RankBudget> budgets = {share_budget(3 * kGiB), share_budget(3 * kGiB)};
  const PartitionPlan plan = partition_layers(12, c, budgets, {});
  expect_consistent_plan(plan, 12, c, budgets);
  EXPECT_LT(plan.stages[0].num_layers, plan.stages[1].num_layers);
  const BruteForce bf = brute_force(12, c, budgets);
  EXPECT_EQ(plan.num_blocks, bf.best_common);
  for (size_t r = 0; r < 2; ++r) {
    const StagePlan& s = plan.stages[r];
    EXPECT_EQ(s.kv_budget_bytes,
              static_cast<int64_t>(static_cast<double>(3 * kGiB - s.weight_bytes) * 0.9));
  }
}

TEST(PartitionerAuto, share_budgets_match_brute_force_on_random_cases) {
  std::mt19937_64 rng(20240611);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  int feasible_cases = 0;
  for (int k = 0; k < 20; ++k) {
    const int64_t ranks = uniform(2, 4);
    const int64_t layers = uniform(std::max<int64_t>(4, ranks), 12);
    const StageCost c = make_cost(uniform(50, 150) * kMiB, uniform(0, 800) * kMiB,
                                  uniform(0, 800) * kMiB, uniform(1, 16) * 64 * kKiB);
    std::vector<RankBudget> budgets;
    const int64_t typical = (layers / ranks) * c.layer_weight_bytes;
    for (int64_t r = 0; r < ranks; ++r)
      budgets.push_back(share_budget(typical + uniform(0, 3000) * kMiB,
                                     static_cast<double>(uniform(50, 95)) / 100.0));
    SCOPED_TRACE("case " + std::to_string(k) + ": " + std::to_string(layers) + " layers, " +
                 std::to_string(ranks) + " ranks");
    const BruteForce bf = brute_force(layers, c, budgets);
    if (!bf.feasible) {
      // No split fits the weights, so the partitioner must refuse rather than return one.
      EXPECT_THROW(partition_layers(layers, c, budgets, {}), std::invalid_argument);
      continue;
    }
    ++feasible_cases;
    const PartitionPlan plan = partition_layers(layers, c, budgets, {});
    expect_consistent_plan(plan, layers, c, budgets);
    EXPECT_EQ(plan.num_blocks, bf.best_common);
    EXPECT_EQ(ref_common(c, budgets, layers_of(plan)), bf.best_common);
  }
  // Guards against a generator that only produces infeasible cases and so tests nothing.
  EXPECT_GE(feasible_cases, 15);
}

TEST(PartitionerAuto, mixed_budgets_match_brute_force_and_are_most_even) {
  std::mt19937_64 rng(7);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int k = 0; k < 30; ++k) {
    const int64_t ranks = uniform(2, 4);
    const int64_t layers = uniform(ranks, 10);
    const StageCost c = make_cost(uniform(50, 150) * kMiB, uniform(0, 400) * kMiB,
                                  uniform(0, 400) * kMiB, uniform(1, 16) * 64 * kKiB);
    std::vector<RankBudget> budgets;
    for (int64_t r = 0; r < ranks; ++r) {
      if (uniform(0, 1) == 0)
        budgets.push_back(fixed_budget(uniform(64, 2048) * kMiB));
      else
        budgets.push_back(share_budget(layers * c.layer_weight_bytes + 800 * kMiB +
                                           uniform(0, 2048) * kMiB,
                                       0.9));
    }
    SCOPED_TRACE("case " + std::to_string(k));
    const BruteForce bf = brute_force(layers, c, budgets);
    ASSERT_TRUE(bf.feasible);
    const PartitionPlan plan = partition_layers(layers, c, budgets, {});
    expect_consistent_plan(plan, layers, c, budgets);
    EXPECT_EQ(plan.num_blocks, bf.best_common);
    EXPECT_EQ(spread(layers_of(plan)), bf.best_spread);
  }
}

TEST(PartitionerAuto, lopsided_budgets_still_give_every_rank_a_layer) {
  // The optimum pushes rank 1 down to a single layer; it must stop there, not at zero.
  const StageCost c = make_cost(100 * kMiB, 0, 0, kKiB);
  const std::vector<RankBudget> budgets = {fixed_budget(kGiB), fixed_budget(kMiB)};
  const PartitionPlan plan = partition_layers(8, c, budgets, {});
  expect_consistent_plan(plan, 8, c, budgets);
  EXPECT_EQ(layers_of(plan), (std::vector<int64_t>{7, 1}));
  EXPECT_EQ(plan.num_blocks, brute_force(8, c, budgets).best_common);
}

TEST(PartitionerAuto, zero_block_budgets_still_give_every_rank_a_layer) {
  // Every split ties at zero blocks; the tie must not be resolved with an empty rank.
  const StageCost c = make_cost(100 * kMiB, 0, 0, kMiB);
  const std::vector<RankBudget> budgets = {fixed_budget(0), fixed_budget(0), fixed_budget(0)};
  const PartitionPlan plan = partition_layers(5, c, budgets, {});
  expect_consistent_plan(plan, 5, c, budgets);
  EXPECT_EQ(plan.num_blocks, 0);
  EXPECT_EQ(spread(layers_of(plan)), 1);
}

TEST(PartitionerAuto, one_rank_takes_every_layer) {
  const StageCost c = make_cost(100 * kMiB, 300 * kMiB, 400 * kMiB, kMiB);
  const std::vector<RankBudget> budgets = {share_budget(4 * kGiB)};
  const PartitionPlan plan = partition_layers(6, c, budgets, {});
  expect_consistent_plan(plan, 6, c, budgets);
  EXPECT_EQ(layers_of(plan), (std::vector<int64_t>{6}));
  EXPECT_EQ(plan.stages[0].weight_bytes, 6 * 100 * kMiB + 300 * kMiB + 400 * kMiB);
}

// ---------------------------------------------------------------------------------------------
// Pinned split

TEST(PartitionerPinned, split_is_used_as_given) {
  const StageCost c = make_cost(10 * kMiB, 100 * kMiB, 50 * kMiB, kMiB);
  // Budgets that would favour another split, so a pinned split that got re-optimised shows.
  const std::vector<RankBudget> budgets = {fixed_budget(kGiB), fixed_budget(4 * kGiB),
                                           fixed_budget(kGiB)};
  const PartitionPlan plan = partition_layers(7, c, budgets, {3, 2, 2});
  ASSERT_EQ(plan.stages.size(), 3u);
  EXPECT_EQ(layers_of(plan), (std::vector<int64_t>{3, 2, 2}));
  EXPECT_EQ(plan.stages[0].first_layer, 0);
  EXPECT_EQ(plan.stages[1].first_layer, 3);
  EXPECT_EQ(plan.stages[2].first_layer, 5);
  EXPECT_EQ(plan.stages[0].weight_bytes, 3 * 10 * kMiB + 100 * kMiB);
  EXPECT_EQ(plan.stages[1].weight_bytes, 2 * 10 * kMiB);
  EXPECT_EQ(plan.stages[2].weight_bytes, 2 * 10 * kMiB + 50 * kMiB);
  expect_consistent_plan(plan, 7, c, budgets);
  EXPECT_EQ(plan.num_blocks, kGiB / (3 * kMiB));
}

TEST(PartitionerPinned, wrong_sum_is_rejected) {
  const StageCost c = make_cost(10, 0, 0, 1);
  const std::vector<RankBudget> budgets(3, fixed_budget(kGiB));
  for (const std::vector<int>& pinned : {std::vector<int>{3, 2, 1}, std::vector<int>{3, 3, 2}}) {
    const std::string msg =
        invalid_argument_message([&] { partition_layers(7, c, budgets, pinned); });
    EXPECT_NE(msg.find("parallel.layers"), std::string::npos) << msg;
  }
}

TEST(PartitionerPinned, wrong_length_is_rejected) {
  const StageCost c = make_cost(10, 0, 0, 1);
  const std::vector<RankBudget> budgets(3, fixed_budget(kGiB));
  for (const std::vector<int>& pinned : {std::vector<int>{4, 3}, std::vector<int>{2, 2, 2, 1}}) {
    const std::string msg =
        invalid_argument_message([&] { partition_layers(7, c, budgets, pinned); });
    EXPECT_NE(msg.find("parallel.layers"), std::string::npos) << msg;
  }
}

TEST(PartitionerPinned, empty_or_negative_entry_is_rejected) {
  const StageCost c = make_cost(10, 0, 0, 1);
  const std::vector<RankBudget> budgets(3, fixed_budget(kGiB));
  // {8, -1, 0} sums to 7, so only the per-entry check can catch it.
  for (const std::vector<int>& pinned :
       {std::vector<int>{5, 0, 2}, std::vector<int>{7, 0, 0}, std::vector<int>{8, -1, 0}}) {
    const std::string msg =
        invalid_argument_message([&] { partition_layers(7, c, budgets, pinned); });
    EXPECT_NE(msg.find("parallel.layers"), std::string::npos) << msg;
  }
}

TEST(PartitionerPinned, split_whose_weights_do_not_fit_names_the_rank) {
  const StageCost c = make_cost(100 * kMiB, 0, 300 * kMiB, kMiB);
  const std::vector<RankBudget> budgets = {share_budget(4 * kGiB), share_budget(4 * kGiB),
                                           share_budget(500 * kMiB)};
  const std::string msg =
      invalid_argument_message([&] { partition_layers(7, c, budgets, {2, 2, 3}); });
  EXPECT_NE(msg.find("rank 2"), std::string::npos) << msg;
}

// ---------------------------------------------------------------------------------------------
// Impossible requests

TEST(PartitionerErrors, more_ranks_than_layers_names_the_rank_count) {
  const StageCost c = make_cost(10, 0, 0, 1);
  const std::vector<RankBudget> budgets(5, fixed_budget(kGiB));
  const std::string msg = invalid_argument_message([&] { partition_layers(3, c, budgets, {}); });
  EXPECT_NE(msg.find("5 ranks"), std::string::npos) << msg;
  // A pinned split cannot rescue it either.
  EXPECT_THROW(partition_layers(3, c, budgets, {1, 1, 1, 0, 0}), std::invalid_argument);
}

TEST(PartitionerErrors, no_ranks_is_rejected) {
  const StageCost c = make_cost(10, 0, 0, 1);
  EXPECT_THROW(partition_layers(3, c, {}, {}), std::invalid_argument);
}

TEST(PartitionerErrors, share_budget_too_small_for_weights_names_the_rank) {
  // Rank 1 is the last stage: even a single layer plus the LM head exceeds its memory.
  const StageCost c = make_cost(100 * kMiB, 200 * kMiB, 300 * kMiB, kMiB);
  const std::vector<RankBudget> budgets = {share_budget(8 * kGiB), share_budget(350 * kMiB)};
  const std::string msg = invalid_argument_message([&] { partition_layers(6, c, budgets, {}); });
  EXPECT_NE(msg.find("rank"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
}

TEST(PartitionerErrors, share_budget_too_small_on_middle_rank_names_it) {
  const StageCost c = make_cost(100 * kMiB, 200 * kMiB, 300 * kMiB, kMiB);
  const std::vector<RankBudget> budgets = {share_budget(8 * kGiB), share_budget(50 * kMiB),
                                           share_budget(8 * kGiB)};
  const std::string msg = invalid_argument_message([&] { partition_layers(6, c, budgets, {}); });
  EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
}

TEST(PartitionerErrors, ranks_that_together_cannot_hold_the_model_are_rejected) {
  // Each rank fits one layer, but not the six layers between them.
  const StageCost c = make_cost(100 * kMiB, 0, 0, kMiB);
  const std::vector<RankBudget> budgets = {share_budget(150 * kMiB), share_budget(250 * kMiB)};
  ASSERT_FALSE(brute_force(6, c, budgets).feasible);
  EXPECT_THROW(partition_layers(6, c, budgets, {}), std::invalid_argument);
}

// The largest models the loader accepts (4096 layers) plan in well under a second: the search
// is not quadratic in the layer count, and the split is still the most even of the best.
TEST(PartitionerScale, thousands_of_layers_plan_quickly) {
  const auto t0 = std::chrono::steady_clock::now();
  const StageCost c = make_cost(10 * kMiB, 100 * kMiB, 100 * kMiB, 64 * kKiB);
  const std::vector<RankBudget> budgets = {share_budget(64 * kGiB), share_budget(64 * kGiB), share_budget(64 * kGiB),
                                           share_budget(64 * kGiB)};
  const PartitionPlan plan = partition_layers(4096, c, budgets, {});
  expect_consistent_plan(plan, 4096, c, budgets);
  EXPECT_LE(spread(layers_of(plan)), 1);
  const std::vector<RankBudget> uneven = {fixed_budget(8 * kGiB), fixed_budget(2 * kGiB), fixed_budget(4 * kGiB)};
  const PartitionPlan lopsided = partition_layers(4000, c, uneven, {});
  expect_consistent_plan(lopsided, 4000, c, uneven);
  EXPECT_GT(lopsided.stages[0].num_layers, lopsided.stages[1].num_layers);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
}

TEST(PartitionerScale, absurd_layer_counts_are_refused_by_name) {
  const StageCost c = make_cost(kMiB, 0, 0, kKiB);
  const std::string msg =
      invalid_argument_message([&] { partition_layers(int64_t{1} << 40, c, {fixed_budget(kGiB)}, {}); });
  EXPECT_NE(msg.find("layers"), std::string::npos) << msg;
}

}  // namespace
}  // namespace kvpipe
