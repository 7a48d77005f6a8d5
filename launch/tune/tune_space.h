// TuneSpace: the settings `kvpipe tune` may change, and the values it tries for each.
//
// Owns which job keys are knobs (the KV-cache strategies, the scheduler's batch and step
// sizes, the pipeline's micro-batches and split, speculative decoding), the candidate values
// of each for a given job, model and rank count, and which values change what the model
// outputs (a narrower cache dtype than the compute dtype, a window): those are offered only
// when the caller allows lossy strategies. Every value is YAML text for `--set KEY=VALUE`;
// the job's own value is always among a knob's values, and marked as its current one.
#pragma once

#include "engine/model/model_config.h"
#include "launch/job_config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace kvpipe {

struct JobPlan;

struct TuneValue {
  std::string yaml;    // as --set takes it: "32", "true", "q8_0", "{sinks: 4, recent: 256}"
  bool lossy = false;  // changes the model's outputs against the job's own value
};

struct TuneKnob {
  std::string key;               // the job key, e.g. "cache.block_size"
  std::vector<TuneValue> values; // in scan order; values[current] is the job's own value
  size_t current = 0;
  // Values on a scale (batch sizes, block sizes): the search walks outward from the job's
  // value and stops a direction once it gets worse, instead of trying every value.
  bool ordered = false;
  // Not tried while the setting `unless_key` holds the value `unless_value` (the number of
  // draft tokens while speculative decoding is off); `unless_job` is the job's own value of
  // `unless_key`, for when that key is not searched itself (--keys).
  std::string unless_key, unless_value, unless_job;
  // A value other than the job's also sets `reset_key` to `reset_value` (`reset_job`: the
  // job's own value of it): tensor ranks change the number of stages, and a pinned layer split
  // is one for the job's stage count, so other tensor values are tried with parallel.layers auto.
  std::string reset_key, reset_value, reset_job;
};

struct TuneSpaceInputs {
  const JobConfig* job = nullptr;
  ModelConfig model;
  int ranks = 1;
  bool allow_lossy = false;
  // The longest request of the workload (tokens): a window only where it would drop some.
  int64_t longest_request = 0;
};

// The knobs, most influential first (the order coordinate descent visits them).
std::vector<TuneKnob> tune_space(const TuneSpaceInputs& inputs);

// Every key tune_space may return, in its order.
const std::vector<std::string>& tune_keys();

// Keeps only the knobs of `keys` (--keys). std::invalid_argument naming --keys for a key that
// is not a tuning key, a lossy one without `allow_lossy`, or one with nothing to try here.
std::vector<TuneKnob> select_knobs(std::vector<TuneKnob> knobs, const std::vector<std::string>& keys,
                                   bool allow_lossy);

// The job's value of `key` as YAML (one of the keys tune_space returns).
std::string job_value_yaml(const JobConfig& job, const std::string& key);

// How the job runs, as one line: every tuned setting with `auto` and no-op values resolved
// (the stages' layer counts, micro-batches, the cache dtype, the batch limit the requests in
// flight can reach, a prefill limit at or above the step limit, draft settings while
// speculative decoding is off). Two configurations with the same fingerprint run alike, so
// the search measures only one of them.
std::string run_fingerprint(const JobConfig& job, const JobPlan& plan);

}  // namespace kvpipe
