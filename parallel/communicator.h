// Communicator: point-to-point transfer of activation tensors between pipeline ranks.
//
// Two backends behind one interface: MPI for tensors in host memory (CPU runs, and every
// test on machines without a GPU), and NCCL for CUDA tensors, compiled when CUDA and NCCL
// are found. A send returns at once with a handle that keeps the tensor alive until the
// transfer is done, so a stage never blocks on a neighbour that is still computing (blocking
// sends between the first and last stage deadlock once messages exceed the eager limit).
// Receives are blocking (MPI) or ordered on the compute stream (NCCL). NCCL transfers run on a
// communication stream of their own, ordered with the compute stream by events: a send waits
// for the kernels that made its tensor only, so the next micro-batch computes while it goes.
#pragma once

#include "parallel/world.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>

namespace kvpipe {

class PendingSend {
 public:
  virtual ~PendingSend() = default;
  virtual bool done() = 0;   // non-blocking check
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual std::string name() const = 0;
  // Device the tensors of this backend live on.
  virtual at::Device device() const = 0;
  virtual std::unique_ptr<PendingSend> isend(const at::Tensor& tensor, int peer) = 0;
  // Fills `tensor` (allocated by the caller with the sender's shape and dtype).
  virtual void recv(at::Tensor& tensor, int peer) = 0;
};

std::unique_ptr<Communicator> make_mpi_communicator(const World& world);

// Throws std::invalid_argument when the build has no NCCL or the machine no GPU.
std::unique_ptr<Communicator> make_nccl_communicator(const World& world);

// Whether this build has the NCCL backend and this process sees a CUDA device.
bool cuda_device_available();

// The NCCL this process runs (ncclGetVersion: 22809 for 2.28.9), or 0 in a build without it.
int nccl_version();

// CUDA devices this process sees (0 without the CUDA runtime), and one device's memory in
// bytes and name (0 and "" when it cannot be read).
int cuda_device_count();
int64_t cuda_device_memory_bytes(int device_index);
std::string cuda_device_name(int device_index);
// Makes `device_index` this thread's current CUDA device (std::runtime_error when it cannot).
void use_cuda_device(int device_index);

// Empty when this process can use a CUDA device; otherwise why not, in words a user can act
// on (no driver, no device, CUDA_VISIBLE_DEVICES hides them all, ...).
std::string cuda_unavailable_reason();

// `backend` is auto | mpi | nccl; auto picks NCCL when tensors live on a GPU (a CUDA
// device is present and LibTorch can use it), MPI otherwise.
std::unique_ptr<Communicator> make_communicator(const std::string& backend, const World& world);

}  // namespace kvpipe
