#include "engine/step_batch.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace kvpipe {

namespace {

StepContext make_host_step_context(const StepBatch& batch, int64_t block_size, bool key_indices) {
  int64_t T = 0, full_total = 0;
  for (const SeqStep& s : batch.seqs) {
    T += s.num_new;
    full_total += s.context_len + s.num_new;
  }
  if ((batch.full_sequences ? full_total : T) != batch.num_tokens())
    throw std::logic_error("step batch: token count does not match the sequences");
  const int64_t S = static_cast<int64_t>(batch.seqs.size());
  at::Tensor positions = at::empty({T}, at::kLong);
  at::Tensor slots = at::empty({T}, at::kLong);
  auto* pos = positions.data_ptr<int64_t>();
  auto* slot = slots.data_ptr<int64_t>();
  StepContext ctx;
  std::vector<int64_t> rows, full_positions, new_rows, key_slots;
  std::vector<int32_t> cu_q(S + 1, 0), cu_k(S + 1, 0), lens;
  // The paged tables have a row per query: a verified draft's rows are decode queries of
  // their own, each seeing the positions up to itself.
  std::vector<int64_t> table_of_row;
  int64_t t = 0, max_blocks = 0;
  ctx.decode_only = is_decode_only(batch);
  ctx.key_indices = key_indices;
  auto slot_of = [&](const SeqStep& s, int64_t p) {
    const int32_t block = s.block_table[p / block_size];
    if (block < 0)
      throw std::logic_error("request " + std::to_string(s.request_id) + " reads position " +
                             std::to_string(p) + " of a freed block");
    return block * block_size + p % block_size;
  };
  for (int64_t i = 0; i < S; ++i) {
    const SeqStep& s = batch.seqs[i];
    const int64_t total = s.context_len + s.num_new;
    if (static_cast<int64_t>(s.block_table.size()) * block_size < total)
      throw std::logic_error("block table too short for request " + std::to_string(s.request_id));
    // Keys of the cached layers: every earlier position, or with a window the sinks and the
    // positions that the first new query can still see.
    std::vector<int64_t> key_pos;
    if (key_indices) {
      if (batch.window_recent <= 0) {
        key_pos.resize(total);
        for (int64_t p = 0; p < total; ++p) key_pos[p] = p;
      } else {
        const int64_t sinks = std::min(batch.window_sinks, total);
        for (int64_t p = 0; p < sinks; ++p) key_pos.push_back(p);
        for (int64_t p = std::max(sinks, s.context_len - batch.window_recent + 1); p < total; ++p) key_pos.push_back(p);
      }
      for (const int64_t p : key_pos) key_slots.push_back(slot_of(s, p));
    }
    if (batch.full_sequences) {
      for (int64_t p = 0; p < total; ++p) full_positions.push_back(p);
      for (int64_t j = 0; j < s.num_new; ++j)
        new_rows.push_back(static_cast<int64_t>(full_positions.size()) - s.num_new + j);
    }
    for (int64_t j = 0; j < s.num_new; ++j, ++t) {
      pos[t] = s.context_len + j;
      slot[t] = slot_of(s, s.context_len + j);
    }
    if (s.sample)
      for (int64_t r = s.num_sampled; r >= 1; --r) rows.push_back(t - r);
    if (key_indices) ctx.seq_key_positions.push_back(at::tensor(key_pos, at::kLong));
    const int64_t keys = static_cast<int64_t>(key_pos.size());
    cu_q[i + 1] = static_cast<int32_t>(cu_q[i] + s.num_new);
    cu_k[i + 1] = static_cast<int32_t>(cu_k[i] + keys);
    if (ctx.decode_only) {
      for (int64_t j = 0; j < s.num_new; ++j) {
        lens.push_back(static_cast<int32_t>(s.context_len + j + 1));
        table_of_row.push_back(i);
      }
    } else {
      lens.push_back(static_cast<int32_t>(total));
      table_of_row.push_back(i);
    }
    ctx.max_seqlen_q = std::max(ctx.max_seqlen_q, s.num_new);
    ctx.max_seqlen_k = std::max(ctx.max_seqlen_k, keys);
    max_blocks = std::max<int64_t>(max_blocks, static_cast<int64_t>(s.block_table.size()));
  }
  ctx.token_ids = at::tensor(batch.token_ids, at::kLong);
  ctx.positions = positions;
  ctx.slots = slots;
  ctx.sample_rows = at::tensor(rows, at::kLong);
  if (batch.full_sequences) {
    ctx.full_positions = at::tensor(full_positions, at::kLong);
    ctx.new_rows = at::tensor(new_rows, at::kLong);
  }
  ctx.cu_seqlens_q = at::tensor(cu_q, at::kInt);
  if (key_indices) {
    // Each sequence's key slots are a view of the packed ones.
    ctx.key_slots = at::tensor(key_slots, at::kLong);
    for (int64_t i = 0; i < S; ++i) ctx.seq_slots.push_back(ctx.key_slots.narrow(0, cu_k[i], cu_k[i + 1] - cu_k[i]));
    ctx.cu_seqlens_k = at::tensor(cu_k, at::kInt);
  }
  ctx.context_lens = at::tensor(lens, at::kInt);
  const int64_t table_rows = static_cast<int64_t>(table_of_row.size());
  ctx.block_tables = at::full({table_rows, max_blocks}, -1, at::kInt);
  for (int64_t r = 0; r < table_rows; ++r) {
    const auto& table = batch.seqs[table_of_row[r]].block_table;
    if (!table.empty())
      std::memcpy(ctx.block_tables[r].data_ptr<int32_t>(), table.data(), table.size() * sizeof(int32_t));
  }
  return ctx;
}

}  // namespace

bool is_decode_only(const StepBatch& batch) {
  return !batch.seqs.empty() && std::all_of(batch.seqs.begin(), batch.seqs.end(), [](const SeqStep& s) {
           return s.num_new == 1 || (s.sample && s.num_sampled == s.num_new);
         });
}

StepContext make_step_context(const StepBatch& batch, int64_t block_size, at::Device device, bool key_indices) {
  StepContext ctx = make_host_step_context(batch, block_size, key_indices);
  return device.is_cpu() ? ctx : pack_step_context(ctx, device);
}

StepContext pack_step_context(const StepContext& host, at::Device device) {
  StepContext ctx = host;
  // Every index tensor goes into one host buffer (int32 ones widened), crosses in one copy,
  // and comes back out as views (int32 ones narrowed on the device).
  std::vector<at::Tensor*> fields = {&ctx.token_ids, &ctx.positions, &ctx.slots, &ctx.sample_rows,
                                     &ctx.cu_seqlens_q, &ctx.block_tables, &ctx.context_lens};
  if (ctx.key_indices) fields.insert(fields.end(), {&ctx.key_slots, &ctx.cu_seqlens_k});
  if (ctx.full_positions.defined()) fields.insert(fields.end(), {&ctx.full_positions, &ctx.new_rows});
  for (auto& t : ctx.seq_key_positions) fields.push_back(&t);
  std::vector<at::Tensor> flat;
  for (const at::Tensor* t : fields) flat.push_back(t->reshape({-1}).to(at::kLong));
  const at::Tensor packed = at::cat(flat).to(device, /*non_blocking=*/true);
  int64_t offset = 0;
  for (at::Tensor* t : fields) {
    const int64_t n = t->numel();
    at::Tensor view = packed.narrow(0, offset, n).view(t->sizes());
    *t = t->scalar_type() == at::kLong ? view : view.to(t->scalar_type());
    offset += n;
  }
  if (ctx.key_indices) {
    // Per-sequence key slots are views of the packed ones.
    const at::Tensor cu_k_host = host.cu_seqlens_k.to(at::kCPU);
    const auto* cu_k = cu_k_host.data_ptr<int32_t>();
    for (size_t i = 0; i < ctx.seq_slots.size(); ++i)
      ctx.seq_slots[i] = ctx.key_slots.narrow(0, cu_k[i], cu_k[i + 1] - cu_k[i]);
  }
  return ctx;
}

namespace {

int64_t double_bits(double v) {
  int64_t w;
  std::memcpy(&w, &v, sizeof(w));
  return w;
}

double bits_double(int64_t w) {
  double v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

}  // namespace

std::vector<int64_t> encode_step_header(const StepBatch& batch, int64_t micro_batch) {
  std::vector<int64_t> w = {micro_batch,         static_cast<int64_t>(batch.seqs.size()),
                            batch.num_tokens(),  batch.want_logits ? 1 : 0,
                            batch.full_sequences ? 1 : 0, batch.window_sinks,
                            batch.window_recent};
  for (const SeqStep& s : batch.seqs) {
    w.insert(w.end(), {s.request_id, s.context_len, s.num_new, s.output_index, s.sample ? 1 : 0, s.num_sampled,
                       double_bits(s.sampling.temperature), s.sampling.top_k, double_bits(s.sampling.top_p),
                       static_cast<int64_t>(s.sampling.seed), s.sampling.stream, double_bits(s.sampling.min_p),
                       static_cast<int64_t>(s.block_table.size())});
    w.insert(w.end(), s.block_table.begin(), s.block_table.end());
  }
  return w;
}

StepBatch decode_step_header(const std::vector<int64_t>& w, int64_t* micro_batch) {
  size_t i = 0;
  auto next = [&]() {
    if (i >= w.size()) throw std::runtime_error("step header is truncated");
    return w[i++];
  };
  StepBatch b;
  *micro_batch = next();
  const int64_t seqs = next();
  const int64_t tokens = next();
  if (seqs < 0 || tokens < 0) throw std::runtime_error("step header is corrupt");
  b.want_logits = next() != 0;
  b.full_sequences = next() != 0;
  b.window_sinks = next();
  b.window_recent = next();
  for (int64_t k = 0; k < seqs; ++k) {
    SeqStep s;
    s.request_id = next();
    s.context_len = next();
    s.num_new = next();
    s.output_index = next();
    s.sample = next() != 0;
    s.num_sampled = next();
    if (s.num_sampled < 1 || s.num_sampled > s.num_new) throw std::runtime_error("step header is corrupt");
    s.sampling.temperature = bits_double(next());
    s.sampling.top_k = static_cast<int>(next());
    s.sampling.top_p = bits_double(next());
    s.sampling.seed = static_cast<uint64_t>(next());
    s.sampling.stream = next();
    s.sampling.min_p = bits_double(next());
    const int64_t blocks = next();
    if (blocks < 0) throw std::runtime_error("step header is corrupt");
    for (int64_t j = 0; j < blocks; ++j) s.block_table.push_back(static_cast<int32_t>(next()));
    b.seqs.push_back(std::move(s));
  }
  // Stages after the first carry no token ids but must know how many rows arrive.
  b.token_ids.assign(tokens, 0);
  return b;
}

}  // namespace kvpipe
