#include "launch/job_runner.h"

#include "cache/block_pool.h"
#include "engine/decode_graphs.h"
#include "engine/model_shard.h"
#include "engine/kernels/cpu/blas_gemm.h"
#include "engine/kernels/cpu/interleaved_blocks.h"
#include "engine/kernels/cpu/quant_types.h"
#include "engine/kernels/cpu/thread_pool.h"
#include "engine/model/huge_pages.h"
#include "engine/model/model_weights.h"
#include "engine/pipeline_executor.h"
#include "engine/speculative/draft_model.h"
#include "launch/device_plan.h"
#include "launch/log.h"
#include "parallel/communicator.h"
#include "parallel/tensor_group.h"
#include "parallel/watchdog.h"

#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/InferenceMode.h>
#include <ATen/Parallel.h>

#include <memory>
#include <sstream>
#include <stdexcept>

namespace kvpipe {

EngineOptions engine_options(const JobConfig& job, const JobPlan& plan, DraftProposer* draft_model) {
  EngineOptions eo;
  eo.scheduler.block_size = plan.block_size;
  eo.scheduler.max_batch = job.scheduler.max_batch;
  eo.scheduler.max_tokens_per_step = job.scheduler.max_tokens_per_step;
  eo.scheduler.max_prefill_tokens_per_step = job.scheduler.max_prefill_tokens_per_step;
  eo.scheduler.max_context = plan.model.max_position;
  eo.scheduler.prefix_reuse = job.cache.prefix_reuse;
  eo.scheduler.window_sinks = job.cache.window_sinks;
  eo.scheduler.window_recent = job.cache.window_recent;
  eo.scheduler.full_sequences = plan.first_cached_layer > 0;
  eo.scheduler.speculative.ngram = job.speculative.method == "ngram";
  eo.scheduler.speculative.num_tokens = job.speculative.num_tokens;
  eo.scheduler.speculative.ngram_min = job.speculative.ngram_min;
  eo.scheduler.speculative.ngram_max = job.speculative.ngram_max;
  eo.scheduler.speculative.max_batch = job.speculative.max_batch;
  if (job.speculative.method == "draft") eo.scheduler.speculative.draft_model = draft_model;
  return eo;
}

EngineCounters engine_counters(const ModelShard& shard, const DecodeGraphs* graphs) {
  EngineCounters c;
  for (const AttentionPath p : {AttentionPath::kPerSequence, AttentionPath::kVarlen, AttentionPath::kPagedDecode})
    c.attention_calls[static_cast<size_t>(p)] = shard.attention_calls(p);
  if (graphs != nullptr) c.graphs_captured = graphs->graphs_captured(), c.graph_replays = graphs->replays();
  return c;
}

namespace {

// A stage's (or the draft model's) weights as the job runs them: on the CPU, with model.repack,
// the types that have interleaved kernels repacked once here.
ModelWeights loaded_weights(const JobConfig& job, const std::string& path, const ModelConfig& cfg,
                            const WeightSelection& sel, at::ScalarType dtype, at::Device device, const char* what) {
  ModelWeights w = load_weights(path, cfg, sel, dtype, device);
  if (!device.is_cpu()) return w;
  if (job.model.repack) {
    const int64_t bytes = interleave_weights(w);
    if (bytes > 0)
      log_printf(LogLevel::kInfo,
                 "model.repack: %.1f MiB of the %s's weights in groups of 8 rows (%s kernels), held in process "
                 "memory instead of the file's shared pages",
                 double(bytes) / double(1 << 20), what, interleave_isa_name(interleave_choice()));
  }
  if (job.model.huge_pages) {
    // After the repack: the matrices the kernels stream are the ones to move.
    const HugePageOutcome pages = back_weights_with_huge_pages(w);
    if (pages.refused.empty())
      log_printf(LogLevel::kInfo, "model.huge_pages: %.1f MiB of the %s's matrices on 2 MiB pages",
                 double(pages.bytes) / double(1 << 20), what);
    else
      log_printf(LogLevel::kInfo, "model.huge_pages: the %s's matrices stay on 4 KiB pages (%s)", what,
                 pages.refused.c_str());
  }
  return w;
}

void log_engine_counters(const ModelShard& shard, const DecodeGraphs* graphs) {
  const EngineCounters c = engine_counters(shard, graphs);
  const auto calls = [&](AttentionPath p) { return static_cast<long long>(c.attention_calls[static_cast<size_t>(p)]); };
  log_printf(LogLevel::kDebug,
             "steps: attention layer calls paged %lld, varlen %lld, per_sequence %lld; CUDA graphs %s",
             calls(AttentionPath::kPagedDecode), calls(AttentionPath::kVarlen), calls(AttentionPath::kPerSequence),
             graphs == nullptr ? "off"
                               : (std::to_string(c.graphs_captured) + " captured, " + std::to_string(c.graph_replays) +
                                  " steps replayed")
                                     .c_str());
}

}  // namespace

JobOutcome run_job(const JobConfig& job, const JobPlan& plan, World& world, TraceRecorder* trace,
                   const std::function<void(CoordinatorContext&)>& coordinator) {
  set_log_rank(world.rank(), world.size());
  // No autograd: every tensor of a job is made and used under inference mode, which skips
  // the autograd and version-counter bookkeeping of each LibTorch call (a decode step makes
  // hundreds of small ones).
  c10::InferenceMode inference_mode;
  // Each rank computes on its own GPU (cuda:<local rank>), or on one it shares with other
  // ranks of its node (runtime.share_gpu), or on the CPU; plan_job resolved `auto`.
  const int local_ranks = local_rank_count_from_env();
  at::Device device = at::kCPU;
  if (plan.device_type == at::kCUDA) {
    const std::string why = cuda_unavailable_reason();
    if (!why.empty())
      throw std::invalid_argument(job.source + ": runtime.device: cuda, but rank " +
                                  std::to_string(world.rank()) + " cannot use a GPU: " + why);
    const std::string name = choose_device(world.local_rank(), local_ranks, cuda_device_count(), job.runtime.share_gpu);
    device = at::Device(name);
    use_cuda_device(device.index());
    log_printf(LogLevel::kDebug, "device %s (%s, local rank %d of %d)", name.c_str(),
               cuda_device_name(device.index()).c_str(), world.local_rank(), local_ranks);
  } else {
    log_printf(LogLevel::kDebug, "device cpu (local rank %d of %d)", world.local_rank(), local_ranks);
  }
  if (job.runtime.pin_threads) {
    // Before the compute pool starts: its threads inherit this thread's affinity.
    const std::vector<int> cores =
        cores_for_rank(allowed_cpus(), world.local_rank(), local_ranks, job.runtime.threads);
    if (cores.empty() || !pin_to_cores(cores)) {
      log_printf(LogLevel::kWarn,
                 "runtime.pin_threads: %d rank(s) x %d thread(s) do not fit in the %zu allowed "
                 "CPU(s); threads are not pinned",
                 local_ranks, job.runtime.threads, allowed_cpus().size());
    } else {
      std::string list;
      for (const int cpu : cores) list += (list.empty() ? "" : ",") + std::to_string(cpu);
      log_printf(LogLevel::kDebug, "compute threads pinned to CPU(s) %s", list.c_str());
    }
  }
  // One pool computes: kvpipe's (engine/kernels/cpu/thread_pool.h), on which projections and
  // attention's products split their work. LibTorch's own intra-op threads stay at one: its
  // idle OpenMP workers spin beside the pool's and, on as many cores as threads, a decode step
  // took 2.6x as long with both pools as with the pool alone.
  at::set_num_threads(1);
  set_cpu_blas_threads(job.runtime.threads);
  ThreadPool::instance().set_threads(job.runtime.threads);
  log_printf(LogLevel::kDebug, "CPU kernels: %s (32-value blocks %s, float types %s), %d thread(s)", dot_kernel_isa(),
             block_kernel_isa(), float_kernel_isa(), job.runtime.threads);

  if (device.is_cpu() && plan.dtype != at::kFloat)
    throw std::invalid_argument(job.source + ": model.dtype " + job.model.dtype +
                                " is not supported on CPU (use float32 or auto)");
  // The communicator comes first: a backend that cannot run fails before any weight loads.
  // NCCL connects ranks on distinct GPUs; ranks that share one (or compute on the CPU) pass
  // hidden states through host memory over MPI.
  const bool gpu_shared = device.is_cuda() && local_ranks > cuda_device_count();
  if (gpu_shared && job.parallel.backend == "nccl")
    throw std::invalid_argument(job.source + ": parallel.backend: nccl cannot connect ranks that share a GPU "
                                "(runtime.share_gpu); use mpi or auto");
  const std::string backend =
      job.parallel.backend != "auto" ? job.parallel.backend : device.is_cuda() && !gpu_shared ? "nccl" : "mpi";
  std::unique_ptr<Communicator> comm;
  if (world.size() > 1) comm = make_communicator(backend, world);
  else if (job.parallel.backend == "nccl") make_nccl_communicator(world);  // checked, though one rank sends nothing
  // From here on every rank is expected to hear from its peers: a rank that goes silent (stopped,
  // or frozen whole) ends the job instead of leaving the others blocked on it forever. Started
  // before the weights load, since a rank can stop there as well as in a step.
  Watchdog watchdog(world, job.parallel.timeout_s);
  if (watchdog.active())
    log_printf(LogLevel::kDebug, "watchdog: heartbeat every %.2f s, a rank silent for %g s stops the job",
               Watchdog::period_s(job.parallel.timeout_s), job.parallel.timeout_s);
  if (world.is_coordinator() && log_enabled(LogLevel::kInfo)) {
    std::ostringstream lines;
    print_plan(lines, plan);
    std::istringstream in(lines.str());
    for (std::string line; std::getline(in, line);) log_line(LogLevel::kInfo, line);
  }
  const ProcessGrid& grid = plan.grid;
  if (grid.world_size != world.size()) throw std::logic_error("the plan is for another number of ranks");
  const int stage_index = grid.stage_of(world.rank());
  const StagePlan& stage = plan.partition.stages[stage_index];
  // A stage's tensor ranks reduce over a communicator of their own (collective over the world).
  std::unique_ptr<TensorGroup> group;
  if (grid.tensor > 1) group = std::make_unique<TensorGroup>(world, grid, backend == "nccl");

  WeightSelection sel;
  sel.layers = {stage.first_layer, stage.first_layer + stage.num_layers};
  sel.embedding = stage_index == 0;
  sel.head = stage_index == grid.stages() - 1;
  sel.split = plan.tensor_splits.at(grid.tensor_rank_of(world.rank()));
  const ModelShard shard(loaded_weights(job, job.model.path, plan.model, sel, plan.dtype, device, "model"),
                         plan.first_cached_layer, group.get());
  // CUDA graphs pad decode batches with rows that write into one scratch block past the
  // scheduler's blocks. A tensor rank's steps reduce over MPI, which a graph cannot hold.
  const bool graphs_wanted = job.runtime.cuda_graphs && device.is_cuda() && grid.tensor == 1;
  if (job.runtime.cuda_graphs && device.is_cuda() && grid.tensor > 1)
    log_printf(LogLevel::kWarn, "runtime.cuda_graphs: tensor ranks all-reduce over MPI; decode steps run without graphs");
  const int64_t scratch_blocks = graphs_wanted ? 1 : 0;
  BlockPool pool(shard.kv_shape(plan.block_size, plan.kv_dtype), plan.partition.num_blocks + scratch_blocks,
                 plan.dtype, device, plan.kv_dtype);
  std::unique_ptr<DecodeGraphs> graphs;
  if (graphs_wanted)
    graphs = std::make_unique<DecodeGraphs>(shard, pool, job.scheduler.max_batch, plan.partition.num_blocks);
  else if (job.runtime.cuda_graphs && !device.is_cuda())
    log_printf(LogLevel::kWarn, "runtime.cuda_graphs: the rank computes on the CPU; decode steps run without graphs");

  const int64_t resident_bytes = shard.weights().bytes() + pool.bytes();
  // What the GPU held at its peak against what the plan allowed beside weights and KV pool:
  // the measure of the plan's step estimate (runtime.memory, cache.memory shares).
  struct GpuPeakLog {
    at::Device device;
    int64_t resident;
    ~GpuPeakLog() {
      if (!device.is_cuda()) return;
      try {
        const int64_t peak =
            c10::getDeviceAllocator(c10::DeviceType::CUDA)
                ->getDeviceStats(device.index())
                .allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
                .peak;
        log_printf(LogLevel::kInfo, "GPU memory: peak %.3f GiB allocated, of which %.3f GiB weights and KV pool",
                   double(peak) / double(1LL << 30), double(resident) / double(1LL << 30));
      } catch (...) {
      }
    }
  } gpu_peak_log{device, resident_bytes};

  // The draft model computes on the coordinator, beside stage 0, with a pool of its own.
  std::unique_ptr<DraftModel> draft_model;
  if (world.is_coordinator() && job.speculative.method == "draft") {
    WeightSelection every_layer;
    every_layer.layers = {0, plan.draft_model.num_layers};
    every_layer.embedding = every_layer.head = true;
    draft_model = std::make_unique<DraftModel>(
        loaded_weights(job, job.speculative.model, plan.draft_model, every_layer, plan.dtype, device, "draft model"),
        plan.draft_blocks,
        plan.block_size);
    log_printf(LogLevel::kInfo, "draft model %s on rank 0: %.1f MiB of weights, %lld KV blocks (%.1f MiB)",
               job.speculative.model.c_str(), double(draft_model->shard().weights().bytes()) / double(1 << 20),
               static_cast<long long>(plan.draft_blocks), double(draft_model->pool().bytes()) / double(1 << 20));
  }

  JobOutcome outcome;
  if (world.size() == 1) {
    outcome.backend = "local";
    if (trace) trace->start(world);
    LocalExecutor executor(shard, pool, trace, graphs.get());
    CoordinatorContext ctx{job, plan, shard, executor, world, graphs.get(), draft_model.get()};
    coordinator(ctx);
    log_engine_counters(shard, graphs.get());
    if (trace) outcome.traces = trace->gather(world);
    return outcome;
  }
  outcome.backend = comm->name();
  PipelineChannel channel(world, *comm);
  channel.set_trace(trace);
  const size_t micro_batches = static_cast<size_t>(resolved_micro_batches(job, plan));
  if (trace) trace->start(world);
  // A later stage's leader starts its clock with its first message; a tensor rank with its
  // leader's, whose broadcasts it waits in.
  if (world.is_coordinator() || !grid.is_leader(world.rank())) channel.start();
  else channel.start_on_first_message();
  if (world.is_coordinator()) {
    PipelineExecutor executor(shard, pool, channel, grid, micro_batches, graphs.get(), group.get());
    CoordinatorContext ctx{job, plan, shard, executor, world, graphs.get(), draft_model.get()};
    coordinator(ctx);
    executor.shutdown();
  } else {
    run_stage_worker(shard, pool, channel, grid, world.rank(), graphs.get(), group.get());
  }
  log_engine_counters(shard, graphs.get());
  channel.stop();
  if (group) channel.set_group_times(group->times());
  channel.set_trace(nullptr);
  outcome.times = channel.gather_times();
  if (trace) outcome.traces = trace->gather(world);
  // Every rank gets here once the job is over; the goodbye exchange keeps a rank that
  // finished first from being called silent by one that has not.
  watchdog.stop();
  return outcome;
}

}  // namespace kvpipe
