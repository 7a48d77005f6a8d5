#include "launch/signals.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

namespace kvpipe {
namespace {

// Lock-free atomics are async-signal-safe; std::sig_atomic_t could not hold "which signal"
// and "how many" together portably.
std::atomic<int> g_signal{0};
std::atomic<int> g_count{0};

void on_stop_signal(int signal) {
  int expected = 0;
  g_signal.compare_exchange_strong(expected, signal);
  if (g_count.fetch_add(1) >= 1) {
    // A second signal: the user (or mpirun) insists; leave now without cleanup.
    ::_exit(128 + signal);
  }
}

}  // namespace

void install_stop_handlers() {
  struct sigaction action;
  std::memset(&action, 0, sizeof action);
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  // No SA_RESTART: a blocking read returns EINTR rather than waiting on.
  action.sa_flags = 0;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

bool stop_requested() { return g_signal.load() != 0; }

int stop_signal() { return g_signal.load(); }

int stop_exit_code() {
  const int signal = g_signal.load();
  return signal ? 128 + signal : 0;
}

void request_stop(int signal) {
  g_signal = signal;
  g_count = signal ? 1 : 0;
}

}  // namespace kvpipe
