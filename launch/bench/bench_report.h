// The arithmetic of `kvpipe bench` reports: distributions, per-rank time breakdowns and
// the Chrome trace, kept apart from the run so that tests can check them on known inputs.
//
// Percentiles interpolate linearly between order statistics (numpy's default), so p50 of
// an even count is the mean of the middle two. A rank's breakdown over a window clips every
// span to it: wait, comm (send + receive) and idle are measured, compute is the rest, so the
// four fractions sum to 1.
#pragma once

#include "launch/job_config.h"
#include "parallel/trace_recorder.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace kvpipe {

struct Distribution {
  int64_t count = 0;
  double mean = 0, median = 0, p90 = 0, p99 = 0, min = 0, max = 0;
};

// `v` rounded to 3 decimals, as report.json keeps its figures.
double round3(double v);
// To the microsecond: a run's duration, which rates are derived from (a run of a few tens
// of milliseconds rounded to the millisecond would be off by a percent or more).
double round6(double v);

// q in [0, 1] of already sorted values; 0 when empty.
double percentile(const std::vector<double>& sorted, double q);
Distribution summarize(std::vector<double> values);
nlohmann::ordered_json to_json(const Distribution& d);

// report.json's "workload" section: the loop mode, lengths, prefix, concurrency, rate, seed.
nlohmann::ordered_json workload_json(const WorkloadSection& w);

// Writes `j` to `path` (`indent` as json::dump): invalid_argument naming --out and the path if
// it cannot be opened, JobFailure naming the path if a write fails.
void write_json(const std::string& path, const nlohmann::ordered_json& j, int indent);

struct RankBreakdown {
  double compute = 0, comm = 0, wait = 0, idle = 0;  // fractions of total_s
  double total_s = 0;
};

// The spans of one rank, clipped to [from_us, to_us).
RankBreakdown breakdown(const std::vector<TraceSpan>& spans, double from_us, double to_us);

// A micro-batch as rank 0 saw it end to end, in microseconds since the trace epoch.
struct StepSpan {
  int64_t micro_batch = 0;
  double start_us = 0, end_us = 0;
  int64_t blocks_used = 0;
};

// Chrome trace-event JSON (Perfetto and chrome://tracing open it): one process track per
// rank named by `rank_names`, a span per compute/send/receive/wait/idle, rank 0's
// micro-batches end to end as async spans, KV blocks in use as a counter, and instant
// events marking the measured window.
nlohmann::ordered_json chrome_trace(const std::vector<std::vector<TraceSpan>>& ranks,
                                    const std::vector<std::string>& rank_names,
                                    const std::vector<StepSpan>& steps, double measure_from_us,
                                    double measure_to_us);

}  // namespace kvpipe
