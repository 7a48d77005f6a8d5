// JobPlan: how a job's model and KV cache are laid out over the ranks.
//
// Joins the job config, the model's shape and the world size into the partitioner's inputs
// (per-rank memory budgets, per-stage weight bytes) and returns the split and the common
// block count. Shared by `generate` (which then loads exactly that) and `validate` (which
// only prints it).
#pragma once

#include "cache/block_pool.h"
#include "engine/model_config.h"
#include "engine/model_weights.h"
#include "launch/job_config.h"
#include "parallel/partitioner.h"

#include <ATen/core/ScalarType.h>

#include <ostream>

namespace kvpipe {

struct JobPlan {
  ModelConfig model;
  at::ScalarType dtype = at::kFloat;
  KvDtype kv_dtype = KvDtype::kFloat32;  // cache.dtype as resolved (auto: the compute dtype)
  int64_t kv_bytes_per_token_layer = 0;  // K and V of one token in one layer, as stored
  StoredWeightBytes weight_bytes;        // the weights as loaded, from the file's index
  PartitionPlan partition;
  int64_t block_size = 16;
  int64_t first_cached_layer = 0;  // layers before it keep no K/V (cache.cached_layers)
};

JobPlan plan_job(const JobConfig& job, int world_size);

// The shape of the job's model.path (its config only); errors name the key that pointed there.
ModelConfig load_job_model_config(const JobConfig& job);

// The plan as log lines: the split, each rank's weight and KV bytes, the common block count
// and the largest number of tokens all running sequences can hold together.
void print_plan(std::ostream& out, const JobPlan& plan);

// Physical memory of this machine, for `runtime.memory: auto` on CPU.
int64_t host_memory_bytes();

// runtime.memory in bytes: the size given, or `auto` / a share of the machine's memory.
int64_t runtime_memory_bytes(const JobConfig& job);

}  // namespace kvpipe
