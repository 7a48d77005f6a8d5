// A `kvpipe generate` run as the multi-rank tests compare it with another: every request's
// output tokens (its JSON lines on stdout) and every step's full-vocabulary
// log-probabilities (its --logprobs-out file).
#pragma once

#include "tests/support/command.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kvpipe::testing {

struct JobRun {
  CommandResult result;
  std::map<int64_t, std::vector<int64_t>> outputs;                      // id -> tokens
  std::map<std::pair<int64_t, int64_t>, std::vector<double>> logprobs;  // (id, step)
};

// The run `result` of a generate that wrote its log-probabilities to `logprobs_file`
// (nothing parsed when it failed).
inline JobRun parse_job_run(CommandResult result, const std::filesystem::path& logprobs_file) {
  JobRun run;
  run.result = std::move(result);
  if (run.result.code != 0) return run;
  std::istringstream lines(run.result.out);
  std::string line;
  while (std::getline(lines, line)) {
    const auto j = nlohmann::json::parse(line);
    run.outputs[j["id"]] = j["output_ids"].get<std::vector<int64_t>>();
  }
  std::ifstream in(logprobs_file);
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    run.logprobs[{j["id"], j["step"]}] = j["logprobs"].get<std::vector<double>>();
  }
  return run;
}

// The largest |difference| between two runs' log-probabilities over every step of every
// request and the whole vocabulary; std::runtime_error when their steps or vocabularies differ.
inline double max_logprob_difference(const JobRun& run, const JobRun& reference) {
  if (run.logprobs.size() != reference.logprobs.size())
    throw std::runtime_error("the runs have " + std::to_string(run.logprobs.size()) + " and " +
                             std::to_string(reference.logprobs.size()) + " steps");
  double worst = 0;
  for (const auto& [key, want] : reference.logprobs) {
    const auto it = run.logprobs.find(key);
    if (it == run.logprobs.end() || it->second.size() != want.size())
      throw std::runtime_error("request " + std::to_string(key.first) + " step " + std::to_string(key.second) +
                               " is missing or has another vocabulary");
    for (size_t v = 0; v < want.size(); ++v) worst = std::max(worst, std::abs(it->second[v] - want[v]));
  }
  return worst;
}

}  // namespace kvpipe::testing
