#include "launch/tune/tune_search.h"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <stdexcept>

namespace kvpipe {
namespace {

double median_of(std::vector<double> v) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string format_ms(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.4g", v);
  return text;
}

std::string bar(double share, int width = 20) {
  share = std::min(1.0, std::max(0.0, share));
  const int full = static_cast<int>(share * width + 0.5);
  return "[" + std::string(static_cast<size_t>(full), '#') + std::string(static_cast<size_t>(width - full), '-') + "]";
}

// The value a candidate gives `key`: its own setting, else the job's (`job_value` when the
// key is not a knob of this search).
std::string value_of(const TuneSettings& settings, const std::vector<TuneKnob>& knobs, const std::string& key,
                     const std::string& job_value = "") {
  for (const auto& [k, v] : settings)
    if (k == key) return v;
  for (const TuneKnob& knob : knobs)
    if (knob.key == key) return knob.values[knob.current].yaml;
  return job_value;
}

class Search {
 public:
  Search(const std::vector<TuneKnob>& knobs, const TuneSearchOptions& options, const TuneSearchHooks& hooks)
      : knobs_(knobs), o_(options), h_(hooks) {}

  TuneOutcome run();

 private:
  TuneCandidate& at(int i) { return out_.candidates[static_cast<size_t>(i)]; }
  double value(int i) { return objective_value(at(i).median(), o_.objective); }
  bool meets_slo(int i) { return at(i).measured() && slo_breach(at(i).median(), o_.slo).empty(); }
  bool usable(int i) { return at(i).measured() && at(i).status.rfind("ok", 0) == 0; }

  int add(const TuneSettings& settings, const std::string& phase, bool lossy);
  double estimate_screen_s() const;
  double reserve_s() const;
  bool afford(double run_s, double reserve) const { return h_.elapsed_s() + run_s + reserve <= o_.budget_s; }
  bool checked(int i);
  int runs_alike(int i);
  bool measure_once(int i);
  bool better(int a, int b) {
    return lower_is_better(o_.objective) ? value(a) < value(b) : value(a) > value(b);
  }
  bool close(int a, int b) {
    const double va = value(a), vb = value(b);
    return std::abs(va - vb) <= out_.noise * std::max(std::abs(va), std::abs(vb));
  }
  bool wins(int challenger, int incumbent);
  void visit(const TuneKnob& knob);
  // What trying a value gave: nothing better (or nothing could run), a new best, or a
  // configuration that runs as the best so far does (a walk goes on past it).
  enum class Step { kWorse, kBetter, kAlike };
  Step try_value(const TuneKnob& knob, size_t index);
  void final_comparison();
  void say(const std::string& what);

  const std::vector<TuneKnob>& knobs_;
  const TuneSearchOptions& o_;
  const TuneSearchHooks& h_;
  TuneOutcome out_;
  int incumbent_ = -1;
  bool stopped_ = false;   // killed at the deadline or by a signal
  std::string stop_reason_;
  bool out_of_budget_ = false;
  int runs_ = 0;
};

int Search::add(const TuneSettings& settings, const std::string& phase, bool lossy) {
  for (const TuneCandidate& c : out_.candidates)
    if (c.settings == settings && c.phase == phase) return c.id;
  TuneCandidate c;
  c.id = static_cast<int>(out_.candidates.size());
  c.settings = settings;
  c.phase = phase;
  c.lossy = lossy;
  out_.candidates.push_back(std::move(c));
  return out_.candidates.back().id;
}

double Search::estimate_screen_s() const {
  std::vector<double> walls;
  for (const TuneCandidate& c : out_.candidates)
    if (c.phase == "screen")
      for (const TuneFigures& f : c.runs) walls.push_back(f.wall_s);
  return walls.empty() ? 0.0 : median_of(walls);
}

// Kept back for the final comparison: one full run of the job and one of the winner.
double Search::reserve_s() const {
  return o_.full_over_screen > 1.0 ? 2.0 * estimate_screen_s() * o_.full_over_screen : 0.0;
}

void Search::say(const std::string& what) {
  if (!h_.progress) return;
  const double used = h_.elapsed_s();
  char head[96];
  std::snprintf(head, sizeof head, "tune %s %3.0f%% of %.1f min, run %d: ", bar(used / o_.budget_s).c_str(),
                100.0 * std::min(1.0, used / o_.budget_s), o_.budget_s / 60.0, runs_);
  h_.progress(head + what);
}

// Checks a candidate once: false (and marked invalid) when it cannot run.
bool Search::checked(int i) {
  TuneCandidate& c = at(i);
  if (c.status.rfind("invalid", 0) == 0) return false;
  if (!c.status.empty() || !c.fingerprint.empty() || !h_.check) return true;
  const TuneCheck check = h_.check(c.settings);
  if (!check.problem.empty()) {
    c.status = "invalid: " + check.problem;
    say(c.label() + ": " + c.status);
    return false;
  }
  c.fingerprint = check.fingerprint;
  return true;
}

// An earlier candidate of the same phase that runs exactly as candidate i would, or -1.
int Search::runs_alike(int i) {
  if (at(i).fingerprint.empty()) return -1;
  for (const TuneCandidate& c : out_.candidates)
    if (c.id != i && c.phase == at(i).phase && c.fingerprint == at(i).fingerprint) return c.id;
  return -1;
}

bool Search::measure_once(int i) {
  if (stopped_) return false;
  if (!checked(i)) return false;
  TuneCandidate& c = at(i);
  ++runs_;
  // The job's own screening runs set the pace; a candidate far slower is stopped early.
  double deadline = o_.budget_s;
  double cut_s = 0.0;
  if (c.phase == "screen" && i != out_.baseline && at(out_.baseline).measured()) {
    cut_s = o_.slow_cut * at(out_.baseline).median().wall_s;
    deadline = std::min(deadline, h_.elapsed_s() + cut_s);
  }
  TuneRunResult r = h_.run(c, deadline);
  TuneCandidate& after = at(i);
  if (r.timed_out && deadline < o_.budget_s) {
    char why[128];
    std::snprintf(why, sizeof why, "too slow: stopped after %.0f s, %.3g x the job's run", cut_s, o_.slow_cut);
    after.status = why;
    say(after.label() + ": " + after.status);
    return false;
  }
  if (r.stopped || r.timed_out) {
    stopped_ = true;
    stop_reason_ = r.stopped ? r.error : "the budget ran out during a run";
    if (!after.measured()) after.status = "stopped: " + stop_reason_;
    say(after.label() + ": stopped (" + stop_reason_ + ")");
    return false;
  }
  if (!r.ok) {
    after.status = "failed: " + r.error;
    say(after.label() + ": " + after.status);
    return false;
  }
  after.runs.push_back(r.figures);
  after.run_dirs.push_back(r.dir);
  const std::string breach = slo_breach(after.median(), o_.slo);
  after.status = breach.empty() ? "ok" : "over SLO: " + breach;
  if (after.lossy && !after.cost && h_.lossy_cost) after.cost = h_.lossy_cost(after);
  std::string line = after.label() + " (" + after.phase + "): " + objective_name(o_.objective) + " " +
                     format_ms(objective_value(r.figures, o_.objective));
  if (after.runs.size() > 1)
    line += " (median of " + std::to_string(after.runs.size()) + " runs " + format_ms(value(i)) + ")";
  if (incumbent_ >= 0 && incumbent_ != i) line += ", best so far " + format_ms(value(incumbent_));
  if (!breach.empty()) line += ", over SLO (" + breach + ")";
  say(line);
  return true;
}

// Reruns the two while their medians lie within noise, then compares: a candidate that meets
// the SLO beats one that does not; otherwise the better median wins, but a difference still
// within noise only counts once both have their full repeats.
bool Search::wins(int challenger, int incumbent) {
  const bool over_slo = at(challenger).status.rfind("over SLO", 0) == 0;
  if (!usable(challenger) && !over_slo) return false;
  bool repeats_done = false;
  while (close(challenger, incumbent) && !stopped_) {
    const int rc = static_cast<int>(at(challenger).runs.size());
    const int ri = static_cast<int>(at(incumbent).runs.size());
    if (rc >= o_.max_repeats && ri >= o_.max_repeats) {
      repeats_done = true;
      break;
    }
    if (!afford(estimate_screen_s(), reserve_s())) {
      out_of_budget_ = true;
      break;
    }
    const int pick = rc <= ri ? challenger : incumbent;
    if (!measure_once(pick)) break;
  }
  const bool c_ok = meets_slo(challenger), i_ok = meets_slo(incumbent);
  if (c_ok != i_ok) return c_ok;
  if (close(challenger, incumbent) && !repeats_done) return false;
  return better(challenger, incumbent);
}

Search::Step Search::try_value(const TuneKnob& knob, size_t index) {
  if (stopped_ || out_of_budget_) return Step::kWorse;
  if (!afford(estimate_screen_s(), reserve_s())) {
    out_of_budget_ = true;
    return Step::kWorse;
  }
  TuneSettings settings;
  bool lossy = false;
  const bool reset = index != knob.current && !knob.reset_key.empty();
  for (const auto& kv : at(incumbent_).settings)
    if (kv.first != knob.key && !(reset && kv.first == knob.reset_key)) settings.push_back(kv);
  if (index != knob.current) settings.push_back({knob.key, knob.values[index].yaml});
  if (reset && knob.reset_job != knob.reset_value) settings.push_back({knob.reset_key, knob.reset_value});
  // Keep the knobs' order, so that one configuration has one label.
  std::vector<std::pair<size_t, std::pair<std::string, std::string>>> ranked;
  for (const auto& kv : settings) {
    size_t rank = knobs_.size();
    for (size_t k = 0; k < knobs_.size(); ++k)
      if (knobs_[k].key == kv.first) {
        rank = k;
        for (const TuneValue& v : knobs_[k].values)
          if (v.yaml == kv.second && v.lossy) lossy = true;
      }
    ranked.push_back({rank, kv});
  }
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  settings.clear();
  for (const auto& r : ranked) settings.push_back(r.second);

  const int c = add(settings, "screen", lossy);
  if (c == incumbent_) return Step::kAlike;
  if (!at(c).measured()) {
    if (!checked(c)) return Step::kWorse;
    // Measuring it again would only measure the other one's noise.
    if (const int twin = runs_alike(c); twin >= 0) {
      if (at(c).status.empty()) {
        at(c).status = "same as #" + std::to_string(twin) + ": runs alike (" + at(twin).label() + ")";
        say(at(c).label() + ": " + at(c).status + ", not run");
      }
      return twin == incumbent_ ? Step::kAlike : Step::kWorse;
    }
    if (!measure_once(c)) return Step::kWorse;
  }
  if (!wins(c, incumbent_)) return Step::kWorse;
  incumbent_ = c;
  say("new best: " + at(c).label());
  return Step::kBetter;
}

void Search::visit(const TuneKnob& knob) {
  if (!knob.unless_key.empty() &&
      value_of(at(incumbent_).settings, knobs_, knob.unless_key, knob.unless_job) == knob.unless_value) {
    out_.knobs_done.push_back(knob.key + " (not tried: " + knob.unless_key + " is " + knob.unless_value + ")");
    return;
  }
  const std::string now = value_of(at(incumbent_).settings, knobs_, knob.key);
  size_t cur = knob.current;
  for (size_t i = 0; i < knob.values.size(); ++i)
    if (knob.values[i].yaml == now) cur = i;
  if (knob.ordered) {
    bool improved = false;
    for (size_t i = cur + 1; i < knob.values.size(); ++i) {
      const Step step = try_value(knob, i);
      if (step == Step::kWorse) break;
      if (step == Step::kBetter) improved = true;
    }
    if (!improved)
      for (size_t i = cur; i-- > 0;)
        if (try_value(knob, i) == Step::kWorse) break;
  } else {
    for (size_t i = 0; i < knob.values.size(); ++i)
      if (i != cur) try_value(knob, i);
  }
  if (stopped_ || out_of_budget_) {
    out_.knobs_left.push_back(knob.key + " (cut short)");
    return;
  }
  out_.knobs_done.push_back(knob.key);
}

void Search::final_comparison() {
  const bool same_size = o_.full_over_screen <= 1.0;
  const int job = same_size ? out_.baseline : add({}, "full", false);
  const int best = same_size ? out_.winner : add(at(out_.winner).settings, "full", at(out_.winner).lossy);
  out_.final_baseline = job;
  out_.final_winner = best;
  double full_s = std::max(estimate_screen_s() * std::max(1.0, o_.full_over_screen), 0.0);
  for (int pair = 0; pair < o_.final_pairs && !stopped_; ++pair) {
    // Once a full run has been timed, it is the estimate.
    if (!same_size && at(job).measured()) full_s = at(job).median().wall_s;
    const bool need_job = static_cast<int>(at(job).runs.size()) <= pair;
    const bool need_best = best != job && static_cast<int>(at(best).runs.size()) <= pair;
    const double cost = full_s * ((need_job ? 1 : 0) + (need_best ? 1 : 0));
    // The first pair is what the search kept its reserve for.
    if (pair > 0 && !afford(cost, 0.0)) break;
    if (need_job && !measure_once(job)) break;
    if (need_best && !measure_once(best)) break;
  }
  const int pairs = static_cast<int>(std::min(at(job).runs.size(), at(best).runs.size()));
  if (stopped_ && pairs == 0) {
    // The budget (or a signal) ended the comparison before both had a full run: the
    // screening figures stand, without a measured gain.
    out_.final_baseline = out_.final_winner = -1;
    out_.end_reason += "; the final comparison was cut short (" + stop_reason_ + ")";
    return;
  }
  if (stopped_) out_.end_reason += "; the final comparison was cut short (" + stop_reason_ + ")";
  if (!usable(best) || !meets_slo(best)) {
    // Measured on the whole workload the winner breaks the SLO (or failed): it is not reported.
    out_.winner = usable(job) && meets_slo(job) ? out_.baseline : -1;
    out_.winner_is_job = out_.winner >= 0;
    out_.final_winner = out_.winner >= 0 ? job : -1;
    if (out_.winner < 0) return;
  }
  if (out_.winner_is_job || pairs == 0) {
    out_.gain = out_.gain_min = out_.gain_max = 0.0;
    out_.gain_pairs = pairs;
    return;
  }
  std::vector<double> gains;
  for (int p = 0; p < pairs; ++p) {
    const double b = objective_value(at(job).runs[static_cast<size_t>(p)], o_.objective);
    const double w = objective_value(at(best).runs[static_cast<size_t>(p)], o_.objective);
    gains.push_back(lower_is_better(o_.objective) ? (b - w) / b : (w - b) / b);
  }
  out_.gain = median_of(gains);
  out_.gain_min = *std::min_element(gains.begin(), gains.end());
  out_.gain_max = *std::max_element(gains.begin(), gains.end());
  out_.gain_pairs = pairs;
  if (out_.gain <= 0.0 && !same_size) {
    // Screening ranked it first, the whole workload does not: keep the job as given. (When
    // the screening runs are the whole workload, the search already compared these very
    // runs, within the noise, and its verdict stands.)
    out_.rejected_winner = out_.winner;
    out_.winner = out_.baseline;
    out_.winner_is_job = true;
  }
}

TuneOutcome Search::run() {
  out_.noise = o_.noise_floor;
  out_.baseline = incumbent_ = add({}, "screen", false);
  if (!measure_once(incumbent_)) {
    out_.end_reason = stopped_ ? "stopped: " + stop_reason_ : "the job as given failed";
    for (const TuneKnob& k : knobs_) out_.knobs_left.push_back(k.key);
    return out_;
  }
  // The job's own spread between two runs is the noise below which candidates are rerun.
  if (afford(estimate_screen_s(), reserve_s()) && measure_once(incumbent_)) {
    const double a = objective_value(at(incumbent_).runs[0], o_.objective);
    const double b = objective_value(at(incumbent_).runs[1], o_.objective);
    if (a + b > 0) out_.noise = std::max(o_.noise_floor, 2.0 * std::abs(a - b) / (a + b));
  }
  for (const TuneKnob& knob : knobs_) {
    if (stopped_ || out_of_budget_) {
      out_.knobs_left.push_back(knob.key);
      continue;
    }
    visit(knob);
  }
  out_.end_reason = stopped_ ? "stopped: " + stop_reason_ : out_of_budget_ ? "budget" : "searched every knob";

  // The winner: where the descent ended if it meets the SLO, else the best candidate that does.
  int winner = meets_slo(incumbent_) && usable(incumbent_) ? incumbent_ : -1;
  if (winner < 0)
    for (const TuneCandidate& c : out_.candidates)
      if (c.phase == "screen" && usable(c.id) && meets_slo(c.id) && (winner < 0 || better(c.id, winner)))
        winner = c.id;
  out_.winner = winner;
  out_.winner_is_job = winner == out_.baseline;
  if (winner >= 0 && !stopped_) final_comparison();
  return out_;
}

}  // namespace

TuneObjective parse_tune_objective(const std::string& text) {
  if (text == "ttft") return TuneObjective::kTtft;
  if (text == "tpot") return TuneObjective::kTpot;
  if (text == "e2e") return TuneObjective::kE2e;
  if (text == "throughput") return TuneObjective::kThroughput;
  throw std::invalid_argument("--objective: expected ttft, tpot, e2e or throughput, got '" + text + "'");
}

std::string objective_name(TuneObjective objective) {
  switch (objective) {
    case TuneObjective::kTtft: return "p99 TTFT (ms)";
    case TuneObjective::kTpot: return "p99 TPOT (ms)";
    case TuneObjective::kE2e: return "mean E2E (ms)";
    case TuneObjective::kThroughput: return "output tok/s";
  }
  return "";
}

bool lower_is_better(TuneObjective objective) { return objective != TuneObjective::kThroughput; }

TuneSlo parse_tune_slo(const std::string& text) {
  TuneSlo slo;
  std::stringstream in(text);
  bool any = false;
  for (std::string item; std::getline(in, item, ',');) {
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    double* target = key == "ttft_p99" ? &slo.ttft_p99_ms
                     : key == "tpot_p99" ? &slo.tpot_p99_ms
                     : key == "e2e_p99" ? &slo.e2e_p99_ms
                                        : nullptr;
    if (eq == std::string::npos || !target)
      throw std::invalid_argument("--slo: '" + item + "': expected ttft_p99=MS, tpot_p99=MS or e2e_p99=MS");
    const std::string value = item.substr(eq + 1);
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    if (value.empty() || *end != '\0' || !(v > 0) || !std::isfinite(v))
      throw std::invalid_argument("--slo: " + key + ": expected a positive number of milliseconds, got '" + value + "'");
    if (*target > 0) throw std::invalid_argument("--slo: " + key + " given twice");
    *target = v;
    any = true;
  }
  if (!any) throw std::invalid_argument("--slo: empty; expected e.g. ttft_p99=500,tpot_p99=50");
  return slo;
}

std::string slo_text(const TuneSlo& slo) {
  std::string out;
  auto add = [&](const char* key, double v) {
    if (v <= 0) return;
    char text[64];
    std::snprintf(text, sizeof text, "%s%s=%g", out.empty() ? "" : ",", key, v);
    out += text;
  };
  add("ttft_p99", slo.ttft_p99_ms);
  add("tpot_p99", slo.tpot_p99_ms);
  add("e2e_p99", slo.e2e_p99_ms);
  return out.empty() ? "none" : out;
}

double objective_value(const TuneFigures& f, TuneObjective objective) {
  switch (objective) {
    case TuneObjective::kTtft: return f.ttft_p99_ms;
    case TuneObjective::kTpot: return f.tpot_p99_ms;
    case TuneObjective::kE2e: return f.e2e_mean_ms;
    case TuneObjective::kThroughput: return f.output_tokens_per_s;
  }
  return 0.0;
}

std::string slo_breach(const TuneFigures& f, const TuneSlo& slo) {
  std::string out;
  auto check = [&](const char* name, double value, double limit) {
    if (limit <= 0 || value <= limit) return;
    if (!out.empty()) out += "; ";
    out += std::string(name) + " " + format_ms(value) + " ms > " + format_ms(limit);
  };
  check("p99 TTFT", f.ttft_p99_ms, slo.ttft_p99_ms);
  check("p99 TPOT", f.tpot_p99_ms, slo.tpot_p99_ms);
  check("p99 E2E", f.e2e_p99_ms, slo.e2e_p99_ms);
  return out;
}

std::string TuneCandidate::label() const {
  if (settings.empty()) return "job as given";
  std::string out;
  for (const auto& [k, v] : settings) out += (out.empty() ? "" : ", ") + k + "=" + v;
  return out;
}

TuneFigures TuneCandidate::median() const {
  TuneFigures m;
  auto med = [&](double TuneFigures::*field) {
    std::vector<double> v;
    for (const TuneFigures& f : runs) v.push_back(f.*field);
    return median_of(v);
  };
  m.ttft_p99_ms = med(&TuneFigures::ttft_p99_ms);
  m.tpot_p99_ms = med(&TuneFigures::tpot_p99_ms);
  m.e2e_mean_ms = med(&TuneFigures::e2e_mean_ms);
  m.e2e_p99_ms = med(&TuneFigures::e2e_p99_ms);
  m.output_tokens_per_s = med(&TuneFigures::output_tokens_per_s);
  m.kv_peak_mib = med(&TuneFigures::kv_peak_mib);
  m.wall_s = med(&TuneFigures::wall_s);
  return m;
}

TuneOutcome tune_search(const std::vector<TuneKnob>& knobs, const TuneSearchOptions& options,
                        const TuneSearchHooks& hooks) {
  return Search(knobs, options, hooks).run();
}

}  // namespace kvpipe
