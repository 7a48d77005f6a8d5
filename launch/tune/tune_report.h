// TuneReport: what `kvpipe tune` leaves in its output directory.
//
// - candidates.csv: one line per candidate (its settings, phase, run count, median figures,
//   the objective's range over its runs, its lossy cost, its status, its run directories);
// - plot.svg: the objective against the KV memory each candidate used at its peak, every
//   point labelled with what it changed (drawn here: no plotting library is packaged for C++
//   on these machines, and an SVG scatter is a few dozen lines);
// - report.md: the result (job as given against tuned, the gain with its spread over the
//   alternating full runs), the candidates' table, the plot, what the search visited;
// - tuned.yaml: the job file with the winner's settings applied (written only when a
//   candidate met the SLO).
#pragma once

#include "launch/tune/tune_search.h"

#include <string>
#include <vector>

namespace kvpipe {

struct TuneReportInputs {
  std::string config;                  // the job file as given
  std::vector<std::string> overrides;  // the user's --set
  int ranks = 1;
  TuneSearchOptions search;
  bool allow_lossy = false;
  int screen_requests = 0, full_requests = 0;
  std::string workload;                // one line: what the workload is
  double elapsed_s = 0.0;
  std::string command;                 // the tune command line, for the report
};

std::string tune_candidates_csv(const TuneOutcome& outcome, TuneObjective objective);
std::string tune_plot_svg(const TuneOutcome& outcome, TuneObjective objective);
std::string tune_report_markdown(const TuneOutcome& outcome, const TuneReportInputs& inputs);
// The job file with the winner's settings (after the user's overrides); empty without a winner.
std::string tuned_yaml(const TuneOutcome& outcome, const TuneReportInputs& inputs);

// Writes the four files into `dir`; returns the paths written.
std::vector<std::string> write_tune_report(const std::string& dir, const TuneOutcome& outcome,
                                           const TuneReportInputs& inputs);

}  // namespace kvpipe
