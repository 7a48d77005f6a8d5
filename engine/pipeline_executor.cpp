#include "engine/pipeline_executor.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace kvpipe {
namespace {

constexpr int64_t kShutdown = -1;

// KVPIPE_INJECT_FAULT="RANK:MICRO_BATCH" makes that rank throw when it reaches that
// micro-batch: the tests use it to check that a rank failing mid-run stops the whole job.
int64_t injected_fault_micro_batch(int rank) {
  const char* spec = std::getenv("KVPIPE_INJECT_FAULT");
  int fault_rank = -1;
  long long micro_batch = -1;
  if (spec == nullptr || std::sscanf(spec, "%d:%lld", &fault_rank, &micro_batch) != 2 || fault_rank != rank)
    return -1;
  return micro_batch;
}

std::vector<int64_t> reply_header(int64_t micro_batch, const StepOutput& out) {
  std::vector<int64_t> reply = {micro_batch, static_cast<int64_t>(out.tokens.size())};
  reply.insert(reply.end(), out.request_ids.begin(), out.request_ids.end());
  reply.insert(reply.end(), out.tokens.begin(), out.tokens.end());
  return reply;
}

}  // namespace

PipelineExecutor::PipelineExecutor(const ModelShard& shard, BlockPool& pool, PipelineChannel& channel,
                                   const ProcessGrid& grid, size_t micro_batches, DecodeGraphs* graphs,
                                   TensorGroup* group)
    : shard_(shard),
      pool_(pool),
      channel_(channel),
      grid_(grid),
      micro_batches_(grid.stages() == 1 ? 1 : micro_batches),
      graphs_(graphs),
      group_(group) {
  if (grid.world_size < 2) throw std::logic_error("a pipeline needs at least two ranks");
  if (grid.tensor > 1 && group == nullptr) throw std::logic_error("tensor ranks need their group");
}

void PipelineExecutor::submit(const StepBatch& batch) {
  const int64_t id = next_id_++;
  const std::vector<int64_t> header = encode_step_header(batch, id);
  StageResult r;
  {
    const ScopedSpan span(channel_.trace(), SpanKind::kCompute, id);
    // Stage 0's other tensor ranks embed the same tokens, which the header does not carry.
    if (group_ != nullptr)
      group_->broadcast({header, at::tensor(at::ArrayRef<int64_t>(batch.token_ids), at::kLong)});
    r = run_stage(shard_, pool_, batch, {}, graphs_);
  }
  if (grid_.stages() == 1) {
    r.output.micro_batch = id;
    done_.push_back(std::move(r.output));
    return;
  }
  channel_.send(grid_.leader_of(1), header, r.hidden);
}

StepOutput PipelineExecutor::wait() {
  if (grid_.stages() == 1) {
    StepOutput out = std::move(done_.front());
    done_.pop_front();
    return out;
  }
  const Message m = channel_.recv(grid_.leader_of(grid_.stages() - 1));
  // [micro-batch id, n, request ids..., tokens...]
  StepOutput out;
  out.micro_batch = m.header.at(0);
  const int64_t n = m.header.at(1);
  out.request_ids.assign(m.header.begin() + 2, m.header.begin() + 2 + n);
  out.tokens.assign(m.header.begin() + 2 + n, m.header.begin() + 2 + 2 * n);
  if (m.tensor.defined()) out.logits = m.tensor.to(at::kCPU);
  return out;
}

void PipelineExecutor::shutdown() {
  if (group_ != nullptr) group_->broadcast({{kShutdown}, {}});
  if (grid_.stages() > 1) channel_.send(grid_.leader_of(1), {kShutdown});
  channel_.flush();
}

void run_stage_worker(const ModelShard& shard, BlockPool& pool, PipelineChannel& channel, const ProcessGrid& grid,
                      int rank, DecodeGraphs* graphs, TensorGroup* group) {
  const int stage = grid.stage_of(rank);
  const bool leader = grid.is_leader(rank), last = stage == grid.stages() - 1;
  if (grid.tensor > 1 && group == nullptr) throw std::logic_error("tensor ranks need their group");
  const int64_t fault_at = injected_fault_micro_batch(rank);
  for (;;) {
    // A leader hears from the previous stage's leader; every other rank from its own leader.
    Message m = leader ? channel.recv(grid.leader_of(stage - 1)) : group->broadcast({});
    if (leader && group != nullptr) group->broadcast(m);
    if (m.header.at(0) == kShutdown) {
      if (leader && !last) channel.send(grid.leader_of(stage + 1), m.header);
      break;
    }
    int64_t micro_batch = 0;
    StepBatch batch = decode_step_header(m.header, &micro_batch);
    if (stage == 0) {
      // A tensor rank of the first stage: the message carries the tokens, not hidden states.
      const at::Tensor ids = m.tensor.contiguous();
      batch.token_ids.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
      m.tensor = at::Tensor();
    }
    if (micro_batch == fault_at)
      throw std::runtime_error("injected fault at micro-batch " + std::to_string(micro_batch));
    StageResult r;
    {
      const ScopedSpan span(channel.trace(), SpanKind::kCompute, micro_batch);
      r = run_stage(shard, pool, batch, m.tensor, graphs);
    }
    if (!leader) continue;
    if (!last) {
      channel.send(grid.leader_of(stage + 1), m.header, r.hidden);
      continue;
    }
    channel.send(0, reply_header(micro_batch, r.output), batch.want_logits ? r.output.logits : at::Tensor());
  }
  channel.flush();
}

}  // namespace kvpipe
