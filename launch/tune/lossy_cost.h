// LossyCost measurement: what a strategy that changes outputs (a narrower cache dtype, a
// window) costs in log-probability on the job's own workload.
//
// Owns the probe: the workload's first prompts (random ids, a dataset's first questions, or a
// multi_turn conversation's whole history, where a window drops the most), written as a
// `kvpipe generate` job of greedy requests (DIR/probe/probe.yaml), run once as given and once
// per lossy candidate with --logprobs-out. The two generations are compared token by token
// while they agree: the KL divergence of the candidate's next-token distribution from the
// job's, and the share of tokens generated before the first difference. One rank, whatever
// the job's, since the cache's dtype and window do not depend on the split.
#pragma once

#include "launch/job_config.h"
#include "launch/tune/tune_search.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kvpipe {

// The first `count` prompts of the job's workload (token ids), each at most `max_tokens` long.
std::vector<std::vector<int64_t>> probe_prompts(const JobConfig& job, int64_t context, int count,
                                                int64_t max_tokens);

// One generated token's record of a --logprobs-out file.
struct ProbeToken {
  int64_t token = 0;
  std::vector<double> logprobs;
};

// Reads a --logprobs-out file: request id -> its tokens in order.
std::vector<std::pair<int64_t, std::vector<ProbeToken>>> read_probe_logprobs(const std::string& path);

// Compares a candidate's greedy generations with the job's (both from read_probe_logprobs).
LossyCost compare_generations(const std::vector<std::pair<int64_t, std::vector<ProbeToken>>>& job,
                              const std::vector<std::pair<int64_t, std::vector<ProbeToken>>>& candidate);

struct LossyProbeOptions {
  std::string kvpipe;                  // this executable
  std::string config;
  std::vector<std::string> overrides;  // the user's --set
  std::string dir;                     // DIR/probe
  int prompts = 4;
  int new_tokens = 16;
};

class LossyProbe {
 public:
  // Writes the probe job; std::invalid_argument for a workload it cannot read.
  LossyProbe(const JobConfig& job, int64_t context, LossyProbeOptions options);
  // The candidate's cost; `timeout_s` bounds each generate run.
  LossyCost measure(const TuneCandidate& candidate, double timeout_s);

 private:
  std::string generate(const TuneSettings& settings, const std::string& name, double timeout_s, std::string* error);

  LossyProbeOptions o_;
  std::string probe_config_;
  std::optional<std::vector<std::pair<int64_t, std::vector<ProbeToken>>>> job_tokens_;
};

}  // namespace kvpipe
