// TensorGroup: the collectives of one pipeline stage's tensor ranks.
//
// Each stage's T ranks get their own MPI communicator (split from the world by stage), so
// that groups reduce at the same time without meeting. All-reduce sums the row-parallel
// projections' partial outputs in place: over NCCL on the compute stream when each rank owns
// a GPU (a NCCL communicator per group), otherwise over MPI, tensors on a GPU staged through
// host memory (ranks that share a GPU cannot use NCCL). The leader (tensor
// rank 0) broadcasts each step's message to the group and gathers the LM head's vocabulary
// slices. Every call is collective over the group: each rank makes the same calls in the
// same order. The group times its all-reduces (calls and seconds) for the per-rank report.
#pragma once

#include "parallel/pipeline_channel.h"
#include "parallel/process_grid.h"
#include "parallel/world.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace kvpipe {

// An all-reduce over the group's devices (parallel/nccl_communicator.cpp).
class DeviceReducer {
 public:
  virtual ~DeviceReducer() = default;
  virtual void all_reduce_sum(at::Tensor& t) = 0;
};
// Over the group's MPI communicator (`mpi_group_comm` points to it); std::invalid_argument in a
// build without NCCL or on a rank without a GPU. Collective over the group.
std::unique_ptr<DeviceReducer> make_nccl_reducer(const void* mpi_group_comm, int rank, int size);

class TensorGroup {
 public:
  // `nccl`: all-reduce CUDA tensors over NCCL (every rank of the group on a GPU of its own).
  TensorGroup(const World& world, const ProcessGrid& grid, bool nccl = false);
  ~TensorGroup();
  TensorGroup(const TensorGroup&) = delete;
  TensorGroup& operator=(const TensorGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  bool is_leader() const { return rank_ == 0; }

  // Sums `t` over the group, in place (float32, float16 or bfloat16): over MPI in float32, over
  // NCCL in the tensor's dtype.
  void all_reduce_sum(at::Tensor& t);
  // The leader's `message` on every rank of the group (ignored on the others).
  Message broadcast(const Message& message);
  // `part` [rows, cols_r] of every rank side by side, [rows, sum of cols_r], on the leader in
  // rank order; undefined on the others.
  at::Tensor gather_columns(const at::Tensor& part);

  const GroupTimes& times() const { return times_; }
  bool uses_nccl() const { return reducer_ != nullptr; }

 private:
  void* comm_ = nullptr;  // MPI_Comm, kept out of this header
  std::unique_ptr<DeviceReducer> reducer_;
  int rank_ = 0;
  int size_ = 1;
  GroupTimes times_;
};

}  // namespace kvpipe
