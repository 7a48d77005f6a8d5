#include "parallel/trace_recorder.h"

#include "parallel/world.h"

#include <mpi.h>

namespace kvpipe {

const char* span_kind_name(SpanKind kind) {
  switch (kind) {
    case SpanKind::kCompute: return "compute";
    case SpanKind::kSend: return "send";
    case SpanKind::kRecv: return "receive";
    case SpanKind::kWait: return "wait";
    case SpanKind::kIdle: return "idle";
  }
  return "unknown";
}

void TraceRecorder::start(const World& world) {
  if (world.size() > 1) MPI_Barrier(MPI_COMM_WORLD);
  epoch_ = Clock::now();
  spans_.clear();
  enabled_ = true;
}

double TraceRecorder::since_epoch_us(Clock::time_point t) const {
  return std::chrono::duration<double, std::micro>(t - epoch_).count();
}

void TraceRecorder::record(SpanKind kind, int64_t micro_batch, Clock::time_point begin, Clock::time_point end) {
  if (!enabled_) return;
  spans_.push_back({kind, micro_batch, since_epoch_us(begin), std::chrono::duration<double, std::micro>(end - begin).count()});
}

std::vector<std::vector<TraceSpan>> TraceRecorder::gather(const World& world) const {
  // Four doubles per span: kind, micro-batch, start, duration (exact for these magnitudes).
  std::vector<double> mine;
  mine.reserve(spans_.size() * 4);
  for (const TraceSpan& s : spans_) {
    mine.push_back(static_cast<double>(static_cast<int>(s.kind)));
    mine.push_back(static_cast<double>(s.micro_batch));
    mine.push_back(s.start_us);
    mine.push_back(s.dur_us);
  }
  std::vector<std::vector<TraceSpan>> out;
  const auto unpack = [](const double* p, size_t n) {
    std::vector<TraceSpan> spans(n / 4);
    for (size_t i = 0; i < spans.size(); ++i) {
      spans[i].kind = static_cast<SpanKind>(static_cast<int>(p[4 * i]));
      spans[i].micro_batch = static_cast<int64_t>(p[4 * i + 1]);
      spans[i].start_us = p[4 * i + 2];
      spans[i].dur_us = p[4 * i + 3];
    }
    return spans;
  };
  if (world.size() == 1) {
    out.push_back(unpack(mine.data(), mine.size()));
    return out;
  }
  const int count = static_cast<int>(mine.size());
  std::vector<int> counts(world.size()), displs(world.size());
  MPI_Gather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::vector<double> all;
  if (world.rank() == 0) {
    int total = 0;
    for (int r = 0; r < world.size(); ++r) displs[r] = total, total += counts[r];
    all.resize(total);
  }
  MPI_Gatherv(mine.data(), count, MPI_DOUBLE, all.data(), counts.data(), displs.data(), MPI_DOUBLE, 0,
              MPI_COMM_WORLD);
  if (world.rank() != 0) return out;
  for (int r = 0; r < world.size(); ++r) out.push_back(unpack(all.data() + displs[r], counts[r]));
  return out;
}

}  // namespace kvpipe
