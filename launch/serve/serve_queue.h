// ServeQueue: the only meeting point of `kvpipe serve`'s HTTP threads and its coordinator.
//
// HTTP threads never touch the engine (nor MPI): they submit parsed requests and cancel
// them here, and read each request's events from its ResponseChannel. The coordinator takes
// submissions and cancellations between steps and pushes events as tokens come back. The
// queue bounds the requests not yet finished (a full queue is a 503) and closes on
// shutdown (new requests are refused, those accepted still get every event).
#pragma once

#include "launch/serve/serve_protocol.h"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

namespace kvpipe {

// The events of one HTTP request, from the coordinator to the thread that answers it.
class ResponseChannel {
 public:
  explicit ResponseChannel(int choices) : open_choices_(choices) {}

  void push(ChoiceEvent event);
  // Waits until events arrive or `timeout` passes; moves them into `out`. False once every
  // choice has finished and nothing is left to read.
  bool wait(std::vector<ChoiceEvent>& out, std::chrono::milliseconds timeout);

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<ChoiceEvent> events_;
  int open_choices_;
};

struct Submission {
  uint64_t id = 0;
  std::shared_ptr<const CompletionRequest> request;
  std::shared_ptr<ResponseChannel> channel;
  std::chrono::steady_clock::time_point arrival;
};

class ServeQueue {
 public:
  explicit ServeQueue(int64_t max_unfinished) : max_unfinished_(max_unfinished) {}

  enum class Admission { kAccepted, kFull, kClosed };
  // Queues a request of `choices` engine requests under a fresh id (set in `s.id`).
  Admission submit(Submission& s, int choices);
  void cancel(uint64_t id);
  // The coordinator: what arrived since the last call.
  void take(std::vector<Submission>& submissions, std::vector<uint64_t>& cancellations);
  // The coordinator: `choices` engine requests have finished.
  void finished(int choices);
  // Sleeps until something arrives or `until`.
  void wait_until(std::chrono::steady_clock::time_point until);
  // Refuses new requests from now on.
  void close();
  bool closed() const;
  int64_t unfinished() const;

 private:
  mutable std::mutex mutex_;
  std::condition_variable arrived_;
  std::vector<Submission> submissions_;
  std::vector<uint64_t> cancellations_;
  int64_t max_unfinished_;
  int64_t unfinished_ = 0;
  uint64_t next_id_ = 1;
  bool closed_ = false;
};

}  // namespace kvpipe
