#include "engine/kernels/cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvpipe {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// How long an idle worker spins before it sleeps: longer than the gap between two kernels of a
// step (a few tens of microseconds), short enough not to hold a core between steps.
constexpr auto kSpin = std::chrono::microseconds(2000);

thread_local bool t_in_task = false;

}  // namespace

struct ThreadPool::State {
  std::vector<std::thread> workers;
  std::atomic<uint64_t> generation{0};
  std::atomic<int> pending{0};
  std::atomic<bool> stop{false};
  std::mutex mutex;
  std::condition_variable wake;
  std::atomic<int> sleepers{0};
  std::mutex busy;  // held by the thread running a task
  const std::function<void(int, int)>* task = nullptr;
  int count = 1;
  std::exception_ptr error;
  std::mutex error_mutex;

  void run(int index) {
    t_in_task = true;
    try {
      (*task)(index, count);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
    t_in_task = false;
  }

  void worker(int index) {
    uint64_t seen = 0;
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      uint64_t g;
      int spins = 0;
      while ((g = generation.load(std::memory_order_acquire)) == seen && !stop.load(std::memory_order_relaxed)) {
        cpu_relax();
        if (++spins % 1024 == 0 && std::chrono::steady_clock::now() - start > kSpin) {
          std::unique_lock<std::mutex> lock(mutex);
          sleepers.fetch_add(1);
          wake.wait(lock, [&] {
            return generation.load(std::memory_order_acquire) != seen || stop.load(std::memory_order_relaxed);
          });
          sleepers.fetch_sub(1);
        }
      }
      if (stop.load(std::memory_order_relaxed)) return;
      seen = g;
      run(index);
      pending.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
};

ThreadPool& ThreadPool::instance() {
  static ThreadPool pool;
  return pool;
}

ThreadPool::~ThreadPool() { set_threads(1); }

void ThreadPool::set_threads(int threads) {
  if (threads < 1) throw std::invalid_argument("thread pool: threads must be at least 1");
  if (state_ != nullptr) {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->stop.store(true);
    }
    state_->wake.notify_all();
    for (auto& t : state_->workers) t.join();
    delete state_;
    state_ = nullptr;
  }
  threads_ = threads;
  if (threads == 1) return;
  state_ = new State;
  state_->workers.reserve(threads - 1);
  for (int i = 1; i < threads; ++i) state_->workers.emplace_back([s = state_, i] { s->worker(i); });
}

void ThreadPool::run_on_all(const std::function<void(int, int)>& fn) {
  if (state_ == nullptr || t_in_task) {
    fn(0, 1);
    return;
  }
  std::unique_lock<std::mutex> busy(state_->busy, std::try_to_lock);
  if (!busy.owns_lock()) {  // another thread's task is in flight: compute here alone
    fn(0, 1);
    return;
  }
  State& s = *state_;
  s.task = &fn;
  s.count = threads_;
  s.error = nullptr;
  s.pending.store(threads_ - 1, std::memory_order_relaxed);
  {
    // The generation moves under the mutex so that a worker about to sleep sees it.
    std::lock_guard<std::mutex> lock(s.mutex);
    s.generation.fetch_add(1, std::memory_order_acq_rel);
  }
  if (s.sleepers.load() > 0) s.wake.notify_all();
  s.run(0);
  while (s.pending.load(std::memory_order_acquire) > 0) cpu_relax();
  s.task = nullptr;
  if (s.error) std::rethrow_exception(s.error);
}

void ThreadPool::parallel_for(int64_t n, int64_t align, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (align < 1) align = 1;
  const int64_t units = (n + align - 1) / align;
  const int64_t parts = std::min<int64_t>(threads_, units);
  if (parts <= 1 || state_ == nullptr || t_in_task) {
    fn(0, n);
    return;
  }
  run_on_all([&](int index, int count) {
    const int64_t used = std::min<int64_t>(count, units);
    if (index >= used) return;
    const int64_t begin = units * index / used * align;
    const int64_t end = std::min(n, units * (index + 1) / used * align);
    if (begin < end) fn(begin, end);
  });
}

void ThreadPool::parallel_chunks(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (chunk < 1) chunk = 1;
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (chunks <= 1 || state_ == nullptr || t_in_task) {
    fn(0, n);
    return;
  }
  // Three quarters of the chunks in one contiguous run per thread (one stream each, as
  // parallel_for), the rest handed out in turn to whichever thread is free.
  const int64_t own = chunks * 3 / 4 / threads_;
  std::atomic<int64_t> next{own * threads_};
  run_on_all([&](int index, int count) {
    if (count != threads_) return fn(0, n);  // run_on_all ran it on this thread alone
    if (own > 0) fn(index * own * chunk, std::min(n, (index + 1) * own * chunk));
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      fn(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

}  // namespace kvpipe
