// ServeMetrics: what `kvpipe serve` reports at GET /metrics, in Prometheus' text format.
//
// Names and meanings follow vLLM's (under a `kvpipe:` prefix): gauges of requests running
// and waiting and of KV-cache usage, counters of prefix-cache queries and hits (tokens),
// preemptions, prompt and generation tokens and finished requests by reason, and histograms
// of time to first token, inter-token latency, end-to-end latency and queue time; and, where
// the server constrains outputs, what that costs (ConstraintStats: the mask's time per
// token, the compile time, the masks' cache). The coordinator records; HTTP threads render.
// Every method is thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace kvpipe {

class ConstraintStats;

// A Prometheus histogram: cumulative counts over fixed upper bounds (seconds).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  // `name`'s _bucket, _sum and _count lines, each with `labels` (a `k="v"` list).
  void render(std::string& out, const std::string& name, const std::string& labels) const;
  int64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;  // per bucket, not cumulative; the last one is +Inf
  double sum_ = 0.0;
  int64_t count_ = 0;
};

class ServeMetrics {
 public:
  explicit ServeMetrics(std::string model_name);

  struct Gauges {
    int64_t running = 0, waiting = 0;
    int64_t kv_blocks_used = 0, kv_blocks_total = 0;  // held by requests (cached free ones not counted)
    int64_t prefix_queries = 0, prefix_hits = 0;  // tokens looked up and found (cumulative)
    int64_t preemptions = 0;                      // cumulative
    // Speculative decoding (cumulative): drafts verified, their tokens, the tokens kept, and
    // per draft position how often it was kept.
    int64_t spec_drafts = 0, spec_draft_tokens = 0, spec_accepted_tokens = 0;
    std::vector<int64_t> spec_accepted_at;
  };
  void set_gauges(const Gauges& g);

  void add_prompt_tokens(int64_t n);
  void add_generation_token(double inter_token_s);  // < 0: the request's first token
  void observe_first_token(double ttft_s);
  void observe_finished(const std::string& reason, double e2e_s, double queue_s);

  // The structured-output constraints' costs, rendered with the rest (null: none).
  void set_constraint_stats(std::shared_ptr<const ConstraintStats> stats);

  std::string render() const;

 private:
  std::string model_name_;
  std::shared_ptr<const ConstraintStats> constraint_stats_;
  mutable std::mutex mutex_;
  Gauges gauges_;
  int64_t prompt_tokens_ = 0, generation_tokens_ = 0;
  std::map<std::string, int64_t> finished_;
  Histogram ttft_, itl_, e2e_, queue_;
};

}  // namespace kvpipe
