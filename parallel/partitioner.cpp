#include "parallel/partitioner.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace kvpipe {
namespace {

int64_t weight_bytes_of(const StageCost& c, size_t rank, size_t ranks, int64_t layers) {
  int64_t w = layers * c.layer_weight_bytes;
  if (rank == 0) w += c.first_extra_bytes;
  if (rank + 1 == ranks) w += c.last_extra_bytes;
  return w;
}

PartitionPlan plan_for(const std::vector<int64_t>& split, const StageCost& cost,
                       const std::vector<RankBudget>& budgets) {
  PartitionPlan plan;
  plan.num_blocks = std::numeric_limits<int64_t>::max();
  int64_t first = 0;
  for (size_t r = 0; r < split.size(); ++r) {
    StagePlan s;
    s.first_layer = first;
    s.num_layers = split[r];
    s.weight_bytes = weight_bytes_of(cost, r, split.size(), split[r]);
    const RankBudget& b = budgets[r];
    s.kv_budget_bytes = b.share_of_memory
                            ? static_cast<int64_t>(static_cast<double>(b.memory_bytes - s.weight_bytes) * b.share)
                            : b.kv_bytes;
    s.max_blocks = stage_blocks(cost, b, s.num_layers, s.weight_bytes);
    // A rank without layers holds no K/V and does not limit the block count.
    if (s.num_layers > 0) plan.num_blocks = std::min(plan.num_blocks, s.max_blocks);
    plan.stages.push_back(s);
    first += split[r];
  }
  if (plan.num_blocks == std::numeric_limits<int64_t>::max()) plan.num_blocks = 0;
  return plan;
}

}  // namespace

int64_t stage_blocks(const StageCost& cost, const RankBudget& b, int64_t layers,
                     int64_t weight_bytes) {
  if (layers == 0) return std::numeric_limits<int64_t>::max();
  int64_t kv = b.kv_bytes;
  if (b.share_of_memory) {
    if (b.memory_bytes < weight_bytes) return -1;
    kv = static_cast<int64_t>(static_cast<double>(b.memory_bytes - weight_bytes) * b.share);
  }
  const int64_t per_block = layers * cost.kv_bytes_per_block_layer;
  return per_block > 0 ? kv / per_block : 0;
}

PartitionPlan partition_layers(int64_t num_layers, const StageCost& cost,
                               const std::vector<RankBudget>& budgets,
                               const std::vector<int>& pinned) {
  const int64_t ranks = static_cast<int64_t>(budgets.size());
  if (ranks < 1) throw std::invalid_argument("partitioner: no ranks");
  if (ranks > num_layers)
    throw std::invalid_argument("parallel: " + std::to_string(ranks) + " ranks but the model has only " +
                                std::to_string(num_layers) + " layers");
  std::vector<int64_t> split;
  if (!pinned.empty()) {
    if (static_cast<int64_t>(pinned.size()) != ranks)
      throw std::invalid_argument("parallel.layers: " + std::to_string(pinned.size()) +
                                  " entries for " + std::to_string(ranks) + " ranks");
    int64_t sum = 0;
    for (size_t r = 0; r < pinned.size(); ++r) {
      if (pinned[r] < 1)
        throw std::invalid_argument("parallel.layers: rank " + std::to_string(r) + " gets no layers");
      sum += pinned[r];
      split.push_back(pinned[r]);
    }
    if (sum != num_layers)
      throw std::invalid_argument("parallel.layers: the split sums to " + std::to_string(sum) +
                                  " layers, the model has " + std::to_string(num_layers));
  } else {
    // Greedy over the layer counts is not exact with per-rank extras; the search space
    // (compositions of L into R parts) is small for real models only when R is small, so
    // search by bisection on the block count instead: the largest B such that the ranks,
    // in order, can each take as many layers as still leave B blocks.
    auto max_layers_for = [&](size_t r, int64_t blocks) {
      int64_t lo = 0;
      for (int64_t n = 1; n <= num_layers; ++n) {
        const int64_t w = weight_bytes_of(cost, r, ranks, n);
        if (stage_blocks(cost, budgets[r], n, w) >= blocks) lo = n; else break;
      }
      return lo;
    };
    auto feasible = [&](int64_t blocks, std::vector<int64_t>* out) {
      std::vector<int64_t> caps(ranks);
      int64_t total = 0;
      for (int64_t r = 0; r < ranks; ++r) {
        caps[r] = max_layers_for(r, blocks);
        if (caps[r] < 1) return false;
        total += caps[r];
      }
      if (total < num_layers) return false;
      if (out) {
        // Start from one layer each, then hand out the rest as evenly as the caps allow.
        std::vector<int64_t> s(ranks, 1);
        int64_t left = num_layers - ranks;
        while (left > 0) {
          int64_t best = -1;
          for (int64_t r = 0; r < ranks; ++r)
            if (s[r] < caps[r] && (best < 0 || s[r] < s[best])) best = r;
          ++s[best];
          --left;
        }
        *out = s;
      }
      return true;
    };
    if (!feasible(0, nullptr)) {
      for (int64_t r = 0; r < ranks; ++r)
        if (max_layers_for(r, 0) < 1)
          throw std::invalid_argument("memory: rank " + std::to_string(r) +
                                      " cannot hold the weights of its stage");
      throw std::invalid_argument("memory: the ranks cannot hold the model's weights together");
    }
    int64_t lo = 0, hi = 1;
    while (feasible(hi, nullptr) && hi < (int64_t{1} << 40)) hi *= 2;
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (feasible(mid, nullptr) ? lo : hi) = mid;
    }
    feasible(lo, &split);
  }
  PartitionPlan plan = plan_for(split, cost, budgets);
  for (size_t r = 0; r < plan.stages.size(); ++r)
    if (plan.stages[r].max_blocks < 0)
      throw std::invalid_argument("memory: rank " + std::to_string(r) + " cannot hold the " +
                                  std::to_string(plan.stages[r].weight_bytes) +
                                  " bytes of weights of its stage");
  return plan;
}

}  // namespace kvpipe
