#include "launch/job_plan.h"

#include "engine/model_weights.h"

#include <unistd.h>

#include <iomanip>
#include <sstream>
#include <stdexcept>

namespace kvpipe {

int64_t host_memory_bytes() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGE_SIZE));
}

JobPlan plan_job(const JobConfig& job, int world_size) {
  JobPlan plan;
  plan.model = load_model_config(job.model.path);
  plan.dtype = parse_dtype(job.model.dtype, job.source + ": model.dtype");
  plan.block_size = job.cache.block_size;
  const ModelConfig& m = plan.model;
  const int64_t elem = static_cast<int64_t>(c10::elementSize(plan.dtype));

  StageCost cost;
  cost.layer_weight_bytes = m.layer_params() * elem;
  cost.first_extra_bytes = m.embedding_params() * elem;
  cost.last_extra_bytes = (m.tie_embeddings ? 0 : m.embedding_params() * elem) + m.hidden_size * elem;
  cost.kv_bytes_per_block_layer = m.kv_bytes_per_token_layer(elem) * job.cache.block_size;

  std::vector<RankBudget> budgets(world_size);
  const MemorySpec& mem = job.cache.memory;
  if (mem.kind == MemorySpec::Kind::kPerRank && static_cast<int>(mem.per_rank.size()) != world_size)
    throw std::invalid_argument(job.source + ": cache.memory lists " + std::to_string(mem.per_rank.size()) +
                                " sizes for " + std::to_string(world_size) + " ranks");
  for (int r = 0; r < world_size; ++r) {
    RankBudget& b = budgets[r];
    switch (mem.kind) {
      case MemorySpec::Kind::kBytes: b.kv_bytes = mem.bytes; break;
      case MemorySpec::Kind::kPerRank: b.kv_bytes = mem.per_rank[r]; break;
      case MemorySpec::Kind::kShare:
        b.share_of_memory = true;
        b.share = mem.share;
        b.memory_bytes = job.runtime.memory_bytes.value_or(host_memory_bytes());
        break;
    }
  }
  plan.partition = partition_layers(m.num_layers, cost, budgets, job.parallel.layers);
  if (plan.partition.num_blocks < 1)
    throw std::invalid_argument(job.source + ": cache.memory holds no KV block of " +
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
  const int64_t kv_per_block_layer =
      plan.model.kv_bytes_per_token_layer(static_cast<int64_t>(c10::elementSize(plan.dtype))) * plan.block_size;
  out << "plan: " << stages.size() << " rank(s), " << plan.model.num_layers << " layers, split [";
  for (size_t r = 0; r < stages.size(); ++r) out << (r ? ", " : "") << stages[r].num_layers;
  out << "], " << plan.partition.num_blocks << " blocks of " << plan.block_size << " tokens ("
      << plan.partition.num_blocks * plan.block_size << " tokens)\n";
  for (size_t r = 0; r < stages.size(); ++r) {
    const StagePlan& s = stages[r];
    out << "plan: rank " << r << " layers " << s.first_layer << ".." << s.first_layer + s.num_layers - 1
        << ", weights " << mib(s.weight_bytes) << ", KV "
        << mib(plan.partition.num_blocks * s.num_layers * kv_per_block_layer) << " (budget "
        << mib(s.kv_budget_bytes) << ")\n";
  }
}

}  // namespace kvpipe
