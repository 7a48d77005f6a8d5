#include "engine/pipeline_executor.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace kvpipe {
namespace {

constexpr int64_t kShutdown = -1;

// KVPIPE_INJECT_FAULT="RANK:MICRO_BATCH" makes that stage throw when it reaches that
// micro-batch: the tests use it to check that a rank failing mid-run stops the whole job.
int64_t injected_fault_micro_batch(int rank) {
  const char* spec = std::getenv("KVPIPE_INJECT_FAULT");
  int fault_rank = -1;
  long long micro_batch = -1;
  if (spec == nullptr || std::sscanf(spec, "%d:%lld", &fault_rank, &micro_batch) != 2 || fault_rank != rank)
    return -1;
  return micro_batch;
}

}  // namespace

PipelineExecutor::PipelineExecutor(const ModelShard& shard, BlockPool& pool, PipelineChannel& channel,
                                   int world_size, size_t micro_batches, DecodeGraphs* graphs)
    : shard_(shard),
      pool_(pool),
      channel_(channel),
      last_rank_(world_size - 1),
      micro_batches_(micro_batches),
      graphs_(graphs) {
  if (world_size < 2) throw std::logic_error("a pipeline needs at least two ranks");
}

void PipelineExecutor::submit(const StepBatch& batch) {
  const int64_t id = next_id_++;
  StageResult r;
  {
    const ScopedSpan span(channel_.trace(), SpanKind::kCompute, id);
    r = run_stage(shard_, pool_, batch, {}, graphs_);
  }
  channel_.send(1, encode_step_header(batch, id), r.hidden);
}

StepOutput PipelineExecutor::wait() {
  const Message m = channel_.recv(last_rank_);
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
  channel_.send(1, {kShutdown});
  channel_.flush();
}

void run_stage_worker(const ModelShard& shard, BlockPool& pool, PipelineChannel& channel, int rank,
                      int world_size, DecodeGraphs* graphs) {
  const bool last = rank == world_size - 1;
  const int64_t fault_at = injected_fault_micro_batch(rank);
  for (;;) {
    const Message m = channel.recv(rank - 1);
    if (m.header.at(0) == kShutdown) {
      if (!last) channel.send(rank + 1, m.header);
      break;
    }
    int64_t micro_batch = 0;
    const StepBatch batch = decode_step_header(m.header, &micro_batch);
    if (micro_batch == fault_at)
      throw std::runtime_error("injected fault at micro-batch " + std::to_string(micro_batch));
    StageResult r;
    {
      const ScopedSpan span(channel.trace(), SpanKind::kCompute, micro_batch);
      r = run_stage(shard, pool, batch, m.tensor, graphs);
    }
    if (!last) {
      channel.send(rank + 1, m.header, r.hidden);
      continue;
    }
    std::vector<int64_t> reply = {micro_batch, static_cast<int64_t>(r.output.tokens.size())};
    reply.insert(reply.end(), r.output.request_ids.begin(), r.output.request_ids.end());
    reply.insert(reply.end(), r.output.tokens.begin(), r.output.tokens.end());
    channel.send(0, reply, batch.want_logits ? r.output.logits : at::Tensor());
  }
  channel.flush();
}

}  // namespace kvpipe
