// The NCCL backend: compiled only when CUDA and NCCL were found at configure time.
#include "parallel/communicator.h"
#include "parallel/tensor_group.h"

#include <ATen/ATen.h>
#include <mpi.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#ifdef KVPIPE_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>

namespace kvpipe {
namespace {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

void check_nccl(ncclResult_t res, const char* what) {
  if (res != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(res));
}

// The legacy default stream: LibTorch computes on it unless told otherwise.
cudaStream_t compute_stream() { return cudaStreamLegacy; }

// Makes `waiter` wait for the work queued on `stream` so far (the event may go at once: the
// wait holds what it needs).
void order_after(cudaStream_t waiter, cudaStream_t stream) {
  cudaEvent_t event;
  check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  check_cuda(cudaEventRecord(event, stream), "cudaEventRecord");
  check_cuda(cudaStreamWaitEvent(waiter, event, 0), "cudaStreamWaitEvent");
  cudaEventDestroy(event);
}

class NcclPendingSend : public PendingSend {
 public:
  NcclPendingSend(at::Tensor tensor, cudaEvent_t event) : tensor_(std::move(tensor)), event_(event) {}
  ~NcclPendingSend() override {
    wait();
    cudaEventDestroy(event_);
  }
  bool done() override { return cudaEventQuery(event_) == cudaSuccess; }
  void wait() override { cudaEventSynchronize(event_); }

 private:
  at::Tensor tensor_;
  cudaEvent_t event_;
};

class NcclCommunicator : public Communicator {
 public:
  explicit NcclCommunicator(const World& world) : device_index_(world.local_rank()) {
    int devices = 0;
    check_cuda(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    device_index_ = world.local_rank() % devices;
    check_cuda(cudaSetDevice(device_index_), "cudaSetDevice");
    // One communicator per job: rank 0 makes the id, MPI carries it to every rank.
    ncclUniqueId id;
    if (world.rank() == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    check_nccl(ncclCommInitRank(&comm_, world.size(), id, world.rank()), "ncclCommInitRank");
    // Transfers have a stream of their own, so that the next micro-batch's kernels run while
    // one is sent; non-blocking, or the legacy default stream would serialise the two again.
    check_cuda(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~NcclCommunicator() override {
    ncclCommDestroy(comm_);
    cudaStreamDestroy(comm_stream_);
  }

  std::string name() const override { return "nccl"; }
  at::Device device() const override { return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index_)); }

  // The send waits for the kernels that made the tensor, not for those queued after them; the
  // pending send keeps the tensor until its event says the transfer is done.
  std::unique_ptr<PendingSend> isend(const at::Tensor& tensor, int peer) override {
    at::Tensor t = tensor.contiguous();
    order_after(comm_stream_, compute_stream());
    check_nccl(ncclSend(t.data_ptr(), t.nbytes(), ncclUint8, peer, comm_, comm_stream_), "ncclSend");
    cudaEvent_t event;
    check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(event, comm_stream_), "cudaEventRecord");
    return std::make_unique<NcclPendingSend>(std::move(t), event);
  }

  // The receive waits for the compute queued so far (the allocator may have handed its buffer
  // out again after kernels that are still to run there), and the compute after it waits for
  // the receive.
  void recv(at::Tensor& tensor, int peer) override {
    order_after(comm_stream_, compute_stream());
    check_nccl(ncclRecv(tensor.data_ptr(), tensor.nbytes(), ncclUint8, peer, comm_, comm_stream_), "ncclRecv");
    order_after(compute_stream(), comm_stream_);
  }

 private:
  int device_index_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t comm_stream_ = nullptr;
};

// A tensor group's all-reduce on its ranks' GPUs: one NCCL communicator per group, its id
// carried over the group's MPI communicator, reducing on the compute stream so that the next
// layer's kernels queue behind it without the host waiting.
class NcclReducer : public DeviceReducer {
 public:
  NcclReducer(const void* mpi_group_comm, int rank, int size) {
    const MPI_Comm group = *static_cast<const MPI_Comm*>(mpi_group_comm);
    ncclUniqueId id;
    if (rank == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, group);
    check_nccl(ncclCommInitRank(&comm_, size, id, rank), "ncclCommInitRank (tensor group)");
  }
  ~NcclReducer() override { ncclCommDestroy(comm_); }

  void all_reduce_sum(at::Tensor& t) override {
    at::Tensor c = t.is_contiguous() ? t : t.contiguous();
    ncclDataType_t type = ncclFloat;
    switch (c.scalar_type()) {
      case at::kFloat: type = ncclFloat; break;
      case at::kHalf: type = ncclHalf; break;
      case at::kBFloat16: type = ncclBfloat16; break;
      default: throw std::logic_error("NCCL all-reduce of an unsupported dtype");
    }
    check_nccl(ncclAllReduce(c.data_ptr(), c.data_ptr(), static_cast<size_t>(c.numel()), type, ncclSum, comm_,
                             compute_stream()),
               "ncclAllReduce");
    if (!c.is_same(t)) t.copy_(c);
  }

 private:
  ncclComm_t comm_ = nullptr;
};

}  // namespace

std::unique_ptr<DeviceReducer> make_nccl_reducer(const void* mpi_group_comm, int rank, int size) {
  const std::string why = cuda_unavailable_reason();
  if (!why.empty()) throw std::invalid_argument("parallel.backend: nccl needs a CUDA GPU (" + why + ")");
  return std::make_unique<NcclReducer>(mpi_group_comm, rank, size);
}

bool cuda_device_available() { return cuda_unavailable_reason().empty(); }

int nccl_version() {
  int version = 0;
  return ncclGetVersion(&version) == ncclSuccess ? version : 0;
}

std::string cuda_unavailable_reason() {
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess) return std::string("the CUDA runtime reports: ") + cudaGetErrorString(err);
  if (devices > 0) return "";
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  return visible ? "no CUDA device is visible (CUDA_VISIBLE_DEVICES=" + std::string(visible) + ")"
                 : "no CUDA device is present";
}

int cuda_device_count() {
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess ? devices : 0;
}

void use_cuda_device(int device_index) { check_cuda(cudaSetDevice(device_index), "cudaSetDevice"); }

int64_t cuda_device_memory_bytes(int device_index) {
  cudaDeviceProp props;
  if (cudaGetDeviceProperties(&props, device_index) != cudaSuccess) return 0;
  return static_cast<int64_t>(props.totalGlobalMem);
}

std::string cuda_device_name(int device_index) {
  cudaDeviceProp props;
  if (cudaGetDeviceProperties(&props, device_index) != cudaSuccess) return "";
  return props.name;
}

std::unique_ptr<Communicator> make_nccl_communicator(const World& world) {
  const std::string why = cuda_unavailable_reason();
  if (!why.empty())
    throw std::invalid_argument("parallel.backend: nccl needs a CUDA GPU, and rank " +
                                std::to_string(world.rank()) + " has none usable (" + why + ")");
  if (!at::hasCUDA())
    throw std::invalid_argument("parallel.backend: nccl needs a CUDA-enabled LibTorch; this one is CPU-only");
  return std::make_unique<NcclCommunicator>(world);
}

}  // namespace kvpipe

#else  // !KVPIPE_HAVE_NCCL

namespace kvpipe {

bool cuda_device_available() { return false; }

int nccl_version() { return 0; }

std::string cuda_unavailable_reason() { return "kvpipe was built without the CUDA runtime"; }

int cuda_device_count() { return 0; }

void use_cuda_device(int) { throw std::invalid_argument("kvpipe was built without the CUDA runtime"); }

int64_t cuda_device_memory_bytes(int) { return 0; }

std::string cuda_device_name(int) { return ""; }

std::unique_ptr<Communicator> make_nccl_communicator(const World&) {
  throw std::invalid_argument("parallel.backend: nccl is not available: kvpipe was built without CUDA/NCCL");
}

std::unique_ptr<DeviceReducer> make_nccl_reducer(const void*, int, int) {
  throw std::invalid_argument("parallel.backend: nccl is not available: kvpipe was built without CUDA/NCCL");
}

}  // namespace kvpipe

#endif
