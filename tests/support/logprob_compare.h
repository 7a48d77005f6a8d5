// Step-by-step comparison of greedy runs: kvpipe's `--logprobs-out` lines against a reference
// engine's lines of the same shape ({"step", "token", "logprobs": [full vocabulary]}).
//
// At every step the full-vocabulary log-probabilities must agree within a tolerance while the
// chosen tokens agree. A different choice is accepted only at a near-tie (the reference's top
// two within `tie_tolerance`), after which the runs no longer share a context and the
// comparison stops there.
#pragma once

#include "tests/support/command.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace kvpipe::testing {

struct LogprobStep {
  int64_t token = -1;
  std::vector<double> logprobs;  // -inf where the engine reports probability 0 (null)
};

inline std::vector<LogprobStep> parse_logprob_steps(const std::string& text) {
  std::vector<LogprobStep> steps;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    LogprobStep s;
    s.token = j.at("token").get<int64_t>();
    for (const auto& v : j.at("logprobs"))
      s.logprobs.push_back(v.is_null() ? -std::numeric_limits<double>::infinity() : v.get<double>());
    steps.push_back(std::move(s));
  }
  return steps;
}

struct LogprobComparison {
  double max_delta = 0;   // over the compared steps
  int compared = 0;       // steps compared
  int diverged_at = -1;   // step of an accepted near-tie divergence
  std::string failure;    // empty when the runs agree
};

inline LogprobComparison compare_logprob_steps(const std::vector<LogprobStep>& ours,
                                               const std::vector<LogprobStep>& ref, size_t steps,
                                               double tolerance, double tie_tolerance) {
  LogprobComparison c;
  if (ours.size() != steps || ref.size() != steps) {
    c.failure = "expected " + std::to_string(steps) + " steps, kvpipe gave " +
                std::to_string(ours.size()) + ", the reference " + std::to_string(ref.size());
    return c;
  }
  for (size_t i = 0; i < steps; ++i) {
    const LogprobStep &a = ours[i], &b = ref[i];
    if (a.logprobs.size() != b.logprobs.size()) {
      c.failure = "step " + std::to_string(i) + ": vocabulary sizes differ (" +
                  std::to_string(a.logprobs.size()) + " vs " + std::to_string(b.logprobs.size()) + ")";
      return c;
    }
    double worst = 0;
    size_t worst_at = 0;
    for (size_t t = 0; t < a.logprobs.size(); ++t) {
      const double d = std::isfinite(b.logprobs[t]) && std::isfinite(a.logprobs[t])
                           ? std::abs(a.logprobs[t] - b.logprobs[t])
                           : std::numeric_limits<double>::infinity();
      if (d > worst) worst = d, worst_at = t;
    }
    c.max_delta = std::max(c.max_delta, worst);
    ++c.compared;
    if (worst > tolerance) {
      c.failure = "step " + std::to_string(i) + ": |logprob difference| " + std::to_string(worst) +
                  " at token " + std::to_string(worst_at) + " exceeds " + std::to_string(tolerance);
      return c;
    }
    if (a.token != b.token) {
      const double gap = std::abs(b.logprobs[a.token] - b.logprobs[b.token]);
      if (gap >= tie_tolerance) {
        c.failure = "step " + std::to_string(i) + ": kvpipe chose " + std::to_string(a.token) +
                    ", the reference " + std::to_string(b.token) + " with log-probabilities " +
                    std::to_string(gap) + " apart (not a near-tie)";
        return c;
      }
      c.diverged_at = static_cast<int>(i);  // the contexts differ from here on
      return c;
    }
  }
  return c;
}

// "max |dlogprob| 1.2e-06 over 32 steps[, near-tie divergence at step 9]"
inline std::string summary(const LogprobComparison& c) {
  char text[96];
  std::snprintf(text, sizeof text, "max |dlogprob| %.3g over %d steps", c.max_delta, c.compared);
  return text + (c.diverged_at >= 0 ? ", near-tie divergence at step " + std::to_string(c.diverged_at) : "");
}

// Writes `dir`/job.yaml: one greedy request of `steps` new tokens (EOS ignored) for the
// comma-separated `prompt`, float32 weights, one thread.
inline void write_greedy_job(const std::filesystem::path& dir, const std::string& model,
                             const std::string& prompt, int steps) {
  std::ofstream job(dir / "job.yaml");
  job << "model: {path: " << model << ", dtype: float32}\n"
      << "runtime: {threads: 1}\n"
      << "cache: {block_size: 16, memory: 16MiB}\n"
      << "sampling: {temperature: 0.0, ignore_eos: true}\n"
      << "requests: [{prompt_ids: [" << prompt << "], max_new_tokens: " << steps << "}]\n";
}

struct KvpipeLogprobRun {
  CommandResult result;  // of `kvpipe generate`
  std::string command;
  std::vector<LogprobStep> steps;
};

// Runs `dir`/job.yaml with `model` on `ranks` ranks (through `mpirun` when more than one) and
// reads back its --logprobs-out lines.
inline KvpipeLogprobRun run_kvpipe_logprobs(const std::string& kvpipe, const std::string& mpirun,
                                            const std::filesystem::path& dir, const std::string& model,
                                            int ranks) {
  KvpipeLogprobRun run;
  const std::filesystem::path lp = dir / ("kvpipe_" + std::to_string(ranks) + ".jsonl");
  run.command = kvpipe + " generate --config " + (dir / "job.yaml").string() + " --set model.path=" + model +
                " --logprobs-out " + lp.string();
  if (ranks > 1) run.command = mpirun + " --oversubscribe -np " + std::to_string(ranks) + " " + run.command;
  run.result = run_command(run.command, dir);
  run.steps = parse_logprob_steps(slurp(lp));
  return run;
}

}  // namespace kvpipe::testing
