#include "launch/job_plan.h"

#include "engine/model/model_weights.h"
#include "launch/device_plan.h"
#include "launch/job_runner.h"
#include "launch/model_text.h"
#include "parallel/communicator.h"

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <iomanip>
#include <limits>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace kvpipe {
namespace {

std::string gib(double bytes) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(bytes < 1e9 ? 3 : 1) << bytes / double(1LL << 30) << " GiB";
  return s.str();
}

// Where the job file sets `key`, else the file itself.
std::string where_of(const JobConfig& job, const std::string& key) {
  const auto it = job.where.find(key);
  return it == job.where.end() ? job.source : it->second;
}

// "WHERE: KEY" for a message about `key`, without repeating the key when WHERE is `--set KEY`.
std::string at_key(const JobConfig& job, const std::string& key) {
  const std::string where = where_of(job, key);
  return where == "--set " + key ? where : where + ": " + key;
}

// The model file and its key for a field of ModelConfig, as a message names them:
// `models/x/config.json: max_position_embeddings`, `m.gguf: context_length`.
std::string model_key(const JobConfig& job, const std::string& hf_key, const std::string& gguf_key) {
  const std::string& path = job.model.path;
  if (path.rfind("dummy:", 0) == 0) return path + ": " + hf_key;
  const std::string gguf = ".gguf";
  if (path.size() > gguf.size() && path.compare(path.size() - gguf.size(), gguf.size(), gguf) == 0)
    return path + ": " + gguf_key + " (" + hf_key + ")";
  return path + "/config.json: " + hf_key;
}

// runtime.memory as messages name it.
std::string memory_limit_text(const JobConfig& job, const JobPlan& plan, int64_t limit) {
  const std::string whose = plan.device_type == at::kCUDA ? "this rank's share of the GPU's " : "this machine's ";
  if (job.runtime.memory_bytes) return "runtime.memory (" + gib(double(limit)) + ")";
  if (job.runtime.memory_share)
    return "runtime.memory (" + gib(double(limit)) + ", a share of " + whose + gib(double(plan.device_memory_bytes)) +
           ")";
  return whose + gib(double(limit)) + " of memory (runtime.memory: auto)";
}

// Bytes a rank needs beside its weights and its KV pool, estimated from the model's shape and
// the job's step limits. Estimates in double: absurd shapes must give a large number, not an
// overflowed one.
struct RankOverhead {
  double rope = 0;         // RoPE cos/sin tables while they are built (in double) and kept
  double activations = 0;  // one maximal step through one layer, attention scores included
  double logits = 0;       // the last stage's logits of one step

  double total(bool last) const { return rope + activations + (last ? logits : 0); }
};

// Queries per attention block of a long prompt (engine/layers.cpp kQueryBlock).
constexpr double kQueryBlock = 256;

RankOverhead rank_overhead(const JobConfig& job, const ModelConfig& m) {
  RankOverhead o;
  const double positions = double(m.max_position), head_dim = double(m.head_dim);
  // Positions (8), frequencies (4 x hd), their concatenation (8 x hd), cos and sin in double
  // (16 x hd), then in float (8 x hd): bytes per position at the peak of make_rope_tables.
  o.rope = positions * (8 + 36 * head_dim);
  const double tokens = double(job.scheduler.max_tokens_per_step);
  const double hidden = double(m.hidden_size), q = double(m.num_heads) * head_dim,
               kv = double(m.num_kv_heads) * head_dim, ff = double(m.intermediate_size);
  // float32 values, twice: an operation's inputs and outputs live together.
  o.activations = 2 * 4 * tokens * (4 * hidden + 2 * q + 2 * kv + 3 * ff) +
                  2 * 4 * double(m.num_heads) * std::min(tokens, kQueryBlock) * positions;
  o.logits = 2 * 4 * double(job.scheduler.max_batch) * double(m.vocab_size);
  return o;
}

// Rank 0's block accounting (free list, reference counts, cache flags and index), per block.
constexpr double kBookkeepingBytesPerBlock = 16;

// Blocks the scheduler holds for a sequence of `tokens` tokens (Scheduler::max_blocks_held).
int64_t blocks_held(const JobConfig& job, const JobPlan& plan, int64_t tokens) {
  const int64_t bs = plan.block_size;
  const int64_t all = (tokens + bs - 1) / bs;
  if (job.cache.window_recent <= 0) return all;
  const int64_t chunk = std::min<int64_t>({job.scheduler.max_tokens_per_step, job.cache.window_recent, tokens});
  const int64_t windowed = (job.cache.window_sinks + bs - 1) / bs + (job.cache.window_recent + chunk + bs - 1) / bs + 2;
  return std::min(all, windowed);
}

}  // namespace

int64_t host_memory_bytes() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGE_SIZE));
}

int64_t runtime_memory_bytes(const JobConfig& job, int64_t device_memory_bytes) {
  if (job.runtime.memory_bytes) return *job.runtime.memory_bytes;
  if (job.runtime.memory_share)
    return static_cast<int64_t>(static_cast<double>(device_memory_bytes) * *job.runtime.memory_share);
  return device_memory_bytes;
}

at::DeviceType resolve_device_type(const JobConfig& job) {
  if (job.runtime.device == "cuda") return at::kCUDA;
  if (job.runtime.device == "cpu") return at::kCPU;
  return cuda_device_available() ? at::kCUDA : at::kCPU;
}

namespace {

// The GPU memory one rank may plan with: the first GPU's (a node's GPUs are alike), split
// evenly among the ranks of this node that share a GPU.
int64_t gpu_memory_per_rank(const JobConfig& job) {
  const int gpus = cuda_device_count();
  if (gpus < 1) return 0;
  const int64_t ranks = std::max(1, local_rank_count_from_env());
  const int64_t sharing = job.runtime.share_gpu ? (ranks + gpus - 1) / gpus : 1;
  return cuda_device_memory_bytes(0) / std::max<int64_t>(sharing, 1);
}

}  // namespace

namespace {

// The loader names the model file; the job file adds which key pointed there.
[[noreturn]] void refuse_model(const JobConfig& job, const std::invalid_argument& e) {
  const auto it = job.where.find("model.path");
  throw std::invalid_argument((it == job.where.end() ? job.source : it->second) + ": model.path: " + e.what());
}

}  // namespace

ModelConfig check_draft_model(const JobConfig& job, const ModelConfig& target) {
  const std::string& draft_path = job.speculative.model;
  const std::string key = at_key(job, "speculative.model");
  ModelConfig draft;
  try {
    draft = load_model_config(draft_path);
    check_model_tensors(draft_path, draft);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(key + ": " + e.what());
  }
  const std::string both = draft_path + " and " + job.model.path;
  if (draft.vocab_size != target.vocab_size)
    throw std::invalid_argument(key + ": the vocabularies of " + both + " differ: " + std::to_string(draft.vocab_size) +
                                " tokens against " + std::to_string(target.vocab_size));
  // Where both carry a tokenizer, every id must stand for the same piece.
  const std::unique_ptr<Tokenizer> a = Tokenizer::load(draft_path);
  const std::unique_ptr<Tokenizer> b = Tokenizer::load(job.model.path);
  if ((a == nullptr) != (b == nullptr))
    throw std::invalid_argument(key + ": the vocabularies of " + both + " differ: only " +
                                (a ? draft_path : job.model.path) + " carries a tokenizer");
  if (a != nullptr) {
    if (a->vocab_size() != b->vocab_size())
      throw std::invalid_argument(key + ": the vocabularies of " + both + " differ: tokenizers of " +
                                  std::to_string(a->vocab_size()) + " and " + std::to_string(b->vocab_size()) +
                                  " tokens");
    for (int64_t id = 0; id < a->vocab_size(); ++id)
      if (a->piece(id) != b->piece(id))
        throw std::invalid_argument(key + ": the vocabularies of " + both + " differ: token " + std::to_string(id) +
                                    " is " + nlohmann::json(a->piece(id)).dump() + " against " +
                                    nlohmann::json(b->piece(id)).dump());
  }
  return draft;
}

ModelConfig load_job_model_config(const JobConfig& job) {
  try {
    return load_model_config(job.model.path);
  } catch (const std::invalid_argument& e) {
    refuse_model(job, e);
  }
}

int64_t resolved_micro_batches(const JobConfig& job, const JobPlan& plan) {
  const int64_t stages = plan.grid.stages();
  if (stages == 1) return 1;
  return job.parallel.micro_batches > 0 ? job.parallel.micro_batches : stages;
}

JobPlan plan_job(const JobConfig& job, int world_size) {
  JobPlan plan;
  auto where = [&](const std::string& key) { return where_of(job, key); };
  // A thread pool of 100000 threads starts them one by one for minutes; more threads than
  // a few per core only slow a rank down.
  const unsigned cores = std::thread::hardware_concurrency();
  if (cores > 0 && job.runtime.threads > 4 * static_cast<int64_t>(cores))
    throw std::invalid_argument(at_key(job, "runtime.threads") + ": " +
                                std::to_string(job.runtime.threads) + " threads per rank is more than 4 x the " +
                                std::to_string(cores) + " CPUs of this machine (at most " +
                                std::to_string(4 * cores) + ")");
  plan.model = load_job_model_config(job);
  if (job.speculative.method == "draft") plan.draft_model = check_draft_model(job, plan.model);
  // Every tensor the ranks will load, from the file's index: a file the load would refuse is
  // refused here, by validate as by generate, before any rank reads a weight.
  try {
    check_model_tensors(job.model.path, plan.model);
  } catch (const std::invalid_argument& e) {
    refuse_model(job, e);
  }
  // The grid and the tensor ranks' split of every layer, from the model's shape and the
  // storage blocks of its row-parallel matrices.
  {
    auto refuse_split = [&](const std::invalid_argument& e) {
      std::string message = e.what();
      const std::string key = "parallel.tensor: ";
      if (message.rfind(key, 0) == 0) message = message.substr(key.size());
      throw std::invalid_argument(at_key(job, "parallel.tensor") + ": " + message);
    };
    try {
      plan.grid = ProcessGrid::make(world_size, job.parallel.tensor);
      const SplitAlignment align = split_alignment(job.model.path, plan.model);
      plan.tensor_splits.clear();
      for (int t = 0; t < plan.grid.tensor; ++t)
        plan.tensor_splits.push_back(plan_tensor_split(plan.model, plan.grid.tensor, t, align));
    } catch (const std::invalid_argument& e) {
      refuse_split(e);
    }
  }
  const int tensor = plan.grid.tensor, stages = plan.grid.stages();
  plan.device_type = resolve_device_type(job);
  plan.device_memory_bytes = plan.device_type == at::kCUDA ? gpu_memory_per_rank(job) : host_memory_bytes();
  // A GPU job planned where there is no GPU (validate on a login node) needs a size.
  if (plan.device_memory_bytes <= 0 && !job.runtime.memory_bytes)
    throw std::invalid_argument(job.source + ": runtime.device: cuda, but this process cannot use a GPU (" +
                                cuda_unavailable_reason() +
                                "); runtime.memory as a size plans the job without one");
  plan.dtype = job.model.dtype == "auto" ? (plan.device_type == at::kCUDA ? at::kBFloat16 : at::kFloat)
                                         : parse_dtype(job.model.dtype, job.source + ": model.dtype");
  plan.block_size = job.cache.block_size;
  const ModelConfig& m = plan.model;

  // What every rank needs beside its weights and KV pool, checked before the weights' index
  // is read or anything is sized by the model's shape.
  const int64_t memory_limit = runtime_memory_bytes(job, plan.device_memory_bytes);
  const std::string limit_text = memory_limit_text(job, plan, memory_limit);
  const RankOverhead overhead = rank_overhead(job, m);
  if (overhead.rope > double(memory_limit))
    throw std::invalid_argument(at_key(job, "model.path") + ": " +
                                model_key(job, "max_position_embeddings", "context_length") + ": " +
                                std::to_string(m.max_position) + " positions need " + gib(overhead.rope) +
                                " for the RoPE tables of each rank, more than " + limit_text);
  if (overhead.total(world_size == 1) > double(memory_limit))
    throw std::invalid_argument(at_key(job, "scheduler.max_tokens_per_step") +
                                ": a step of " +
                                std::to_string(job.scheduler.max_tokens_per_step) + " tokens (with max_batch " +
                                std::to_string(job.scheduler.max_batch) + ") needs about " +
                                gib(overhead.total(world_size == 1)) + " of activations per rank, more than " +
                                limit_text);
  {
    // The weights at their smallest (4-bit blocks): a model far larger than every rank's
    // memory together is refused before its tensor index is read.
    const double params = double(m.num_layers) *
                              (double(m.hidden_size) * double(m.num_heads + 2 * m.num_kv_heads) * double(m.head_dim) +
                               double(m.num_heads) * double(m.head_dim) * double(m.hidden_size) +
                               3 * double(m.hidden_size) * double(m.intermediate_size)) +
                          double(m.vocab_size) * double(m.hidden_size);
    const double least_bytes = params / 2;
    const double room = double(world_size) * (double(memory_limit) - overhead.total(false));
    if (least_bytes > room)
      throw std::invalid_argument(at_key(job, "model.path") + ": " +
                                  model_key(job, "num_hidden_layers", "block_count") + ": " +
                                  std::to_string(m.num_layers) + " layers of " + std::to_string(m.hidden_size) +
                                  " hidden units take at least " + gib(least_bytes) + " of weights, more than " +
                                  std::to_string(world_size) + " rank(s) of " + limit_text + " hold");
  }

  StageCost cost;
  // What the weights take as stored (quantised files: their blocks), read from the file's index;
  // a tensor rank holds 1 / T of every matrix and the whole of every norm.
  const bool repack = job.model.repack && plan.device_type == at::kCPU;
  plan.weight_bytes = stored_weight_bytes(job.model.path, m, plan.dtype, plan.device_type != at::kCPU, repack);
  const int64_t norm_bytes = 4 * m.hidden_size * static_cast<int64_t>(c10::elementSize(plan.dtype));
  auto per_rank = [&](int64_t bytes) { return tensor == 1 ? bytes : (bytes + tensor - 1) / tensor + norm_bytes; };
  cost.layer_weight_bytes = per_rank(plan.weight_bytes.per_layer);
  cost.first_extra_bytes = per_rank(plan.weight_bytes.embedding);
  cost.last_extra_bytes = per_rank(plan.weight_bytes.head);
  const std::string kv_name = job.cache.dtype == "auto" ? dtype_name(plan.dtype) : job.cache.dtype;
  plan.kv_dtype = parse_kv_dtype(kv_name, where("cache.dtype") + ": cache.dtype");
  if (plan.kv_dtype == KvDtype::kQ8_0 && m.head_dim % 32 != 0)
    throw std::invalid_argument(where("cache.dtype") + ": cache.dtype: q8_0 needs a head dimension that is a "
                                "multiple of 32 (the model's is " + std::to_string(m.head_dim) + ")");
  // Each rank caches its own KV heads (a replicated head counts on every rank that holds it).
  plan.kv_bytes_per_token_layer = 2 * plan.tensor_splits[0].kv_heads * kv_row_bytes(plan.kv_dtype, m.head_dim);
  cost.kv_bytes_per_block_layer = plan.kv_bytes_per_token_layer * job.cache.block_size;
  // Layer-level reuse: only the last cached_layers layers keep K/V.
  if (job.cache.cached_layers > m.num_layers)
    throw std::invalid_argument(where("cache.cached_layers") + ": cache.cached_layers: " +
                                std::to_string(job.cache.cached_layers) + " exceeds the model's " +
                                std::to_string(m.num_layers) + " layers");
  plan.first_cached_layer = job.cache.cached_layers < 0 ? 0 : m.num_layers - job.cache.cached_layers;
  cost.first_cached_layer = plan.first_cached_layer;
  if (job.cache.window_recent > m.max_position)
    throw std::invalid_argument(where("cache.window.recent") + ": cache.window.recent: " +
                                std::to_string(job.cache.window_recent) + " is larger than the model's context of " +
                                std::to_string(m.max_position) + " tokens");
  if (job.cache.window_sinks > m.max_position)
    throw std::invalid_argument(at_key(job, "cache.window.sinks") + ": " +
                                std::to_string(job.cache.window_sinks) + " is larger than the model's context of " +
                                std::to_string(m.max_position) + " tokens");

  throw_if_problems(check_job_for_ranks(job, world_size));
  // The draft model lives on rank 0 beside stage 0: its weights (as loaded, every matrix in
  // model.dtype on a GPU) and its own pool, in model.dtype, room for speculative.max_batch
  // requests at their longest. A share of memory is taken after them.
  double draft_bytes_at_most = 0;
  // Blocks of the draft's pool: speculative.max_batch requests of `longest` tokens and a draft.
  auto draft_pool_blocks = [&](int64_t longest) {
    const int64_t tokens = longest + job.speculative.num_tokens;
    return (tokens + plan.block_size - 1) / plan.block_size * int64_t{job.speculative.max_batch};
  };
  if (job.speculative.method == "draft") {
    const ModelConfig& d = plan.draft_model;
    const StoredWeightBytes w =
        stored_weight_bytes(job.speculative.model, d, plan.dtype, plan.device_type != at::kCPU, repack);
    plan.draft_weight_bytes = w.per_layer * d.num_layers + w.embedding + w.head;
    plan.draft_kv_bytes_per_block = 2 * d.num_kv_heads * d.num_layers * job.cache.block_size *
                                    kv_row_bytes(parse_kv_dtype(dtype_name(plan.dtype), "model.dtype"), d.head_dim);
    draft_bytes_at_most = double(plan.draft_weight_bytes) +
                          double(draft_pool_blocks(std::min(m.max_position, d.max_position))) *
                              double(plan.draft_kv_bytes_per_block);
  }
  // One budget per stage: its ranks hold the same layers and as many KV heads each, so the
  // smallest of their budgets is the stage's.
  std::vector<RankBudget> budgets(stages);
  const MemorySpec& mem = job.cache.memory;
  for (int st = 0; st < stages; ++st) {
    RankBudget& b = budgets[st];
    switch (mem.kind) {
      case MemorySpec::Kind::kBytes: b.kv_bytes = mem.bytes; break;
      case MemorySpec::Kind::kPerRank:
        b.kv_bytes = *std::min_element(mem.per_rank.begin() + st * tensor, mem.per_rank.begin() + (st + 1) * tensor);
        break;
      case MemorySpec::Kind::kShare:
        // The share is of what is left after the weights and a step's working memory.
        b.share_of_memory = true;
        b.share = mem.share;
        b.memory_bytes = static_cast<int64_t>(double(memory_limit) - overhead.total(st + 1 == stages) -
                                              (st == 0 ? draft_bytes_at_most : 0.0));
        break;
    }
  }
  try {
    plan.partition = partition_layers(m.num_layers, cost, budgets, job.parallel.layers);
  } catch (const std::invalid_argument& e) {
    // The partitioner names the key; the job file adds where it is.
    const std::string message = e.what();
    const std::string key = message.rfind("parallel", 0) == 0 ? "parallel.layers" : "cache.memory";
    const auto it = job.where.find(key);
    throw std::invalid_argument((it == job.where.end() ? job.source : it->second) + ": " + message);
  }
  // Block ids are 32-bit; rank 0 keeps a few bytes of accounting per block.
  constexpr int64_t kMaxBlocks = std::numeric_limits<int32_t>::max();
  if (plan.partition.num_blocks == std::numeric_limits<int64_t>::max()) {
    // No rank keeps K/V: blocks are only the scheduler's accounting, enough for every
    // sequence that can run at once to reach the full context.
    const double blocks = double((m.max_position + plan.block_size - 1) / plan.block_size) *
                          double(job.scheduler.max_batch) * double(std::max(stages, job.parallel.micro_batches));
    plan.partition.num_blocks = static_cast<int64_t>(std::min(blocks, double(kMaxBlocks)));
  } else if (plan.partition.num_blocks > kMaxBlocks) {
    throw std::invalid_argument(at_key(job, "cache.memory") + ": holds " +
                                std::to_string(plan.partition.num_blocks) + " KV blocks of " +
                                std::to_string(job.cache.block_size) + " tokens, more than the " +
                                std::to_string(kMaxBlocks) + " a pool can address (raise cache.block_size)");
  }
  if (plan.partition.num_blocks < 1)
    throw std::invalid_argument((job.where.count("cache.memory") ? job.where.at("cache.memory") : job.source) +
                                ": cache.memory holds no KV block of " +
                                std::to_string(job.cache.block_size) + " tokens (one block takes " +
                                std::to_string(cost.kv_bytes_per_block_layer * plan.partition.stages[0].num_layers) +
                                " bytes on rank 0)");
  // Everything a rank allocates, against what it has: a fixed cache.memory is not bounded by
  // runtime.memory otherwise.
  auto stage_kv_bytes = [&](size_t r) {
    return double(plan.partition.num_blocks) * double(plan.partition.stages[r].cached_layers) *
           double(cost.kv_bytes_per_block_layer);
  };
  auto stage_other_bytes = [&](size_t r) {  // RoPE tables, activations and rank 0's accounting
    return overhead.total(r + 1 == plan.partition.stages.size()) +
           (r == 0 ? kBookkeepingBytesPerBlock * double(plan.partition.num_blocks) : 0.0);
  };
  for (size_t r = 0; r < plan.partition.stages.size(); ++r) {
    const StagePlan& s = plan.partition.stages[r];
    const double kv = stage_kv_bytes(r);
    const double other = stage_other_bytes(r);
    const double need = double(s.weight_bytes) + kv + other;
    if (need > double(memory_limit))
      throw std::invalid_argument(
          at_key(job, "cache.memory") + ": " + (tensor == 1 ? "rank " : "stage ") + std::to_string(r) +
          " would need " + gib(need) +
          " (weights " + gib(double(s.weight_bytes)) + ", KV cache " + gib(kv) +
          ", RoPE tables, activations and accounting " + gib(other) + "), more than " + limit_text +
          ": lower cache.memory (or scheduler.max_tokens_per_step), or raise runtime.memory");
  }
  // The scheduler's own admission rule over this pool (windows and chunked prefill included).
  plan.longest_request =
      Scheduler(engine_options(job, plan).scheduler, plan.partition.num_blocks).max_request_tokens();
  if (job.speculative.method == "draft") {
    // Room for speculative.max_batch requests at their longest, never more blocks than the
    // model's own pool (a draft model is smaller: its blocks are too).
    plan.draft_blocks = std::min(plan.partition.num_blocks,
                                 draft_pool_blocks(std::min(plan.longest_request, plan.draft_model.max_position)));
    // Rank 0 holds both models and both pools.
    const double draft = double(plan.draft_weight_bytes) + double(plan.draft_blocks) * double(plan.draft_kv_bytes_per_block);
    const double need =
        double(plan.partition.stages[0].weight_bytes) + stage_kv_bytes(0) + stage_other_bytes(0) + draft;
    if (need > double(memory_limit))
      throw std::invalid_argument(
          at_key(job, "speculative.model") + ": rank 0 would need " + gib(need) + " with the draft model " +
          job.speculative.model + " (its weights and KV pool " + gib(draft) + "), more than " + limit_text +
          ": lower cache.memory or speculative.max_batch, or raise runtime.memory");
  }
  return plan;
}

void check_request(const JobConfig& job, const JobPlan& plan, const std::vector<int64_t>& prompt,
                   int64_t max_new_tokens, const std::string& who) {
  const ModelConfig& m = plan.model;
  if (prompt.empty()) throw std::invalid_argument(who + ": empty prompt");
  for (const int64_t id : prompt)
    if (id < 0 || id >= m.vocab_size)
      throw std::invalid_argument(who + ": token id " + std::to_string(id) + " is outside the vocabulary (0.." +
                                  std::to_string(m.vocab_size - 1) + ")");
  if (max_new_tokens < 1) throw std::invalid_argument(who + ": max_new_tokens must be at least 1");
  const int64_t length = static_cast<int64_t>(prompt.size());
  if (length >= m.max_position)
    throw std::invalid_argument(who + ": prompt of " + std::to_string(length) +
                                " tokens does not fit the model's context of " + std::to_string(m.max_position) +
                                " tokens");
  // The last sampled token is never fed back, so a finished sequence holds one token less
  // than it outputs.
  const int64_t longest = std::min(length + max_new_tokens - 1, m.max_position);
  const int64_t need = blocks_held(job, plan, longest);
  if (need > plan.partition.num_blocks)
    throw std::invalid_argument(who + ": needs " + std::to_string(need) + " KV blocks of " +
                                std::to_string(plan.block_size) + " tokens but the pool has " +
                                std::to_string(plan.partition.num_blocks) +
                                " (raise cache.memory or lower max_new_tokens)");
}

std::string request_who(const JobConfig& job, size_t index) {
  const RequestSpec& spec = job.requests.at(index);
  const std::string path = "requests[" + std::to_string(index) + "]";
  const std::string field = spec.prompt ? ".prompt" : !spec.messages.empty() ? ".messages" : ".prompt_ids";
  return where_of(job, path + field) + ": " + path;
}

void check_job_requests(const JobConfig& job, const JobPlan& plan) {
  std::unique_ptr<ModelText> text;  // loaded only for requests given as text or messages
  for (size_t i = 0; i < job.requests.size(); ++i) {
    const RequestSpec& spec = job.requests[i];
    const std::string who = request_who(job, i);
    std::vector<int64_t> ids = spec.prompt_ids;
    if (spec.prompt || !spec.messages.empty()) {
      if (!text) text = std::make_unique<ModelText>(job.model.path);
      ids = text->prompt_ids(spec, who);
    }
    check_request(job, plan, ids, spec.max_new_tokens, who);
  }
}

namespace {
std::string mib(int64_t bytes) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(1) << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return s.str();
}
}  // namespace

void print_plan(std::ostream& out, const JobPlan& plan) {
  const auto& stages = plan.partition.stages;
  const int tensor = plan.grid.tensor;
  const int64_t kv_per_block_layer = plan.kv_bytes_per_token_layer * plan.block_size;
  out << "plan: " << plan.grid.world_size << " rank(s)";
  if (tensor > 1) out << " = " << stages.size() << " stage(s) x " << tensor << " tensor ranks";
  out << ", " << plan.model.num_layers << " layers, split [";
  for (size_t r = 0; r < stages.size(); ++r) out << (r ? ", " : "") << stages[r].num_layers;
  out << "], " << plan.partition.num_blocks << " blocks of " << plan.block_size << " tokens ("
      << plan.partition.num_blocks * plan.block_size << " tokens)\n";
  // Every rank holds the same block count, so this bounds the tokens of all running
  // sequences together (prompts and outputs), whatever the split.
  out << "plan: at most " << plan.partition.num_blocks * plan.block_size
      << " concurrent tokens (" << plan.partition.num_blocks << " blocks x " << plan.block_size
      << " tokens per block), KV cache " << kv_dtype_name(plan.kv_dtype) << "\n";
  out << "plan: a request may hold at most " << plan.longest_request << " tokens (prompt + output), set by "
      << (plan.longest_request < plan.model.max_position ? "cache.memory"
                                                         : "the model's context length")
      << "\n";
  out << "plan: device " << (plan.device_type == at::kCUDA ? "cuda" : "cpu") << ", dtype "
      << dtype_name(plan.dtype) << ", " << gib(double(plan.device_memory_bytes))
      << (plan.device_type == at::kCUDA ? " of GPU memory per rank\n" : " of host memory\n");
  if (plan.weight_bytes.repacked > 0)
    out << "plan: model.repack: " << mib(plan.weight_bytes.repacked)
        << " of the model's projections in groups of 8 rows, in process memory (" << mib(plan.weight_bytes.repack_growth)
        << " over the stored layout, counted in the weights below)\n";
  for (int r = 0; r < plan.grid.world_size; ++r) {
    const StagePlan& s = stages[plan.grid.stage_of(r)];
    out << "plan: rank " << r;
    if (tensor > 1) {
      const TensorSplit& t = plan.tensor_splits[plan.grid.tensor_rank_of(r)];
      out << " (stage " << plan.grid.stage_of(r) << ", tensor rank " << t.rank << ": heads " << t.first_head << ".."
          << t.first_head + t.heads - 1 << ", KV heads " << t.first_kv_head << ".." << t.first_kv_head + t.kv_heads - 1
          << ", MLP units " << t.ff_begin << ".." << t.ff_begin + t.ff_units - 1 << ", vocabulary " << t.vocab_begin
          << ".." << t.vocab_begin + t.vocab_rows - 1 << ")";
    }
    out << " layers " << s.first_layer << ".." << s.first_layer + s.num_layers - 1
        << ", weights " << mib(s.weight_bytes) << ", KV "
        << mib(plan.partition.num_blocks * s.cached_layers * kv_per_block_layer) << " for "
        << s.cached_layers << " cached layer(s) (budget " << mib(s.kv_budget_bytes) << "), "
        << plan.partition.num_blocks << " blocks\n";
  }
  if (plan.draft_blocks > 0)
    out << "plan: rank 0 draft model " << plan.draft_model.num_layers << " layers, weights "
        << mib(plan.draft_weight_bytes) << ", KV " << mib(plan.draft_blocks * plan.draft_kv_bytes_per_block) << ", "
        << plan.draft_blocks << " blocks\n";
}

}  // namespace kvpipe
