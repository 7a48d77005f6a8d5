#include "launch/serve/serve_metrics.h"

#include "engine/grammar/token_constraint.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace kvpipe {
namespace {

std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  // The shortest text that reads back as `v` (0.005, not 0.0050000000000000001).
  char buf[64];
  for (int precision = 15; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

void header(std::string& out, const std::string& name, const char* type, const char* help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

// A histogram's _bucket, _sum and _count lines from its per-bucket counts (the last: +Inf).
void render_buckets(std::string& out, const std::string& name, const std::string& labels,
                    const std::vector<double>& bounds, const std::vector<int64_t>& counts, double sum) {
  int64_t cumulative = 0;
  for (size_t i = 0; i <= bounds.size(); ++i) {
    cumulative += counts[i];
    const std::string le = i < bounds.size() ? number(bounds[i]) : "+Inf";
    out += name + "_bucket{" + labels + ",le=\"" + le + "\"} " + std::to_string(cumulative) + "\n";
  }
  out += name + "_sum{" + labels + "} " + number(sum) + "\n";
  out += name + "_count{" + labels + "} " + std::to_string(cumulative) + "\n";
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& labels) const {
  render_buckets(out, name, labels, bounds_, counts_, sum_);
}

// vLLM's buckets for these histograms.
ServeMetrics::ServeMetrics(std::string model_name)
    : model_name_(std::move(model_name)),
      ttft_({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
             160.0, 640.0, 2560.0}),
      itl_({0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}),
      e2e_({0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
            1920.0, 7680.0}),
      queue_({0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
              1920.0, 7680.0}) {}

void ServeMetrics::set_constraint_stats(std::shared_ptr<const ConstraintStats> stats) {
  std::lock_guard<std::mutex> lock(mutex_);
  constraint_stats_ = std::move(stats);
}

void ServeMetrics::set_gauges(const Gauges& g) {
  std::lock_guard<std::mutex> lock(mutex_);
  gauges_ = g;
}

void ServeMetrics::add_prompt_tokens(int64_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  prompt_tokens_ += n;
}

void ServeMetrics::add_generation_token(double inter_token_s) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++generation_tokens_;
  if (inter_token_s >= 0.0) itl_.observe(inter_token_s);
}

void ServeMetrics::observe_first_token(double ttft_s) {
  std::lock_guard<std::mutex> lock(mutex_);
  ttft_.observe(ttft_s);
}

void ServeMetrics::observe_finished(const std::string& reason, double e2e_s, double queue_s) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++finished_[reason];
  e2e_.observe(e2e_s);
  if (queue_s >= 0.0) queue_.observe(queue_s);
}

std::string ServeMetrics::render() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string escaped;
  for (const char c : model_name_) {
    if (c == '\\' || c == '"') escaped += '\\';
    if (c == '\n') escaped += "\\n";
    else escaped += c;
  }
  const std::string labels = "model_name=\"" + escaped + "\"";
  std::string out;
  auto gauge = [&](const char* name, const char* help, double v) {
    header(out, name, "gauge", help);
    out += std::string(name) + "{" + labels + "} " + number(v) + "\n";
  };
  auto counter = [&](const char* name, const char* help, double v) {
    header(out, name, "counter", help);
    out += std::string(name) + "{" + labels + "} " + number(v) + "\n";
  };
  gauge("kvpipe:num_requests_running", "Requests in the running batch.", gauges_.running);
  gauge("kvpipe:num_requests_waiting", "Requests waiting to be scheduled.", gauges_.waiting);
  gauge("kvpipe:kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use.",
        gauges_.kv_blocks_total > 0 ? static_cast<double>(gauges_.kv_blocks_used) / gauges_.kv_blocks_total : 0.0);
  gauge("kvpipe:kv_cache_used_blocks", "KV blocks held by requests.", gauges_.kv_blocks_used);
  gauge("kvpipe:kv_cache_total_blocks", "KV blocks of the pool.", gauges_.kv_blocks_total);
  counter("kvpipe:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", gauges_.prefix_queries);
  counter("kvpipe:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", gauges_.prefix_hits);
  counter("kvpipe:num_preemptions_total", "Requests preempted (they resume by recomputation).", gauges_.preemptions);
  // vLLM's speculative-decoding counters, under kvpipe's prefix.
  counter("kvpipe:spec_decode_num_drafts_total", "Speculative drafts verified.", gauges_.spec_drafts);
  counter("kvpipe:spec_decode_num_draft_tokens_total", "Draft tokens verified.", gauges_.spec_draft_tokens);
  counter("kvpipe:spec_decode_num_accepted_tokens_total", "Draft tokens accepted into outputs.",
          gauges_.spec_accepted_tokens);
  header(out, "kvpipe:spec_decode_num_accepted_tokens_per_pos_total", "counter",
         "Draft tokens accepted, by position in the draft (0 = the first).");
  for (size_t p = 0; p < gauges_.spec_accepted_at.size(); ++p)
    out += "kvpipe:spec_decode_num_accepted_tokens_per_pos_total{" + labels + ",position=\"" + std::to_string(p) +
           "\"} " + std::to_string(gauges_.spec_accepted_at[p]) + "\n";
  counter("kvpipe:prompt_tokens_total", "Prompt tokens of the requests admitted.", prompt_tokens_);
  counter("kvpipe:generation_tokens_total", "Tokens generated.", generation_tokens_);
  header(out, "kvpipe:request_success_total", "counter", "Requests finished, by finish reason.");
  for (const char* reason : {"stop", "length", "abort", "error"}) {
    const auto it = finished_.find(reason);
    out += "kvpipe:request_success_total{" + labels + ",finished_reason=\"" + reason + "\"} " +
           std::to_string(it == finished_.end() ? 0 : it->second) + "\n";
  }
  header(out, "kvpipe:time_to_first_token_seconds", "histogram", "Time from arrival to the first token.");
  ttft_.render(out, "kvpipe:time_to_first_token_seconds", labels);
  header(out, "kvpipe:inter_token_latency_seconds", "histogram", "Time between consecutive tokens of a request.");
  itl_.render(out, "kvpipe:inter_token_latency_seconds", labels);
  header(out, "kvpipe:e2e_request_latency_seconds", "histogram", "Time from arrival to the last token.");
  e2e_.render(out, "kvpipe:e2e_request_latency_seconds", labels);
  header(out, "kvpipe:request_queue_time_seconds", "histogram", "Time from arrival to the first step that runs it.");
  queue_.render(out, "kvpipe:request_queue_time_seconds", labels);
  if (constraint_stats_) {
    const ConstraintStats::Snapshot c = constraint_stats_->snapshot();
    header(out, "kvpipe:structured_output_mask_seconds", "histogram",
           "Time to mask one constrained token's logits (a cached state's lookup, or a state's first walk of the "
           "vocabulary).");
    render_buckets(out, "kvpipe:structured_output_mask_seconds", labels, c.mask.bounds, c.mask.counts, c.mask.sum);
    header(out, "kvpipe:structured_output_compile_seconds", "histogram",
           "Time to compile a structured-output pattern to its automaton, on its first use.");
    render_buckets(out, "kvpipe:structured_output_compile_seconds", labels, c.compile.bounds, c.compile.counts,
                   c.compile.sum);
    gauge("kvpipe:structured_output_cache_bytes", "Memory of the cached token masks of the constraints held.",
          static_cast<double>(c.cache_bytes));
    gauge("kvpipe:structured_output_cache_states", "Automaton states whose token masks are cached.",
          static_cast<double>(c.cached_states));
  }
  return out;
}

}  // namespace kvpipe
