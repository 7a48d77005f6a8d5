// Watchdog: turns a rank that has gone silent into the end of the whole job.
//
// A rank stopped by SIGSTOP, or frozen with every thread inside a stuck driver, would
// otherwise leave its neighbours blocked on a receive forever. Each rank runs a thread that
// sends a heartbeat on a communicator of its own (a duplicate of MPI_COMM_WORLD, so no
// message of the pipeline can match it) every timeout/4 s: rank 0 to every other rank, and
// every other rank to rank 0. A rank that hears nothing from a peer it watches for
// `timeout_s` seconds prints one line naming the silent rank and aborts the job, so every
// rank exits non-zero. Waiting for work is not silence: the heartbeat thread beats whatever
// the main thread is doing, so a server idle for hours keeps its job alive.
//
// Guarantees: nothing on the step path (the main thread never touches the watchdog between
// start and stop); a normal end never trips it, because stop() is a goodbye exchange (a rank
// that finishes first keeps watching, and is not watched, until its peers finish too); one
// rank, or a timeout of 0, starts nothing.
#pragma once

#include "parallel/world.h"

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace kvpipe {

class Watchdog {
 public:
  // Collective: every rank constructs it at the same point (it duplicates MPI_COMM_WORLD).
  // `what` names the setting in the message, e.g. "parallel.timeout".
  Watchdog(const World& world, double timeout_s, std::string what = "parallel.timeout");
  // Stops as stop() does; while an exception unwinds (the job is about to be aborted by the
  // caller) it leaves at once, without the goodbye exchange.
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Collective: says goodbye to the watched peers and returns once each of them has said
  // goodbye too. A peer that goes silent before it does still ends the job.
  void stop();

  bool active() const { return thread_.joinable(); }
  // The heartbeat interval: timeout/4, within [10 ms, 5 s].
  static double period_s(double timeout_s);

 private:
  void run();

  const World& world_;
  const double timeout_s_;
  const std::string what_;
  struct Comm;  // the duplicated MPI_Comm, kept out of the header
  std::unique_ptr<Comm> comm_;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;   // guarded by mutex_
  bool abandon_ = false;    // guarded by mutex_: leave without the goodbye exchange
};

}  // namespace kvpipe
