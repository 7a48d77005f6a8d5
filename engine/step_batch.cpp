#include "engine/step_batch.h"

#include <ATen/ATen.h>

#include <stdexcept>

namespace kvpipe {

StepContext make_step_context(const StepBatch& batch, int64_t block_size) {
  const int64_t T = batch.num_tokens();
  at::Tensor positions = at::empty({T}, at::kLong);
  at::Tensor slots = at::empty({T}, at::kLong);
  auto* pos = positions.data_ptr<int64_t>();
  auto* slot = slots.data_ptr<int64_t>();
  StepContext ctx;
  std::vector<int64_t> rows;
  int64_t t = 0;
  for (const SeqStep& s : batch.seqs) {
    const int64_t total = s.context_len + s.num_new;
    if (static_cast<int64_t>(s.block_table.size()) * block_size < total)
      throw std::logic_error("block table too short for request " + std::to_string(s.request_id));
    at::Tensor all = at::empty({total}, at::kLong);
    auto* a = all.data_ptr<int64_t>();
    for (int64_t p = 0; p < total; ++p) a[p] = s.block_table[p / block_size] * block_size + p % block_size;
    for (int64_t i = 0; i < s.num_new; ++i, ++t) {
      pos[t] = s.context_len + i;
      slot[t] = a[s.context_len + i];
    }
    if (s.sample) rows.push_back(t - 1);
    ctx.seq_slots.push_back(all);
  }
  if (t != T) throw std::logic_error("step batch: token count does not match the sequences");
  ctx.positions = positions;
  ctx.slots = slots;
  ctx.sample_rows = at::tensor(rows, at::kLong);
  return ctx;
}

}  // namespace kvpipe
