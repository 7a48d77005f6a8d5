#include "parallel/partitioner.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <stdexcept>
#include <string>

namespace kvpipe {
namespace {

constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();
// The plan keeps a table of (ranks + 1) x (layers + 1) entries.
constexpr int64_t kMaxLayers = int64_t{1} << 20;

int64_t weight_bytes_of(const StageCost& c, size_t rank, size_t ranks, int64_t layers) {
  int64_t w = layers * c.layer_weight_bytes;
  if (rank == 0) w += c.first_extra_bytes;
  if (rank + 1 == ranks) w += c.last_extra_bytes;
  return w;
}

int64_t cached_in(const StageCost& c, int64_t begin, int64_t end) {
  return std::max<int64_t>(0, end - std::max(begin, c.first_cached_layer));
}

// Blocks rank `r` can hold when it runs layers [begin, end).
int64_t range_blocks(const StageCost& c, const std::vector<RankBudget>& budgets, size_t r, int64_t begin,
                     int64_t end) {
  return stage_blocks(c, budgets[r], cached_in(c, begin, end), weight_bytes_of(c, r, budgets.size(), end - begin));
}

PartitionPlan plan_for(const std::vector<int64_t>& split, const StageCost& cost,
                       const std::vector<RankBudget>& budgets) {
  PartitionPlan plan;
  plan.num_blocks = kUnlimited;
  int64_t first = 0;
  for (size_t r = 0; r < split.size(); ++r) {
    StagePlan s;
    s.first_layer = first;
    s.num_layers = split[r];
    s.cached_layers = cached_in(cost, first, first + split[r]);
    s.weight_bytes = weight_bytes_of(cost, r, split.size(), split[r]);
    const RankBudget& b = budgets[r];
    s.kv_budget_bytes = b.share_of_memory
                            ? static_cast<int64_t>(static_cast<double>(b.memory_bytes - s.weight_bytes) * b.share)
                            : b.kv_bytes;
    s.max_blocks = stage_blocks(cost, b, s.cached_layers, s.weight_bytes);
    plan.num_blocks = std::min(plan.num_blocks, s.max_blocks);
    plan.stages.push_back(s);
    first += split[r];
  }
  return plan;
}

// Ranks 0..R-1 take contiguous ranges covering all layers, each range's size within
// [min_size, max_size] and each rank holding at least `blocks`: one such split, or empty.
// A rank's blocks only shrink as its range grows (more weights, more cached layers), so the
// ends a start `a` can reach form one interval, found by bisection; each end takes the
// smallest start that reaches it. O(ranks x layers x log(layers)): a model of thousands of
// layers plans in well under a second.
std::vector<int64_t> find_split(int64_t layers, const StageCost& cost, const std::vector<RankBudget>& budgets,
                                int64_t blocks, int64_t min_size, int64_t max_size) {
  const size_t ranks = budgets.size();
  // from[r][l] >= 0: ranks 0..r-1 can cover layers [0, l), rank r-1 starting at from[r][l].
  std::vector<std::vector<int64_t>> from(ranks + 1, std::vector<int64_t>(layers + 1, -1));
  from[0][0] = 0;
  std::vector<int64_t> last_end(layers + 1);
  std::deque<int64_t> starts;
  for (size_t r = 0; r < ranks; ++r) {
    // last_end[a]: the farthest end rank r reaches from a reachable start a (< a + min_size: none).
    for (int64_t a = 0; a <= layers; ++a) {
      last_end[a] = -1;
      if (from[r][a] < 0 || a + min_size > layers) continue;
      int64_t lo = a + min_size - 1, hi = std::min(layers, a + max_size);
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (range_blocks(cost, budgets, r, a, mid) >= blocks) lo = mid;
        else hi = mid - 1;
      }
      last_end[a] = lo;
    }
    starts.clear();
    int64_t next_start = 0;
    for (int64_t b = 0; b <= layers; ++b) {
      for (; next_start + min_size <= b; ++next_start)
        if (last_end[next_start] >= next_start + min_size) starts.push_back(next_start);
      while (!starts.empty() && last_end[starts.front()] < b) starts.pop_front();
      if (!starts.empty()) from[r + 1][b] = starts.front();
    }
  }
  if (from[ranks][layers] < 0) return {};
  std::vector<int64_t> split(ranks);
  int64_t end = layers;
  for (size_t r = ranks; r > 0; --r) {
    const int64_t begin = from[r][end];
    split[r - 1] = end - begin;
    end = begin;
  }
  return split;
}

}  // namespace

int64_t stage_blocks(const StageCost& cost, const RankBudget& b, int64_t cached_layers, int64_t weight_bytes) {
  if (b.share_of_memory && b.memory_bytes < weight_bytes) return -1;
  if (cached_layers == 0) return kUnlimited;
  const int64_t kv = b.share_of_memory
                         ? static_cast<int64_t>(static_cast<double>(b.memory_bytes - weight_bytes) * b.share)
                         : b.kv_bytes;
  const int64_t per_block = cached_layers * cost.kv_bytes_per_block_layer;
  return per_block > 0 ? kv / per_block : 0;
}

PartitionPlan partition_layers(int64_t num_layers, const StageCost& cost,
                               const std::vector<RankBudget>& budgets,
                               const std::vector<int>& pinned) {
  const int64_t ranks = static_cast<int64_t>(budgets.size());
  if (ranks < 1) throw std::invalid_argument("partitioner: no ranks");
  if (num_layers > kMaxLayers)
    throw std::invalid_argument("parallel: the model's " + std::to_string(num_layers) +
                                " layers are more than the " + std::to_string(kMaxLayers) +
                                " a pipeline can be planned for");
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
    // The best common block count: the largest B for which some split gives every rank at
    // least B blocks (feasibility is monotone in B, so bisect).
    auto feasible = [&](int64_t blocks) { return !find_split(num_layers, cost, budgets, blocks, 1, num_layers).empty(); };
    if (!feasible(0)) {
      for (int64_t r = 0; r < ranks; ++r) {
        bool fits = false;
        for (int64_t a = 0; a < num_layers && !fits; ++a) fits = range_blocks(cost, budgets, r, a, a + 1) >= 0;
        if (!fits)
          throw std::invalid_argument("memory: rank " + std::to_string(r) + " cannot hold the weights of its stage");
      }
      throw std::invalid_argument("memory: the ranks cannot hold the model's weights together");
    }
    int64_t lo = 0, hi = 1;
    while (hi < kUnlimited / 2 && feasible(hi)) hi *= 2;
    if (hi >= kUnlimited / 2 && feasible(kUnlimited)) lo = kUnlimited;  // no rank keeps K/V
    while (lo != kUnlimited && hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (feasible(mid) ? lo : hi) = mid;
    }
    // Among the best splits, the most even one: the smallest spread between the largest and
    // the smallest stage; of those, the largest smallest stage. For a smallest stage m the
    // least largest stage is found by bisection (a larger one only allows more splits);
    // sizes in [m, m + spread] cover the layers only when ranks x (m + spread) reaches them,
    // which ends the scan once no smaller m can do better.
    const int64_t even = (num_layers + ranks - 1) / ranks;
    int64_t best_min = 0, best_spread = -1;
    for (int64_t m = num_layers / ranks; m >= 1; --m) {
      if (best_spread == 0 || (best_spread > 0 && even - m >= best_spread)) break;
      int64_t top = best_spread < 0 ? num_layers : std::min(num_layers, m + best_spread - 1);
      if (top < m || find_split(num_layers, cost, budgets, lo, m, top).empty()) continue;
      int64_t bottom = m;
      while (bottom < top) {
        const int64_t mid = bottom + (top - bottom) / 2;
        if (find_split(num_layers, cost, budgets, lo, m, mid).empty()) bottom = mid + 1;
        else top = mid;
      }
      best_min = m;
      best_spread = top - m;
    }
    if (best_spread >= 0) split = find_split(num_layers, cost, budgets, lo, best_min, best_min + best_spread);
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
