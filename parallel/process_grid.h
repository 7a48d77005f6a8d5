// ProcessGrid: an MPI job of N ranks as S pipeline stages by T tensor ranks (N = S x T).
//
// Rank r is stage r / T and tensor rank r % T: a tensor group is T contiguous ranks, as
// vLLM and TensorRT-LLM place them, so that mpirun's and SLURM's default placement (ranks
// filled node by node) keeps a group on one node and its all-reduces off the network. The
// first rank of each stage (tensor rank 0) is its leader: it alone talks to the neighbouring
// stages and hands what it receives to the rest of its group.
#pragma once

#include <stdexcept>
#include <string>

namespace kvpipe {

struct ProcessGrid {
  int world_size = 1;
  int tensor = 1;  // ranks per stage

  // std::invalid_argument naming parallel.tensor when `tensor` does not divide `world_size`.
  static ProcessGrid make(int world_size, int tensor) {
    if (tensor < 1)
      throw std::invalid_argument("parallel.tensor: " + std::to_string(tensor) + " must be at least 1");
    if (world_size % tensor != 0)
      throw std::invalid_argument("parallel.tensor: " + std::to_string(tensor) + " does not divide the job's " +
                                  std::to_string(world_size) + (world_size == 1 ? " rank" : " ranks") +
                                  " (ranks = stages x parallel.tensor)");
    return {world_size, tensor};
  }

  int stages() const { return world_size / tensor; }
  int stage_of(int rank) const { return rank / tensor; }
  int tensor_rank_of(int rank) const { return rank % tensor; }
  int leader_of(int stage) const { return stage * tensor; }
  bool is_leader(int rank) const { return rank % tensor == 0; }
};

}  // namespace kvpipe
