#include "launch/tune/tune_report.h"

#include "launch/job_config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace kvpipe {
namespace {

std::string num(double v, int digits = 1) {
  if (!std::isfinite(v)) return "";
  char text[48];
  std::snprintf(text, sizeof text, "%.*f", digits, v);
  return text;
}

std::string percent(double share) { return std::isfinite(share) ? num(100.0 * share, 1) + "%" : "n/a"; }

std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\n") == std::string::npos) return text;
  std::string out = "\"";
  for (char c : text) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::string xml_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '&') out += "&amp;";
    else if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '"') out += "&quot;";
    else out += c;
  }
  return out;
}

std::string md_cell(const std::string& text) {
  std::string out;
  for (char c : text) out += c == '|' ? std::string("\\|") : std::string(1, c);
  return out;
}

std::string cost_text(const TuneCandidate& c) {
  if (!c.cost) return c.lossy ? "not measured" : "";
  if (!c.cost->error.empty()) return "not measured: " + c.cost->error;
  char kl[64];
  std::snprintf(kl, sizeof kl, "KL %.3g nats/token (max %.3g), ", c.cost->kl_mean, c.cost->kl_max);
  return kl +
         percent(c.cost->token_agreement) + " of tokens as the job's";
}

std::pair<double, double> objective_range(const TuneCandidate& c, TuneObjective objective) {
  double lo = INFINITY, hi = -INFINITY;
  for (const TuneFigures& f : c.runs) {
    lo = std::min(lo, objective_value(f, objective));
    hi = std::max(hi, objective_value(f, objective));
  }
  return {lo, hi};
}

// A short name for a point of the plot: the values it changed, keys shortened.
std::string short_label(const TuneCandidate& c) {
  if (c.settings.empty()) return "job";
  std::string out;
  for (const auto& [k, v] : c.settings) {
    const std::string key = k.substr(k.find('.') + 1);
    out += (out.empty() ? "" : ", ") + key + "=" + v;
  }
  return out;
}

double nice_step(double span) {
  const double raw = span / 5.0;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * p) return m * p;
  return 10.0 * p;
}

}  // namespace

std::string tune_candidates_csv(const TuneOutcome& outcome, TuneObjective objective) {
  std::ostringstream out;
  out << "id,phase,settings,runs,ttft_p99_ms,tpot_p99_ms,e2e_mean_ms,e2e_p99_ms,output_tokens_per_s,kv_peak_mib,"
         "objective,objective_min,objective_max,lossy,kl_mean,kl_max,token_agreement,winner,status,run_dirs\n";
  for (const TuneCandidate& c : outcome.candidates) {
    const TuneFigures m = c.median();
    const bool measured = c.measured();
    const auto [lo, hi] = objective_range(c, objective);
    std::string dirs;
    for (const std::string& d : c.run_dirs) dirs += (dirs.empty() ? "" : " ") + d;
    const bool cost = c.cost && c.cost->error.empty();
    const bool winner = outcome.is_winner(c.id);
    out << c.id << "," << c.phase << "," << csv_field(c.label()) << "," << c.runs.size() << ","
        << (measured ? num(m.ttft_p99_ms, 3) : "") << "," << (measured ? num(m.tpot_p99_ms, 3) : "") << ","
        << (measured ? num(m.e2e_mean_ms, 3) : "") << "," << (measured ? num(m.e2e_p99_ms, 3) : "") << ","
        << (measured ? num(m.output_tokens_per_s, 3) : "") << "," << (measured ? num(m.kv_peak_mib, 3) : "") << ","
        << (measured ? num(objective_value(m, objective), 3) : "") << "," << (measured ? num(lo, 3) : "") << ","
        << (measured ? num(hi, 3) : "") << "," << (c.lossy ? "true" : "false") << ","
        << (cost ? num(c.cost->kl_mean, 6) : "") << "," << (cost ? num(c.cost->kl_max, 6) : "") << ","
        << (cost ? num(c.cost->token_agreement, 4) : "") << "," << (winner ? "true" : "false") << ","
        << csv_field(c.status) << "," << csv_field(dirs) << "\n";
  }
  return out.str();
}

std::string tune_plot_svg(const TuneOutcome& outcome, TuneObjective objective) {
  struct Point {
    double x, y;
    std::string label, color;
  };
  std::vector<Point> points;
  for (const TuneCandidate& c : outcome.candidates) {
    if (!c.measured() || c.phase != "screen") continue;
    const TuneFigures m = c.median();
    std::string color = c.status.rfind("ok", 0) == 0 ? "#1f77b4" : "#999999";
    if (c.lossy) color = c.status.rfind("ok", 0) == 0 ? "#ff7f0e" : "#ffbf8e";
    if (c.id == outcome.baseline) color = "#000000";
    if (c.id == outcome.winner && !outcome.winner_is_job) color = "#2ca02c";
    points.push_back({m.kv_peak_mib, objective_value(m, objective), short_label(c), color});
  }
  const double W = 900, H = 560, left = 80, right = 260, top = 50, bottom = 60;
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
      << "\" font-family=\"sans-serif\" font-size=\"11\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << W / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">"
      << xml_escape(objective_name(objective)) << " against peak KV memory (screening runs)</text>\n";
  if (points.empty()) {
    svg << "<text x=\"" << W / 2 << "\" y=\"" << H / 2 << "\" text-anchor=\"middle\">no candidate was measured</text>\n</svg>\n";
    return svg.str();
  }
  double x0 = 0, x1 = 0, y0 = 0, y1 = 0;
  for (const Point& p : points) {
    x1 = std::max(x1, p.x);
    y1 = std::max(y1, p.y);
  }
  x1 = x1 > 0 ? x1 * 1.1 : 1.0;
  y1 = y1 > 0 ? y1 * 1.1 : 1.0;
  const double pw = W - left - right, ph = H - top - bottom;
  auto sx = [&](double x) { return left + (x - x0) / (x1 - x0) * pw; };
  auto sy = [&](double y) { return top + ph - (y - y0) / (y1 - y0) * ph; };
  svg << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
      << "\" fill=\"none\" stroke=\"#333\"/>\n";
  for (double x = 0, step = nice_step(x1 - x0); x <= x1 + 1e-9; x += step)
    svg << "<line x1=\"" << sx(x) << "\" y1=\"" << top + ph << "\" x2=\"" << sx(x) << "\" y2=\"" << top + ph + 5
        << "\" stroke=\"#333\"/><text x=\"" << sx(x) << "\" y=\"" << top + ph + 18 << "\" text-anchor=\"middle\">"
        << num(x, step < 1 ? 1 : 0) << "</text>\n";
  for (double y = 0, step = nice_step(y1 - y0); y <= y1 + 1e-9; y += step)
    svg << "<line x1=\"" << left - 5 << "\" y1=\"" << sy(y) << "\" x2=\"" << left << "\" y2=\"" << sy(y)
        << "\" stroke=\"#333\"/><text x=\"" << left - 8 << "\" y=\"" << sy(y) + 4 << "\" text-anchor=\"end\">"
        << num(y, step < 1 ? 2 : 0) << "</text>\n";
  svg << "<text x=\"" << left + pw / 2 << "\" y=\"" << H - 18 << "\" text-anchor=\"middle\">peak KV memory in use (MiB, all ranks)</text>\n"
      << "<text transform=\"translate(20," << top + ph / 2 << ") rotate(-90)\" text-anchor=\"middle\">"
      << xml_escape(objective_name(objective)) << "</text>\n";
  for (size_t i = 0; i < points.size(); ++i) {
    const Point& p = points[i];
    svg << "<circle cx=\"" << sx(p.x) << "\" cy=\"" << sy(p.y) << "\" r=\"4\" fill=\"" << p.color << "\"/>"
        << "<text x=\"" << sx(p.x) + 6 << "\" y=\"" << sy(p.y) - 4 << "\" font-size=\"9\" fill=\"#444\">" << i
        << "</text>\n";
  }
  // The legend: each point's number and what it changed.
  double ly = top;
  for (size_t i = 0; i < points.size() && ly < H - 12; ++i, ly += 13) {
    std::string label = points[i].label;
    if (label.size() > 44) label = label.substr(0, 41) + "...";
    svg << "<circle cx=\"" << W - right + 16 << "\" cy=\"" << ly + 4 << "\" r=\"4\" fill=\"" << points[i].color
        << "\"/><text x=\"" << W - right + 26 << "\" y=\"" << ly + 8 << "\" font-size=\"9\">" << i << ": "
        << xml_escape(label) << "</text>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

std::string tuned_yaml(const TuneOutcome& outcome, const TuneReportInputs& in) {
  if (outcome.winner < 0) return "";
  std::vector<std::string> sets = in.overrides;
  for (const auto& [k, v] : outcome.candidates[static_cast<size_t>(outcome.winner)].settings) sets.push_back(k + "=" + v);
  std::ostringstream out;
  out << "# " << in.config << " tuned by kvpipe tune (" << objective_name(in.search.objective) << ", SLO "
      << slo_text(in.search.slo) << ", " << in.ranks << " rank(s)).\n";
  if (outcome.winner_is_job) out << "# Nothing beat the job as given: these are its own settings.\n";
  else out << "# Changed: " << outcome.candidates[static_cast<size_t>(outcome.winner)].label() << "\n";
  out << job_yaml_with_overrides(in.config, sets);
  return out.str();
}

std::string tune_report_markdown(const TuneOutcome& o, const TuneReportInputs& in) {
  const TuneObjective objective = in.search.objective;
  std::ostringstream md;
  md << "# kvpipe tune: " << in.config << "\n\n";
  md << "- command: `" << in.command << "`\n";
  md << "- ranks: " << in.ranks << "; objective: " << objective_name(objective) << " ("
     << (lower_is_better(objective) ? "lower" : "higher") << " is better); SLO: " << slo_text(in.search.slo) << "\n";
  md << "- workload: " << in.workload << "; screening runs of " << in.screen_requests << " requests, full runs of "
     << in.full_requests << "\n";
  md << "- budget: " << num(in.search.budget_s / 60.0) << " min, used " << num(in.elapsed_s / 60.0) << " min; lossy strategies "
     << (in.allow_lossy ? "allowed (their cost in log-probability beside their speed)" : "not tried (--allow-lossy)") << "\n";
  md << "- search: coordinate descent, ended: " << o.end_reason << "; noise between the job's first two runs: "
     << percent(o.noise) << " (candidates closer than that are rerun, up to " << in.search.max_repeats << " runs each)\n\n";

  md << "## Result\n\n";
  if (o.winner < 0) {
    md << "No configuration " << (in.search.slo.any() ? "met the SLO" : "was measured") << ". No tuned.yaml was written.\n\n";
  } else {
    const TuneCandidate& w = o.candidates[static_cast<size_t>(o.winner)];
    if (o.rejected_winner >= 0) {
      md << "**Nothing beat the job as given** on the whole workload: the screening winner, "
         << md_cell(o.candidates[static_cast<size_t>(o.rejected_winner)].label()) << ", gained " << percent(o.gain)
         << " in " << objective_name(objective) << " (median of " << o.gain_pairs << " alternating pair(s) of full runs; range "
         << percent(o.gain_min) << " to " << percent(o.gain_max) << ")";
    } else if (o.winner_is_job) {
      md << "**Nothing beat the job as given** within the noise";
    } else {
      md << "**Tuned: " << md_cell(w.label()) << "**";
    }
    md << ". tuned.yaml holds it: `kvpipe bench --config tuned.yaml --out OUT` runs it.\n\n";
    const int fb = o.final_baseline >= 0 ? o.final_baseline : o.baseline;
    const int fw = o.final_winner >= 0 ? o.final_winner : o.winner;
    const TuneCandidate& b = o.candidates[static_cast<size_t>(fb)];
    const TuneCandidate& t = o.candidates[static_cast<size_t>(fw)];
    const TuneFigures bm = b.median(), tm = t.median();
    const char* other = o.rejected_winner >= 0 ? "screening winner" : "tuned";
    md << "Medians over the " << b.phase << " runs (" << b.runs.size() << " of the job, " << t.runs.size() << " of the "
       << other << "):\n\n";
    md << "| figure | job as given | " << other << " | change |\n|---|---|---|---|\n";
    auto row = [&](const char* name, double x, double y) {
      md << "| " << name << " | " << num(x) << " | " << num(y) << " | " << (x != 0 ? percent((y - x) / x) : "") << " |\n";
    };
    row("p99 TTFT (ms)", bm.ttft_p99_ms, tm.ttft_p99_ms);
    row("p99 TPOT (ms)", bm.tpot_p99_ms, tm.tpot_p99_ms);
    row("mean E2E (ms)", bm.e2e_mean_ms, tm.e2e_mean_ms);
    row("p99 E2E (ms)", bm.e2e_p99_ms, tm.e2e_p99_ms);
    row("output tok/s", bm.output_tokens_per_s, tm.output_tokens_per_s);
    row("peak KV memory (MiB)", bm.kv_peak_mib, tm.kv_peak_mib);
    md << "\n";
    if (!o.winner_is_job && o.gain_pairs > 0)
      md << "Gain in " << objective_name(objective) << ": **" << percent(o.gain) << "** (median of " << o.gain_pairs
         << " alternating pair(s) of full runs; range " << percent(o.gain_min) << " to " << percent(o.gain_max) << ").\n\n";
    if (w.cost) md << "Lossy: " << cost_text(w) << ".\n\n";
  }

  md << "## Candidates\n\n";
  md << "| id | phase | settings | runs | p99 TTFT | p99 TPOT | mean E2E | tok/s | peak KV MiB | " << objective_name(objective)
     << " range | lossy cost | status |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const TuneCandidate& c : o.candidates) {
    const TuneFigures m = c.median();
    const auto [lo, hi] = objective_range(c, objective);
    std::string name = md_cell(c.label());
    if (o.is_winner(c.id)) name = "**" + name + "**";
    md << "| " << c.id << " | " << c.phase << " | " << name << " | " << c.runs.size() << " | "
       << (c.measured() ? num(m.ttft_p99_ms) : "") << " | " << (c.measured() ? num(m.tpot_p99_ms, 2) : "") << " | "
       << (c.measured() ? num(m.e2e_mean_ms) : "") << " | " << (c.measured() ? num(m.output_tokens_per_s) : "") << " | "
       << (c.measured() ? num(m.kv_peak_mib, 2) : "") << " | " << (c.measured() ? num(lo) + " .. " + num(hi) : "")
       << " | " << md_cell(cost_text(c)) << " | " << md_cell(c.status) << " |\n";
  }
  md << "\n![" << objective_name(objective) << " against peak KV memory](plot.svg)\n\n";
  md << "## Search\n\n";
  md << "- knobs visited: ";
  for (size_t i = 0; i < o.knobs_done.size(); ++i) md << (i ? ", " : "") << "`" << o.knobs_done[i] << "`";
  md << "\n- knobs left for want of budget: ";
  if (o.knobs_left.empty()) md << "none";
  for (size_t i = 0; i < o.knobs_left.size(); ++i) md << (i ? ", " : "") << "`" << o.knobs_left[i] << "`";
  md << "\n- every run's report.json, requests.csv and stderr are in runs/NNN (candidates.csv names them).\n";
  return md.str();
}

std::vector<std::string> write_tune_report(const std::string& dir, const TuneOutcome& outcome,
                                           const TuneReportInputs& inputs) {
  std::vector<std::string> written;
  auto put = [&](const std::string& name, const std::string& text) {
    const std::string path = (std::filesystem::path(dir) / name).string();
    std::ofstream out(path);
    out << text;
    out.close();
    if (!out) throw std::runtime_error("cannot write " + path);
    written.push_back(path);
  };
  put("candidates.csv", tune_candidates_csv(outcome, inputs.search.objective));
  put("plot.svg", tune_plot_svg(outcome, inputs.search.objective));
  put("report.md", tune_report_markdown(outcome, inputs));
  const std::string tuned = tuned_yaml(outcome, inputs);
  const std::string tuned_path = (std::filesystem::path(dir) / "tuned.yaml").string();
  if (tuned.empty()) std::filesystem::remove(tuned_path);
  else put("tuned.yaml", tuned);
  return written;
}

}  // namespace kvpipe
