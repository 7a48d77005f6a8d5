#include "engine/model/model_weights.h"

#include "engine/kernels/cpu/interleaved_blocks.h"
#include "engine/model/architecture.h"
#include "engine/model/gguf.h"
#include "engine/model/safetensors.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <mutex>
#include <stdexcept>

namespace kvpipe {
namespace {

const char* kDummyPrefix = "dummy:";

bool is_gguf_path(const std::string& path) {
  const std::string ext = ".gguf";
  return path.size() > ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0;
}

std::string layer_name(int64_t i, const std::string& suffix) {
  return "model.layers." + std::to_string(i) + "." + suffix;
}

// FNV-1a: a stable hash (std::hash is not guaranteed across builds) for per-tensor seeds.
uint64_t stable_hash(const std::string& s, uint64_t seed) {
  uint64_t h = 1469598103934665603ULL ^ (seed * 0x9E3779B97F4A7C15ULL);
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

bool is_norm(const std::string& name) {
  return name.find("norm") != std::string::npos;
}

using TensorSource = std::function<at::Tensor(const std::string&, const std::vector<int64_t>&)>;

}  // namespace

int64_t ModelWeights::bytes() const {
  int64_t total = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) total += t.numel() * static_cast<int64_t>(t.element_size());
  };
  auto add_matrix = [&](const WeightMatrix& m) { total += m.bytes(); };
  add_matrix(embedding);
  add(final_norm);
  if (!(lm_head.defined() && embedding.defined() && lm_head.storage_id() == embedding.storage_id()))
    add_matrix(lm_head);
  for (const auto& l : layer) {
    add(l.input_norm), add_matrix(l.qkv), add(l.qkv_bias), add(l.qk_norm), add_matrix(l.o), add(l.post_norm);
    add(l.attn_out_norm), add(l.mlp_out_norm);
    add_matrix(l.gate_up), add_matrix(l.down);
  }
  return total;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> hf_tensor_layout(const ModelConfig& c) {
  const Architecture& arch = architecture(c.architecture);
  const int64_t h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim,
                ff = c.intermediate_size;
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  out.push_back({"model.embed_tokens.weight", {c.vocab_size, h}});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    out.push_back({layer_name(i, "input_layernorm.weight"), {h}});
    if (arch.fused_qkv) {
      out.push_back({layer_name(i, "self_attn.qkv_proj.weight"), {q + 2 * kv, h}});
    } else {
      out.push_back({layer_name(i, "self_attn.q_proj.weight"), {q, h}});
      out.push_back({layer_name(i, "self_attn.k_proj.weight"), {kv, h}});
      out.push_back({layer_name(i, "self_attn.v_proj.weight"), {kv, h}});
    }
    if (c.qkv_bias) {
      out.push_back({layer_name(i, "self_attn.q_proj.bias"), {q}});
      out.push_back({layer_name(i, "self_attn.k_proj.bias"), {kv}});
      out.push_back({layer_name(i, "self_attn.v_proj.bias"), {kv}});
    }
    if (c.qk_norm) {
      out.push_back({layer_name(i, "self_attn.q_norm.weight"), {c.head_dim}});
      out.push_back({layer_name(i, "self_attn.k_norm.weight"), {c.head_dim}});
    }
    out.push_back({layer_name(i, "self_attn.o_proj.weight"), {h, q}});
    out.push_back({layer_name(i, "post_attention_layernorm.weight"), {h}});
    if (arch.sandwich_norms) {
      out.push_back({layer_name(i, "pre_feedforward_layernorm.weight"), {h}});
      out.push_back({layer_name(i, "post_feedforward_layernorm.weight"), {h}});
    }
    if (arch.fused_gate_up) {
      out.push_back({layer_name(i, "mlp.gate_up_proj.weight"), {2 * ff, h}});
    } else {
      out.push_back({layer_name(i, "mlp.gate_proj.weight"), {ff, h}});
      out.push_back({layer_name(i, "mlp.up_proj.weight"), {ff, h}});
    }
    out.push_back({layer_name(i, "mlp.down_proj.weight"), {h, ff}});
  }
  out.push_back({"model.norm.weight", {h}});
  if (!c.tie_embeddings) out.push_back({"lm_head.weight", {c.vocab_size, h}});
  return out;
}

at::Generator seeded_generator(at::Generator shared, uint64_t seed) {
  at::Generator own;
  {
    // The shared generator's state is read under its lock; the copy is this caller's alone.
    std::lock_guard<std::mutex> lock(shared.mutex());
    own = shared.clone();
  }
  own.set_current_seed(seed);
  return own;
}

at::Tensor random_tensor(const std::string& name, const std::vector<int64_t>& shape, uint64_t seed,
                         double std, at::Device device) {
  // A draw locks its generator itself (the CPU and CUDA kernels both do): it must get one no
  // caller holds, or it waits forever on its own thread.
  const at::Generator gen = seeded_generator(at::globalContext().defaultGenerator(device), stable_hash(name, seed));
  at::Tensor t = at::normal(0.0, std, shape, gen, at::TensorOptions().dtype(at::kFloat).device(device));
  if (is_norm(name)) t.add_(1.0);
  return t;
}

at::ScalarType parse_dtype(const std::string& name, const std::string& what) {
  if (name == "float32") return at::kFloat;
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  throw std::invalid_argument(what + ": unknown dtype '" + name + "' (float32, float16, bfloat16)");
}

std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    default: return c10::toString(dtype);
  }
}

ModelConfig load_model_config(const std::string& path) {
  if (path.rfind(kDummyPrefix, 0) == 0) {
    ModelConfig cfg = preset_config(path.substr(std::string(kDummyPrefix).size()));
    cfg.validate(path);
    return cfg;
  }
  if (is_gguf_path(path)) return load_gguf_config(path);
  return load_hf_config(path);
}

namespace {

// A matrix from its file: `name` of `shape`, read only as far as `slice` reaches.
using MatrixSource =
    std::function<WeightMatrix(const std::string&, const std::vector<int64_t>&, const MatrixSlice&)>;

MatrixSlice row_slice(int64_t begin, int64_t rows) { return {begin, rows, 0, -1}; }
MatrixSlice col_slice(int64_t begin, int64_t cols) { return {0, -1, begin, cols}; }

ModelWeights build_weights(const ModelConfig& cfg, const WeightSelection& sel, at::ScalarType dtype,
                           at::Device device, const TensorSource& source, const MatrixSource& matrix_source) {
  if (sel.layers.begin < 0 || sel.layers.end > cfg.num_layers || sel.layers.begin > sel.layers.end)
    throw std::invalid_argument("layer range [" + std::to_string(sel.layers.begin) + ", " +
                                std::to_string(sel.layers.end) + ") is outside the model's " +
                                std::to_string(cfg.num_layers) + " layers");
  auto get = [&](const std::string& name, std::vector<int64_t> shape) {
    return source(name, shape).to(device, dtype).contiguous();
  };
  // On the CPU a float32 run keeps float16/bfloat16 and block matrices as stored; a 16-bit
  // run converts float matrices to its dtype (LibTorch's 16-bit products), blocks stay
  // blocks. On a GPU each matrix becomes one dense dtype tensor there, one at a time, so the
  // host holds at most one dequantised matrix.
  auto matrix = [&](const std::string& name, std::vector<int64_t> shape, const MatrixSlice& slice = {}) {
    WeightMatrix m = matrix_source(name, shape, slice);
    if (!device.is_cpu()) return WeightMatrix::from_tensor(m.dequantize(dtype).to(device));
    return dtype == at::kFloat ? m : m.with_float_dtype(dtype);
  };
  const Architecture& arch = architecture(cfg.architecture);
  const TensorSplit split = sel.split.whole() ? whole_model_split(cfg) : sel.split;
  const int64_t hd = cfg.head_dim;
  const int64_t h = cfg.hidden_size, q = cfg.num_heads * hd, kv = cfg.num_kv_heads * hd, ff = cfg.intermediate_size;
  // This rank's rows of q, k and v (whole heads) and of gate and up (whole units).
  const int64_t q0 = split.first_head * hd, qn = split.heads * hd;
  const int64_t kv0 = split.first_kv_head * hd, kvn = split.kv_heads * hd;
  const int64_t f0 = split.ff_begin, fn = split.ff_units;
  const MatrixSlice vocab = split.whole() ? MatrixSlice{} : row_slice(split.vocab_begin, split.vocab_rows);
  auto part = [](const at::Tensor& t, int64_t begin, int64_t n) { return t.narrow(0, begin, n); };
  ModelWeights w;
  w.config = cfg;
  w.layers = sel.layers;
  w.split = split;
  w.dtype = dtype;
  w.device = device;
  if (sel.embedding || (sel.head && cfg.tie_embeddings))
    w.embedding = matrix("model.embed_tokens.weight", {cfg.vocab_size, h}, vocab);
  if (sel.head) {
    w.final_norm = get("model.norm.weight", {h});
    w.lm_head = cfg.tie_embeddings ? w.embedding : matrix("lm_head.weight", {cfg.vocab_size, h}, vocab);
    if (!sel.embedding && cfg.tie_embeddings) w.embedding = WeightMatrix();
  }
  for (int64_t i = sel.layers.begin; i < sel.layers.end; ++i) {
    LayerWeights l;
    l.input_norm = get(layer_name(i, "input_layernorm.weight"), {h});
    if (arch.fused_qkv) {
      const std::string name = layer_name(i, "self_attn.qkv_proj.weight");
      const std::vector<int64_t> shape = {q + 2 * kv, h};
      l.qkv = split.whole() ? matrix(name, shape)
                            : WeightMatrix::concat({matrix(name, shape, row_slice(q0, qn)),
                                                    matrix(name, shape, row_slice(q + kv0, kvn)),
                                                    matrix(name, shape, row_slice(q + kv + kv0, kvn))});
    } else {
      l.qkv = WeightMatrix::concat({matrix(layer_name(i, "self_attn.q_proj.weight"), {q, h}, row_slice(q0, qn)),
                                    matrix(layer_name(i, "self_attn.k_proj.weight"), {kv, h}, row_slice(kv0, kvn)),
                                    matrix(layer_name(i, "self_attn.v_proj.weight"), {kv, h}, row_slice(kv0, kvn))});
    }
    if (cfg.qkv_bias)
      l.qkv_bias = at::cat({part(get(layer_name(i, "self_attn.q_proj.bias"), {q}), q0, qn),
                            part(get(layer_name(i, "self_attn.k_proj.bias"), {kv}), kv0, kvn),
                            part(get(layer_name(i, "self_attn.v_proj.bias"), {kv}), kv0, kvn)});
    if (cfg.qk_norm)
      l.qk_norm = at::cat({get(layer_name(i, "self_attn.q_norm.weight"), {hd}).expand({split.heads, hd}),
                           get(layer_name(i, "self_attn.k_norm.weight"), {hd}).expand({split.kv_heads, hd})});
    // Row-parallel: this rank's heads' columns; the ranks' outputs sum to the whole product.
    l.o = matrix(layer_name(i, "self_attn.o_proj.weight"), {h, q}, split.whole() ? MatrixSlice{} : col_slice(q0, qn));
    if (arch.sandwich_norms) {
      // Gemma 2's post_attention_layernorm is on the attention's output, not before the MLP.
      l.attn_out_norm = get(layer_name(i, "post_attention_layernorm.weight"), {h});
      l.post_norm = get(layer_name(i, "pre_feedforward_layernorm.weight"), {h});
      l.mlp_out_norm = get(layer_name(i, "post_feedforward_layernorm.weight"), {h});
    } else {
      l.post_norm = get(layer_name(i, "post_attention_layernorm.weight"), {h});
    }
    if (arch.fused_gate_up) {
      const std::string name = layer_name(i, "mlp.gate_up_proj.weight");
      l.gate_up = split.whole() ? matrix(name, {2 * ff, h})
                                : WeightMatrix::concat({matrix(name, {2 * ff, h}, row_slice(f0, fn)),
                                                        matrix(name, {2 * ff, h}, row_slice(ff + f0, fn))});
    } else {
      l.gate_up = WeightMatrix::concat({matrix(layer_name(i, "mlp.gate_proj.weight"), {ff, h}, row_slice(f0, fn)),
                                        matrix(layer_name(i, "mlp.up_proj.weight"), {ff, h}, row_slice(f0, fn))});
    }
    l.down = matrix(layer_name(i, "mlp.down_proj.weight"), {h, ff}, split.whole() ? MatrixSlice{} : col_slice(f0, fn));
    w.layer.push_back(std::move(l));
  }
  return w;
}

}  // namespace

ModelWeights random_weights(const ModelConfig& cfg, const WeightSelection& sel, uint64_t seed,
                            double std, at::ScalarType dtype, at::Device device) {
  const TensorSource source = [seed, std, device](const std::string& name, const std::vector<int64_t>& shape) {
    return random_tensor(name, shape, seed, std, device);
  };
  return build_weights(cfg, sel, dtype, device, source,
                       [&](const std::string& name, const std::vector<int64_t>& shape, const MatrixSlice& slice) {
                         const at::Tensor t = source(name, shape);
                         return WeightMatrix::from_tensor(
                             slice_stored(t, QuantType::F32, t.size(1), slice).to(dtype).contiguous());
                       });
}

ModelWeights move_weights(const ModelWeights& from, at::Device device, at::ScalarType dtype) {
  auto tensor = [&](const at::Tensor& t) { return t.defined() ? t.to(device, dtype).contiguous() : t; };
  auto matrix = [&](const WeightMatrix& m) {
    return m.defined() ? WeightMatrix::from_tensor(m.dequantize(dtype).to(device)) : m;
  };
  ModelWeights w;
  w.config = from.config;
  w.layers = from.layers;
  w.split = from.split;
  w.dtype = dtype;
  w.device = device;
  w.embedding = matrix(from.embedding);
  w.final_norm = tensor(from.final_norm);
  const bool tied = from.lm_head.defined() && from.embedding.defined() &&
                    from.lm_head.storage_id() == from.embedding.storage_id();
  w.lm_head = tied ? w.embedding : matrix(from.lm_head);
  for (const LayerWeights& l : from.layer)
    w.layer.push_back({tensor(l.input_norm), matrix(l.qkv), tensor(l.qkv_bias), tensor(l.qk_norm), matrix(l.o),
                       tensor(l.post_norm), tensor(l.attn_out_norm), tensor(l.mlp_out_norm), matrix(l.gate_up),
                       matrix(l.down)});
  return w;
}

StoredWeightBytes stored_weight_bytes(const std::string& path, const ModelConfig& cfg, at::ScalarType dtype,
                                      bool dense, bool repack) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  StoredWeightBytes b;
  b.per_layer = cfg.layer_params() * elem;
  b.embedding = cfg.embedding_params() * elem;
  b.head = (cfg.tie_embeddings ? 0 : cfg.embedding_params() * elem) + cfg.hidden_size * elem;
  if (dense || path.rfind(kDummyPrefix, 0) == 0) return b;
  if (!is_gguf_path(path)) {
    // Safetensors matrices keep their 16-bit dtype in a float32 run (vectors are converted).
    if (dtype != at::kFloat) return b;
    const SafetensorsModel files(path);
    StoredWeightBytes stored;
    int64_t layers = 0;
    try {
      for (const auto& [name, shape] : hf_tensor_layout(cfg)) {
        int64_t elements = 1;
        for (const int64_t n : shape) elements *= n;
        const int64_t bytes =
            elements * (shape.size() == 2 ? static_cast<int64_t>(c10::elementSize(files.stored_dtype(name))) : elem);
        if (name.rfind("model.layers.", 0) == 0) layers += bytes;
        else if (name == "model.embed_tokens.weight") stored.embedding += bytes;
        else stored.head += bytes;
      }
    } catch (const std::invalid_argument&) {
      // A shard that cannot be read is reported by the rank that loads it, naming the file;
      // until then the plan counts the run dtype's bytes.
      return b;
    }
    stored.per_layer = (layers + cfg.num_layers - 1) / std::max<int64_t>(cfg.num_layers, 1);
    return stored;
  }
  // Norms and biases (1-D) load in the run dtype; matrices keep their stored bytes.
  const GgufFile file(path);
  int64_t layers = 0;
  b.embedding = b.head = 0;
  for (const std::string& name : file.tensor_names()) {
    const GgufTensorInfo& t = file.tensor(name);
    int64_t elements = 1;
    for (const int64_t n : t.ne) elements *= n;
    int64_t bytes = t.ne.size() == 1 ? elements * elem : static_cast<int64_t>(t.bytes);
    // interleave_weights repacks the layers' matrices and an LM head of its own, each up to its
    // last whole group of 8 rows (WeightMatrix::interleaved).
    const std::optional<QuantType> type =
        repack && t.ne.size() == 2 && name != "token_embd.weight" ? quant_type_from_ggml(t.type) : std::nullopt;
    if (type && interleave_supports(*type)) {
      const int64_t grouped = t.ne[1] / kInterleavedRows * kInterleavedRows;
      const int64_t packed = grouped * interleaved_row_bytes(*type, t.ne[0]);
      const int64_t growth = packed - grouped * quant_row_bytes(*type, t.ne[0]);
      bytes += growth;
      b.repacked += packed;
      b.repack_growth += growth;
    }
    if (name.rfind("blk.", 0) == 0) layers += bytes;
    else if (name == "token_embd.weight") b.embedding += bytes;
    else if (name == "output.weight" || name == "output_norm.weight") b.head += bytes;
  }
  b.per_layer = (layers + cfg.num_layers - 1) / std::max<int64_t>(cfg.num_layers, 1);
  return b;
}

SplitAlignment split_alignment(const std::string& path, const ModelConfig& cfg) {
  SplitAlignment a;
  if (!is_gguf_path(path)) return a;  // safetensors and dummy models hold float matrices
  const GgufFile file(path);
  for (int64_t i = 0; i < cfg.num_layers; ++i) {
    for (const auto& [hf, cols] : {std::pair<std::string, int64_t*>{"self_attn.o_proj.weight", &a.o_cols},
                                   std::pair<std::string, int64_t*>{"mlp.down_proj.weight", &a.down_cols}}) {
      const std::string name = gguf_tensor_name(cfg, layer_name(i, hf));
      if (!file.contains(name)) continue;  // check_model_tensors names what is missing
      const std::optional<QuantType> type = quant_type_from_ggml(file.tensor(name).type);
      if (type) *cols = std::max(*cols, quant_traits(*type).block_values);
    }
  }
  return a;
}

namespace {

void check_safetensors_shape(const SafetensorsModel& files, const std::string& path, const std::string& name,
                             const std::vector<int64_t>& shape) {
  const std::vector<int64_t> actual = files.shape(name);
  if (actual != shape)
    throw std::invalid_argument(path + ": tensor '" + name + "' has shape " + c10::str(at::IntArrayRef(actual)) +
                                ", config.json implies " + c10::str(at::IntArrayRef(shape)));
}

}  // namespace

int64_t interleave_weights(ModelWeights& w) {
  if (!w.device.is_cpu()) return 0;
  int64_t bytes = 0;
  auto repack = [&](WeightMatrix& m) {
    if (!m.defined()) return;
    m = m.interleaved();
    bytes += m.interleaved_bytes();
  };
  for (LayerWeights& l : w.layer) {
    repack(l.qkv);
    repack(l.o);
    repack(l.gate_up);
    repack(l.down);
  }
  // A tied head is the embedding's table, which the lookup reads a row at a time: one copy.
  if (w.lm_head.defined() && w.lm_head.storage_id() != w.embedding.storage_id()) repack(w.lm_head);
  return bytes;
}

void check_model_tensors(const std::string& path, const ModelConfig& cfg) {
  if (path.rfind(kDummyPrefix, 0) == 0) return;
  if (is_gguf_path(path)) {
    const GgufFile file(path);
    for (const auto& [name, shape] : hf_tensor_layout(cfg)) check_gguf_tensor(file, cfg, name, shape);
    return;
  }
  // A directory of config.json alone describes a shape to plan for (a cluster job's model
  // that lives elsewhere until it runs); its missing weights are the loading rank's to report.
  if (!std::filesystem::exists(path + "/model.safetensors") &&
      !std::filesystem::exists(path + "/model.safetensors.index.json"))
    return;
  const SafetensorsModel files(path);
  for (const auto& [name, shape] : hf_tensor_layout(cfg)) {
    check_safetensors_shape(files, path, name, shape);
    files.check_loadable(name);
  }
}

ModelWeights load_weights(const std::string& path, const ModelConfig& cfg,
                          const WeightSelection& sel, at::ScalarType dtype, at::Device device) {
  if (path.rfind(kDummyPrefix, 0) == 0) return random_weights(cfg, sel, 0, kDefaultInitStd, dtype, device);
  if (is_gguf_path(path)) {
    auto file = std::make_shared<GgufFile>(path);
    return build_weights(
        cfg, sel, dtype, device,
        [file, cfg](const std::string& name, const std::vector<int64_t>& shape) {
          return load_gguf_tensor(*file, cfg, name, shape);
        },
        [file, cfg](const std::string& name, const std::vector<int64_t>& shape, const MatrixSlice& slice) {
          return load_gguf_matrix(*file, cfg, name, shape, slice);
        });
  }
  auto files = std::make_shared<SafetensorsModel>(path);
  auto check_shape = [files, path](const std::string& name, const std::vector<int64_t>& shape) {
    check_safetensors_shape(*files, path, name, shape);
  };
  return build_weights(
      cfg, sel, dtype, device,
      [files, check_shape, dtype, plus_one = architecture(cfg.architecture).norm_plus_one](
          const std::string& name, const std::vector<int64_t>& shape) {
        check_shape(name, shape);
        // Gemma's norms multiply by 1 + weight: added here, in float32, as the GGUF converter does.
        if (plus_one && is_norm(name)) return files->load(name, at::kFloat).add(1.0).to(dtype);
        return files->load(name, dtype);
      },
      [files, check_shape, dtype](const std::string& name, const std::vector<int64_t>& shape,
                                  const MatrixSlice& slice) {
        check_shape(name, shape);
        // float16/bfloat16 files stay 16-bit in a float32 run
        const at::ScalarType stored = files->stored_dtype(name);
        return WeightMatrix::from_tensor(files->load(name, dtype == at::kFloat ? stored : dtype, slice));
      });
}

}  // namespace kvpipe
