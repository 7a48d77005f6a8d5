// `kvpipe tune`: the KV-cache and scheduling settings that serve the job's own workload best
// on this machine, measured.
//
// Owns the sub-command: it checks the job, lays out the search space (tune_space.h), runs the
// search (tune_search.h) with each measurement a `kvpipe bench` process of its own
// (candidate_runner.h; under mpirun for --ranks N), measures what lossy strategies cost in
// log-probability when they are allowed (lossy_cost.h), and writes DIR/candidates.csv,
// DIR/report.md with plot.svg, and DIR/tuned.yaml (tune_report.h). It never runs past
// --budget: every run is stopped at the budget's end. It must not itself run under mpirun.
#pragma once

#include <string>
#include <vector>

namespace kvpipe {

struct TuneOptions {
  std::string config;
  std::vector<std::string> overrides;
  std::string out_dir;
  int ranks = 1;
  std::string objective = "e2e";
  std::string slo;                 // "ttft_p99=MS,tpot_p99=MS"; empty: none
  double budget_min = 30.0;
  bool allow_lossy = false;
  std::vector<std::string> keys;   // search only these (--keys); empty: every one
  int screen_requests = 0;         // 0: a quarter of the workload's requests, at least 2 x concurrency
  std::string command;             // the command line, for the report
};

// std::invalid_argument for bad input (exit 2); JobFailure when the job as given fails or no
// candidate meets the SLO (exit 1, after the reports are written).
void tune(const TuneOptions& options);

}  // namespace kvpipe
