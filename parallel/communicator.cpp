#include "parallel/communicator.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <mpi.h>

#include <stdexcept>

namespace kvpipe {
namespace {

// Payloads travel on their own tag so they never match a control message.
constexpr int kTensorTag = 2;

class MpiPendingSend : public PendingSend {
 public:
  MpiPendingSend(at::Tensor tensor, MPI_Request request) : tensor_(std::move(tensor)), request_(request) {}
  ~MpiPendingSend() override { wait(); }
  bool done() override {
    if (request_ == MPI_REQUEST_NULL) return true;
    int flag = 0;
    MPI_Test(&request_, &flag, MPI_STATUS_IGNORE);
    return flag != 0;
  }
  void wait() override {
    if (request_ != MPI_REQUEST_NULL) MPI_Wait(&request_, MPI_STATUS_IGNORE);
  }

 private:
  at::Tensor tensor_;
  MPI_Request request_;
};

class MpiCommunicator : public Communicator {
 public:
  std::string name() const override { return "mpi"; }
  at::Device device() const override { return at::kCPU; }

  std::unique_ptr<PendingSend> isend(const at::Tensor& tensor, int peer) override {
    at::Tensor t = tensor.contiguous();
    if (!t.is_cpu()) throw std::logic_error("the MPI communicator sends host tensors only");
    MPI_Request req;
    MPI_Isend(t.data_ptr(), static_cast<int>(t.nbytes()), MPI_BYTE, peer, kTensorTag, MPI_COMM_WORLD, &req);
    return std::make_unique<MpiPendingSend>(std::move(t), req);
  }

  void recv(at::Tensor& tensor, int peer) override {
    if (!tensor.is_contiguous() || !tensor.is_cpu()) throw std::logic_error("recv needs a contiguous host tensor");
    MPI_Status status;
    MPI_Recv(tensor.data_ptr(), static_cast<int>(tensor.nbytes()), MPI_BYTE, peer, kTensorTag, MPI_COMM_WORLD,
             &status);
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    if (static_cast<size_t>(count) != tensor.nbytes())
      throw std::runtime_error("tensor from rank " + std::to_string(peer) + " has " + std::to_string(count) +
                               " bytes, expected " + std::to_string(tensor.nbytes()));
  }
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(const World&) { return std::make_unique<MpiCommunicator>(); }

std::unique_ptr<Communicator> make_communicator(const std::string& backend, const World& world) {
  if (backend == "mpi") return make_mpi_communicator(world);
  if (backend == "nccl") return make_nccl_communicator(world);
  if (backend != "auto") throw std::invalid_argument("parallel.backend: unknown backend '" + backend + "'");
  // Tensors live on the GPU only when LibTorch itself can use one.
  if (cuda_device_available() && at::hasCUDA()) return make_nccl_communicator(world);
  return make_mpi_communicator(world);
}

}  // namespace kvpipe
