// CandidateRunner: one `kvpipe bench` process per measurement of a `kvpipe tune` candidate.
//
// Owns the command line (the job file, the user's --set overrides, the candidate's settings,
// the run's request count; under `mpirun --oversubscribe -np N` for more than one rank), the
// run's directory (DIR/runs/NNN: report.json, requests.csv, stdout.txt, stderr.txt), and the
// child's lifetime: it runs in a process group of its own, which is stopped (SIGTERM, then
// SIGKILL after 10 s) at the deadline or when kvpipe tune itself is asked to stop, so no
// process outlives the tune. Separate processes keep candidates from sharing a heap, a
// thread pool or an MPI world, and give each the start-up a user's job has.
#pragma once

#include "launch/tune/tune_search.h"

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <vector>

namespace kvpipe {

struct ProcessOutcome {
  bool started = false;
  bool killed = false;     // stopped at the deadline or on a stop request
  int exit_code = -1;      // when it exited; 128 + the signal when a signal ended it
  double wall_s = 0.0;
  std::string error;       // why it could not start
};

// Runs `argv` (argv[0] looked up in PATH) with stdin from /dev/null and stdout/stderr into
// the two files, until it exits or `timeout_s` passes.
ProcessOutcome run_process(const std::vector<std::string>& argv, const std::string& stdout_path,
                           const std::string& stderr_path, double timeout_s);

// The figures tune compares, from a bench report.json; std::invalid_argument when one is missing.
TuneFigures tune_figures_from_report(const nlohmann::json& report);

struct CandidateRunnerOptions {
  std::string kvpipe;                  // this executable
  std::string mpirun = "mpirun";
  std::string config;                  // the job file
  std::vector<std::string> overrides;  // the user's --set, before the candidate's settings
  int ranks = 1;
  std::string out_dir;                 // runs go to out_dir/runs/NNN
  int screen_requests = 0;             // workload.requests of a screening run
  int full_requests = 0;               // the job's own
};

class CandidateRunner {
 public:
  explicit CandidateRunner(CandidateRunnerOptions options) : o_(std::move(options)) {}

  // The whole command of one run of `candidate` into `dir`.
  std::vector<std::string> command(const TuneCandidate& candidate, const std::string& dir) const;
  // The --set list of `candidate` (the user's overrides, then its settings, then its size).
  std::vector<std::string> overrides(const TuneCandidate& candidate) const;
  // One run; `deadline_s` is seconds from now.
  TuneRunResult run(const TuneCandidate& candidate, double deadline_s);
  int runs() const { return next_; }

 private:
  CandidateRunnerOptions o_;
  int next_ = 0;
};

}  // namespace kvpipe
