// Workload: the synthetic requests of `kvpipe bench` and the way they arrive.
//
// make_workload draws each request's prompt and output lengths (fixed, uniform in a range,
// or from a file of lengths) and its prompt tokens, all from the workload's seed, so the
// same config always yields the same requests, whatever the rank count. A shared-prefix
// fraction makes the first tokens of every prompt common to all requests (the case prefix
// caching serves). WorkloadSource feeds them to the engine while it runs: closed loop (a
// new request as soon as fewer than `concurrency` are unfinished) or open loop (Poisson
// arrivals at `rate` per second, still at most `concurrency` unfinished: a request due
// while the engine is full waits, and its latency counts from when it was due).
#pragma once

#include "engine/engine.h"
#include "launch/job_config.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

namespace kvpipe {

struct WorkloadRequest {
  std::vector<int64_t> prompt;
  int64_t output_len = 0;
  double arrival_s = 0.0;  // due time after the measured phase starts (open loop)
};

// `count` requests starting at index `first` of the workload's stream (warm-up requests
// take the first indices). Token ids are drawn from [0, vocab).
std::vector<WorkloadRequest> make_workload(const WorkloadSection& workload, int64_t vocab, int64_t first,
                                           int64_t count);

// Open loop: when each of `count` requests is due after the measured phase starts (Poisson
// arrivals at workload.rate, the first at once); all zeros in closed loop.
std::vector<double> arrival_times(const WorkloadSection& workload, int64_t count);

// Throws std::invalid_argument (naming the job file) when the longest prompt plus the longest
// output exceed `context` tokens.
void check_workload_fits(const JobConfig& job, int64_t context);

class WorkloadSource : public RequestSource {
 public:
  // `rate` 0: closed loop; otherwise request i is due `arrival_s[i]` seconds after `start`.
  WorkloadSource(std::vector<Request> requests, std::vector<double> arrival_s, int64_t concurrency,
                 double rate, Clock::time_point start);
  void poll(Engine& engine, Clock::time_point now) override;
  bool exhausted() const override { return next_ >= requests_.size(); }
  std::optional<Clock::time_point> next_arrival() const override;

 private:
  Clock::time_point due(size_t i) const;

  std::vector<Request> requests_;
  std::vector<double> arrival_s_;
  int64_t concurrency_;
  bool open_loop_;
  Clock::time_point start_;
  size_t next_ = 0;
};

}  // namespace kvpipe
