// Partitioner: which contiguous range of layers each pipeline rank runs.
//
// A split is either pinned by the job (`parallel.layers: [3, 2, 2]`) or chosen here. The
// choice maximises the number of KV blocks every rank can hold (usable capacity is the
// minimum over ranks, since one block table addresses every rank's pool), given each rank's
// memory budget and what its weights take; the embedding counts on the first stage and the
// final norm and LM head on the last. Impossible requests (more ranks than layers, a pinned
// split that does not cover the model, a budget that cannot hold a rank's weights) are
// std::invalid_argument naming the rank or key.
#pragma once

#include <cstdint>
#include <vector>

namespace kvpipe {

struct StageCost {
  int64_t layer_weight_bytes = 0;   // weights of one decoder layer
  int64_t first_extra_bytes = 0;    // embedding, on the first stage
  int64_t last_extra_bytes = 0;     // final norm and LM head, on the last stage
  int64_t kv_bytes_per_block_layer = 0;  // one block of K and V for one layer
  int64_t first_cached_layer = 0;  // layers before it keep no K/V (layer-level reuse)
};

struct RankBudget {
  // Either a fixed KV budget, or the memory left after weights times a share.
  bool share_of_memory = false;
  int64_t kv_bytes = 0;         // when !share_of_memory
  int64_t memory_bytes = 0;     // when share_of_memory
  double share = 1.0;
};

struct StagePlan {
  int64_t first_layer = 0;
  int64_t num_layers = 0;
  int64_t weight_bytes = 0;
  int64_t kv_budget_bytes = 0;
  int64_t cached_layers = 0;    // layers whose K/V the rank keeps
  int64_t max_blocks = 0;       // blocks this rank alone could hold
};

struct PartitionPlan {
  std::vector<StagePlan> stages;
  int64_t num_blocks = 0;       // common to every rank; int64 max when no rank keeps K/V
};

// Blocks a rank holding `cached_layers` layers with K/V and `weight_bytes` of weights can
// keep under `budget`: int64 max when it caches no layer, -1 when the weights do not fit.
int64_t stage_blocks(const StageCost& cost, const RankBudget& budget, int64_t cached_layers,
                     int64_t weight_bytes);

// `pinned` empty: the split that maximises the common block count (ties: the most even).
PartitionPlan partition_layers(int64_t num_layers, const StageCost& cost,
                               const std::vector<RankBudget>& budgets,
                               const std::vector<int>& pinned);

}  // namespace kvpipe
