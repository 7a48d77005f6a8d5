// TraceRecorder: what one rank did, when, for the Chrome trace of `kvpipe bench`.
//
// Each rank records spans (compute, send, receive, wait, idle) labelled with the micro-batch
// they belong to, in microseconds since an epoch that every rank takes right after one
// barrier, so the ranks' tracks line up to within the barrier's exit skew (microseconds on
// one node). Recording is off unless enabled, costs one vector push per span, and never
// synchronises ranks; `gather` collects every rank's spans on rank 0 once, at the end.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

namespace kvpipe {

class World;

enum class SpanKind : int { kCompute = 0, kSend = 1, kRecv = 2, kWait = 3, kIdle = 4 };

const char* span_kind_name(SpanKind kind);

struct TraceSpan {
  SpanKind kind = SpanKind::kCompute;
  int64_t micro_batch = -1;  // -1: not tied to one (e.g. idle)
  double start_us = 0;
  double dur_us = 0;
};

class TraceRecorder {
 public:
  using Clock = std::chrono::steady_clock;

  // Collective when `world` has more than one rank: a barrier, then this rank's epoch.
  void start(const World& world);
  bool enabled() const { return enabled_; }

  void record(SpanKind kind, int64_t micro_batch, Clock::time_point begin, Clock::time_point end);
  double since_epoch_us(Clock::time_point t) const;
  Clock::time_point epoch() const { return epoch_; }

  const std::vector<TraceSpan>& spans() const { return spans_; }

  // Every rank's spans on rank 0, indexed by rank (empty on other ranks). Collective.
  std::vector<std::vector<TraceSpan>> gather(const World& world) const;

 private:
  bool enabled_ = false;
  Clock::time_point epoch_{};
  std::vector<TraceSpan> spans_;
};

// Times a span from construction to destruction into `recorder` (when not null and enabled).
class ScopedSpan {
 public:
  ScopedSpan(TraceRecorder* recorder, SpanKind kind, int64_t micro_batch)
      : recorder_(recorder && recorder->enabled() ? recorder : nullptr), kind_(kind), micro_batch_(micro_batch) {
    if (recorder_) begin_ = TraceRecorder::Clock::now();
  }
  ~ScopedSpan() {
    if (recorder_) recorder_->record(kind_, micro_batch_, begin_, TraceRecorder::Clock::now());
  }
  ScopedSpan(const ScopedSpan&) = delete;
  ScopedSpan& operator=(const ScopedSpan&) = delete;

 private:
  TraceRecorder* recorder_;
  SpanKind kind_;
  int64_t micro_batch_;
  TraceRecorder::Clock::time_point begin_{};
};

}  // namespace kvpipe
