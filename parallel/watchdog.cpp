#include "parallel/watchdog.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <vector>

namespace kvpipe {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kTag = 0;
// Payloads: static, since an Isend reads its buffer until it completes.
const int kBeat = 0;
const int kGoodbye = 1;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

struct Watchdog::Comm {
  MPI_Comm comm = MPI_COMM_NULL;
};

double Watchdog::period_s(double timeout_s) { return std::clamp(timeout_s / 4.0, 0.01, 5.0); }

Watchdog::Watchdog(const World& world, double timeout_s, std::string what)
    : world_(world), timeout_s_(timeout_s), what_(std::move(what)) {
  if (world_.size() < 2 || !(timeout_s_ > 0.0)) return;
  comm_ = std::make_unique<Comm>();
  MPI_Comm_dup(MPI_COMM_WORLD, &comm_->comm);
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  if (!thread_.joinable()) return;
  if (std::uncaught_exceptions() > 0) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      abandon_ = true;
    }
    wake_.notify_all();
    thread_.join();
    // Sends may be outstanding and the peers are not told: the caller aborts the job, and
    // freeing the communicator here could block on them.
    comm_.release();
    return;
  }
  stop();
}

void Watchdog::stop() {
  if (!thread_.joinable()) return;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
  MPI_Comm_free(&comm_->comm);
  comm_.reset();
}

void Watchdog::run() {
  const MPI_Comm comm = comm_->comm;
  const int rank = world_.rank();
  // A star: rank 0 watches every rank and every rank watches rank 0, so any silent rank is
  // seen by someone with messages linear in the rank count.
  std::vector<int> peers;
  if (rank == 0) {
    for (int r = 1; r < world_.size(); ++r) peers.push_back(r);
  } else {
    peers.push_back(0);
  }
  const double period = period_s(timeout_s_);
  // Wake often enough to notice silence well within the timeout, and a stop at once.
  const auto tick = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(std::min(period, 0.1)));
  std::vector<Clock::time_point> heard(world_.size(), Clock::now());
  std::vector<char> gone(world_.size(), 0);  // said goodbye
  std::vector<MPI_Request> sends;
  Clock::time_point next_beat = Clock::now();
  Clock::time_point last_round = Clock::now();
  bool said_goodbye = false;

  const auto send_all = [&](const int* payload) {
    for (int p : peers) {
      sends.emplace_back();
      MPI_Isend(payload, 1, MPI_INT, p, kTag, comm, &sends.back());
    }
  };
  for (;;) {
    bool stopping = false;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // Once the goodbye is out, only the peers' goodbyes are awaited: poll them briskly,
      // since the caller's stop() waits on them.
      wake_.wait_for(lock, said_goodbye ? std::chrono::milliseconds(2) : tick,
                     [&] { return abandon_ || (stopping_ && !said_goodbye); });
      if (abandon_) return;
      stopping = stopping_;
    }
    const Clock::time_point now = Clock::now();
    // This thread itself did not run for a long while (this process was stopped and then
    // continued, or starved): the peers' silence over that span proves nothing, so it counts
    // afresh. A stopped rank resumed by mpirun to be killed must not accuse the others.
    if (seconds(now - last_round) > timeout_s_ / 2) std::fill(heard.begin(), heard.end(), now);
    last_round = now;
    if (stopping && !said_goodbye) {
      send_all(&kGoodbye);
      said_goodbye = true;
    } else if (!said_goodbye && now >= next_beat) {
      send_all(&kBeat);
      next_beat = now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(period));
    }
    // Completed heartbeats are dropped so the list stays short however long the job runs.
    sends.erase(std::remove_if(sends.begin(), sends.end(),
                               [](MPI_Request& r) {
                                 int done = 0;
                                 MPI_Test(&r, &done, MPI_STATUS_IGNORE);
                                 return done != 0;
                               }),
                sends.end());
    for (;;) {
      int flag = 0;
      MPI_Status status;
      MPI_Iprobe(MPI_ANY_SOURCE, kTag, comm, &flag, &status);
      if (!flag) break;
      int payload = 0;
      MPI_Recv(&payload, 1, MPI_INT, status.MPI_SOURCE, kTag, comm, MPI_STATUS_IGNORE);
      heard[status.MPI_SOURCE] = Clock::now();
      if (payload == kGoodbye) gone[status.MPI_SOURCE] = 1;
    }
    const Clock::time_point checked = Clock::now();
    bool all_gone = true;
    for (int p : peers) {
      if (gone[p]) continue;
      all_gone = false;
      const double silent = seconds(checked - heard[p]);
      if (silent < timeout_s_) continue;
      std::fprintf(stderr, "kvpipe: rank %d: error: rank %d has been silent for %.1f s (%s): stopping the job\n",
                   rank, p, silent, what_.c_str());
      std::fflush(stderr);
      world_.abort(1);
    }
    if (said_goodbye && all_gone) break;
  }
  // Every peer has our goodbye in flight or received, and stays until it has it.
  if (!sends.empty()) MPI_Waitall(static_cast<int>(sends.size()), sends.data(), MPI_STATUSES_IGNORE);
}

}  // namespace kvpipe
