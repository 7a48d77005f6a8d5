// World: the MPI job this process belongs to.
//
// Initialises MPI with thread support (a one-rank run needs no mpirun: MPI starts as a
// singleton), knows the world rank and size and the local rank on the node (which picks the
// GPU), and finalises MPI on destruction. `abort` ends every rank of the job at once, which
// is how a failure on one rank becomes a non-zero exit everywhere instead of a hang.
#pragma once

#include <string>

namespace kvpipe {

class World {
 public:
  World(int* argc, char*** argv);
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  bool is_coordinator() const { return rank_ == 0; }

  // Ends the whole job with `exit_code`, from any rank.
  [[noreturn]] void abort(int exit_code) const;

 private:
  int rank_ = 0;
  int size_ = 1;
  int local_rank_ = 0;
};

}  // namespace kvpipe
