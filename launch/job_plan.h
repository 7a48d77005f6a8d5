// JobPlan: how a job's model and KV cache are laid out over the ranks.
//
// Joins the job config, the model's shape and the world size into the partitioner's inputs
// (per-rank memory budgets, per-stage weight bytes) and returns the split and the common
// block count. Shared by `generate` (which then loads exactly that) and `validate` (which
// only prints it). Guarantees that what a rank will allocate (weights, KV pool, RoPE tables,
// an estimate of one maximal step's activations) fits runtime.memory (the machine's memory
// when auto) and that runtime.threads fits the machine, refusing with std::invalid_argument
// naming the key before anything is allocated; check_request refuses what the engine would.
#pragma once

#include "cache/block_pool.h"
#include "engine/model/model_config.h"
#include "engine/model/model_weights.h"
#include "launch/job_config.h"
#include "engine/model/tensor_split.h"
#include "parallel/partitioner.h"
#include "parallel/process_grid.h"

#include <ATen/core/ScalarType.h>
#include <c10/core/DeviceType.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace kvpipe {

struct JobPlan {
  ModelConfig model;
  ProcessGrid grid;  // stages x tensor ranks (parallel.tensor)
  std::vector<TensorSplit> tensor_splits;  // one per tensor rank, the same in every stage
  // runtime.device as resolved: auto is CUDA when this process sees a GPU, else the CPU.
  at::DeviceType device_type = at::kCPU;
  // What runtime.memory: auto and its shares refer to: the host's memory, or on a GPU that
  // GPU's memory divided among the ranks of this node that share it.
  int64_t device_memory_bytes = 0;
  at::ScalarType dtype = at::kFloat;  // model.dtype as resolved (auto: bfloat16 on a GPU)
  KvDtype kv_dtype = KvDtype::kFloat32;  // cache.dtype as resolved (auto: the compute dtype)
  int64_t kv_bytes_per_token_layer = 0;  // K and V of one token in one layer on one rank, as stored
  StoredWeightBytes weight_bytes;        // the weights as loaded, from the file's index
  PartitionPlan partition;  // one StagePlan per stage (stage_of(rank) indexes it)
  int64_t block_size = 16;
  int64_t first_cached_layer = 0;  // layers before it keep no K/V (cache.cached_layers)
  // Prompt + output tokens of the longest request one sequence's KV blocks can hold in the
  // pool (at most the model's context; the scheduler's admission rule).
  int64_t longest_request = 0;
  // speculative.method draft: the draft model's shape (its vocabulary checked against the
  // model's), and the blocks of its own KV pool on rank 0, with what its weights and its pool
  // take there (counted in rank 0's memory check).
  ModelConfig draft_model;
  int64_t draft_blocks = 0;
  int64_t draft_weight_bytes = 0;
  int64_t draft_kv_bytes_per_block = 0;
};

JobPlan plan_job(const JobConfig& job, int world_size);

// The micro-batches the pipeline runs: parallel.micro_batches, auto (0) being one per stage;
// always 1 with a single stage.
int64_t resolved_micro_batches(const JobConfig& job, const JobPlan& plan);

// The shape of the job's model.path (its config only); errors name the key that pointed there.
ModelConfig load_job_model_config(const JobConfig& job);

// The shape of speculative.model, refused (naming the key and both files) unless it shares
// `target`'s vocabulary: as many tokens, and where both carry a tokenizer, the same pieces.
ModelConfig check_draft_model(const JobConfig& job, const ModelConfig& target);

// The plan as log lines: the split, each rank's weight and KV bytes, the common block count,
// the largest number of tokens all running sequences can hold together, and the longest
// request with what limits it (cache.memory or the model's context).
void print_plan(std::ostream& out, const JobPlan& plan);

// Physical memory of this machine, for `runtime.memory: auto` on CPU.
int64_t host_memory_bytes();

// runtime.memory in bytes: the size given, or `auto` / a share of the device's memory
// (device_memory_bytes).
int64_t runtime_memory_bytes(const JobConfig& job, int64_t device_memory_bytes);

// runtime.device resolved: "cuda" and "cpu" as given, "auto" CUDA when a GPU is visible.
at::DeviceType resolve_device_type(const JobConfig& job);

// What generate's engine refuses of one request, checked before anything is loaded: an empty
// prompt, a token outside the vocabulary, a prompt that fills the model's context, a request
// whose longest sequence needs more KV blocks than the pool has. Messages start with `who`
// (`job.yaml:12:5: requests[3]`, `--prompt-ids`) and read as the engine's do after it.
// Throws std::invalid_argument.
void check_request(const JobConfig& job, const JobPlan& plan, const std::vector<int64_t>& prompt,
                   int64_t max_new_tokens, const std::string& who);

// How messages name request `index` of the job file: `job.yaml:12:5: requests[3]`.
std::string request_who(const JobConfig& job, size_t index);

// check_request for every request of the job file; text prompts and chat messages are
// tokenised as generate tokenises them (the model's tokenizer is loaded only for those).
void check_job_requests(const JobConfig& job, const JobPlan& plan);

}  // namespace kvpipe
