#include "engine/decode_graphs.h"

#include "engine/attention_backend.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <stdexcept>

namespace kvpipe {

struct DecodeGraphs::Graph {
  int64_t filled = 0;  // rows the last replay used (the rest hold padding)
  // Static inputs: what the captured kernels read.
  at::Tensor token_ids, positions, slots, block_tables, context_lens, hidden_in;
  at::Tensor output;  // hidden [bucket, hidden] or logits [bucket, vocab]
  at::cuda::CUDAGraph graph;
};

DecodeGraphs::DecodeGraphs(const ModelShard& shard, BlockPool& pool, int64_t max_batch, int64_t scratch_block)
    : shard_(shard), pool_(pool), max_batch_(max_batch), scratch_block_(scratch_block) {
  if (!shard.device().is_cuda()) throw std::invalid_argument("CUDA graphs: the shard does not compute on a GPU");
  if (scratch_block < 0 || scratch_block >= pool.num_blocks())
    throw std::invalid_argument("CUDA graphs: scratch block " + std::to_string(scratch_block) +
                                " is outside the KV pool");
  const int64_t bs = pool.block_size();
  table_width_ = (shard.config().max_position + bs - 1) / bs;
  // A pool shared across instances (a process-wide handle) is freed with the last graph of the
  // first instance, and the allocator refuses a later capture into it.
  graph_pool_ = at::cuda::graph_pool_handle();
}

DecodeGraphs::~DecodeGraphs() = default;

int64_t decode_graph_bucket(int64_t sequences, int64_t max_batch) {
  if (sequences < 1 || sequences > max_batch) return 0;
  int64_t bucket = 1;
  while (bucket < sequences && bucket < 8) bucket *= 2;
  if (bucket < sequences) bucket = (sequences + 7) / 8 * 8;
  return std::min(bucket, max_batch);
}

bool DecodeGraphs::handles(const StepBatch& batch, const StepContext& ctx) const {
  if (batch.full_sequences || shard_.num_cached_layers() != shard_.layers().size()) return false;
  if (decode_graph_bucket(ctx.context_lens.numel(), max_batch_) == 0 || ctx.block_tables.size(1) > table_width_)
    return false;
  // A verified draft's rows are decode queries too, but a graph's bucket counts sequences.
  for (const SeqStep& s : batch.seqs)
    if (!s.sample || s.num_new != 1) return false;
  // The graph's attention is the paged kernel: the step must be one it takes, and no other
  // path may be pinned (KVPIPE_ATTENTION).
  const std::optional<AttentionPath> pinned = shard_.attention_path();
  if (pinned && *pinned != AttentionPath::kPagedDecode) return false;
  // Soft-capped or windowed layers (Gemma 2) only the per-sequence path computes.
  if (shard_.config().masked_or_capped_attention()) return false;
  return paged_decode_fits(shard_.weights().dtype, shard_.config().head_dim, /*on_gpu=*/true, pool_, batch, ctx);
}

DecodeGraphs::Graph& DecodeGraphs::graph_for(int64_t bucket) {
  auto it = graphs_.find(bucket);
  if (it != graphs_.end()) return *it->second;
  auto g = std::make_unique<Graph>();
  const at::Device device = shard_.device();
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  const auto ints = at::TensorOptions().dtype(at::kInt).device(device);
  const int64_t bs = pool_.block_size();
  // Every row starts as padding: token 0 at position 0, written to and reading the scratch block.
  g->token_ids = at::zeros({bucket}, longs);
  g->positions = at::zeros({bucket}, longs);
  g->slots = at::full({bucket}, scratch_block_ * bs, longs);
  g->block_tables = at::full({bucket, table_width_}, -1, ints);
  g->block_tables.select(1, 0).fill_(static_cast<int32_t>(scratch_block_));
  g->context_lens = at::ones({bucket}, ints);
  if (!shard_.has_embedding())
    g->hidden_in = at::zeros({bucket, shard_.config().hidden_size}, at::TensorOptions().dtype(shard_.weights().dtype).device(device));

  StepBatch fake;
  for (int64_t i = 0; i < bucket; ++i) {
    SeqStep s;
    s.request_id = i, s.context_len = 0, s.num_new = 1, s.sample = true;
    fake.seqs.push_back(s);
    fake.token_ids.push_back(0);
  }
  StepContext ctx;
  ctx.token_ids = g->token_ids;
  ctx.positions = g->positions;
  ctx.slots = g->slots;
  ctx.block_tables = g->block_tables;
  ctx.context_lens = g->context_lens;
  ctx.decode_only = true;
  const auto body = [&] {
    const at::Tensor input = shard_.has_embedding() ? shard_.embed(ctx.token_ids) : g->hidden_in;
    const at::Tensor out = shard_.forward(input, fake, ctx, pool_);
    return shard_.has_head() ? shard_.logits(out) : out;
  };
  {
    const c10::cuda::CUDAGuard guard(device);
    // Captured on a side stream (the default stream cannot be captured), after one eager run
    // there that makes cuBLAS and the allocator ready.
    const c10::cuda::CUDAStream capture_stream = c10::cuda::getStreamFromPool(false, device.index());
    capture_stream.synchronize();
    c10::cuda::getCurrentCUDAStream(device.index()).synchronize();
    const c10::cuda::CUDAStreamGuard stream_guard(capture_stream);
    body();
    capture_stream.synchronize();
    g->graph.capture_begin(graph_pool_, cudaStreamCaptureModeThreadLocal);
    g->output = body();
    g->graph.capture_end();
    capture_stream.synchronize();
  }
  return *graphs_.emplace(bucket, std::move(g)).first->second;
}

at::Tensor DecodeGraphs::run(const StepContext& ctx, const at::Tensor& hidden) {
  const int64_t S = ctx.context_lens.numel();
  Graph& g = graph_for(decode_graph_bucket(S, max_batch_));
  const int64_t width = ctx.block_tables.size(1), bs = pool_.block_size();
  // Rows a larger batch used last time go back to padding.
  if (g.filled > S) {
    const int64_t n = g.filled - S;
    g.token_ids.narrow(0, S, n).zero_();
    g.positions.narrow(0, S, n).zero_();
    g.slots.narrow(0, S, n).fill_(scratch_block_ * bs);
    g.block_tables.narrow(0, S, n).fill_(-1);
    g.block_tables.narrow(0, S, n).select(1, 0).fill_(static_cast<int32_t>(scratch_block_));
    g.context_lens.narrow(0, S, n).fill_(1);
  }
  g.filled = S;
  g.token_ids.narrow(0, 0, S).copy_(ctx.token_ids);
  g.positions.narrow(0, 0, S).copy_(ctx.positions);
  g.slots.narrow(0, 0, S).copy_(ctx.slots);
  g.block_tables.narrow(0, 0, S).narrow(1, 0, width).copy_(ctx.block_tables);
  g.context_lens.narrow(0, 0, S).copy_(ctx.context_lens);
  if (g.hidden_in.defined()) g.hidden_in.narrow(0, 0, S).copy_(hidden.to(g.hidden_in.device(), /*non_blocking=*/true));
  g.graph.replay();
  ++replays_;
  // A copy: the next replay overwrites the static output while this one may still be in use.
  return g.output.narrow(0, 0, S).clone();
}

}  // namespace kvpipe
