#include "launch/job_plan.h"

#include "engine/model_weights.h"

#include <unistd.h>

#include <iomanip>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace kvpipe {

int64_t host_memory_bytes() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGE_SIZE));
}

int64_t runtime_memory_bytes(const JobConfig& job) {
  if (job.runtime.memory_bytes) return *job.runtime.memory_bytes;
  const int64_t device = host_memory_bytes();
  if (job.runtime.memory_share) return static_cast<int64_t>(static_cast<double>(device) * *job.runtime.memory_share);
  return device;
}

ModelConfig load_job_model_config(const JobConfig& job) {
  try {
    return load_model_config(job.model.path);
  } catch (const std::invalid_argument& e) {
    // The loader names the model file; the job file adds which key pointed there.
    const auto it = job.where.find("model.path");
    throw std::invalid_argument((it == job.where.end() ? job.source : it->second) + ": model.path: " + e.what());
  }
}

JobPlan plan_job(const JobConfig& job, int world_size) {
  JobPlan plan;
  plan.model = load_job_model_config(job);
  plan.dtype = parse_dtype(job.model.dtype, job.source + ": model.dtype");
  plan.block_size = job.cache.block_size;
  const ModelConfig& m = plan.model;

  StageCost cost;
  // What the weights take as stored (quantised files: their blocks), read from the file's index.
  plan.weight_bytes = stored_weight_bytes(job.model.path, m, plan.dtype);
  cost.layer_weight_bytes = plan.weight_bytes.per_layer;
  cost.first_extra_bytes = plan.weight_bytes.embedding;
  cost.last_extra_bytes = plan.weight_bytes.head;
  const std::string kv_name = job.cache.dtype == "auto" ? (plan.dtype == at::kHalf       ? "float16"
                                                           : plan.dtype == at::kBFloat16 ? "bfloat16"
                                                                                         : "float32")
                                                        : job.cache.dtype;
  auto where = [&](const std::string& key) {
    const auto it = job.where.find(key);
    return it == job.where.end() ? job.source : it->second;
  };
  plan.kv_dtype = parse_kv_dtype(kv_name, where("cache.dtype") + ": cache.dtype");
  if (plan.kv_dtype == KvDtype::kQ8_0 && m.head_dim % 32 != 0)
    throw std::invalid_argument(where("cache.dtype") + ": cache.dtype: q8_0 needs a head dimension that is a "
                                "multiple of 32 (the model's is " + std::to_string(m.head_dim) + ")");
  plan.kv_bytes_per_token_layer = 2 * m.num_kv_heads * kv_row_bytes(plan.kv_dtype, m.head_dim);
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

  throw_if_problems(check_job_for_ranks(job, world_size));
  std::vector<RankBudget> budgets(world_size);
  const MemorySpec& mem = job.cache.memory;
  for (int r = 0; r < world_size; ++r) {
    RankBudget& b = budgets[r];
    switch (mem.kind) {
      case MemorySpec::Kind::kBytes: b.kv_bytes = mem.bytes; break;
      case MemorySpec::Kind::kPerRank: b.kv_bytes = mem.per_rank[r]; break;
      case MemorySpec::Kind::kShare:
        b.share_of_memory = true;
        b.share = mem.share;
        b.memory_bytes = runtime_memory_bytes(job);
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
  if (plan.partition.num_blocks == std::numeric_limits<int64_t>::max()) {
    // No rank keeps K/V: blocks are only the scheduler's accounting, enough for every
    // sequence that can run at once to reach the full context.
    plan.partition.num_blocks = (m.max_position + plan.block_size - 1) / plan.block_size *
                                job.scheduler.max_batch * std::max(world_size, job.parallel.micro_batches);
  }
  if (plan.partition.num_blocks < 1)
    throw std::invalid_argument((job.where.count("cache.memory") ? job.where.at("cache.memory") : job.source) +
                                ": cache.memory holds no KV block of " +
                                std::to_string(job.cache.block_size) + " tokens (one block takes " +
                                std::to_string(cost.kv_bytes_per_block_layer * plan.partition.stages[0].num_layers) +
                                " bytes on rank 0)");
  return plan;
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
  const int64_t kv_per_block_layer = plan.kv_bytes_per_token_layer * plan.block_size;
  out << "plan: " << stages.size() << " rank(s), " << plan.model.num_layers << " layers, split [";
  for (size_t r = 0; r < stages.size(); ++r) out << (r ? ", " : "") << stages[r].num_layers;
  out << "], " << plan.partition.num_blocks << " blocks of " << plan.block_size << " tokens ("
      << plan.partition.num_blocks * plan.block_size << " tokens)\n";
  // Every rank holds the same block count, so this bounds the tokens of all running
  // sequences together (prompts and outputs), whatever the split.
  out << "plan: at most " << plan.partition.num_blocks * plan.block_size
      << " concurrent tokens (" << plan.partition.num_blocks << " blocks x " << plan.block_size
      << " tokens per block), KV cache " << kv_dtype_name(plan.kv_dtype) << "\n";
  for (size_t r = 0; r < stages.size(); ++r) {
    const StagePlan& s = stages[r];
    out << "plan: rank " << r << " layers " << s.first_layer << ".." << s.first_layer + s.num_layers - 1
        << ", weights " << mib(s.weight_bytes) << ", KV "
        << mib(plan.partition.num_blocks * s.cached_layers * kv_per_block_layer) << " for "
        << s.cached_layers << " cached layer(s) (budget " << mib(s.kv_budget_bytes) << "), "
        << plan.partition.num_blocks << " blocks\n";
  }
}

}  // namespace kvpipe
