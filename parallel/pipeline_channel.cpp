#include "parallel/pipeline_channel.h"

#include "parallel/mpi_wait.h"

#include <ATen/ATen.h>
#include <mpi.h>

#include <stdexcept>

namespace kvpipe {
namespace {

constexpr int kHeaderTag = 1;
// Words the channel appends to a header: dtype, rank, then the dims.
constexpr int64_t kNoTensor = -1;

double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

PipelineChannel::PipelineChannel(const World& world, Communicator& comm) : world_(world), comm_(comm) {}

PipelineChannel::~PipelineChannel() {
  try {
    flush();
  } catch (...) {
  }
}

void PipelineChannel::reap() {
  while (!pending_.empty()) {
    Pending& p = *pending_.front();
    int flag = 0;
    auto* req = static_cast<MPI_Request*>(p.header_request);
    MPI_Test(req, &flag, MPI_STATUS_IGNORE);
    if (!flag || (p.tensor && !p.tensor->done())) break;
    delete req;
    pending_.pop_front();
  }
}

void PipelineChannel::send(int peer, const std::vector<int64_t>& header, const at::Tensor& tensor) {
  const auto t0 = Clock::now();
  reap();
  auto p = std::make_unique<Pending>();
  p->header = header;
  if (tensor.defined()) {
    p->header.push_back(static_cast<int64_t>(tensor.scalar_type()));
    p->header.push_back(tensor.dim());
    for (int64_t d : tensor.sizes()) p->header.push_back(d);
  } else {
    p->header.push_back(kNoTensor);
  }
  p->header.push_back(static_cast<int64_t>(header.size()));
  auto* req = new MPI_Request;
  MPI_Isend(p->header.data(), static_cast<int>(p->header.size()), MPI_INT64_T, peer, kHeaderTag, MPI_COMM_WORLD, req);
  p->header_request = req;
  // A GPU tensor over MPI (ranks sharing a GPU) is staged through host memory here; a host
  // tensor over NCCL (the logits rank 0 asked for) goes to the device first.
  if (tensor.defined()) p->tensor = comm_.isend(tensor.to(comm_.device()), peer);
  const int64_t micro_batch = header.empty() ? -1 : header[0];
  pending_.push_back(std::move(p));
  const auto t1 = Clock::now();
  comm_s_ += seconds(t1 - t0);
  if (trace_) trace_->record(SpanKind::kSend, micro_batch, t0, t1);
}

Message PipelineChannel::recv(int peer) {
  const auto t0 = Clock::now();
  MPI_Status status;
  probe_without_spinning(peer, kHeaderTag, MPI_COMM_WORLD, &status);
  const auto t1 = Clock::now();
  if (start_pending_) {
    start();
    started_ = t1;
  } else {
    wait_s_ += seconds(t1 - t0);
  }
  int count = 0;
  MPI_Get_count(&status, MPI_INT64_T, &count);
  std::vector<int64_t> words(count);
  MPI_Recv(words.data(), count, MPI_INT64_T, peer, kHeaderTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  if (words.empty()) throw std::runtime_error("empty message from rank " + std::to_string(peer));
  const int64_t user = words.back();
  Message m;
  m.header.assign(words.begin(), words.begin() + user);
  if (words[user] != kNoTensor) {
    const auto dtype = static_cast<at::ScalarType>(words[user]);
    const int64_t dims = words[user + 1];
    std::vector<int64_t> shape(words.begin() + user + 2, words.begin() + user + 2 + dims);
    m.tensor = at::empty(shape, at::TensorOptions().dtype(dtype).device(comm_.device()));
    comm_.recv(m.tensor, peer);
  }
  const auto t2 = Clock::now();
  comm_s_ += seconds(t2 - t1);
  if (trace_) {
    const int64_t micro_batch = m.header.empty() ? -1 : m.header[0];
    trace_->record(SpanKind::kWait, micro_batch, t0, t1);
    trace_->record(SpanKind::kRecv, micro_batch, t1, t2);
  }
  return m;
}

void PipelineChannel::flush() {
  if (pending_.empty()) return;
  const auto t0 = Clock::now();
  for (auto& p : pending_) {
    auto* req = static_cast<MPI_Request*>(p->header_request);
    MPI_Wait(req, MPI_STATUS_IGNORE);
    delete req;
    if (p->tensor) p->tensor->wait();
  }
  pending_.clear();
  const auto t1 = Clock::now();
  comm_s_ += seconds(t1 - t0);
  if (trace_) trace_->record(SpanKind::kSend, -1, t0, t1);
}

void PipelineChannel::start() {
  started_ = Clock::now();
  start_pending_ = false;
  wait_s_ = comm_s_ = total_s_ = 0;
}

void PipelineChannel::start_on_first_message() { start_pending_ = true; }

void PipelineChannel::stop() { total_s_ = seconds(Clock::now() - started_); }

RankTimes PipelineChannel::times() const {
  RankTimes t;
  t.wait_s = wait_s_;
  t.comm_s = comm_s_;
  t.total_s = total_s_;
  t.all_reduce_s = group_.all_reduce_s;
  t.all_reduce_calls = static_cast<double>(group_.all_reduce_calls);
  t.group_s = group_.other_s;
  t.compute_s = std::max(0.0, total_s_ - wait_s_ - comm_s_ - t.all_reduce_s - t.group_s);
  return t;
}

std::vector<RankTimes> PipelineChannel::gather_times() const {
  const RankTimes mine = times();
  constexpr int kWords = 7;
  const double local[kWords] = {mine.wait_s,       mine.comm_s,           mine.compute_s, mine.total_s,
                                mine.all_reduce_s, mine.all_reduce_calls, mine.group_s};
  std::vector<double> all(kWords * world_.size());
  MPI_Gather(local, kWords, MPI_DOUBLE, all.data(), kWords, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  std::vector<RankTimes> out;
  if (world_.rank() != 0) return out;
  for (int r = 0; r < world_.size(); ++r) {
    const double* a = all.data() + kWords * r;
    RankTimes t;
    t.wait_s = a[0], t.comm_s = a[1], t.compute_s = a[2], t.total_s = a[3];
    t.all_reduce_s = a[4], t.all_reduce_calls = a[5], t.group_s = a[6];
    out.push_back(t);
  }
  return out;
}

}  // namespace kvpipe
