#include "parallel/tensor_group.h"

#include "parallel/mpi_wait.h"

#include <ATen/ATen.h>
#include <mpi.h>

#include <chrono>
#include <limits>
#include <stdexcept>

namespace kvpipe {
namespace {

using Clock = std::chrono::steady_clock;

MPI_Comm& as_comm(void* p) { return *static_cast<MPI_Comm*>(p); }

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Message shape on the wire: [header words, has tensor, dtype, dims, sizes...].
constexpr int kMaxDims = 8;
constexpr int kMetaWords = 4 + kMaxDims;

}  // namespace

TensorGroup::TensorGroup(const World& world, const ProcessGrid& grid, bool nccl) {
  comm_ = new MPI_Comm(MPI_COMM_NULL);
  // Collective over the world: the stage is the colour, the tensor rank the order.
  MPI_Comm_split(MPI_COMM_WORLD, grid.stage_of(world.rank()), grid.tensor_rank_of(world.rank()), &as_comm(comm_));
  MPI_Comm_rank(as_comm(comm_), &rank_);
  MPI_Comm_size(as_comm(comm_), &size_);
  if (size_ != grid.tensor || rank_ != grid.tensor_rank_of(world.rank()))
    throw std::logic_error("tensor group of rank " + std::to_string(world.rank()) + " has the wrong shape");
  if (nccl) reducer_ = make_nccl_reducer(comm_, rank_, size_);
}

TensorGroup::~TensorGroup() {
  reducer_.reset();
  if (as_comm(comm_) != MPI_COMM_NULL) MPI_Comm_free(&as_comm(comm_));
  delete static_cast<MPI_Comm*>(comm_);
}

void TensorGroup::all_reduce_sum(at::Tensor& t) {
  const auto t0 = Clock::now();
  if (reducer_ != nullptr && t.is_cuda()) {
    reducer_->all_reduce_sum(t);
    ++times_.all_reduce_calls;
    times_.all_reduce_s += seconds_since(t0);  // the queueing only: NCCL runs on the stream
    return;
  }
  const bool in_place = t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
  at::Tensor host = in_place ? t : t.to(at::kCPU, at::kFloat).contiguous();
  if (host.numel() > std::numeric_limits<int>::max()) throw std::logic_error("all-reduce of more than 2^31 values");
  MPI_Allreduce(MPI_IN_PLACE, host.data_ptr(), static_cast<int>(host.numel()), MPI_FLOAT, MPI_SUM,
                as_comm(comm_));
  if (!in_place) t.copy_(host);
  ++times_.all_reduce_calls;
  times_.all_reduce_s += seconds_since(t0);
}

Message TensorGroup::broadcast(const Message& message) {
  const auto t0 = Clock::now();
  int64_t meta[kMetaWords] = {};
  at::Tensor payload;
  if (is_leader()) {
    meta[0] = static_cast<int64_t>(message.header.size());
    if (message.tensor.defined()) {
      payload = message.tensor.to(at::kCPU).contiguous();
      if (payload.dim() > kMaxDims) throw std::logic_error("broadcast of a tensor of more than 8 dimensions");
      meta[1] = 1;
      meta[2] = static_cast<int64_t>(payload.scalar_type());
      meta[3] = payload.dim();
      for (int64_t d = 0; d < payload.dim(); ++d) meta[4 + d] = payload.size(d);
    }
  }
  // The followers wait here for the leader's next step, however long the server idles.
  MPI_Request request;
  MPI_Ibcast(meta, kMetaWords, MPI_INT64_T, 0, as_comm(comm_), &request);
  wait_without_spinning(&request);
  Message out;
  out.header = is_leader() ? message.header : std::vector<int64_t>(static_cast<size_t>(meta[0]));
  if (meta[0] > 0) MPI_Bcast(out.header.data(), static_cast<int>(meta[0]), MPI_INT64_T, 0, as_comm(comm_));
  if (meta[1] != 0) {
    if (!is_leader()) {
      std::vector<int64_t> sizes(meta + 4, meta + 4 + meta[3]);
      payload = at::empty(sizes, at::TensorOptions().dtype(static_cast<at::ScalarType>(meta[2])));
    }
    MPI_Bcast(payload.data_ptr(), static_cast<int>(payload.nbytes()), MPI_BYTE, 0, as_comm(comm_));
    out.tensor = is_leader() ? message.tensor : payload;
  }
  ++times_.other_calls;
  times_.other_s += seconds_since(t0);
  return out;
}

at::Tensor TensorGroup::gather_columns(const at::Tensor& part) {
  const auto t0 = Clock::now();
  const at::Tensor mine = part.to(at::kCPU).contiguous();
  if (mine.dim() != 2) throw std::logic_error("gather_columns of a tensor that is not 2-D");
  const int64_t rows = mine.size(0), elem = static_cast<int64_t>(mine.element_size());
  int64_t cols = mine.size(1);
  std::vector<int64_t> all_cols(static_cast<size_t>(size_));
  MPI_Gather(&cols, 1, MPI_INT64_T, all_cols.data(), 1, MPI_INT64_T, 0, as_comm(comm_));
  std::vector<int> counts, displs;
  at::Tensor flat;
  if (is_leader()) {
    int64_t total = 0;
    for (const int64_t c : all_cols) {
      counts.push_back(static_cast<int>(rows * c * elem));
      displs.push_back(static_cast<int>(total * rows * elem));
      total += c;
    }
    flat = at::empty({rows * total}, mine.options());
  }
  MPI_Gatherv(mine.data_ptr(), static_cast<int>(mine.nbytes()), MPI_BYTE, is_leader() ? flat.data_ptr() : nullptr,
              counts.data(), displs.data(), MPI_BYTE, 0, as_comm(comm_));
  at::Tensor out;
  if (is_leader()) {
    std::vector<at::Tensor> pieces;
    int64_t offset = 0;
    for (const int64_t c : all_cols) {
      pieces.push_back(flat.narrow(0, offset, rows * c).view({rows, c}));
      offset += rows * c;
    }
    out = at::cat(pieces, 1);
  }
  ++times_.other_calls;
  times_.other_s += seconds_since(t0);
  return out;
}

}  // namespace kvpipe
