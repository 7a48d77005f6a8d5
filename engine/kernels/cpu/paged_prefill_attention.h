// paged_prefill_attention: prompt and mixed-step attention on the CPU over the paged KV pool,
// read in place, tiled the way FlashAttention tiles it.
//
// Owns the CPU's attention for steps that are not all decode queries: each sequence's new
// queries (a prompt, a prompt's chunk after its cached prefix, or one token beside them) against
// the keys and values its block table points at, in the pool's stored type, with no gather of
// K/V into a tensor and no score matrix: per (sequence, KV head, tile of new tokens) the tile's
// query rows (every query head of the group for each token) take the keys in chunks of 32
// positions; a chunk's keys are decoded to float32 once and shared by every row, scores form as
// a small matrix product, the rows keep an online softmax (running maximum and sum), and the
// chunk's values are added into the rows' accumulators as a second product. Chunks no row of
// the tile may see (past its last token, outside its windows) are skipped, so a causal prompt
// does about half the products of a full one and a windowed one only those of its windows.
// Work items are handed to the rank's thread pool longest first.
//
// Guarantees: a query row's result depends only on its own visible keys: chunks sit at fixed
// positions (multiples of 32), each score is one float32 sum over the head's values in order,
// and the softmax and value sums take the chunks in order. So it is the same bit for bit
// whatever tile, thread or step the query falls in (a prompt split into chunks, a prefix
// reused or recomputed, a batch or alone). Every product and sum is float32; the test holds it
// to a float64 softmax over the keys each query sees (engine/kernels/cpu's tests). Windows of
// attention sinks plus recent keys, a layer's sliding window and Gemma 2's soft-cap are applied
// as engine/layers.h defines them. Scratch is per thread, sized by the tile, not the context.
#pragma once

#include "engine/kernels/cpu/paged_attention.h"

#include <cstdint>

namespace kvpipe {

// out[t, h, :] = softmax(q[t, h] . K / ...) V for every new token t: sequence s's new tokens are
// rows cu_seqlens_q[s] .. cu_seqlens_q[s + 1] of q and out (float32 [T, num_heads, head_dim],
// contiguous), at positions context_lens[s] - n_s .. context_lens[s] - 1 (n_s its new tokens;
// context_lens counts the cached tokens and the new ones, whose K/V the pool already holds).
// The token at position p sees the keys the decode query of context p + 1 sees
// (PagedDecodeWindow). block_tables int32 [num_seqs, max_blocks] row-major (-1 for blocks a
// window freed). A context length below its new tokens or past max_blocks * block_size, a
// decreasing cu_seqlens_q, or a visible position whose block is outside the pool is refused
// with std::invalid_argument naming the argument.
void paged_prefill_attention_cpu(const float* q, int64_t num_heads, const PagedKvLayer& kv,
                                 const int32_t* block_tables, int64_t max_blocks, const int32_t* context_lens,
                                 const int32_t* cu_seqlens_q, int64_t num_seqs, const PagedDecodeWindow& window,
                                 float scale, float* out);

}  // namespace kvpipe
