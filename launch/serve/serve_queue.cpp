#include "launch/serve/serve_queue.h"

namespace kvpipe {

void ResponseChannel::push(ChoiceEvent event) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!event.finish_reason.empty()) --open_choices_;
    events_.push_back(std::move(event));
  }
  ready_.notify_all();
}

bool ResponseChannel::wait(std::vector<ChoiceEvent>& out, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  ready_.wait_for(lock, timeout, [&] { return !events_.empty() || open_choices_ <= 0; });
  const bool moved = !events_.empty();
  out.insert(out.end(), std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
  events_.clear();
  return open_choices_ > 0 || moved;
}

ServeQueue::Admission ServeQueue::submit(Submission& s, int choices) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return Admission::kClosed;
    if (unfinished_ + choices > max_unfinished_) return Admission::kFull;
    unfinished_ += choices;
    s.id = next_id_++;
    submissions_.push_back(s);
  }
  arrived_.notify_all();
  return Admission::kAccepted;
}

void ServeQueue::cancel(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    cancellations_.push_back(id);
  }
  arrived_.notify_all();
}

void ServeQueue::take(std::vector<Submission>& submissions, std::vector<uint64_t>& cancellations) {
  std::lock_guard<std::mutex> lock(mutex_);
  submissions.swap(submissions_);
  submissions_.clear();
  cancellations.swap(cancellations_);
  cancellations_.clear();
}

void ServeQueue::finished(int choices) {
  std::lock_guard<std::mutex> lock(mutex_);
  unfinished_ -= choices;
}

void ServeQueue::wait_until(std::chrono::steady_clock::time_point until) {
  std::unique_lock<std::mutex> lock(mutex_);
  arrived_.wait_until(lock, until, [&] { return !submissions_.empty() || !cancellations_.empty(); });
}

void ServeQueue::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
  }
  arrived_.notify_all();
}

bool ServeQueue::closed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return closed_;
}

int64_t ServeQueue::unfinished() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return unfinished_;
}

}  // namespace kvpipe
