#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/step_batch.h"

namespace kvpipe {
namespace {

SeqStep make_seq(int64_t request_id, int64_t context_len, int64_t num_new, bool sample,
                 std::vector<int32_t> block_table) {
  SeqStep s;
  s.request_id = request_id;
  s.context_len = context_len;
  s.num_new = num_new;
  s.output_index = context_len + num_new;
  s.sample = sample;
  s.block_table = std::move(block_table);
  return s;
}

// token_ids must carry one entry per new token or make_step_context rejects the batch.
StepBatch make_batch(std::vector<SeqStep> seqs) {
  StepBatch b;
  b.seqs = std::move(seqs);
  int64_t next_token = 100;
  for (const SeqStep& s : b.seqs)
    for (int64_t i = 0; i < s.num_new; ++i) b.token_ids.push_back(next_token++);
  return b;
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  EXPECT_EQ(t.scalar_type(), at::kLong);
  EXPECT_EQ(t.dim(), 1);
  const at::Tensor c = t.contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

StepBatch three_sequence_batch() {
  SeqStep a = make_seq(11, 0, 6, true, {4, 9});
  a.output_index = 0;
  a.sampling.temperature = 0.7;
  a.sampling.top_k = 5;
  a.sampling.top_p = 0.93;
  a.sampling.seed = (uint64_t{1} << 40) + 3;

  SeqStep b = make_seq(12, 17, 1, false, {1, 3, 8, 0, 6});
  b.output_index = 4;

  SeqStep c = make_seq(13, 3, 2, true, {2, 5});
  c.output_index = 7;
  c.sampling.temperature = 1.25;
  c.sampling.top_k = 0;
  c.sampling.top_p = 0.5;
  c.sampling.seed = 99;
  c.sampling.min_p = 0.07;
  c.num_sampled = 2;  // a verified draft of one token

  StepBatch batch = make_batch({a, b, c});
  batch.want_logits = true;
  return batch;
}

void expect_same_seq(const SeqStep& got, const SeqStep& want) {
  EXPECT_EQ(got.request_id, want.request_id);
  EXPECT_EQ(got.context_len, want.context_len);
  EXPECT_EQ(got.num_new, want.num_new);
  EXPECT_EQ(got.output_index, want.output_index);
  EXPECT_EQ(got.sample, want.sample);
  EXPECT_EQ(got.num_sampled, want.num_sampled);
  // Sampling must be reproducible across stages, so doubles travel bit for bit.
  EXPECT_EQ(got.sampling.temperature, want.sampling.temperature);
  EXPECT_EQ(got.sampling.top_k, want.sampling.top_k);
  EXPECT_EQ(got.sampling.top_p, want.sampling.top_p);
  EXPECT_EQ(got.sampling.seed, want.sampling.seed);
  EXPECT_EQ(got.sampling.stream, want.sampling.stream);
  EXPECT_EQ(got.sampling.min_p, want.sampling.min_p);
  EXPECT_EQ(got.block_table, want.block_table);
}

// ---------------------------------------------------------------------------------------------
// Wire header

TEST(StepBatchHeader, round_trip_keeps_every_field) {
  const StepBatch batch = three_sequence_batch();
  int64_t micro_batch = -1;
  const StepBatch got = decode_step_header(encode_step_header(batch, 42), &micro_batch);
  EXPECT_EQ(micro_batch, 42);
  EXPECT_TRUE(got.want_logits);
  ASSERT_EQ(got.seqs.size(), batch.seqs.size());
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    SCOPED_TRACE("seq " + std::to_string(i));
    expect_same_seq(got.seqs[i], batch.seqs[i]);
  }
  // Later stages get only the row count, not the ids themselves.
  EXPECT_EQ(got.num_tokens(), batch.num_tokens());
  EXPECT_EQ(got.token_ids, std::vector<int64_t>(9, 0));
}

TEST(StepBatchHeader, round_trip_of_extreme_values) {
  SeqStep s = make_seq(std::numeric_limits<int64_t>::max(), 0, 1, true, {0, 2147483647});
  s.sampling.seed = std::numeric_limits<uint64_t>::max();  // high bit set: must survive int64
  s.sampling.temperature = 1e-300;
  s.sampling.top_p = 0.1 + 0.2;  // not representable exactly in decimal
  s.sampling.top_k = -1;
  const StepBatch batch = make_batch({s});
  int64_t micro_batch = 0;
  const StepBatch got =
      decode_step_header(encode_step_header(batch, std::numeric_limits<int64_t>::min()), &micro_batch);
  EXPECT_EQ(micro_batch, std::numeric_limits<int64_t>::min());
  EXPECT_FALSE(got.want_logits);
  ASSERT_EQ(got.seqs.size(), 1u);
  expect_same_seq(got.seqs[0], s);
}

TEST(StepBatchHeader, empty_batch_round_trips) {
  const StepBatch batch;
  int64_t micro_batch = 0;
  const StepBatch got = decode_step_header(encode_step_header(batch, 3), &micro_batch);
  EXPECT_EQ(micro_batch, 3);
  EXPECT_TRUE(got.seqs.empty());
  EXPECT_EQ(got.num_tokens(), 0);
}

TEST(StepBatchHeader, token_ids_are_not_sent) {
  // Two batches that differ only in their token ids must look the same on the wire.
  StepBatch a = three_sequence_batch();
  StepBatch b = a;
  for (int64_t& t : b.token_ids) t += 1000;
  EXPECT_EQ(encode_step_header(a, 1), encode_step_header(b, 1));
}

TEST(StepBatchHeader, truncated_header_throws) {
  const std::vector<int64_t> words = encode_step_header(three_sequence_batch(), 5);
  // Every strict prefix is missing something the decoder needs.
  for (size_t n = 0; n < words.size(); ++n) {
    const std::vector<int64_t> prefix(words.begin(), words.begin() + static_cast<long>(n));
    int64_t micro_batch = 0;
    EXPECT_THROW(decode_step_header(prefix, &micro_batch), std::runtime_error) << "length " << n;
  }
}

// ---------------------------------------------------------------------------------------------
// Step context

TEST(StepBatchContext, positions_and_slots_follow_the_block_table) {
  const StepBatch batch = make_batch({make_seq(1, 5, 3, true, {7, 2})});
  const StepContext ctx = make_step_context(batch, 4);
  EXPECT_EQ(to_vector(ctx.positions), (std::vector<int64_t>{5, 6, 7}));
  EXPECT_EQ(to_vector(ctx.slots), (std::vector<int64_t>{9, 10, 11}));
  ASSERT_EQ(ctx.seq_slots.size(), 1u);
  EXPECT_EQ(to_vector(ctx.seq_slots[0]), (std::vector<int64_t>{28, 29, 30, 31, 8, 9, 10, 11}));
  EXPECT_EQ(to_vector(ctx.sample_rows), (std::vector<int64_t>{2}));
}

TEST(StepBatchContext, sequences_concatenate) {
  const StepBatch batch =
      make_batch({make_seq(1, 5, 3, false, {7, 2}), make_seq(2, 0, 2, true, {3})});
  const StepContext ctx = make_step_context(batch, 4);
  EXPECT_EQ(to_vector(ctx.positions), (std::vector<int64_t>{5, 6, 7, 0, 1}));
  EXPECT_EQ(to_vector(ctx.slots), (std::vector<int64_t>{9, 10, 11, 12, 13}));
  ASSERT_EQ(ctx.seq_slots.size(), 2u);
  EXPECT_EQ(to_vector(ctx.seq_slots[0]), (std::vector<int64_t>{28, 29, 30, 31, 8, 9, 10, 11}));
  EXPECT_EQ(to_vector(ctx.seq_slots[1]), (std::vector<int64_t>{12, 13}));
  EXPECT_EQ(to_vector(ctx.sample_rows), (std::vector<int64_t>{4}));
}

TEST(StepBatchContext, sample_rows_are_last_new_token_of_sampled_sequences) {
  // A prefill chunk that is not the last one (sample=false) must not be sampled.
  const StepBatch batch = make_batch({make_seq(1, 0, 4, true, {0}),
                                      make_seq(2, 9, 1, false, {1, 2, 3}),
                                      make_seq(3, 2, 3, true, {4, 5}),
                                      make_seq(4, 6, 1, true, {6, 7})});
  const StepContext ctx = make_step_context(batch, 4);
  EXPECT_EQ(ctx.positions.numel(), 9);
  EXPECT_EQ(to_vector(ctx.sample_rows), (std::vector<int64_t>{3, 7, 8}));
}

TEST(StepBatchContext, a_verified_draft_samples_its_last_rows_in_order) {
  SeqStep draft = make_seq(3, 2, 4, true, {4, 5});
  draft.num_sampled = 3;  // the last fed token and two draft tokens
  const StepBatch batch = make_batch({make_seq(1, 0, 4, true, {0}), draft, make_seq(4, 6, 1, true, {6, 7})});
  const StepContext ctx = make_step_context(batch, 4);
  EXPECT_EQ(to_vector(ctx.sample_rows), (std::vector<int64_t>{3, 5, 6, 7, 8}));
  EXPECT_FALSE(ctx.decode_only);  // a prompt chunk rides along
}

TEST(StepBatchContext, a_verified_draft_alone_is_decode_queries_with_their_own_lengths) {
  SeqStep draft = make_seq(3, 5, 3, true, {4, 5});
  draft.num_sampled = 3;
  const StepBatch batch = make_batch({make_seq(1, 2, 1, true, {0}), draft});
  EXPECT_TRUE(is_decode_only(batch));
  const StepContext ctx = make_step_context(batch, 4);
  EXPECT_TRUE(ctx.decode_only);
  const at::Tensor lens = ctx.context_lens;
  EXPECT_EQ(std::vector<int32_t>(lens.data_ptr<int32_t>(), lens.data_ptr<int32_t>() + lens.numel()),
            (std::vector<int32_t>{3, 6, 7, 8}));
  ASSERT_EQ(ctx.block_tables.size(0), 4);
  for (int64_t r = 1; r < 4; ++r) {
    EXPECT_EQ(ctx.block_tables[r][0].item<int32_t>(), 4);
    EXPECT_EQ(ctx.block_tables[r][1].item<int32_t>(), 5);
  }
  EXPECT_EQ(ctx.block_tables[0][1].item<int32_t>(), -1);
}

TEST(StepBatchHeader, more_sampled_rows_than_new_tokens_is_corrupt) {
  SeqStep s = make_seq(1, 0, 2, true, {0});
  s.num_sampled = 3;
  int64_t micro_batch = 0;
  EXPECT_THROW(decode_step_header(encode_step_header(make_batch({s}), 1), &micro_batch), std::runtime_error);
}

TEST(StepBatchContext, no_sampled_sequence_gives_empty_sample_rows) {
  const StepBatch batch = make_batch({make_seq(1, 0, 3, false, {5})});
  const StepContext ctx = make_step_context(batch, 4);
  EXPECT_EQ(ctx.sample_rows.numel(), 0);
  EXPECT_EQ(ctx.sample_rows.scalar_type(), at::kLong);
}

TEST(StepBatchContext, slots_match_formula_for_every_position) {
  const int64_t bs = 3;
  const std::vector<int32_t> table = {10, 0, 4, 7};
  const StepBatch batch = make_batch({make_seq(1, 7, 4, true, table)});
  const StepContext ctx = make_step_context(batch, bs);
  const std::vector<int64_t> all = to_vector(ctx.seq_slots[0]);
  ASSERT_EQ(all.size(), 11u);
  for (int64_t p = 0; p < 11; ++p) EXPECT_EQ(all[p], table[p / bs] * bs + p % bs) << p;
  EXPECT_EQ(to_vector(ctx.slots), (std::vector<int64_t>{all[7], all[8], all[9], all[10]}));
}

std::vector<int32_t> to_int_vector(const at::Tensor& t) {
  EXPECT_EQ(t.scalar_type(), at::kInt);
  const at::Tensor c = t.contiguous().view({-1});
  const int32_t* p = c.data_ptr<int32_t>();
  return std::vector<int32_t>(p, p + c.numel());
}

// The packed indices the GPU's varlen and paged kernels read.
TEST(StepBatchContext, packed_indices_for_varlen_and_paged_attention) {
  const StepBatch batch =
      make_batch({make_seq(1, 5, 3, false, {7, 2}), make_seq(2, 0, 2, true, {3}), make_seq(3, 9, 1, true, {1, 0, 6})});
  const StepContext ctx = make_step_context(batch, 4);
  EXPECT_EQ(to_int_vector(ctx.cu_seqlens_q), (std::vector<int32_t>{0, 3, 5, 6}));
  EXPECT_EQ(to_int_vector(ctx.cu_seqlens_k), (std::vector<int32_t>{0, 8, 10, 20}));
  EXPECT_EQ(ctx.max_seqlen_q, 3);
  EXPECT_EQ(ctx.max_seqlen_k, 10);
  std::vector<int64_t> keys;
  for (const at::Tensor& t : ctx.seq_slots) {
    const std::vector<int64_t> v = to_vector(t);
    keys.insert(keys.end(), v.begin(), v.end());
  }
  EXPECT_EQ(to_vector(ctx.key_slots), keys);
  EXPECT_EQ(to_int_vector(ctx.context_lens), (std::vector<int32_t>{8, 2, 10}));
  EXPECT_EQ(ctx.block_tables.sizes(), (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(to_int_vector(ctx.block_tables), (std::vector<int32_t>{7, 2, -1, 3, -1, -1, 1, 0, 6}));
  EXPECT_FALSE(ctx.decode_only);
  const StepContext decode =
      make_step_context(make_batch({make_seq(1, 7, 1, true, {7, 2}), make_seq(2, 2, 1, true, {3})}), 4);
  EXPECT_TRUE(decode.decode_only);
  EXPECT_EQ(to_int_vector(decode.context_lens), (std::vector<int32_t>{8, 3}));
}

// What a GPU step receives: every index through one packed buffer, taken apart again.
TEST(StepBatchContext, packed_copy_gives_the_same_indices) {
  for (const bool full : {false, true}) for (const bool keys : {true, false}) {
    StepBatch batch =
        make_batch({make_seq(1, 5, 3, false, {7, 2}), make_seq(2, 0, 2, true, {3}), make_seq(3, 9, 1, true, {1, 0, 6})});
    if (full) {
      batch.full_sequences = true;
      batch.token_ids.assign(5 + 3 + 2 + 9 + 1, 4);
    }
    const StepContext host = make_step_context(batch, 4, at::kCPU, keys);
    const StepContext packed = pack_step_context(host, at::kCPU);
    const std::vector<std::pair<const at::Tensor*, const at::Tensor*>> fields = {
        {&host.token_ids, &packed.token_ids},       {&host.positions, &packed.positions},
        {&host.slots, &packed.slots},               {&host.sample_rows, &packed.sample_rows},
        {&host.key_slots, &packed.key_slots},       {&host.cu_seqlens_q, &packed.cu_seqlens_q},
        {&host.cu_seqlens_k, &packed.cu_seqlens_k}, {&host.block_tables, &packed.block_tables},
        {&host.context_lens, &packed.context_lens}, {&host.full_positions, &packed.full_positions},
        {&host.new_rows, &packed.new_rows}};
    for (size_t i = 0; i < fields.size(); ++i) {
      const at::Tensor& want = *fields[i].first;
      const at::Tensor& got = *fields[i].second;
      ASSERT_EQ(want.defined(), got.defined()) << "field " << i;
      if (!want.defined()) continue;
      EXPECT_EQ(want.scalar_type(), got.scalar_type()) << "field " << i;
      EXPECT_TRUE(at::equal(want, got)) << "field " << i << " (full " << full << ")";
    }
    ASSERT_EQ(packed.seq_slots.size(), host.seq_slots.size());
    for (size_t i = 0; i < host.seq_slots.size(); ++i) {
      EXPECT_TRUE(at::equal(host.seq_slots[i], packed.seq_slots[i])) << "sequence " << i;
      EXPECT_TRUE(at::equal(host.seq_key_positions[i], packed.seq_key_positions[i])) << "sequence " << i;
    }
    EXPECT_EQ(packed.max_seqlen_q, host.max_seqlen_q);
    EXPECT_EQ(packed.max_seqlen_k, host.max_seqlen_k);
    EXPECT_EQ(packed.decode_only, host.decode_only);
    EXPECT_EQ(packed.key_indices, host.key_indices);
  }
}

// The paged decode path and CUDA graphs read block tables, not a slot per key: a context built
// for them has no per-key indices and every other index as a full one has it.
TEST(StepBatchContext, without_key_indices_the_rest_is_the_same) {
  const StepBatch batch =
      make_batch({make_seq(1, 7, 1, true, {7, 2}), make_seq(2, 2, 1, true, {3}), make_seq(3, 9, 1, true, {1, 0, 6})});
  const StepContext full = make_step_context(batch, 4);
  const StepContext lean = make_step_context(batch, 4, at::kCPU, /*key_indices=*/false);
  EXPECT_TRUE(full.key_indices);
  EXPECT_FALSE(lean.key_indices);
  EXPECT_FALSE(lean.key_slots.defined());
  EXPECT_FALSE(lean.cu_seqlens_k.defined());
  EXPECT_TRUE(lean.seq_slots.empty());
  EXPECT_TRUE(lean.seq_key_positions.empty());
  EXPECT_EQ(lean.max_seqlen_k, 0);
  for (const auto& [want, got] : std::vector<std::pair<at::Tensor, at::Tensor>>{
           {full.token_ids, lean.token_ids},       {full.positions, lean.positions},
           {full.slots, lean.slots},               {full.sample_rows, lean.sample_rows},
           {full.cu_seqlens_q, lean.cu_seqlens_q}, {full.block_tables, lean.block_tables},
           {full.context_lens, lean.context_lens}})
    EXPECT_TRUE(at::equal(want, got));
  EXPECT_EQ(lean.max_seqlen_q, full.max_seqlen_q);
  EXPECT_TRUE(lean.decode_only);
  EXPECT_TRUE(is_decode_only(batch));
  EXPECT_FALSE(is_decode_only(StepBatch{}));
  EXPECT_FALSE(is_decode_only(make_batch({make_seq(1, 7, 1, true, {7, 2}), make_seq(2, 0, 2, true, {3})})));
}

TEST(StepBatchContext, decoded_header_gives_same_context) {
  // Later stages build their context from the decoded header, so it must agree with stage 0.
  const StepBatch batch = three_sequence_batch();
  int64_t micro_batch = 0;
  const StepBatch decoded = decode_step_header(encode_step_header(batch, 0), &micro_batch);
  const StepContext want = make_step_context(batch, 4);
  const StepContext got = make_step_context(decoded, 4);
  EXPECT_EQ(to_vector(got.positions), to_vector(want.positions));
  EXPECT_EQ(to_vector(got.slots), to_vector(want.slots));
  EXPECT_EQ(to_vector(got.sample_rows), to_vector(want.sample_rows));
  ASSERT_EQ(got.seq_slots.size(), want.seq_slots.size());
  for (size_t i = 0; i < want.seq_slots.size(); ++i)
    EXPECT_EQ(to_vector(got.seq_slots[i]), to_vector(want.seq_slots[i]));
}

TEST(StepBatchContext, short_block_table_throws) {
  // 5 + 4 tokens need three blocks of 4; two is one too few.
  const StepBatch batch = make_batch({make_seq(1, 5, 4, true, {7, 2})});
  EXPECT_THROW(make_step_context(batch, 4), std::logic_error);
  const StepBatch later = make_batch({make_seq(1, 0, 1, true, {3}), make_seq(2, 4, 1, true, {6})});
  EXPECT_THROW(make_step_context(later, 4), std::logic_error);
}

TEST(StepBatchContext, more_token_ids_than_new_tokens_throws) {
  StepBatch batch = make_batch({make_seq(1, 0, 3, true, {0})});
  batch.token_ids.push_back(7);
  EXPECT_THROW(make_step_context(batch, 4), std::logic_error);
}

// Too few token ids must be refused before positions and slots (sized by the token ids)
// are written.
TEST(StepBatchContext, fewer_token_ids_than_new_tokens_throws_before_writing) {
  StepBatch batch = make_batch({make_seq(1, 0, 3, true, {0})});
  batch.token_ids.pop_back();
  EXPECT_THROW(make_step_context(batch, 4), std::logic_error);
}

}  // namespace
}  // namespace kvpipe
