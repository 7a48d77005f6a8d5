// ModelWeights: the tensors of one pipeline stage (a contiguous range of decoder layers plus,
// where the stage holds them, the embedding and the final norm with the LM head).
//
// Weights come from an HF safetensors directory or a GGUF file (only the stage's tensors are
// read from the memory-mapped files) or are made in memory from a preset (`dummy:<preset>`).
// Projection matrices, the embedding and the LM head stay in their stored type (GGUF blocks
// such as Q4_K, or float16/bfloat16) when the run dtype is float32, and float matrices are
// converted to a 16-bit run dtype; norms and biases are always in the run dtype. A random tensor is seeded by its own name, so a stage that
// generates only its layers gets exactly the values a whole-model run (or `init-model` with
// the same seed) has. q/k/v and gate/up are concatenated at load so that each becomes one
// matrix product (as vLLM's fused QKV and gate-up projections).
#pragma once

#include "engine/model/model_config.h"
#include "engine/model/tensor_split.h"
#include "engine/model/weight_matrix.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace at {
struct Generator;
}  // namespace at

namespace kvpipe {

struct LayerRange {
  int64_t begin = 0;  // first layer
  int64_t end = 0;    // one past the last layer
  int64_t size() const { return end - begin; }
};

struct LayerWeights {
  at::Tensor input_norm;   // [hidden]
  WeightMatrix qkv;        // [(heads + 2 * kv_heads) * head_dim, hidden]
  at::Tensor qkv_bias;     // undefined unless the model has q/k/v biases
  // [heads + kv_heads, head_dim]: the q norm's weight on each q head, then the k norm's on
  // each kv head, so one RMSNorm over the rotated heads applies both (Qwen3); undefined
  // unless the model normalises q and k.
  at::Tensor qk_norm;
  WeightMatrix o;          // [hidden, heads * head_dim]
  at::Tensor post_norm;    // [hidden]: the norm before the MLP
  at::Tensor attn_out_norm;  // [hidden], Gemma 2: on the attention's output, before the residual
  at::Tensor mlp_out_norm;   // [hidden], Gemma 2: on the MLP's output, before the residual
  WeightMatrix gate_up;    // [2 * intermediate, hidden]
  WeightMatrix down;       // [hidden, intermediate]
};

struct ModelWeights {
  ModelConfig config;
  LayerRange layers;
  // The heads, MLP units and vocabulary rows this rank holds (all of them on one rank); the
  // layers' shapes below are those of the slice: q/k/v of split.heads and split.kv_heads,
  // gate/up of split.ff_units, the embedding and LM head of split.vocab_rows.
  TensorSplit split;
  at::ScalarType dtype = c10::ScalarType::Float;  // of activations, norms and the KV cache
  at::Device device = at::kCPU;                    // where every tensor of the shard lives
  WeightMatrix embedding;  // [vocab, hidden], defined on the first stage
  at::Tensor final_norm;   // [hidden], defined on the last stage
  WeightMatrix lm_head;    // [vocab, hidden], defined on the last stage (the embedding when tied)
  std::vector<LayerWeights> layer;  // layer[i] is model layer layers.begin + i

  int64_t bytes() const;
};

struct WeightSelection {
  LayerRange layers;
  bool embedding = true;
  bool head = true;
  // A tensor rank's slice (plan_tensor_split); size 1 (the default): the whole of each layer.
  TensorSplit split;
};

// The HF tensor names of a model, in the order init-model writes them, with their shapes.
std::vector<std::pair<std::string, std::vector<int64_t>>> hf_tensor_layout(const ModelConfig& cfg);

// Random float32 tensor for `name`, a pure function of (seed, name, shape, std, device type):
// norms are 1 + N(0, std), everything else N(0, std). On a GPU the tensor is drawn there
// (a CPU draw of an 8B model takes a minute), from a generator of the device's kind, so its
// values differ from the CPU's for the same seed; every rank on a GPU still draws the same
// values. Safe to call from several threads at once.
at::Tensor random_tensor(const std::string& name, const std::vector<int64_t>& shape, uint64_t seed,
                         double std, at::Device device = at::kCPU);

// A generator of the caller's own, of `shared`'s kind (CPU or CUDA) and seeded with `seed`:
// `shared` (a device's default generator) is locked only while it is copied, so draws from
// the copy neither wait for nor disturb anyone else's use of it, and their values depend on
// the seed alone. Draw with no generator lock held: the kernels take the lock themselves.
at::Generator seeded_generator(at::Generator shared, uint64_t seed);

// Resolves model.path: a directory with config.json, a GGUF file (*.gguf), or "dummy:<preset>".
ModelConfig load_model_config(const std::string& path);

// The selected tensors of a random model, as `init-model --seed seed --std std` writes it.
ModelWeights random_weights(const ModelConfig& cfg, const WeightSelection& selection, uint64_t seed,
                            double std, at::ScalarType dtype, at::Device device = at::kCPU);

// The same weights as `dtype` on `device`, every matrix one dense tensor (as load_weights
// places a GPU's): tests compare devices on equal weights, which a GPU's own draw of random
// weights would not give.
ModelWeights move_weights(const ModelWeights& weights, at::Device device, at::ScalarType dtype);

// Loads the selected tensors of the model at `path` as `dtype` onto `device` (dummy models
// use seed 0 and std 0.02, as `init-model` does by default). On the CPU, matrices keep their
// stored type (see above); on a GPU every matrix becomes one dense `dtype` tensor there
// (quantised blocks are dequantised once at load: kvpipe has no GPU block kernels yet), so
// projections are cuBLAS products.
ModelWeights load_weights(const std::string& path, const ModelConfig& cfg,
                          const WeightSelection& selection, at::ScalarType dtype,
                          at::Device device = at::kCPU);

// Repacks, on the CPU, the projections whose type has an interleaved layout (Q4_0, Q8_0, Q4_K, Q6_K:
// every layer's q/k/v, o, gate/up and down, and an LM head that is not the embedding's table)
// in groups of 8 rows for the kernels that read 8 rows at a time (model.repack). The bytes
// stay as many (Q4_K's 2.8% more), but live in the process's memory instead of the file's
// mapped pages.
// Returns the bytes repacked; a no-op (0) for weights on a GPU.
int64_t interleave_weights(ModelWeights& weights);

// Refuses, from the files' headers alone and with the message load_weights would give, a
// model at `path` that lacks a tensor `cfg` needs, holds one in another shape, or in a type
// or dtype kvpipe cannot compute with (what `validate` checks before any rank loads). A
// directory with config.json and no safetensors file is a shape to plan for: nothing to check.
void check_model_tensors(const std::string& path, const ModelConfig& cfg);

// The storage blocks the row-parallel matrices' input dimension is split on (o_proj and
// down_proj of every layer, from the file's tensor index; 1 for float matrices).
SplitAlignment split_alignment(const std::string& path, const ModelConfig& cfg);

// What a stage's weights take in memory as loaded for a run in `dtype`: per decoder layer
// (the mean over the model's layers: quantised files mix types per layer), the embedding
// table, and the head (LM head unless tied, final norm). Counted from the file's tensor
// index, before any weight is read.
struct StoredWeightBytes {
  int64_t per_layer = 0;
  int64_t embedding = 0;
  int64_t head = 0;
  // With `repack`: the bytes of the projections repacked into groups of 8 rows, in process
  // memory (interleave_weights), and what that layout adds over the stored one; both are
  // already counted in the figures above.
  int64_t repacked = 0;
  int64_t repack_growth = 0;
};
// `dense`: the weights as a GPU holds them (every matrix in `dtype`), not as stored.
// `repack`: a GGUF file's projections as interleave_weights leaves them (model.repack on the CPU).
StoredWeightBytes stored_weight_bytes(const std::string& path, const ModelConfig& cfg, at::ScalarType dtype,
                                      bool dense = false, bool repack = false);

// "float32" | "float16" | "bfloat16"; std::invalid_argument naming `what` otherwise.
at::ScalarType parse_dtype(const std::string& name, const std::string& what);
// The name parse_dtype reads for `dtype` (LibTorch's own name for others).
std::string dtype_name(at::ScalarType dtype);

// Default std of random weights.
constexpr double kDefaultInitStd = 0.02;

}  // namespace kvpipe
