// PipelineChannel: the wire between pipeline stages, and the clock of each rank.
//
// A message is a control header (int64 words, always over MPI) followed by an optional
// tensor whose shape and dtype travel in the header (over the Communicator: NCCL for CUDA
// tensors, MPI for host tensors; a tensor on another device than the communicator's is
// copied to it first, which is the host staging of ranks that share a GPU over MPI).
// Received tensors live on the communicator's device. Sends are asynchronous and completed lazily, so a rank
// never blocks on a neighbour that is still computing. The channel times what the rank does
// with it: waiting for a message to arrive (the pipeline bubble), moving tensors, and
// computing between messages, without adding any synchronisation between ranks, and can
// record each of those spans for a trace.
#pragma once

#include "parallel/communicator.h"
#include "parallel/trace_recorder.h"

#include <ATen/Tensor.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

namespace kvpipe {

struct Message {
  std::vector<int64_t> header;
  at::Tensor tensor;  // undefined when the sender sent none
};

// A tensor group's collectives on this rank (parallel/tensor_group.h).
struct GroupTimes {
  int64_t all_reduce_calls = 0;
  double all_reduce_s = 0;
  int64_t other_calls = 0;  // the leader's broadcasts of each step and gathers of the logits
  double other_s = 0;
};

struct RankTimes {
  double wait_s = 0;     // blocked until a message arrived
  double comm_s = 0;     // moving tensors and completing sends
  double compute_s = 0;  // the rest of the time between start() and stop()
  double total_s = 0;
  // Tensor ranks: in all-reduces (waiting for the slowest rank of the group included), and in
  // the group's broadcasts and gathers (where a rank waits for its leader's next step).
  double all_reduce_s = 0;
  double all_reduce_calls = 0;
  double group_s = 0;
};

class PipelineChannel {
 public:
  PipelineChannel(const World& world, Communicator& comm);
  ~PipelineChannel();

  void send(int peer, const std::vector<int64_t>& header, const at::Tensor& tensor = {});
  Message recv(int peer);
  // Completes every pending send.
  void flush();

  // Accounting window: everything outside wait and comm between start and stop is compute.
  // A stage that only reacts to messages starts its window when the first one arrives, so
  // that the coordinator's start-up does not count as pipeline bubble.
  void start();
  void start_on_first_message();
  void stop();
  RankTimes times() const;
  // The rank's tensor-group time, taken out of compute (call before times()).
  void set_group_times(const GroupTimes& g) { group_ = g; }
  // Gathers every rank's times on rank 0 (collective: every rank calls it).
  std::vector<RankTimes> gather_times() const;

  Communicator& communicator() { return comm_; }

  // Records wait, receive and send spans into `trace` (not owned; null turns it off). The
  // span's micro-batch is the first header word, where the pipeline protocol puts it.
  void set_trace(TraceRecorder* trace) { trace_ = trace; }
  TraceRecorder* trace() const { return trace_; }

 private:
  using Clock = std::chrono::steady_clock;
  void reap();

  const World& world_;
  Communicator& comm_;
  struct Pending {
    std::vector<int64_t> header;
    void* header_request = nullptr;
    std::unique_ptr<PendingSend> tensor;
  };
  std::deque<std::unique_ptr<Pending>> pending_;
  Clock::time_point started_{};
  bool start_pending_ = false;
  double wait_s_ = 0, comm_s_ = 0, total_s_ = 0;
  GroupTimes group_;
  TraceRecorder* trace_ = nullptr;
};

}  // namespace kvpipe
