// GGUF: reading and writing llama.cpp's single-file model format (version 3).
//
// A GgufFile maps one file and validates its whole header up front (magic, version, metadata,
// tensor index, tensor types, byte ranges inside the file, alignment), so a malformed file
// fails before any tensor is used. The data section must be accounted for: tensors may not
// overlap, and apart from alignment padding no byte of it may belong to no tensor, so a
// header whose tensor count is off cannot shift every tensor onto the wrong bytes; tensor bytes are only touched when a tensor is loaded,
// which lets a pipeline rank read just its own layers. Tensors of the types quant_types.h lists
// (F32, F16, BF16 and ggml's block types of llama-quantize's standard mixes) load as matrices
// in their stored type (WeightMatrix) or as float32 copies; any other type is refused, naming it.
//
// The model-level functions translate between GGUF and the HF layout the engine runs:
// llama's GGUF q/k rows are permuted per head (llama.cpp rotates adjacent pairs, HF rotates
// halves), so loading undoes the permutation and writing applies it, and one forward pass
// serves both formats. Every problem with a file is a std::invalid_argument whose one-line
// message names the file and the problem.
#pragma once

#include "engine/model/model_config.h"
#include "engine/model/weight_matrix.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kvpipe {

class MappedFile;

// ggml tensor type ids (ggml.h), the ones this code reads or writes.
enum class GgmlType : uint32_t { F32 = 0, F16 = 1, Q8_0 = 8, BF16 = 30 };

// GGUF metadata value type ids.
enum class GgufValueType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, U64 = 10, I64 = 11, F64 = 12,
};

struct GgufValue {
  GgufValueType type = GgufValueType::U8;
  int64_t integer = 0;      // integer and bool types
  double number = 0;        // float types
  std::string string;       // STRING
  GgufValueType element = GgufValueType::U8;  // ARRAY: element type
  uint64_t count = 0;                         // ARRAY: element count
  // ARRAY: where the elements start in the file; they are read on request (get_*_array), so
  // opening a model does not copy a 150k-entry vocabulary it may never use.
  uint64_t offset = 0;
};

struct GgufTensorInfo {
  std::string name;
  uint32_t type = 0;            // ggml type id
  std::vector<int64_t> ne;      // dims innermost first, as stored (ne[0] = columns)
  uint64_t offset = 0;          // relative to the start of the data section
  uint64_t bytes = 0;           // 0 for a type this code cannot size (refused at load)
  // Row-major shape, outermost first (reversed ne): what at::Tensor calls the shape.
  std::vector<int64_t> shape() const { return {ne.rbegin(), ne.rend()}; }
};

class GgufFile {
 public:
  explicit GgufFile(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  bool has(const std::string& key) const { return metadata_.count(key) != 0; }
  // Typed metadata access; a missing key or a value of the wrong type is an
  // std::invalid_argument naming the file and the key.
  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;  // accepts integer values too
  const std::string& get_string(const std::string& key) const;
  // Array metadata, read from the mapped file; a missing key or an array of another element
  // type is an std::invalid_argument naming the file and the key. get_int_array accepts any
  // integer element type (and bool), get_float_array F32/F64 and integers.
  std::vector<std::string> get_string_array(const std::string& key) const;
  std::vector<int64_t> get_int_array(const std::string& key) const;
  std::vector<float> get_float_array(const std::string& key) const;

  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  const GgufTensorInfo& tensor(const std::string& name) const;
  std::vector<std::string> tensor_names() const;  // in file order

  // A float32 copy of the tensor, shaped as GgufTensorInfo::shape().
  at::Tensor load(const std::string& name) const;
  // A 2-D tensor as stored: float rows as a float tensor, blocks as they are in the file;
  // with `slice`, only its rows and columns are read and copied (a tensor rank's share).
  WeightMatrix load_matrix(const std::string& name, const MatrixSlice& slice = {}) const;
  // Refuses, as load and load_matrix would, a tensor of a type kvpipe cannot compute with.
  void check_loadable(const std::string& name) const { stored_type(tensor(name)); }

 private:
  std::string path_;
  uint32_t version_ = 0;
  std::unique_ptr<MappedFile> file_;
  const uint8_t* map_ = nullptr;   // the whole file
  size_t map_size_ = 0;
  const uint8_t* data_ = nullptr;  // start of the data section
  std::map<std::string, GgufValue> metadata_;
  std::map<std::string, GgufTensorInfo> tensors_;
  std::vector<std::string> order_;

  QuantType stored_type(const GgufTensorInfo& t) const;  // refuses a type it cannot compute with
};

// Builds a GGUF file in memory: metadata in insertion order, then tensors, each at an
// offset aligned to `alignment` (written as general.alignment when not 32).
class GgufWriter {
 public:
  void add_string(const std::string& key, const std::string& value);
  void add_u32(const std::string& key, uint32_t value);
  void add_i32(const std::string& key, int32_t value);
  void add_f32(const std::string& key, float value);
  void add_bool(const std::string& key, bool value);
  void add_string_array(const std::string& key, const std::vector<std::string>& values);
  void add_f32_array(const std::string& key, const std::vector<float>& values);
  void add_i32_array(const std::string& key, const std::vector<int32_t>& values);
  // `ne` innermost first; `bytes` already in the type's layout.
  void add_tensor(const std::string& name, uint32_t type, const std::vector<int64_t>& ne,
                  std::string bytes);
  // A contiguous CPU tensor of float32, float16 or bfloat16, under its own shape.
  void add_tensor(const std::string& name, const at::Tensor& tensor);

  std::string serialize(uint32_t alignment = 32) const;
  void write(const std::string& path, uint32_t alignment = 32) const;

 private:
  struct Tensor {
    std::string name;
    uint32_t type;
    std::vector<int64_t> ne;
    std::string bytes;
  };
  std::string kv_;  // serialized key/value pairs
  uint64_t kv_count_ = 0;
  std::vector<Tensor> tensors_;
};

// The name of ggml type `type` ("Q4_K", ...), or "type N" when unknown.
std::string ggml_type_name(uint32_t type);

// The model's hyper-parameters from GGUF metadata (the general.architecture names of
// engine/model/architecture.h: llama, qwen2, qwen3, phi3).
ModelConfig load_gguf_config(const std::string& path);
ModelConfig gguf_config(const GgufFile& file);

// The GGUF name of an HF tensor name ("model.layers.3.self_attn.q_proj.weight" ->
// "blk.3.attn_q.weight"); std::invalid_argument for a name with no GGUF counterpart.
std::string gguf_tensor_name(const std::string& hf_name);
// The same for a model of `cfg`'s architecture (Gemma 2 names its norms differently).
std::string gguf_tensor_name(const ModelConfig& cfg, const std::string& hf_name);

// HF q/k rows -> GGUF llama order (per head: [half, i] -> [i, half]) and back.
at::Tensor gguf_permute_rows(const at::Tensor& w, int64_t heads);
at::Tensor gguf_unpermute_rows(const at::Tensor& w, int64_t heads);

// The HF tensor `hf_name` from `file` as float32 in HF layout (q/k rows un-permuted for
// llama); its shape must be `expected`.
at::Tensor load_gguf_tensor(const GgufFile& file, const ModelConfig& cfg, const std::string& hf_name,
                            const std::vector<int64_t>& expected);

// Refuses, with the message load_gguf_tensor or load_gguf_matrix would give, the HF tensor
// `hf_name` when `file` lacks it, holds it in another shape than `expected` or in a type
// kvpipe cannot compute with; reads no tensor data.
void check_gguf_tensor(const GgufFile& file, const ModelConfig& cfg, const std::string& hf_name,
                       const std::vector<int64_t>& expected);

// The HF matrix `hf_name` from `file` in its stored type, in HF row order; `slice` in HF
// coordinates (q/k rows of whole heads, whose rows GGUF permutes only inside each head).
WeightMatrix load_gguf_matrix(const GgufFile& file, const ModelConfig& cfg, const std::string& hf_name,
                              const std::vector<int64_t>& expected, const MatrixSlice& slice = {});

// Writes a model given as HF-named float tensors (hf_tensor_layout order) as one GGUF file
// that llama.cpp loads: architecture metadata, then what `add_tokenizer` adds (the
// tokenizer.* keys: a vocabulary is text's, not the format's; init-model's is
// write_gguf_model in launch/init_model.h), then matrices in `dtype` (float32, float16 or
// bfloat16) and 1-D tensors in F32 (as llama.cpp's converter does; their values are rounded
// through `dtype` first so both formats hold the same numbers).
void write_gguf_file(const std::string& path, const ModelConfig& cfg,
                     const std::vector<std::pair<std::string, at::Tensor>>& hf_tensors, at::ScalarType dtype,
                     const std::function<void(GgufWriter&)>& add_tokenizer);

}  // namespace kvpipe
