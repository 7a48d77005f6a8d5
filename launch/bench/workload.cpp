#include "launch/bench/workload.h"

#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>

namespace kvpipe {
namespace {

// A stream per (seed, purpose, index), so that one request's draws do not depend on how
// many numbers the others drew.
uint64_t stream_seed(uint64_t seed, uint64_t purpose, uint64_t index) {
  return splitmix64(splitmix64(splitmix64(seed) ^ purpose) ^ index);
}

int64_t draw_length(const LengthRange& r, std::mt19937_64& rng, int64_t index) {
  if (!r.values.empty()) return r.values[static_cast<size_t>(index) % r.values.size()];
  if (r.lo == r.hi) return r.lo;
  // Modulo bias is below 2^-40 for these ranges; this keeps the draw the same on every
  // standard library, which std::uniform_int_distribution does not promise.
  return r.lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(r.hi - r.lo + 1));
}

enum Purpose : uint64_t { kLengths = 1, kTokens = 2, kPrefix = 3, kArrivals = 4 };

}  // namespace

std::vector<WorkloadRequest> make_workload(const WorkloadSection& w, int64_t vocab, int64_t first, int64_t count) {
  std::vector<int64_t> common;
  if (w.shared_prefix > 0) {
    std::mt19937_64 rng(stream_seed(w.seed, kPrefix, 0));
    common.resize(static_cast<size_t>(w.prompt_len.hi));
    for (int64_t& t : common) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab));
  }
  const std::vector<double> due = arrival_times(w, count);
  std::vector<WorkloadRequest> out;
  for (int64_t i = first; i < first + count; ++i) {
    std::mt19937_64 lengths(stream_seed(w.seed, kLengths, static_cast<uint64_t>(i)));
    WorkloadRequest r;
    const int64_t prompt_len = draw_length(w.prompt_len, lengths, i);
    r.output_len = draw_length(w.output_len, lengths, i);
    const auto shared = static_cast<int64_t>(std::floor(w.shared_prefix * static_cast<double>(prompt_len)));
    std::mt19937_64 tokens(stream_seed(w.seed, kTokens, static_cast<uint64_t>(i)));
    r.prompt.resize(static_cast<size_t>(prompt_len));
    for (int64_t k = 0; k < prompt_len; ++k)
      r.prompt[k] = k < shared ? common[k] : static_cast<int64_t>(tokens() % static_cast<uint64_t>(vocab));
    r.arrival_s = due[static_cast<size_t>(i - first)];
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<double> arrival_times(const WorkloadSection& w, int64_t count) {
  // Poisson arrivals: exponential gaps, the first request due at once.
  std::mt19937_64 arrivals(stream_seed(w.seed, kArrivals, 0));
  std::exponential_distribution<double> gap(w.rate > 0 ? w.rate : 1.0);
  std::vector<double> due(static_cast<size_t>(std::max<int64_t>(count, 0)), 0.0);
  double t = 0.0;
  for (size_t i = 1; i < due.size() && w.rate > 0; ++i) due[i] = t += gap(arrivals);
  return due;
}

void check_workload_fits(const JobConfig& job, int64_t context) {
  const WorkloadSection& w = job.workload;
  const int64_t longest = static_cast<int64_t>(w.prompt_len.hi) + w.output_len.hi;
  if (longest > context)
    throw std::invalid_argument(job.source + ": workload.prompt_len + workload.output_len reach " +
                                std::to_string(longest) + " tokens, more than the model's context of " +
                                std::to_string(context));
}

WorkloadSource::WorkloadSource(std::vector<Request> requests, std::vector<double> arrival_s, int64_t concurrency,
                               double rate, Clock::time_point start)
    : requests_(std::move(requests)),
      arrival_s_(std::move(arrival_s)),
      concurrency_(concurrency),
      open_loop_(rate > 0),
      start_(start) {}

Clock::time_point WorkloadSource::due(size_t i) const {
  return start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(arrival_s_.at(i)));
}

void WorkloadSource::poll(Engine& engine, Clock::time_point now) {
  while (next_ < requests_.size() && engine.unfinished() < concurrency_) {
    Request r = requests_[next_];
    if (open_loop_) {
      if (due(next_) > now) break;
      r.arrival_time = due(next_);
    } else {
      r.arrival_time = now;
    }
    engine.add(r);
    ++next_;
  }
}

std::optional<Clock::time_point> WorkloadSource::next_arrival() const {
  if (!open_loop_ || exhausted()) return std::nullopt;
  return due(next_);
}

}  // namespace kvpipe
