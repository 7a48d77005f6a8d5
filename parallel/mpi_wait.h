// MPI waits that do not spin while nothing comes.
//
// Open MPI's blocking calls (MPI_Probe, MPI_Bcast, MPI_Wait) poll at full speed, so a rank
// waiting for a step that does not come (an idle server) keeps a core busy, and ranks that
// share cores take it from the ones computing. These poll at full speed for a short while
// (within a running pipeline the next message comes within a step, and a spin sees it
// soonest), then sleep between polls, lengthening the nap up to kMaxNap: a message after
// idle is seen within about that long, and idling costs a few wake-ups per millisecond.
#pragma once

#include <mpi.h>

#include <chrono>

namespace kvpipe {

inline constexpr std::chrono::microseconds kSpinBeforeNapping{50000};
inline constexpr std::chrono::microseconds kMaxNap{1000};

// MPI_Probe, then the status of the message found.
void probe_without_spinning(int source, int tag, MPI_Comm comm, MPI_Status* status);

// MPI_Wait on a request that may take long (a broadcast whose root is idle).
void wait_without_spinning(MPI_Request* request);

}  // namespace kvpipe
