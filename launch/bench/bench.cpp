#include "launch/bench/bench.h"

#include "engine/kernels/cpu/blas_gemm.h"
#include "engine/kernels/cpu/cpu_features.h"
#include "engine/kernels/cpu/quant_matmul.h"
#include "engine/kernels/cpu/quant_types.h"
#include "launch/bench/bench_report.h"
#include "launch/bench/dataset_workload.h"
#include "launch/device_plan.h"
#include "launch/job_config.h"
#include "launch/job_plan.h"
#include "launch/job_runner.h"
#include "launch/log.h"
#include "launch/model_text.h"
#include "launch/bench/op_profiler.h"
#include "launch/output.h"
#include "launch/signals.h"
#include "launch/bench/workload.h"
#include "parallel/communicator.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <nlohmann/json.hpp>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <thread>

#ifndef KVPIPE_VERSION
#define KVPIPE_VERSION "unknown"
#endif
#ifndef KVPIPE_GIT_COMMIT
#define KVPIPE_GIT_COMMIT "unknown"
#endif
#ifndef KVPIPE_BUILD_TYPE
#define KVPIPE_BUILD_TYPE "unknown"
#endif
#ifndef KVPIPE_COMPILER
#define KVPIPE_COMPILER "unknown"
#endif

namespace kvpipe {
namespace {

using ordered_json = nlohmann::ordered_json;
using ms = std::chrono::duration<double, std::milli>;

struct RequestRow {
  int64_t id = 0;
  double arrival_ms = 0;  // since the measured phase started
  int64_t prompt_tokens = 0, output_tokens = 0, preemptions = 0;
  double ttft_ms = 0, tpot_ms = 0, e2e_ms = 0, itl_max_ms = 0;
  std::string finish_reason;
  int64_t conversation = -1, turn = -1;  // multi_turn: which conversation and turn (from 0)
  int64_t cached_tokens = 0;             // prompt tokens found in the prefix cache
};

// What rank 0 measured; filled by the coordinator, reported after the job.
struct Measured {
  Clock::time_point start{}, end{};
  bool stopped = false;
  std::vector<RequestRow> rows;
  std::vector<double> ttft, tpot, itl, e2e;
  std::vector<StepRecord> steps;
  PrefixCacheStats prefix;
  int64_t preemptions = 0, recomputed_tokens = 0, computed_tokens = 0, peak_blocks_used = 0;
  int64_t spec_drafts = 0, spec_draft_tokens = 0, spec_accepted_tokens = 0;
  std::vector<int64_t> spec_accepted_at;
  std::vector<OpTotal> top_ops;
  // Rank 0 over the measured phase: which attention path its layers took, how many steps its
  // CUDA graphs replayed (-1: no graphs), and a digest of every measured request's output.
  int64_t attention_calls[3] = {0, 0, 0};
  int64_t cached_layers = 0;  // rank 0's layers that keep K/V (each makes one attention call a step)
  int64_t graphs_captured = -1, graph_replays = -1;
  uint64_t output_digest = 0;
};

// FNV-1a over the measured requests' ids and output tokens, in id order: two runs of one
// workload that generate the same tokens have the same digest.
uint64_t output_digest(const std::vector<std::pair<int64_t, std::vector<int64_t>>>& outputs) {
  uint64_t h = 1469598103934665603ULL;
  auto add = [&](int64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint64_t>(v >> (8 * b)) & 0xFF;
      h *= 1099511628211ULL;
    }
  };
  for (const auto& [id, tokens] : outputs) {
    add(id);
    add(static_cast<int64_t>(tokens.size()));
    for (const int64_t t : tokens) add(t);
  }
  return h;
}

std::vector<Request> to_requests(const std::vector<WorkloadRequest>& drawn, int64_t first_id, const JobConfig& job,
                                 const LogitsProcessing& processing) {
  std::vector<Request> out;
  for (size_t i = 0; i < drawn.size(); ++i) {
    Request r;
    r.id = first_id + static_cast<int64_t>(i);
    r.prompt = drawn[i].prompt;
    r.max_new_tokens = drawn[i].output_len;
    r.sampling = request_sampling(job.sampling);
    r.processing = processing;
    r.ignore_eos = true;
    out.push_back(std::move(r));
  }
  return out;
}

// multi_turn options for requests numbered from `first_id`.
MultiTurnOptions multi_turn_options(const JobConfig& job, int64_t context, int64_t first_id,
                                    const LogitsProcessing& processing) {
  MultiTurnOptions mo;
  mo.concurrency = job.workload.concurrency;
  mo.turn_gap_s = job.workload.turn_gap;
  mo.context = context;
  mo.first_id = first_id;
  mo.sampling = request_sampling(job.sampling);
  mo.processing = processing;
  return mo;
}

// Rank 0: warm-up, then the measured phase. `data`: the dataset workload (null: random tokens).
void run_benchmark(CoordinatorContext& c, TraceRecorder& trace, const BenchOptions& o, DatasetWorkload* data,
                   Measured& m) {
  const JobConfig& job = c.job;
  const WorkloadSection& w = job.workload;
  const bool multi_turn = data != nullptr && w.mode == "multi_turn";
  const int64_t context = c.plan.longest_request;  // the model's context, or less where cache.memory says
  MultiTurnSource* turn_source = nullptr;  // the running multi_turn source, told of finished turns
  EngineOptions eo = engine_options(job, c.plan, c.draft_model);
  eo.should_stop = [] { return stop_requested(); };
  eo.trace = &trace;
  eo.on_finished = [&turn_source](const Sequence& s) {
    if (turn_source != nullptr) turn_source->on_finished(s);
  };
  Engine engine(c.executor, c.plan.model, c.plan.partition.num_blocks, eo);
  const int64_t vocab = c.plan.model.vocab_size;
  // The job's penalties and bias apply to the synthetic requests too (bad words need the
  // model's tokenizer: a dataset's, or loaded only then).
  std::unique_ptr<ModelText> own_text;
  const ModelText* text = data != nullptr ? data->text.get() : nullptr;
  if (text == nullptr && !job.sampling.bad_words.empty()) text = (own_text = std::make_unique<ModelText>(job.model.path)).get();
  const LogitsProcessing processing = request_processing(job.sampling, text, vocab);

  if (w.warmup > 0 && multi_turn) {
    // The first turns of the warm-up's conversations.
    log_printf(LogLevel::kInfo, "bench: the first turns of %d warm-up conversation(s)", w.warmup);
    std::vector<Conversation> firsts(data->conversations.begin(), data->conversations.begin() + w.warmup);
    for (Conversation& conversation : firsts) conversation.turns.resize(1);
    DatasetSummary not_reported;
    MultiTurnSource warm(std::move(firsts), *data->text, multi_turn_options(job, context, 0, processing), not_reported);
    turn_source = &warm;
    engine.set_source(&warm);
    engine.run();
    turn_source = nullptr;
  } else if (w.warmup > 0) {
    log_printf(LogLevel::kInfo, "bench: %d warm-up request(s)", w.warmup);
    const std::vector<WorkloadRequest> warm_requests =
        data != nullptr ? std::vector<WorkloadRequest>(data->requests.begin(), data->requests.begin() + w.warmup)
                        : make_workload(w, vocab, 0, w.warmup);
    WorkloadSource warm(to_requests(warm_requests, 0, job, processing), std::vector<double>(w.warmup, 0.0),
                        w.concurrency, 0.0, Clock::now());
    engine.set_source(&warm);
    engine.run();
  }
  const size_t steps_before = engine.stats().step_records.size();
  const EngineCounters counters_before = engine_counters(c.shard, c.graphs);
  const PrefixCacheStats prefix_before = engine.scheduler().blocks().stats();
  const SchedulerStats sched_before = engine.scheduler().stats();

  std::vector<WorkloadRequest> drawn;
  if (data == nullptr) {
    drawn = make_workload(w, vocab, w.warmup, w.requests);
  } else if (!multi_turn) {
    drawn.assign(data->requests.begin() + w.warmup, data->requests.end());
    const std::vector<double> due = arrival_times(w, static_cast<int64_t>(drawn.size()));
    for (size_t i = 0; i < drawn.size(); ++i) drawn[i].arrival_s = due[i];
  }
  std::vector<double> arrivals;
  for (const WorkloadRequest& r : drawn) arrivals.push_back(r.arrival_s);
  if (multi_turn)
    log_printf(LogLevel::kInfo, "bench: %d measured conversation(s) turn by turn, %d at once, %.3g s between turns",
               w.requests, w.concurrency, w.turn_gap);
  else
    log_printf(LogLevel::kInfo, "bench: %d measured request(s), %s", w.requests,
               w.rate > 0 ? ("open loop at " + std::to_string(w.rate) + " requests/s").c_str()
                          : ("closed loop, concurrency " + std::to_string(w.concurrency)).c_str());
  std::map<int64_t, std::vector<Clock::time_point>> token_times;
  std::unique_ptr<OpProfiler> profiler;
  if (o.profile) profiler = std::make_unique<OpProfiler>((std::filesystem::path(o.out_dir) / "profile_rank0.json").string());
  // Made before the clock starts: the source tokenises every reply once, up front.
  std::unique_ptr<MultiTurnSource> turns;
  if (multi_turn)
    turns = std::make_unique<MultiTurnSource>(
        std::vector<Conversation>(data->conversations.begin() + w.warmup, data->conversations.end()), *data->text,
        multi_turn_options(job, context, w.warmup, processing), data->summary);
  int64_t planned_tokens = static_cast<int64_t>(w.requests) * w.output_len.hi;
  if (data != nullptr) {
    planned_tokens = 0;
    for (const WorkloadRequest& r : drawn) planned_tokens += r.output_len;
    if (turns) planned_tokens = turns->planned_output_tokens();
  }
  ProgressBar progress(planned_tokens, data != nullptr || w.output_len.lo == w.output_len.hi);
  m.start = Clock::now();
  std::unique_ptr<WorkloadSource> source;
  if (turns) {
    turn_source = turns.get();
    engine.set_source(turns.get());
  } else {
    source = std::make_unique<WorkloadSource>(to_requests(drawn, w.warmup, job, processing), arrivals, w.concurrency,
                                              w.rate, m.start);
    engine.set_source(source.get());
  }
  engine.run([&](const TokenEvent& ev) {
    token_times[ev.request_id].push_back(Clock::now());
    progress.advance(1);
  });
  m.end = Clock::now();
  turn_source = nullptr;
  progress.finish();
  if (profiler) {
    profiler->stop();
    // LibTorch writes the profile without reporting a failed write: reading it back is the check.
    try {
      m.top_ops = top_operators(profiler->path(), 12);
    } catch (const std::exception& e) {
      std::string why = e.what();
      throw JobFailure("cannot write the operator profile to " + profiler->path() + ": " + why.substr(0, why.find('\n')));
    }
  }
  m.stopped = stop_requested();
  if (m.stopped)
    log_printf(LogLevel::kWarn, "stopped by signal %d: reporting the requests finished so far", stop_signal());

  const auto& records = engine.stats().step_records;
  m.steps.assign(records.begin() + static_cast<std::ptrdiff_t>(steps_before), records.end());
  const PrefixCacheStats& prefix = engine.scheduler().blocks().stats();
  m.prefix.lookup_tokens = prefix.lookup_tokens - prefix_before.lookup_tokens;
  m.prefix.hit_tokens = prefix.hit_tokens - prefix_before.hit_tokens;
  m.prefix.evictions = prefix.evictions - prefix_before.evictions;
  const SchedulerStats& ss = engine.scheduler().stats();
  m.preemptions = ss.preemptions - sched_before.preemptions;
  m.recomputed_tokens = ss.recomputed_tokens - sched_before.recomputed_tokens;
  m.computed_tokens = ss.computed_tokens - sched_before.computed_tokens;
  m.spec_drafts = ss.spec_drafts - sched_before.spec_drafts;
  m.spec_draft_tokens = ss.spec_draft_tokens - sched_before.spec_draft_tokens;
  m.spec_accepted_tokens = ss.spec_accepted_tokens - sched_before.spec_accepted_tokens;
  m.spec_accepted_at = ss.spec_accepted_at;
  for (size_t p = 0; p < sched_before.spec_accepted_at.size() && p < m.spec_accepted_at.size(); ++p)
    m.spec_accepted_at[p] -= sched_before.spec_accepted_at[p];
  for (const StepRecord& s : m.steps) m.peak_blocks_used = std::max(m.peak_blocks_used, s.blocks_used);
  const EngineCounters counters = engine_counters(c.shard, c.graphs);
  for (size_t p = 0; p < 3; ++p) m.attention_calls[p] = counters.attention_calls[p] - counters_before.attention_calls[p];
  m.cached_layers = c.shard.num_cached_layers();
  m.graphs_captured = counters.graphs_captured;
  if (c.graphs != nullptr) m.graph_replays = counters.graph_replays - counters_before.graph_replays;
  std::vector<std::pair<int64_t, std::vector<int64_t>>> outputs;

  for (const auto& seq : engine.scheduler().sequences()) {
    if (seq->request.id < w.warmup || !seq->finished()) continue;
    RequestRow row;
    row.id = seq->request.id;
    row.arrival_ms = ms(seq->arrival_time - m.start).count();
    row.prompt_tokens = static_cast<int64_t>(seq->request.prompt.size());
    row.output_tokens = seq->num_output();
    row.preemptions = seq->preemptions;
    row.finish_reason = seq->finish_reason;
    row.cached_tokens = seq->cached_tokens;
    if (turns) {
      const auto it = turns->turns().find(row.id);
      if (it != turns->turns().end()) row.conversation = it->second.conversation, row.turn = it->second.turn;
    }
    row.ttft_ms = ms(seq->first_token_time - seq->arrival_time).count();
    row.e2e_ms = ms(seq->last_token_time - seq->arrival_time).count();
    if (row.output_tokens > 1)
      row.tpot_ms = ms(seq->last_token_time - seq->first_token_time).count() / static_cast<double>(row.output_tokens - 1);
    const std::vector<Clock::time_point>& times = token_times[row.id];
    for (size_t k = 1; k < times.size(); ++k) {
      const double gap = ms(times[k] - times[k - 1]).count();
      m.itl.push_back(gap);
      row.itl_max_ms = std::max(row.itl_max_ms, gap);
    }
    outputs.emplace_back(row.id, std::vector<int64_t>(seq->tokens.end() - row.output_tokens, seq->tokens.end()));
    m.ttft.push_back(row.ttft_ms);
    m.e2e.push_back(row.e2e_ms);
    if (row.output_tokens > 1) m.tpot.push_back(row.tpot_ms);
    m.rows.push_back(row);
  }
  std::sort(outputs.begin(), outputs.end());
  m.output_digest = output_digest(outputs);
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  }
  return "unknown";
}

std::string host_name() {
  char buf[256] = {};
  return gethostname(buf, sizeof(buf) - 1) == 0 ? std::string(buf) : "unknown";
}

ordered_json memory_json(const MemorySpec& m) {
  switch (m.kind) {
    case MemorySpec::Kind::kBytes: return m.bytes;
    case MemorySpec::Kind::kPerRank: return m.per_rank;
    case MemorySpec::Kind::kShare: return std::to_string(m.share * 100.0) + "%";
  }
  return nullptr;
}

struct ReportInputs {
  const BenchOptions& options;
  const JobConfig& job;
  const JobPlan& plan;
  const World& world;
  const JobOutcome& outcome;
  const Measured& m;
  const std::vector<RankBreakdown>& ranks;
  bool oversubscribed;
  int64_t decode_weight_bytes;
  const DatasetWorkload* data;  // null: random tokens
};

// multi_turn: the figures of each turn index over the conversations that reached it.
ordered_json by_turn_json(const std::vector<RequestRow>& rows) {
  std::map<int64_t, std::vector<const RequestRow*>> turns;
  for (const RequestRow& r : rows)
    if (r.turn >= 0) turns[r.turn].push_back(&r);
  ordered_json out = ordered_json::array();
  for (const auto& [turn, list] : turns) {
    std::vector<double> ttft, tpot, e2e;
    double prompt = 0, cached = 0;
    for (const RequestRow* r : list) {
      ttft.push_back(r->ttft_ms), e2e.push_back(r->e2e_ms);
      if (r->output_tokens > 1) tpot.push_back(r->tpot_ms);
      prompt += static_cast<double>(r->prompt_tokens), cached += static_cast<double>(r->cached_tokens);
    }
    const auto n = static_cast<double>(list.size());
    out.push_back({{"turn", turn + 1},
                   {"requests", static_cast<int64_t>(list.size())},
                   {"mean_prompt_tokens", round3(prompt / n)},
                   {"mean_cached_tokens", round3(cached / n)},
                   {"ttft", to_json(summarize(ttft))},
                   {"tpot", to_json(summarize(tpot))},
                   {"e2e", to_json(summarize(e2e))}});
  }
  return out;
}

ordered_json make_report(const ReportInputs& in) {
  const JobConfig& job = in.job;
  const Measured& m = in.m;
  const JobPlan& plan = in.plan;
  const WorkloadSection& w = job.workload;
  const double duration_s = std::chrono::duration<double>(m.end - m.start).count();
  int64_t prompt_tokens = 0, output_tokens = 0;
  for (const RequestRow& r : m.rows) prompt_tokens += r.prompt_tokens, output_tokens += r.output_tokens;

  ordered_json report;
  report["kvpipe"] = bench_build_json();
  report["machine"] = bench_machine_json();
  report["world_size"] = in.world.size();
  report["backend"] = in.outcome.backend;
  report["threads_per_rank"] = job.runtime.threads;
  report["oversubscribed"] = in.oversubscribed;
  ordered_json layers = ordered_json::array();
  for (const StagePlan& s : plan.partition.stages) layers.push_back(s.num_layers);
  const int64_t micro_batches = resolved_micro_batches(job, plan);
  report["tensor_parallel"] = plan.grid.tensor;
  report["pipeline_stages"] = plan.grid.stages();
  report["config"] = {
      {"file", in.options.config},
      {"overrides", in.options.overrides},
      {"runtime", {{"device", plan.device_type == at::kCUDA ? "cuda" : "cpu"},
                   {"cuda_graphs", job.runtime.cuda_graphs}}},
      {"model", {{"path", job.model.path}, {"dtype", dtype_name(plan.dtype)}, {"layers", plan.model.num_layers},
                 {"hidden_size", plan.model.hidden_size}, {"vocab_size", plan.model.vocab_size},
                 {"max_position", plan.model.max_position}}},
      {"parallel", {{"layers", layers}, {"micro_batches", micro_batches}, {"backend", job.parallel.backend}}},
      {"cache", {{"block_size", plan.block_size}, {"num_blocks", plan.partition.num_blocks},
                 {"memory", memory_json(job.cache.memory)}, {"prefix_reuse", job.cache.prefix_reuse},
                 {"cached_layers", plan.model.num_layers - plan.first_cached_layer},
                 {"window", {{"sinks", job.cache.window_sinks}, {"recent", job.cache.window_recent}}}}},
      {"scheduler", {{"max_batch", job.scheduler.max_batch}, {"max_tokens_per_step", job.scheduler.max_tokens_per_step},
                     {"max_prefill_tokens_per_step", job.scheduler.max_prefill_tokens_per_step}}},
      {"sampling", {{"temperature", job.sampling.temperature}, {"top_k", job.sampling.top_k},
                    {"top_p", job.sampling.top_p}, {"seed", job.sampling.seed}}},
      {"speculative", {{"method", job.speculative.method}, {"num_tokens", job.speculative.num_tokens},
                       {"ngram", {{"min", job.speculative.ngram_min}, {"max", job.speculative.ngram_max}}},
                       {"max_batch", job.speculative.max_batch},
                       {"model", job.speculative.model.empty() ? ordered_json() : ordered_json(job.speculative.model)}}}};
  report["workload"] = workload_json(w);
  if (in.data != nullptr) {
    const DatasetSummary& d = in.data->summary;
    report["dataset"] = {{"path", d.path},
                         {"conversations", d.conversations},
                         {"skipped", d.skipped},
                         {"truncated", d.truncated},
                         {"truncated_bytes", d.truncated_bytes},
                         {"filtered", d.filtered},
                         {"used", d.used},
                         {"turns_cut", d.turns_cut}};
    if (w.mode == "multi_turn") report["by_turn"] = by_turn_json(m.rows);
  }
  report["stopped"] = m.stopped;
  report["requests"] = {{"completed", static_cast<int64_t>(m.rows.size())},
                        {"prompt_tokens", prompt_tokens},
                        {"output_tokens", output_tokens}};
  // Microseconds, as the endpoint report: a run of a few tens of milliseconds rounded to whole
  // ones would give rates that disagree with tokens / duration_s by more than a percent.
  report["duration_s"] = round6(duration_s);
  const double d = std::max(duration_s, 1e-9);
  report["throughput"] = {{"output_tokens_per_s", round3(output_tokens / d)},
                          {"total_tokens_per_s", round3((prompt_tokens + output_tokens) / d)},
                          {"requests_per_s", round3(static_cast<double>(m.rows.size()) / d)}};
  std::vector<double> step_ms, decode_step_ms, full_batch_ms;
  double blocks_sum = 0;
  int64_t full_batch = 0;  // the most sequences one decode-only step carried
  for (const StepRecord& s : m.steps) {
    const double v = s.ms();
    step_ms.push_back(v);
    if (s.prompt_tokens == 0) decode_step_ms.push_back(v), full_batch = std::max(full_batch, s.sequences);
    blocks_sum += static_cast<double>(s.blocks_used);
  }
  // Decode steps at the full batch alone: requests that finish early leave a tail of smaller
  // steps, which a batch-size measurement should not average in.
  for (const StepRecord& s : m.steps)
    if (s.prompt_tokens == 0 && s.sequences == full_batch) full_batch_ms.push_back(s.ms());
  report["latency_ms"] = {{"ttft", to_json(summarize(m.ttft))},  {"tpot", to_json(summarize(m.tpot))},
                          {"itl", to_json(summarize(m.itl))},    {"e2e", to_json(summarize(m.e2e))},
                          {"step", to_json(summarize(step_ms))}, {"decode_step", to_json(summarize(decode_step_ms))},
                          {"decode_step_full_batch", to_json(summarize(full_batch_ms))}};
  int64_t prompt_tokens_computed = 0, decode_tokens = 0, sequences = 0;
  for (const StepRecord& s : m.steps)
    prompt_tokens_computed += s.prompt_tokens, decode_tokens += s.decode_tokens, sequences += s.sequences;
  report["steps"] = {{"count", static_cast<int64_t>(m.steps.size())},
                     {"decode_steps", static_cast<int64_t>(decode_step_ms.size())},
                     {"decode_full_batch", full_batch},
                     {"prompt_tokens", prompt_tokens_computed},
                     {"decode_tokens", decode_tokens},
                     {"mean_sequences", m.steps.empty() ? 0.0 : round3(static_cast<double>(sequences) / m.steps.size())}};
  report["decode_weight_bytes"] = in.decode_weight_bytes;
  // K and V of one token over every cached layer of every rank, as stored: what a decode step
  // reads per context token (the KV side of a bandwidth floor).
  report["kv_bytes_per_token"] = plan.kv_bytes_per_token_layer * (plan.model.num_layers - plan.first_cached_layer);
  // What the measured steps ran on (rank 0): a figure is only what its path is.
  const auto calls = [&](AttentionPath p) { return m.attention_calls[static_cast<size_t>(p)]; };
  char digest[17];
  std::snprintf(digest, sizeof(digest), "%016llx", static_cast<unsigned long long>(m.output_digest));
  report["engine"] = {
      {"attention_calls", {{"paged", calls(AttentionPath::kPagedDecode)},
                           {"varlen", calls(AttentionPath::kVarlen)},
                           {"per_sequence", calls(AttentionPath::kPerSequence)}}},
      {"cached_layers", m.cached_layers},
      {"cuda_graphs", {{"enabled", m.graphs_captured >= 0},
                       {"captured", std::max<int64_t>(0, m.graphs_captured)},
                       {"replayed_steps", std::max<int64_t>(0, m.graph_replays)}}},
      {"output_digest", digest}};
  ordered_json ranks = ordered_json::array();
  for (size_t r = 0; r < in.ranks.size(); ++r) {
    const RankBreakdown& b = in.ranks[r];
    const int rank = static_cast<int>(r);
    const StagePlan& st = plan.partition.stages.at(plan.grid.stage_of(rank));
    ordered_json entry = {{"rank", static_cast<int64_t>(r)},
                          {"stage", plan.grid.stage_of(rank)},
                          {"tensor_rank", plan.grid.tensor_rank_of(rank)},
                          {"first_layer", st.first_layer},
                          {"num_layers", st.num_layers},
                          {"compute", std::round(b.compute * 1e6) / 1e6},
                          {"comm", std::round(b.comm * 1e6) / 1e6},
                          {"wait", std::round(b.wait * 1e6) / 1e6},
                          {"idle", std::round(b.idle * 1e6) / 1e6},
                          {"total_s", round3(b.total_s)}};
    if (plan.grid.tensor > 1 && r < in.outcome.times.size()) {
      // The whole run's all-reduces on this rank (warm-up included), per call and as a share.
      const RankTimes& t = in.outcome.times[r];
      entry["all_reduce"] = {{"calls", static_cast<int64_t>(t.all_reduce_calls)},
                             {"us_per_call", t.all_reduce_calls > 0 ? round3(1e6 * t.all_reduce_s / t.all_reduce_calls) : 0.0},
                             {"share", t.total_s > 0 ? std::round(t.all_reduce_s / t.total_s * 1e4) / 1e4 : 0.0},
                             {"group_share", t.total_s > 0 ? std::round(t.group_s / t.total_s * 1e4) / 1e4 : 0.0}};
    }
    ranks.push_back(entry);
  }
  report["ranks"] = ranks;
  // At most ~500 samples of the blocks in use, evenly spaced over the steps.
  ordered_json samples = ordered_json::array();
  const size_t stride = std::max<size_t>(1, m.steps.size() / 500);
  for (size_t i = 0; i < m.steps.size(); i += stride)
    samples.push_back({round3(std::chrono::duration<double>(m.steps[i].done - m.start).count()), m.steps[i].blocks_used});
  report["kv_cache"] = {
      {"num_blocks", plan.partition.num_blocks},
      {"block_size", plan.block_size},
      {"peak_blocks_used", m.peak_blocks_used},
      {"mean_blocks_used", m.steps.empty() ? 0.0 : round3(blocks_sum / m.steps.size())},
      {"blocks_used", samples},
      {"prefix_hit_rate", std::round(m.prefix.hit_rate() * 1e6) / 1e6},
      {"prefix_hit_tokens", m.prefix.hit_tokens},
      {"prefix_lookup_tokens", m.prefix.lookup_tokens},
      {"evictions", m.prefix.evictions},
      {"preemptions", m.preemptions},
      {"recomputed_tokens", m.recomputed_tokens},
      {"computed_tokens", m.computed_tokens}};
  // vLLM's figures: acceptance rate = accepted / draft tokens; mean accepted length = tokens
  // a verifying step yields (the model's own token included) = 1 + accepted / drafts.
  ordered_json accepted_at = ordered_json::array();
  for (size_t p = 0; p < m.spec_accepted_at.size(); ++p)
    accepted_at.push_back(m.spec_drafts > 0 ? round3(static_cast<double>(m.spec_accepted_at[p]) / m.spec_drafts) : 0.0);
  report["speculative"] = {
      {"method", job.speculative.method},
      {"drafts", m.spec_drafts},
      {"draft_tokens", m.spec_draft_tokens},
      {"accepted_tokens", m.spec_accepted_tokens},
      {"acceptance_rate",
       m.spec_draft_tokens > 0 ? round3(static_cast<double>(m.spec_accepted_tokens) / m.spec_draft_tokens) : 0.0},
      {"mean_accepted_length",
       m.spec_drafts > 0 ? round3(1.0 + static_cast<double>(m.spec_accepted_tokens) / m.spec_drafts) : 0.0},
      {"acceptance_rate_by_position", accepted_at}};
  ordered_json ops = ordered_json::array();
  for (const OpTotal& op : m.top_ops)
    ops.push_back({{"name", op.name}, {"calls", op.calls}, {"total_ms", round3(op.total_ms)}});
  if (in.options.profile) report["profile_top_ops"] = ops;
  report["files"] = {{"requests_csv", "requests.csv"},
                     {"trace", "trace.json"},
                     {"profile", in.options.profile ? ordered_json("profile_rank0.json") : ordered_json(nullptr)}};
  return report;
}

void write_csv(const std::string& path, const std::vector<RequestRow>& rows) {
  std::string out;
  out += "id,arrival_ms,prompt_tokens,output_tokens,ttft_ms,tpot_ms,e2e_ms,itl_max_ms,preemptions,finish_reason,"
         "cached_tokens,conversation,turn\n";
  char line[512];
  for (const RequestRow& r : rows) {
    // conversation and turn are empty outside multi_turn; turns count from 1 as in report.json.
    const std::string conversation = r.turn >= 0 ? std::to_string(r.conversation) : "";
    const std::string turn = r.turn >= 0 ? std::to_string(r.turn + 1) : "";
    std::snprintf(line, sizeof(line), "%lld,%.3f,%lld,%lld,%.3f,%.3f,%.3f,%.3f,%lld,%s,%lld,%s,%s\n",
                  static_cast<long long>(r.id), r.arrival_ms, static_cast<long long>(r.prompt_tokens),
                  static_cast<long long>(r.output_tokens), r.ttft_ms, r.tpot_ms, r.e2e_ms, r.itl_max_ms,
                  static_cast<long long>(r.preemptions), r.finish_reason.c_str(), static_cast<long long>(r.cached_tokens),
                  conversation.c_str(), turn.c_str());
    out += line;
  }
  write_text_file(path, out, "--out", "the request table");
}

// The one-screen summary on stdout.
void print_summary(std::ostream& os, const ordered_json& r, const std::string& dir) {
  char buf[256];
  const auto& w = r["workload"];
  const auto& t = r["throughput"];
  os << "kvpipe bench: " << r["config"]["file"].get<std::string>() << ", " << r["world_size"].get<int>()
     << " rank(s) (" << r["backend"].get<std::string>() << (r["oversubscribed"].get<bool>() ? ", oversubscribed" : "")
     << "), " << r["threads_per_rank"].get<int>() << " thread(s) per rank\n";
  const std::string loop = w["mode"] == "open" ? "open loop, " + std::to_string(w["rate"].get<double>()) + " req/s, concurrency " +
                                                     std::to_string(w["concurrency"].get<int>())
                                               : "closed loop, concurrency " + std::to_string(w["concurrency"].get<int>());
  if (w["dataset"] == "random") {
    std::snprintf(buf, sizeof(buf), "workload: %d requests (%s), prompt %d..%d, output %d..%d tokens, warm-up %d\n",
                  w["requests"].get<int>(), loop.c_str(), w["prompt_len"][0].get<int>(), w["prompt_len"][1].get<int>(),
                  w["output_len"][0].get<int>(), w["output_len"][1].get<int>(), w["warmup"].get<int>());
  } else {
    const auto& d = r["dataset"];
    const bool multi = w["dataset_mode"] == "multi_turn";
    std::snprintf(buf, sizeof(buf), "workload: %d %s (%s), %s of %s (%lld complete conversations%s), warm-up %d\n",
                  w["requests"].get<int>(), multi ? "conversations" : "requests", loop.c_str(),
                  w["dataset_mode"].get<std::string>().c_str(), d["path"].get<std::string>().c_str(),
                  d["conversations"].get<long long>(), d["truncated"].get<bool>() ? ", a broken tail dropped" : "",
                  w["warmup"].get<int>());
  }
  os << buf;
  std::snprintf(buf, sizeof(buf), "duration %.3f s: %lld requests, %lld prompt + %lld output tokens\n",
                r["duration_s"].get<double>(), r["requests"]["completed"].get<long long>(),
                r["requests"]["prompt_tokens"].get<long long>(), r["requests"]["output_tokens"].get<long long>());
  os << buf;
  std::snprintf(buf, sizeof(buf), "throughput: %.1f output tok/s, %.1f total tok/s, %.3f req/s\n",
                t["output_tokens_per_s"].get<double>(), t["total_tokens_per_s"].get<double>(),
                t["requests_per_s"].get<double>());
  os << buf;
  std::snprintf(buf, sizeof(buf), "%-16s %10s %10s %10s %10s %8s\n", "latency (ms)", "mean", "median", "p90", "p99", "count");
  os << buf;
  for (const auto& [key, label] : std::vector<std::pair<std::string, std::string>>{
           {"ttft", "TTFT"}, {"tpot", "TPOT"}, {"itl", "ITL"}, {"e2e", "end to end"}, {"step", "step"},
           {"decode_step", "decode step"}}) {
    const auto& d = r["latency_ms"][key];
    std::snprintf(buf, sizeof(buf), "%-16s %10.2f %10.2f %10.2f %10.2f %8lld\n", label.c_str(), d["mean"].get<double>(),
                  d["median"].get<double>(), d["p90"].get<double>(), d["p99"].get<double>(), d["count"].get<long long>());
    os << buf;
  }
  std::snprintf(buf, sizeof(buf), "%-16s %10s %10s %10s %10s\n", "rank (layers)", "compute", "comm", "wait", "idle");
  os << buf;
  for (const auto& k : r["ranks"]) {
    const int64_t first = k["first_layer"].get<int64_t>(), n = k["num_layers"].get<int64_t>();
    const std::string name = std::to_string(k["rank"].get<int>()) + " (" + std::to_string(first) + ".." +
                             std::to_string(first + n - 1) + ")";
    std::snprintf(buf, sizeof(buf), "%-16s %9.1f%% %9.1f%% %9.1f%% %9.1f%%\n", name.c_str(), 100 * k["compute"].get<double>(),
                  100 * k["comm"].get<double>(), 100 * k["wait"].get<double>(), 100 * k["idle"].get<double>());
    os << buf;
  }
  const auto& kv = r["kv_cache"];
  std::snprintf(buf, sizeof(buf),
                "kv cache: peak %lld of %lld blocks (mean %.1f), prefix hit rate %.1f%%, %lld evictions, %lld "
                "preemptions\n",
                kv["peak_blocks_used"].get<long long>(), kv["num_blocks"].get<long long>(),
                kv["mean_blocks_used"].get<double>(), 100 * kv["prefix_hit_rate"].get<double>(),
                kv["evictions"].get<long long>(), kv["preemptions"].get<long long>());
  os << buf;
  if (r.contains("profile_top_ops")) {
    os << "top operators on rank 0 (inclusive ms, calls):";
    int shown = 0;
    for (const auto& op : r["profile_top_ops"]) {
      if (shown++ == 6) break;
      std::snprintf(buf, sizeof(buf), " %s %.1f (%lld);", op["name"].get<std::string>().c_str(),
                    op["total_ms"].get<double>(), op["calls"].get<long long>());
      os << buf;
    }
    os << "\n";
  }
  os << "files: " << dir << "/report.json, requests.csv, trace.json"
     << (r["files"]["profile"].is_null() ? "" : ", profile_rank0.json") << "\n";
}

}  // namespace

ordered_json bench_build_json() {
  return ordered_json{{"version", KVPIPE_VERSION},
                      {"git", KVPIPE_GIT_COMMIT},
                      {"build_type", KVPIPE_BUILD_TYPE},
                      {"compiler", KVPIPE_COMPILER},
                      {"torch", TORCH_VERSION},
#ifdef KVPIPE_HAVE_NCCL
                      {"nccl", true},
#else
                      {"nccl", false},
#endif
                      {"nccl_version", nccl_version()},
                      {"cpu_blas", cpu_blas_name()}};
}

ordered_json bench_machine_json() {
  return ordered_json{{"hostname", host_name()},
                      {"cpu", cpu_model()},
                      {"cpu_features", describe_cpu_features()},
                      {"cpu_kernels", dot_kernel_isa()},
                      {"cpu_block_kernels", block_kernel_isa()},
                      {"cpu_float_kernels", float_kernel_isa()},
                      {"cpu_prompt_kernels", prompt_kernels_description()},
                      {"cores", std::thread::hardware_concurrency()},
                      {"memory_bytes", host_memory_bytes()},
                      {"gpus", at::detail::getCUDAHooks().getNumGPUs()},
                      {"gpu", cuda_device_count() > 0 ? cuda_device_name(0) : ""}};
}

void bench(const BenchOptions& o, World& world) {
  if (!o.endpoint.empty())
    throw std::logic_error("bench: an --endpoint run is bench_endpoint's (it needs no MPI job)");
  if (o.out_dir.empty()) throw std::invalid_argument("--out: an output directory is required");
  const JobConfig job = load_job_config(o.config, o.overrides);
  const JobPlan plan = plan_job(job, world.size());
  // Before anything is loaded or logged: a workload that cannot run is bad input. A dataset
  // is read on every rank, so that its errors stop every rank alike.
  std::unique_ptr<DatasetWorkload> data;
  if (job.workload.dataset != "random") data = std::make_unique<DatasetWorkload>(load_dataset_workload(job, plan.longest_request));
  else check_workload_fits(job, plan.model.max_position);
  if (world.is_coordinator()) {
    std::error_code ec;
    std::filesystem::create_directories(o.out_dir, ec);
    if (ec || !std::filesystem::is_directory(o.out_dir))
      throw std::invalid_argument("--out: cannot create the directory " + o.out_dir);
  }
  TraceRecorder trace;
  Measured m;
  const JobOutcome outcome = run_job(job, plan, world, &trace, [&](CoordinatorContext& c) { run_benchmark(c, trace, o, data.get(), m); });
  if (!world.is_coordinator()) return;

  const double from_us = trace.since_epoch_us(m.start), to_us = trace.since_epoch_us(m.end);
  std::vector<RankBreakdown> ranks;
  for (const auto& spans : outcome.traces) ranks.push_back(breakdown(spans, from_us, to_us));
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const bool oversubscribed = static_cast<int64_t>(local_rank_count_from_env()) * job.runtime.threads > cores;
  // A decode step reads every layer, the final norm and the LM head over all ranks (as stored:
  // quantised files read their blocks); of the embedding table, one row per sequence.
  const ModelConfig& model = plan.model;
  const StoredWeightBytes& stored = plan.weight_bytes;
  const int64_t decode_weight_bytes =
      stored.per_layer * model.num_layers + stored.head + (model.tie_embeddings ? stored.embedding : 0);
  const ordered_json report =
      make_report({o, job, plan, world, outcome, m, ranks, oversubscribed, decode_weight_bytes, data.get()});

  const std::filesystem::path dir(o.out_dir);
  std::vector<std::string> names;
  for (int r = 0; r < plan.grid.world_size; ++r) {
    const StagePlan& s = plan.partition.stages.at(plan.grid.stage_of(r));
    names.push_back("layers " + std::to_string(s.first_layer) + ".." + std::to_string(s.first_layer + s.num_layers - 1) +
                    (plan.grid.tensor > 1 ? ", tensor rank " + std::to_string(plan.grid.tensor_rank_of(r)) : ""));
  }
  std::vector<StepSpan> steps;
  for (const StepRecord& s : m.steps)
    steps.push_back({s.micro_batch, trace.since_epoch_us(s.submitted), trace.since_epoch_us(s.done), s.blocks_used});
  write_json((dir / "trace.json").string(), chrome_trace(outcome.traces, names, steps, from_us, to_us), -1);
  write_csv((dir / "requests.csv").string(), m.rows);
  write_json((dir / "report.json").string(), report, 2);
  print_summary(std::cout, report, o.out_dir);
  flush_stdout("the bench summary");
}

}  // namespace kvpipe
