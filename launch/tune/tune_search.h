// TuneSearch: which configurations `kvpipe tune` measures, in what order, and which wins.
//
// Coordinate descent from the job as given: the knobs (tune_space.h) are visited in turn,
// each value tried with the others held at the best found so far; a knob on a scale is
// walked outward from its value and a direction is left at the first step that does not
// help (batch sizes "until latency plateaus"). Screening runs are short (fewer requests than
// the job's workload). Two candidates whose figures lie within the noise measured on the job
// itself are measured again, up to `max_repeats` runs each, and compared by their medians.
// A candidate whose median breaks the SLO is never the winner. The winner and the job as
// given are then measured on the whole workload, alternately, for the reported gain and its
// spread; a winner that does no better than the job there is not reported (the job as given
// stands). Nothing starts that the budget cannot finish: a run is only begun when the time
// left covers it (its estimate from the runs before) and the final comparison. A screening
// run that takes `slow_cut` times the job's own is stopped and its candidate dropped.
//
// The search runs nothing itself: hooks run a candidate, check it, and measure its cost in
// log-probability, so that tests can drive it with synthetic figures.
#pragma once

#include "launch/tune/tune_space.h"

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kvpipe {

enum class TuneObjective { kTtft, kTpot, kE2e, kThroughput };

// "ttft" | "tpot" | "e2e" | "throughput"; std::invalid_argument naming --objective otherwise.
TuneObjective parse_tune_objective(const std::string& text);
std::string objective_name(TuneObjective objective);   // "p99 TTFT (ms)", ...
bool lower_is_better(TuneObjective objective);

// Limits a candidate's figures must meet; 0 = none.
struct TuneSlo {
  double ttft_p99_ms = 0.0;
  double tpot_p99_ms = 0.0;
  double e2e_p99_ms = 0.0;
  bool any() const { return ttft_p99_ms > 0 || tpot_p99_ms > 0 || e2e_p99_ms > 0; }
};

// "ttft_p99=MS,tpot_p99=MS,e2e_p99=MS" (any subset); std::invalid_argument naming --slo
// and the bad item otherwise.
TuneSlo parse_tune_slo(const std::string& text);
std::string slo_text(const TuneSlo& slo);  // "ttft_p99=500,tpot_p99=50" or "none"

// One run's figures (from its report.json).
struct TuneFigures {
  double ttft_p99_ms = 0.0;
  double tpot_p99_ms = 0.0;
  double e2e_mean_ms = 0.0;
  double e2e_p99_ms = 0.0;
  double output_tokens_per_s = 0.0;
  double kv_peak_mib = 0.0;   // KV memory in use at the peak, every rank together
  double wall_s = 0.0;        // the process's whole run, start-up included
};

double objective_value(const TuneFigures& figures, TuneObjective objective);
// Empty when the figures meet the SLO, else which limit they break ("p99 TTFT 812 ms > 500").
std::string slo_breach(const TuneFigures& figures, const TuneSlo& slo);

// Key -> YAML value, the changes from the job as given, in knob order.
using TuneSettings = std::vector<std::pair<std::string, std::string>>;

// What a lossy strategy costs: greedy generations of the workload's first prompts against
// those of the job as given (lossy_cost.h).
struct LossyCost {
  double kl_mean = std::numeric_limits<double>::quiet_NaN();   // mean KL(job || candidate) per token, nats
  double kl_max = std::numeric_limits<double>::quiet_NaN();
  double token_agreement = std::numeric_limits<double>::quiet_NaN();  // share of tokens before the first difference
  int64_t tokens = 0;          // tokens compared
  std::string error;           // why it could not be measured
};

struct TuneCandidate {
  int id = 0;
  TuneSettings settings;
  std::string phase;           // "screen" (short runs) or "full" (the job's whole workload)
  bool lossy = false;
  std::vector<TuneFigures> runs;
  std::vector<std::string> run_dirs;
  std::string status;          // "" until measured; "ok", "over SLO: ...", "invalid: ...", "failed: ...",
                               // "same as #N: ..." (not run: it runs as candidate N does)
  std::string fingerprint;     // how it runs (TuneCheck), once checked
  std::optional<LossyCost> cost;

  std::string label() const;   // "job as given" or "cache.block_size=32, scheduler.max_batch=4"
  TuneFigures median() const;  // every figure's median over the runs
  bool measured() const { return !runs.empty(); }
};

// What running one candidate once gave.
struct TuneRunResult {
  bool ok = false;
  bool stopped = false;        // stopped by a signal: the search ends
  bool timed_out = false;      // killed at the deadline it was given
  TuneFigures figures;
  std::string dir;
  std::string error;           // one line, when not ok
};

struct TuneSearchOptions {
  TuneObjective objective = TuneObjective::kE2e;
  TuneSlo slo;
  double budget_s = 1800.0;
  int max_repeats = 3;          // runs of one candidate when it is within noise of another
  int final_pairs = 3;          // alternating full runs of the job and the winner, at most
  double noise_floor = 0.02;    // candidates closer than this share are always rerun
  // A screening run taking this many times the job's own is stopped there and its candidate
  // dropped (a layer-level reuse that recomputes most layers at every step can be 30x slower):
  // the budget goes to candidates that can win.
  double slow_cut = 3.0;
  // How much longer a full run takes than a screening one (requests ratio); 1: the screening
  // runs are the whole workload and the final comparison reuses them.
  double full_over_screen = 1.0;
};

// Whether a configuration can run, and how it runs: candidates with the same non-empty
// fingerprint run alike (run_fingerprint), so only the first of them is measured.
struct TuneCheck {
  std::string problem;         // "" or why it is invalid (one line)
  std::string fingerprint;
};

struct TuneSearchHooks {
  std::function<double()> elapsed_s;                                             // since tune started
  std::function<TuneCheck(const TuneSettings&)> check;                            // may be empty
  std::function<TuneRunResult(const TuneCandidate&, double deadline_s)> run;      // one run
  std::function<LossyCost(const TuneCandidate&)> lossy_cost;                      // may be empty
  std::function<void(const std::string&)> progress;                               // one line
};

struct TuneOutcome {
  std::vector<TuneCandidate> candidates;
  int baseline = -1;            // screening runs of the job as given
  int winner = -1;              // the best screening candidate that met the SLO (-1: none)
  int final_baseline = -1;      // full runs of the job as given, and of the winner
  int final_winner = -1;
  double noise = 0.0;           // relative difference of the job's first two runs (at least the floor)
  std::vector<std::string> knobs_done, knobs_left;  // visited, and left for want of budget
  std::string end_reason;       // "searched every knob", "budget", "stopped", "the job as given failed"
  // The gain of the winner over the job on the full workload: median over alternating
  // pairs, and the range of the pairs (share, positive = better).
  double gain = std::numeric_limits<double>::quiet_NaN();
  double gain_min = std::numeric_limits<double>::quiet_NaN();
  double gain_max = std::numeric_limits<double>::quiet_NaN();
  int gain_pairs = 0;
  bool winner_is_job = false;   // nothing beat the job as given
  // The screening winner that, on the whole workload, did no better than the job (gain <= 0
  // over the full pairs; only where screening runs are shorter than the whole workload): the
  // job as given stands, final_winner holds its full runs, and the gain says what it lost.
  int rejected_winner = -1;

  // Whether candidate `id` is what the tune reports as best: the winner's screening runs or
  // its full runs (not those of a set-aside screening winner).
  bool is_winner(int id) const { return id == winner || (id == final_winner && rejected_winner < 0); }
};

TuneOutcome tune_search(const std::vector<TuneKnob>& knobs, const TuneSearchOptions& options,
                        const TuneSearchHooks& hooks);

}  // namespace kvpipe
