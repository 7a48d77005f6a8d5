// ThreadPool: the one set of compute threads of a rank, kept for the whole run.
//
// A decode step calls a few hundred small kernels, each worth tens of microseconds, so a
// hand-off must cost about a microsecond: workers spin on a generation counter for a short
// while after each task (then sleep on a condition variable) and the calling thread takes a
// share of every task itself. Work is split into one contiguous range per thread (the
// memory-bound kernels want one sequential stream per core), or, for kernels that do not care
// how their work is split, into chunks taken in turn. A parallel_for inside a task, or
// from another thread while one is in flight, runs inline on the caller. Threads are created
// once (set_threads) and inherit the affinity of the thread that creates them.
#pragma once

#include <cstdint>
#include <functional>

namespace kvpipe {

class ThreadPool {
 public:
  // The process's pool (one thread until set_threads).
  static ThreadPool& instance();

  // Threads that compute, the caller included; starts or stops workers. Not during a task.
  void set_threads(int threads);
  int threads() const { return threads_; }

  // fn(begin, end) over [0, n) split into at most threads() ranges, each a multiple of
  // `align` (except the last); returns when every range is done. Exceptions from fn are
  // rethrown on the caller (the first one).
  void parallel_for(int64_t n, int64_t align, const std::function<void(int64_t, int64_t)>& fn);

  // fn(begin, end) over [0, n) in pieces of `chunk` (the last one shorter), each handed to the
  // next thread that is free, in order. For kernels whose result does not depend on the split:
  // the two cores of a machine do not always run at one speed (a guest's cores share their host
  // with others), and with one fixed range each the step waits for the slower one.
  void parallel_chunks(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn);

  // fn(thread_index, thread_count) once on each of the pool's threads.
  void run_on_all(const std::function<void(int, int)>& fn);

  ~ThreadPool();

 private:
  ThreadPool() = default;
  struct State;
  State* state_ = nullptr;
  int threads_ = 1;
};

// ThreadPool::instance().parallel_for.
inline void parallel_rows(int64_t n, int64_t align, const std::function<void(int64_t, int64_t)>& fn) {
  ThreadPool::instance().parallel_for(n, align, fn);
}

// ThreadPool::instance().parallel_chunks.
inline void parallel_chunks(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
  ThreadPool::instance().parallel_chunks(n, chunk, fn);
}

}  // namespace kvpipe
