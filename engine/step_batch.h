// StepBatch: what one forward step computes, in a form that can cross a process boundary.
//
// The coordinator fills it from the scheduler; a stage turns it into the index tensors its
// layers need (StepContext). Each sequence contributes `num_new` consecutive tokens that
// follow `context_len` tokens already in the KV cache; its block table covers all
// context_len + num_new tokens (-1 for blocks a window has freed). With layer-level reuse
// (`full_sequences`) the token ids are every token of each sequence, since the layers that
// keep no K/V recompute the whole sequence.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

namespace kvpipe {

struct SamplingParams {
  double temperature = 0.0;  // 0 = greedy
  int top_k = 0;             // 0 = off
  double top_p = 1.0;
  uint64_t seed = 0;
  // The random stream a request draws from together with `seed`: -1 is the request's own id.
  // A server sets it so that equal seeds give equal samples whatever id a request gets.
  int64_t stream = -1;
  // Tokens whose probability (after temperature) is below min_p times the most likely one's
  // are dropped before top-k and top-p (vLLM's and llama.cpp's min_p); 0 = off.
  double min_p = 0.0;
};

struct SeqStep {
  int64_t request_id = 0;
  int64_t context_len = 0;       // tokens already cached before this step
  int64_t num_new = 0;           // tokens computed in this step
  int64_t output_index = 0;      // index of the token sampled after this step
  bool sample = false;           // the last new token's distribution is wanted
  // With `sample`: how many of the last new tokens are sampled rows (more than 1 when the
  // step verifies a speculative draft); row r's token has output index output_index + r.
  int64_t num_sampled = 1;
  SamplingParams sampling;
  std::vector<int32_t> block_table;
};

struct StepBatch {
  std::vector<SeqStep> seqs;
  std::vector<int64_t> token_ids;  // sum of num_new (or of context_len + num_new), in order
  bool want_logits = false;        // return the raw logits of sampled rows too
  bool full_sequences = false;
  int64_t window_sinks = 0;
  int64_t window_recent = 0;       // 0: attention sees every earlier position
  int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }
};

// Index tensors derived once per step and shared by every layer of a stage. On a GPU they
// cross to the device in one copy (make_step_context), so a step pays one transfer for its
// indices whatever its batch. The per-key indices (a slot and a position for every key of
// every sequence: they grow with the context) are built only when the step's attention path
// reads them (`key_indices`); the paged decode path and CUDA graphs read block tables instead.
struct StepContext {
  at::Tensor token_ids;               // int64: the batch's token ids (the first stage's input)
  at::Tensor positions;               // int64 [T]: position of each new token
  at::Tensor slots;                   // int64 [T]: cache slot of each new token
  bool key_indices = true;            // seq_slots, seq_key_positions, key_slots, cu_seqlens_k,
                                      // max_seqlen_k are built (else empty, undefined, 0)
  std::vector<at::Tensor> seq_slots;  // per sequence: slots of the cached keys it attends to
  std::vector<at::Tensor> seq_key_positions;  // per sequence: their positions
  at::Tensor sample_rows;             // int64 [sampled rows]: rows of T whose logits are sampled
  // With full_sequences: every token's position, and where the new tokens sit among them.
  at::Tensor full_positions;          // int64 [sum of context_len + num_new]
  at::Tensor new_rows;                // int64 [T]

  // The same indices packed for varlen and paged attention kernels (FlashAttention's
  // cumulative lengths, vLLM's block tables), sequence after sequence:
  at::Tensor key_slots;      // int64 [sum of keys]: seq_slots one after the other
  at::Tensor cu_seqlens_q;   // int32 [S + 1]: where each sequence's new tokens start in T
  at::Tensor cu_seqlens_k;   // int32 [S + 1]: where each sequence's keys start in key_slots
  int64_t max_seqlen_q = 0;  // most new tokens of one sequence
  int64_t max_seqlen_k = 0;  // most keys of one sequence
  // Per sequence, or with decode_only per new token (a verified draft's row r is a decode
  // query of its own: its sequence's table, context_len + r + 1 keys):
  at::Tensor block_tables;   // int32 [S or T, most blocks of one sequence], -1 past a table's end
  at::Tensor context_lens;   // int32 [S or T]: context_len + num_new of each sequence (or row)
  bool decode_only = false;  // every new token is a decode query (is_decode_only)
};

// The step's indices on `device` (the CPU: as built; a GPU: copied there in one transfer),
// with the per-key ones only when `key_indices` (ModelShard::step_reads_keys says).
StepContext make_step_context(const StepBatch& batch, int64_t block_size, at::Device device = at::kCPU,
                              bool key_indices = true);

// Every new token of the (non-empty) batch is a decode query: its sequence computes one new
// token, or verifies a draft (every new token a sampled row), so the paged decode kernel takes
// each row with the keys up to its own position, as the steps without the draft would.
bool is_decode_only(const StepBatch& batch);

// `host`'s index tensors packed into one buffer, moved to `device` in one copy and taken
// apart again as views (what make_step_context does for a GPU; any device, for tests).
StepContext pack_step_context(const StepContext& host, at::Device device);

// The wire format of a step header between pipeline stages: `batch` without its token ids
// (only the first stage needs them) as int64 words, led by the micro-batch id.
std::vector<int64_t> encode_step_header(const StepBatch& batch, int64_t micro_batch);
StepBatch decode_step_header(const std::vector<int64_t>& words, int64_t* micro_batch);

// A sampled "token" that says the row's logits were not finite (NaN or +inf): the request
// fails instead of taking a token. Token ids are never negative, so it travels back from the
// last stage in the same int64 words as a token.
constexpr int64_t kNonFiniteToken = -1;

struct StepOutput {
  int64_t micro_batch = 0;
  std::vector<int64_t> request_ids;  // one per sampled row, in batch order
  std::vector<int64_t> tokens;       // kNonFiniteToken where the row could not be sampled
  at::Tensor logits;                 // float32 [sampled rows, vocab] when asked for
};

}  // namespace kvpipe
