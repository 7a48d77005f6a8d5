#include "launch/bench/bench_report.h"

#include "launch/output.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
#include <stdexcept>

namespace kvpipe {

using ordered_json = nlohmann::ordered_json;

double percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0.0;
  const double pos = std::clamp(q, 0.0, 1.0) * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

Distribution summarize(std::vector<double> values) {
  Distribution d;
  if (values.empty()) return d;
  std::sort(values.begin(), values.end());
  d.count = static_cast<int64_t>(values.size());
  d.mean = std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
  d.median = percentile(values, 0.5);
  d.p90 = percentile(values, 0.9);
  d.p99 = percentile(values, 0.99);
  d.min = values.front();
  d.max = values.back();
  return d;
}

double round3(double v) { return std::round(v * 1000.0) / 1000.0; }
double round6(double v) { return std::round(v * 1e6) / 1e6; }

ordered_json to_json(const Distribution& d) {
  return ordered_json{{"count", d.count},       {"mean", round3(d.mean)}, {"median", round3(d.median)},
                      {"p90", round3(d.p90)},   {"p99", round3(d.p99)},   {"min", round3(d.min)},
                      {"max", round3(d.max)}};
}

ordered_json workload_json(const WorkloadSection& w) {
  ordered_json workload = {{"mode", w.rate > 0 ? "open" : "closed"},
                           {"requests", w.requests},
                           {"prompt_len", ordered_json::array({w.prompt_len.lo, w.prompt_len.hi})},
                           {"output_len", ordered_json::array({w.output_len.lo, w.output_len.hi})},
                           {"shared_prefix", w.shared_prefix},
                           {"concurrency", w.concurrency},
                           {"rate", w.rate},
                           {"warmup", w.warmup},
                           {"seed", w.seed}};
  workload["dataset"] = w.dataset;
  if (w.dataset != "random") {
    // The lengths come from the data: the synthetic ones do not apply.
    workload.erase("prompt_len");
    workload.erase("output_len");
    workload.erase("shared_prefix");
    workload["dataset_mode"] = w.mode;
    if (w.mode == "multi_turn") workload["turn_gap"] = w.turn_gap, workload["min_turns"] = w.min_turns;
  }
  if (!w.prompt_len.file.empty()) workload["prompt_len_file"] = w.prompt_len.file;
  if (!w.output_len.file.empty()) workload["output_len_file"] = w.output_len.file;
  return workload;
}

void write_json(const std::string& path, const ordered_json& j, int indent) {
  write_text_file(path, j.dump(indent) + "\n", "--out", "the report");
}

RankBreakdown breakdown(const std::vector<TraceSpan>& spans, double from_us, double to_us) {
  RankBreakdown b;
  const double window = std::max(to_us - from_us, 0.0);
  b.total_s = window * 1e-6;
  if (window <= 0) return b;
  double wait = 0, comm = 0, idle = 0;
  for (const TraceSpan& s : spans) {
    const double clipped = std::min(s.start_us + s.dur_us, to_us) - std::max(s.start_us, from_us);
    if (clipped <= 0) continue;
    switch (s.kind) {
      case SpanKind::kWait: wait += clipped; break;
      case SpanKind::kSend:
      case SpanKind::kRecv: comm += clipped; break;
      case SpanKind::kIdle: idle += clipped; break;
      case SpanKind::kCompute: break;  // the rest of the window, below
    }
  }
  b.wait = wait / window;
  b.comm = comm / window;
  b.idle = idle / window;
  b.compute = std::max(0.0, 1.0 - b.wait - b.comm - b.idle);
  return b;
}

ordered_json chrome_trace(const std::vector<std::vector<TraceSpan>>& ranks, const std::vector<std::string>& rank_names,
                          const std::vector<StepSpan>& steps, double measure_from_us, double measure_to_us) {
  ordered_json events = ordered_json::array();
  const auto meta = [&](const char* name, int pid, int tid, const ordered_json& args) {
    ordered_json e{{"name", name}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", args}};
    events.push_back(std::move(e));
  };
  for (size_t r = 0; r < ranks.size(); ++r) {
    const int pid = static_cast<int>(r);
    meta("process_name", pid, 0, {{"name", "rank " + std::to_string(r)}});
    meta("process_sort_index", pid, 0, {{"sort_index", pid}});
    meta("thread_name", pid, 0, {{"name", r < rank_names.size() ? rank_names[r] : "stage"}});
  }
  if (!steps.empty()) meta("thread_name", 0, 1, {{"name", "micro-batches, end to end"}});
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (const TraceSpan& s : ranks[r]) {
      ordered_json e{{"name", span_kind_name(s.kind)}, {"cat", span_kind_name(s.kind)}, {"ph", "X"},
                     {"pid", static_cast<int>(r)}, {"tid", 0}, {"ts", round3(s.start_us)},
                     {"dur", round3(s.dur_us)}};
      if (s.micro_batch >= 0) e["args"] = {{"micro_batch", s.micro_batch}};
      events.push_back(std::move(e));
    }
  }
  // Micro-batches overlap when several are in flight, so they are async spans, not nested ones.
  for (const StepSpan& s : steps) {
    const std::string name = "micro-batch " + std::to_string(s.micro_batch);
    events.push_back({{"name", name}, {"cat", "step"}, {"ph", "b"}, {"id", s.micro_batch}, {"pid", 0},
                      {"tid", 1}, {"ts", round3(s.start_us)}});
    events.push_back({{"name", name}, {"cat", "step"}, {"ph", "e"}, {"id", s.micro_batch}, {"pid", 0},
                      {"tid", 1}, {"ts", round3(s.end_us)}});
    events.push_back({{"name", "kv_blocks_used"}, {"ph", "C"}, {"pid", 0}, {"ts", round3(s.end_us)},
                      {"args", {{"blocks", s.blocks_used}}}});
  }
  events.push_back({{"name", "measured window starts"}, {"ph", "i"}, {"s", "g"}, {"pid", 0}, {"tid", 0},
                    {"ts", round3(measure_from_us)}});
  events.push_back({{"name", "measured window ends"}, {"ph", "i"}, {"s", "g"}, {"pid", 0}, {"tid", 0},
                    {"ts", round3(measure_to_us)}});
  return ordered_json{{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

}  // namespace kvpipe
