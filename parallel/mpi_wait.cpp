#include "parallel/mpi_wait.h"

#include <algorithm>
#include <thread>

namespace kvpipe {
namespace {

// Polls `done` (true once the operation has completed) at full speed, then with naps.
template <typename Done>
void poll_until(Done done) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point spin_end = Clock::now() + kSpinBeforeNapping;
  while (Clock::now() < spin_end)
    if (done()) return;
  std::chrono::microseconds nap{20};
  while (!done()) {
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, kMaxNap);
  }
}

}  // namespace

void probe_without_spinning(int source, int tag, MPI_Comm comm, MPI_Status* status) {
  poll_until([&] {
    int flag = 0;
    MPI_Iprobe(source, tag, comm, &flag, status);
    return flag != 0;
  });
}

void wait_without_spinning(MPI_Request* request) {
  poll_until([&] {
    int flag = 0;
    MPI_Test(request, &flag, MPI_STATUS_IGNORE);
    return flag != 0;
  });
}

}  // namespace kvpipe
