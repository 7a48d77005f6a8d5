#include "engine/model/tensor_split.h"

#include <stdexcept>

namespace kvpipe {
namespace {

std::string n(int64_t v) { return std::to_string(v); }

[[noreturn]] void refuse(int size, const std::string& why) {
  throw std::invalid_argument("parallel.tensor: " + n(size) + " " + why);
}

}  // namespace

TensorSplit whole_model_split(const ModelConfig& cfg) {
  TensorSplit s;
  s.heads = cfg.num_heads;
  s.kv_heads = cfg.num_kv_heads;
  s.ff_units = cfg.intermediate_size;
  s.vocab_rows = cfg.vocab_size;
  return s;
}

void check_tensor_split(const ModelConfig& cfg, int size, const SplitAlignment& align) {
  if (size < 1) refuse(size, "must be at least 1");
  if (size == 1) return;
  const int64_t t = size;
  if (cfg.num_heads % t != 0)
    refuse(size, "does not divide the model's " + n(cfg.num_heads) + " attention heads");
  const int64_t kv = cfg.num_kv_heads;
  if (t <= kv ? kv % t != 0 : t % kv != 0)
    refuse(size, "and the model's " + n(kv) + " KV heads: neither divides the other (a KV head is split over " +
                     "ranks only when T is a multiple of the KV heads)");
  // Row-parallel o_proj: each rank's first column and column count must fall on o's blocks.
  const int64_t cols = cfg.num_heads / t * cfg.head_dim;
  if (cols % align.o_cols != 0)
    refuse(size, "gives each rank " + n(cfg.num_heads / t) + " heads of " + n(cfg.head_dim) + " = " + n(cols) +
                     " columns of o_proj, which is not a whole number of its " + n(align.o_cols) +
                     "-value blocks");
  if (cfg.intermediate_size % align.down_cols != 0)
    refuse(size, "cannot split down_proj: its " + n(cfg.intermediate_size) + " inputs are not whole " +
                     n(align.down_cols) + "-value blocks");
  const int64_t blocks = cfg.intermediate_size / align.down_cols;
  if (blocks < t)
    refuse(size, "ranks cannot each take a block of the " + n(cfg.intermediate_size) + " intermediate units (" +
                     n(blocks) + " blocks of " + n(align.down_cols) + ")");
  if (cfg.vocab_size < t) refuse(size, "ranks cannot split a vocabulary of " + n(cfg.vocab_size));
}

TensorSplit plan_tensor_split(const ModelConfig& cfg, int size, int rank, const SplitAlignment& align) {
  check_tensor_split(cfg, size, align);
  if (size == 1) return whole_model_split(cfg);
  if (rank < 0 || rank >= size) throw std::logic_error("tensor rank " + n(rank) + " of " + n(size));
  const int64_t t = size, r = rank;
  TensorSplit s;
  s.rank = rank;
  s.size = size;
  s.heads = cfg.num_heads / t;
  s.first_head = r * s.heads;
  if (t <= cfg.num_kv_heads) {
    s.kv_heads = cfg.num_kv_heads / t;
    s.first_kv_head = r * s.kv_heads;
  } else {
    // T / kv_heads ranks share each KV head; their query heads all read it.
    s.kv_heads = 1;
    s.first_kv_head = r / (t / cfg.num_kv_heads);
  }
  const int64_t blocks = cfg.intermediate_size / align.down_cols;
  const int64_t b0 = r * blocks / t, b1 = (r + 1) * blocks / t;
  s.ff_begin = b0 * align.down_cols;
  s.ff_units = (b1 - b0) * align.down_cols;
  const int64_t v0 = r * cfg.vocab_size / t, v1 = (r + 1) * cfg.vocab_size / t;
  s.vocab_begin = v0;
  s.vocab_rows = v1 - v0;
  return s;
}

}  // namespace kvpipe
