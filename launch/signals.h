// Stopping a job on SIGINT or SIGTERM.
//
// The handlers only record the signal: the coordinator's step loop polls stop_requested(),
// stops scheduling, lets the micro-batches in flight come back, and the job shuts its
// pipeline down and exits with 128 + the signal (130 for SIGINT, 143 for SIGTERM). The
// requests finished before the signal are already printed (generate writes each line as
// its request finishes), so nothing is lost when mpirun kills the ranks soon after passing
// the signal on. A second signal of the same kind ends the process at once, for a job that
// does not get to its next step.
#pragma once

namespace kvpipe {

// Installs the handlers for SIGINT and SIGTERM (idempotent).
void install_stop_handlers();

// True once SIGINT or SIGTERM arrived (or request_stop was called).
bool stop_requested();

// The first stop signal received, 0 if none.
int stop_signal();

// 128 + stop_signal(), or 0 if no signal arrived.
int stop_exit_code();

// As if `signal` arrived (tests); 0 clears the request.
void request_stop(int signal);

}  // namespace kvpipe
