// TensorSplit: the part of every layer one tensor rank holds (Megatron's split).
//
// Inside a pipeline stage, T tensor ranks split each layer: q, k and v by heads and gate/up
// by intermediate units (column-parallel: each rank computes its own heads and units), the
// output and down projections along their inputs (row-parallel: each rank's partial sum is
// all-reduced), the embedding and the LM head by vocabulary rows; norms are replicated.
// When T exceeds the model's KV heads each KV head (and its cache) is replicated on
// T / kv_heads ranks, as vLLM does. A split along a matrix's input dimension falls on its
// storage blocks (32 or 256 values for GGUF block types), so the intermediate units are
// dealt out in whole blocks, as evenly as the blocks allow. `plan_tensor_split` refuses what
// cannot be split with std::invalid_argument naming parallel.tensor and the numbers.
#pragma once

#include "engine/model/model_config.h"

#include <cstdint>
#include <string>

namespace kvpipe {

struct TensorSplit {
  int rank = 0;  // tensor rank in the stage
  int size = 1;  // tensor ranks in the stage (parallel.tensor)
  int64_t first_head = 0, heads = 0;        // query heads
  int64_t first_kv_head = 0, kv_heads = 0;  // KV heads (one replicated head when size > the model's)
  int64_t ff_begin = 0, ff_units = 0;       // intermediate units of the MLP
  int64_t vocab_begin = 0, vocab_rows = 0;  // rows of the embedding and the LM head
  bool whole() const { return size == 1; }
};

// Values per storage block along the input dimension of the row-parallel matrices (1 for
// float matrices): every layer's o_proj and down_proj of the model's file.
struct SplitAlignment {
  int64_t o_cols = 1;
  int64_t down_cols = 1;
};

// The whole model on one rank.
TensorSplit whole_model_split(const ModelConfig& cfg);

// Tensor rank `rank` of `size`.
TensorSplit plan_tensor_split(const ModelConfig& cfg, int size, int rank, const SplitAlignment& align = {});

// Refuses (std::invalid_argument naming parallel.tensor) a `size` whose split of `cfg` cannot
// be made: heads, KV heads, intermediate blocks or the output projection's blocks.
void check_tensor_split(const ModelConfig& cfg, int size, const SplitAlignment& align = {});

}  // namespace kvpipe
