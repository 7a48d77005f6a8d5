#include "launch/tune/tune.h"

#include "launch/job_config.h"
#include "launch/job_plan.h"
#include "launch/output.h"
#include "launch/signals.h"
#include "launch/slurm_script.h"
#include "launch/tune/candidate_runner.h"
#include "launch/tune/lossy_cost.h"
#include "launch/tune/tune_report.h"
#include "launch/tune/tune_search.h"
#include "launch/tune/tune_space.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <stdexcept>

namespace kvpipe {
namespace {

std::string workload_line(const JobConfig& job) {
  const WorkloadSection& w = job.workload;
  std::string line = w.dataset == "random" ? "random token ids" : "dataset " + w.dataset + ", mode " + w.mode;
  line += ", " + std::to_string(w.requests) + (w.mode == "multi_turn" ? " conversations" : " requests") +
          ", concurrency " + std::to_string(w.concurrency);
  if (w.rate > 0) line += ", rate " + std::to_string(w.rate) + "/s";
  return line;
}

}  // namespace

void tune(const TuneOptions& o) {
  // Started as one of several ranks (mpirun, srun): each would run the whole search.
  const auto launched_size = [](const char* name) {
    const char* v = std::getenv(name);
    return v ? std::atoi(v) : 0;
  };
  if (launched_size("OMPI_COMM_WORLD_SIZE") > 1 || launched_size("PMI_SIZE") > 1)
    throw std::invalid_argument("tune: run it alone, not under mpirun: it starts every candidate itself "
                                "(with --ranks N under mpirun)");
  if (o.ranks < 1) throw std::invalid_argument("--ranks: expected an integer >= 1");
  if (!(o.budget_min > 0) || !std::isfinite(o.budget_min))
    throw std::invalid_argument("--budget: expected a positive number of minutes");
  if (o.screen_requests < 0) throw std::invalid_argument("--screen-requests: expected an integer >= 0");
  TuneSearchOptions search;
  search.objective = parse_tune_objective(o.objective);
  if (!o.slo.empty()) search.slo = parse_tune_slo(o.slo);
  search.budget_s = o.budget_min * 60.0;

  throw_if_problems(validate_job_config_file(o.config, o.overrides, o.ranks));
  const JobConfig job = load_job_config(o.config, o.overrides);
  const JobPlan plan = plan_job(job, o.ranks);

  TuneSpaceInputs space_in;
  space_in.job = &job;
  space_in.model = plan.model;
  space_in.ranks = o.ranks;
  space_in.allow_lossy = o.allow_lossy;
  space_in.longest_request = job.workload.dataset == "random"
                                 ? std::min<int64_t>(plan.longest_request,
                                                     job.workload.prompt_len.hi + job.workload.output_len.hi)
                                 : plan.longest_request;
  const std::vector<TuneKnob> knobs = select_knobs(tune_space(space_in), o.keys, o.allow_lossy);

  const int full = job.workload.requests;
  int screen = o.screen_requests > 0 ? o.screen_requests
                                     : std::max(2 * job.workload.concurrency, (full + 3) / 4);
  screen = std::min(screen, full);
  search.full_over_screen = static_cast<double>(full) / screen;

  std::filesystem::create_directories(o.out_dir);
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [start] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };

  CandidateRunnerOptions runner_options;
  runner_options.kvpipe = current_executable();
  runner_options.config = o.config;
  runner_options.overrides = o.overrides;
  runner_options.ranks = o.ranks;
  runner_options.out_dir = o.out_dir;
  runner_options.screen_requests = screen;
  runner_options.full_requests = full;
  CandidateRunner runner(runner_options);

  std::unique_ptr<LossyProbe> probe;
  if (o.allow_lossy) {
    LossyProbeOptions p;
    p.kvpipe = runner_options.kvpipe;
    p.config = o.config;
    p.overrides = o.overrides;
    p.dir = (std::filesystem::path(o.out_dir) / "probe").string();
    probe = std::make_unique<LossyProbe>(job, plan.longest_request, p);
  }

  std::fprintf(stderr, "tune: %s on %d rank(s), %zu knobs, %s, budget %.1f min; screening runs of %d of %d requests\n",
               o.config.c_str(), o.ranks, knobs.size(), objective_name(search.objective).c_str(), o.budget_min,
               screen, full);
  TuneSearchHooks hooks;
  hooks.elapsed_s = elapsed;
  hooks.check = [&](const TuneSettings& settings) -> TuneCheck {
    std::vector<std::string> sets = o.overrides;
    for (const auto& [k, v] : settings) sets.push_back(k + "=" + v);
    TuneCheck check;
    try {
      const JobConfig candidate = load_job_config(o.config, sets);
      const std::vector<ConfigProblem> problems = check_job_for_ranks(candidate, o.ranks);
      if (!problems.empty()) {
        check.problem = problems.front().message;
        return check;
      }
      check.fingerprint = run_fingerprint(candidate, plan_job(candidate, o.ranks));
    } catch (const JobConfigError& e) {
      check.problem = e.problems().empty() ? e.what() : e.problems().front().message;
    } catch (const std::exception& e) {
      check.problem = e.what();
    }
    return check;
  };
  hooks.run = [&](const TuneCandidate& c, double deadline_s) { return runner.run(c, deadline_s - elapsed()); };
  if (probe)
    hooks.lossy_cost = [&](const TuneCandidate& c) {
      return probe->measure(c, std::max(1.0, search.budget_s - elapsed()));
    };
  hooks.progress = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };

  const TuneOutcome outcome = tune_search(knobs, search, hooks);

  TuneReportInputs report;
  report.config = o.config;
  report.overrides = o.overrides;
  report.ranks = o.ranks;
  report.search = search;
  report.allow_lossy = o.allow_lossy;
  report.screen_requests = screen;
  report.full_requests = full;
  report.workload = workload_line(job);
  report.elapsed_s = elapsed();
  report.command = o.command;
  write_tune_report(o.out_dir, outcome, report);

  const std::string dir = o.out_dir;
  std::fprintf(stderr, "tune: %d runs in %.1f min (%s); %s/report.md, candidates.csv, plot.svg\n", runner.runs(),
               elapsed() / 60.0, outcome.end_reason.c_str(), dir.c_str());
  if (stop_requested()) return;
  if (outcome.baseline >= 0 && !outcome.candidates[static_cast<size_t>(outcome.baseline)].measured())
    throw JobFailure("tune: the job as given failed: " + outcome.candidates[static_cast<size_t>(outcome.baseline)].status +
                     " (" + dir + "/runs/000/stderr.txt)");
  if (outcome.winner < 0)
    throw JobFailure("tune: no configuration met --slo " + slo_text(search.slo) + "; " + dir + "/report.md lists them");
  const TuneCandidate& w = outcome.candidates[static_cast<size_t>(outcome.winner)];
  if (outcome.rejected_winner >= 0) {
    std::printf("tune: nothing beat the job as given on the whole workload: the screening winner, %s, gained %.1f%% "
                "(range %.1f%% to %.1f%% over %d pair(s) of full runs); %s/tuned.yaml is the job\n",
                outcome.candidates[static_cast<size_t>(outcome.rejected_winner)].label().c_str(), 100 * outcome.gain,
                100 * outcome.gain_min, 100 * outcome.gain_max, outcome.gain_pairs, dir.c_str());
  } else if (outcome.winner_is_job) {
    std::printf("tune: nothing beat the job as given; %s/tuned.yaml is the job\n", dir.c_str());
  } else {
    std::printf("tune: best %s: %s", objective_name(search.objective).c_str(), w.label().c_str());
    if (outcome.gain_pairs > 0)
      std::printf(", %.1f%% better than the job as given (range %.1f%% to %.1f%% over %d pair(s) of full runs)",
                  100 * outcome.gain, 100 * outcome.gain_min, 100 * outcome.gain_max, outcome.gain_pairs);
    std::printf("\ntune: %s/tuned.yaml\n", dir.c_str());
  }
  std::fflush(stdout);
}

}  // namespace kvpipe
