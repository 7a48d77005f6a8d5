#include "engine/model/gguf.h"

#include "engine/model/architecture.h"
#include "engine/model/mapped_file.h"

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <utility>
#include <vector>

namespace kvpipe {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian uint32
constexpr uint32_t kVersion = 3;
constexpr uint32_t kDefaultAlignment = 32;
// Far above any real model; stops a corrupt count from driving a huge allocation.
constexpr uint64_t kMaxCount = uint64_t{1} << 32;
constexpr uint32_t kMaxDims = 4;  // GGML_MAX_DIMS
// Alignments are small powers of two (32 by default); a huge one would make padding swallow
// the data section.
constexpr int64_t kMaxAlignment = int64_t{1} << 20;

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  std::string message = where + ": " + what;
  std::replace_if(
      message.begin(), message.end(), [](char c) { return c == '\n' || c == '\r'; }, ' ');
  throw std::invalid_argument(message);
}

// How ggml lays out each type it knows (ggml.c's type_traits): values per block and bytes per
// block. Types this code cannot compute with are sized too, so that the data section of any
// file can be accounted for.
struct TypeLayout {
  const char* name;
  uint64_t block_values;
  uint64_t block_bytes;
};

const std::map<uint32_t, TypeLayout>& type_layouts() {
  static const std::map<uint32_t, TypeLayout> layouts = {
      {0, {"F32", 1, 4}},          {1, {"F16", 1, 2}},         {2, {"Q4_0", 32, 18}},
      {3, {"Q4_1", 32, 20}},       {6, {"Q5_0", 32, 22}},      {7, {"Q5_1", 32, 24}},
      {8, {"Q8_0", 32, 34}},       {9, {"Q8_1", 32, 36}},      {10, {"Q2_K", 256, 84}},
      {11, {"Q3_K", 256, 110}},    {12, {"Q4_K", 256, 144}},   {13, {"Q5_K", 256, 176}},
      {14, {"Q6_K", 256, 210}},    {15, {"Q8_K", 256, 292}},   {16, {"IQ2_XXS", 256, 66}},
      {17, {"IQ2_XS", 256, 74}},   {18, {"IQ3_XXS", 256, 98}}, {19, {"IQ1_S", 256, 50}},
      {20, {"IQ4_NL", 32, 18}},    {21, {"IQ3_S", 256, 110}},  {22, {"IQ2_S", 256, 82}},
      {23, {"IQ4_XS", 256, 136}},  {24, {"I8", 1, 1}},         {25, {"I16", 1, 2}},
      {26, {"I32", 1, 4}},         {27, {"I64", 1, 8}},        {28, {"F64", 1, 8}},
      {29, {"IQ1_M", 256, 56}},    {30, {"BF16", 1, 2}},       {34, {"TQ1_0", 256, 54}},
      {35, {"TQ2_0", 256, 66}},    {39, {"MXFP4", 32, 17}}};
  return layouts;
}

uint64_t pad_to(uint64_t n, uint64_t alignment) { return (n + alignment - 1) / alignment * alignment; }

// Tensors may not share bytes, and apart from the padding that aligns each one no byte of the
// data section may be left to no tensor: a header that lists one tensor too few (its info
// then read as the start of the data section) would otherwise shift every tensor onto the
// wrong bytes and quietly drop the last one.
void check_data_section(const std::string& path, const std::map<std::string, GgufTensorInfo>& tensors,
                        uint64_t alignment, uint64_t data_size) {
  std::vector<const GgufTensorInfo*> by_offset;
  for (const auto& item : tensors) by_offset.push_back(&item.second);
  std::sort(by_offset.begin(), by_offset.end(), [](const GgufTensorInfo* a, const GgufTensorInfo* b) {
    return a->offset != b->offset ? a->offset < b->offset : a->name < b->name;
  });
  auto range = [](const GgufTensorInfo* t) {
    return "tensor '" + t->name + "' [" + std::to_string(t->offset) + ", " + std::to_string(t->offset + t->bytes) + ")";
  };
  const GgufTensorInfo* previous = nullptr;
  uint64_t end = 0;  // of the previous tensor; offsets and sizes were checked against the file
  for (const GgufTensorInfo* t : by_offset) {
    if (previous != nullptr && t->offset < end)
      fail(path, range(previous) + " and " + range(t) + " overlap");
    if (t->offset > pad_to(end, alignment))
      fail(path, "data bytes [" + std::to_string(pad_to(end, alignment)) + ", " + std::to_string(t->offset) +
                     ") before " + range(t) + " belong to no tensor (the tensor index does not match the data)");
    previous = t;
    end = t->offset + t->bytes;
  }
  if (data_size > pad_to(end, alignment))
    fail(path, std::to_string(data_size - end) + " bytes at the end of the data section belong to no tensor (" +
                   std::to_string(tensors.size()) + " tensors listed; is the tensor count wrong?)");
}

bool supported(uint32_t type) { return quant_type_from_ggml(type).has_value(); }

const char* kSupportedTypes =
    "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS";

// Little-endian cursor over the mapped header; every read is bounds-checked so a truncated
// or corrupt header is a message, not a crash.
class Reader {
 public:
  Reader(const std::string& path, const uint8_t* p, size_t size) : path_(path), p_(p), size_(size) {}

  size_t pos() const { return pos_; }

  const uint8_t* take(uint64_t n, const std::string& what) {
    if (n > size_ - pos_)
      fail(path_, "file ends inside the header (reading " + what + " at byte " +
                      std::to_string(pos_) + ")");
    const uint8_t* at = p_ + pos_;
    pos_ += n;
    return at;
  }
  template <typename T>
  T read(const std::string& what) {
    T v;
    std::memcpy(&v, take(sizeof(T), what), sizeof(T));  // hosts are little-endian (x86, arm64)
    return v;
  }
  std::string string(const std::string& what) {
    const uint64_t n = read<uint64_t>(what);
    if (n > kMaxCount) fail(path_, what + ": string length " + std::to_string(n) + " is implausible");
    const uint8_t* s = take(n, what);
    return std::string(reinterpret_cast<const char*>(s), n);
  }

 private:
  std::string path_;
  const uint8_t* p_;
  size_t size_;
  size_t pos_ = 0;
};

size_t scalar_size(GgufValueType t) {
  switch (t) {
    case GgufValueType::U8: case GgufValueType::I8: case GgufValueType::BOOL: return 1;
    case GgufValueType::U16: case GgufValueType::I16: return 2;
    case GgufValueType::U32: case GgufValueType::I32: case GgufValueType::F32: return 4;
    case GgufValueType::U64: case GgufValueType::I64: case GgufValueType::F64: return 8;
    default: return 0;
  }
}

GgufValue read_scalar(Reader& r, GgufValueType t, const std::string& what) {
  GgufValue v;
  v.type = t;
  switch (t) {
    case GgufValueType::U8: v.integer = r.read<uint8_t>(what); break;
    case GgufValueType::I8: v.integer = r.read<int8_t>(what); break;
    case GgufValueType::U16: v.integer = r.read<uint16_t>(what); break;
    case GgufValueType::I16: v.integer = r.read<int16_t>(what); break;
    case GgufValueType::U32: v.integer = r.read<uint32_t>(what); break;
    case GgufValueType::I32: v.integer = r.read<int32_t>(what); break;
    case GgufValueType::U64: v.integer = static_cast<int64_t>(r.read<uint64_t>(what)); break;
    case GgufValueType::I64: v.integer = r.read<int64_t>(what); break;
    case GgufValueType::BOOL: v.integer = r.read<uint8_t>(what) != 0; break;
    case GgufValueType::F32: v.number = r.read<float>(what); break;
    case GgufValueType::F64: v.number = r.read<double>(what); break;
    case GgufValueType::STRING: v.string = r.string(what); break;
    default: break;
  }
  return v;
}

bool is_integer(GgufValueType t) {
  return t != GgufValueType::F32 && t != GgufValueType::F64 && t != GgufValueType::STRING &&
         t != GgufValueType::ARRAY;
}

std::string layer_suffix_to_gguf(const std::string& s) {
  static const std::map<std::string, std::string> m = {
      {"input_layernorm.weight", "attn_norm.weight"},
      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.q_proj.bias", "attn_q.bias"},
      {"self_attn.k_proj.bias", "attn_k.bias"},
      {"self_attn.v_proj.bias", "attn_v.bias"},
      {"self_attn.q_norm.weight", "attn_q_norm.weight"},
      {"self_attn.k_norm.weight", "attn_k_norm.weight"},
      {"self_attn.qkv_proj.weight", "attn_qkv.weight"},
      {"self_attn.o_proj.weight", "attn_output.weight"},
      {"post_attention_layernorm.weight", "ffn_norm.weight"},
      {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"},
      // Phi-3's fused gate/up: llama.cpp's ffn_up of 2 * feed_forward_length rows, gate first.
      {"mlp.gate_up_proj.weight", "ffn_up.weight"}};
  const auto it = m.find(s);
  return it == m.end() ? std::string() : it->second;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string arch_of(const ModelConfig& cfg) { return architecture(cfg.architecture).gguf_name; }

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

}  // namespace

std::string ggml_type_name(uint32_t type) {
  const auto it = type_layouts().find(type);
  return it == type_layouts().end() ? "type " + std::to_string(type) : it->second.name;
}

// ---------------------------------------------------------------------------------------------
// Reading

GgufFile::GgufFile(const std::string& path) : path_(path) {
  file_ = std::make_unique<MappedFile>(path);
  map_ = file_->data();
  map_size_ = file_->size();
  if (map_size_ < 8) fail(path, "too short for a GGUF header (" + std::to_string(map_size_) + " bytes)");
  const uint8_t* base = map_;
  Reader r(path, base, map_size_);
  const uint32_t magic = r.read<uint32_t>("magic");
  if (magic != kMagic) fail(path, "bad magic: not a GGUF file");
  version_ = r.read<uint32_t>("version");
  if (version_ != kVersion)
    fail(path, "unsupported GGUF version " + std::to_string(version_) + " (only 3 is read)");
  const uint64_t n_tensors = r.read<uint64_t>("tensor count");
  const uint64_t n_kv = r.read<uint64_t>("metadata count");
  if (n_tensors > kMaxCount || n_kv > kMaxCount)
    fail(path, "implausible tensor or metadata count");

  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string key = r.string("metadata key " + std::to_string(i));
    const std::string what = "metadata '" + key + "'";
    const auto type = static_cast<GgufValueType>(r.read<uint32_t>(what));
    GgufValue v;
    if (type == GgufValueType::ARRAY) {
      v.type = type;
      v.element = static_cast<GgufValueType>(r.read<uint32_t>(what));
      v.count = r.read<uint64_t>(what);
      if (v.count > kMaxCount) fail(path, what + ": implausible array length");
      v.offset = r.pos();
      if (v.element == GgufValueType::STRING) {
        for (uint64_t j = 0; j < v.count; ++j) r.string(what);
      } else {
        const size_t size = scalar_size(v.element);
        if (size == 0) fail(path, what + ": unknown array element type " + std::to_string(uint32_t(v.element)));
        r.take(size * v.count, what);  // at most 8 * 2^32: no overflow
      }
    } else {
      if (type != GgufValueType::STRING && scalar_size(type) == 0)
        fail(path, what + ": unknown value type " + std::to_string(uint32_t(type)));
      v = read_scalar(r, type, what);
    }
    if (!metadata_.emplace(key, std::move(v)).second) fail(path, "duplicate " + what);
  }

  uint64_t alignment = kDefaultAlignment;
  if (has("general.alignment")) {
    const int64_t a = get_int("general.alignment");
    if (a <= 0 || a > kMaxAlignment || (a & (a - 1)) != 0)
      fail(path, "metadata 'general.alignment': " + std::to_string(a) + " is not a power of two up to " +
                     std::to_string(kMaxAlignment));
    alignment = static_cast<uint64_t>(a);
  }

  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    t.name = r.string("tensor info " + std::to_string(i));
    const std::string what = "tensor '" + t.name + "'";
    const uint32_t n_dims = r.read<uint32_t>(what);
    if (n_dims == 0 || n_dims > kMaxDims)
      fail(path, what + ": " + std::to_string(n_dims) + " dimensions (1 to 4 allowed)");
    uint64_t elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t n = r.read<uint64_t>(what);
      if (n == 0 || n > (uint64_t{1} << 40) || __builtin_mul_overflow(elements, n, &elements))
        fail(path, what + ": bad dimension " + std::to_string(n));
      t.ne.push_back(static_cast<int64_t>(n));
    }
    t.type = r.read<uint32_t>(what);
    t.offset = r.read<uint64_t>(what);
    const auto layout = type_layouts().find(t.type);
    if (layout == type_layouts().end())
      fail(path, what + ": unknown tensor type " + std::to_string(t.type));
    if (t.offset % alignment != 0)
      fail(path, what + ": offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
                     std::to_string(alignment));
    // Every known type is sized, loadable or not, so that the whole data section is
    // accounted for below.
    const TypeLayout& tl = layout->second;
    if (static_cast<uint64_t>(t.ne[0]) % tl.block_values != 0)
      fail(path, what + ": " + tl.name + " row of " + std::to_string(t.ne[0]) + " values is not a multiple of " +
                     std::to_string(tl.block_values));
    if (__builtin_mul_overflow(elements / tl.block_values, tl.block_bytes, &t.bytes))
      fail(path, what + ": " + std::to_string(elements) + " " + tl.name + " values overflow a byte count");
    if (!tensors_.emplace(t.name, t).second) fail(path, "duplicate " + what);
    order_.push_back(t.name);
  }

  const uint64_t data_start = (r.pos() + alignment - 1) / alignment * alignment;
  if (data_start > map_size_ && n_tensors > 0)
    fail(path, "file ends before the tensor data section (truncated)");
  data_ = base + std::min<uint64_t>(data_start, map_size_);
  const uint64_t data_size = map_size_ - std::min<uint64_t>(data_start, map_size_);
  for (const auto& [name, t] : tensors_) {
    if (t.offset > data_size || t.bytes > data_size - t.offset)
      fail(path, "tensor '" + name + "': data [" + std::to_string(t.offset) + ", " +
                     std::to_string(t.offset + t.bytes) + ") runs past the end of the file (" +
                     std::to_string(data_size) + " data bytes; truncated or offset out of range)");
  }
  check_data_section(path, tensors_, alignment, data_size);
}

GgufFile::~GgufFile() = default;

int64_t GgufFile::get_int(const std::string& key) const {
  const auto it = metadata_.find(key);
  if (it == metadata_.end()) fail(path_, "missing metadata '" + key + "'");
  if (!is_integer(it->second.type)) fail(path_, "metadata '" + key + "' is not an integer");
  return it->second.integer;
}

double GgufFile::get_float(const std::string& key) const {
  const auto it = metadata_.find(key);
  if (it == metadata_.end()) fail(path_, "missing metadata '" + key + "'");
  const GgufValue& v = it->second;
  if (v.type == GgufValueType::F32 || v.type == GgufValueType::F64) return v.number;
  if (is_integer(v.type) && v.type != GgufValueType::BOOL) return static_cast<double>(v.integer);
  fail(path_, "metadata '" + key + "' is not a number");
}

const std::string& GgufFile::get_string(const std::string& key) const {
  const auto it = metadata_.find(key);
  if (it == metadata_.end()) fail(path_, "missing metadata '" + key + "'");
  if (it->second.type != GgufValueType::STRING) fail(path_, "metadata '" + key + "' is not a string");
  return it->second.string;
}

namespace {

const GgufValue& array_value(const std::string& path, const std::map<std::string, GgufValue>& metadata,
                             const std::string& key) {
  const auto it = metadata.find(key);
  if (it == metadata.end()) fail(path, "missing metadata '" + key + "'");
  if (it->second.type != GgufValueType::ARRAY) fail(path, "metadata '" + key + "' is not an array");
  return it->second;
}

}  // namespace

std::vector<std::string> GgufFile::get_string_array(const std::string& key) const {
  const GgufValue& v = array_value(path_, metadata_, key);
  if (v.element != GgufValueType::STRING) fail(path_, "metadata '" + key + "' is not an array of strings");
  // The header was validated at open, so these reads stay inside the file.
  Reader r(path_, map_, map_size_);
  r.take(v.offset, key);
  std::vector<std::string> out;
  out.reserve(v.count);
  for (uint64_t i = 0; i < v.count; ++i) out.push_back(r.string("metadata '" + key + "'"));
  return out;
}

std::vector<int64_t> GgufFile::get_int_array(const std::string& key) const {
  const GgufValue& v = array_value(path_, metadata_, key);
  if (!is_integer(v.element) || v.element == GgufValueType::ARRAY)
    fail(path_, "metadata '" + key + "' is not an array of integers");
  Reader r(path_, map_, map_size_);
  r.take(v.offset, key);
  std::vector<int64_t> out;
  out.reserve(v.count);
  for (uint64_t i = 0; i < v.count; ++i) out.push_back(read_scalar(r, v.element, key).integer);
  return out;
}

std::vector<float> GgufFile::get_float_array(const std::string& key) const {
  const GgufValue& v = array_value(path_, metadata_, key);
  const bool floating = v.element == GgufValueType::F32 || v.element == GgufValueType::F64;
  if (!floating && (!is_integer(v.element) || v.element == GgufValueType::ARRAY || v.element == GgufValueType::BOOL))
    fail(path_, "metadata '" + key + "' is not an array of numbers");
  Reader r(path_, map_, map_size_);
  r.take(v.offset, key);
  std::vector<float> out;
  out.reserve(v.count);
  for (uint64_t i = 0; i < v.count; ++i) {
    const GgufValue e = read_scalar(r, v.element, key);
    out.push_back(floating ? static_cast<float>(e.number) : static_cast<float>(e.integer));
  }
  return out;
}

const GgufTensorInfo& GgufFile::tensor(const std::string& name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) fail(path_, "missing tensor '" + name + "'");
  return it->second;
}

std::vector<std::string> GgufFile::tensor_names() const { return order_; }

at::Tensor GgufFile::load(const std::string& name) const {
  const GgufTensorInfo& t = tensor(name);
  const QuantType type = stored_type(t);
  const std::vector<int64_t> shape = t.shape();
  void* src = const_cast<uint8_t*>(data_ + t.offset);  // from_blob wants void*; never written
  switch (type) {
    case QuantType::F32: return at::from_blob(src, shape, at::kFloat).clone();
    case QuantType::F16: return at::from_blob(src, shape, at::kHalf).to(at::kFloat);
    case QuantType::BF16: return at::from_blob(src, shape, at::kBFloat16).to(at::kFloat);
    default: break;
  }
  at::Tensor out = at::empty(shape, at::kFloat);
  const int64_t cols = t.ne[0], rows = out.numel() / cols, row_bytes = quant_row_bytes(type, cols);
  for (int64_t r = 0; r < rows; ++r)
    dequantize_row(type, data_ + t.offset + r * row_bytes, out.data_ptr<float>() + r * cols, cols);
  return out;
}

WeightMatrix GgufFile::load_matrix(const std::string& name, const MatrixSlice& slice) const {
  const GgufTensorInfo& t = tensor(name);
  const QuantType type = stored_type(t);
  if (t.ne.size() != 2) fail(path_, "tensor '" + name + "' is not a matrix");
  const int64_t cols = t.ne[0], rows = t.ne[1];
  void* src = const_cast<uint8_t*>(data_ + t.offset);
  // A view of the mapping, narrowed to the slice, then copied: only the slice's bytes are read.
  auto copy = [&](const at::Tensor& stored) {
    try {
      return slice_stored(stored, type, cols, slice).clone(at::MemoryFormat::Contiguous);
    } catch (const std::invalid_argument& e) {
      fail(path_, "tensor '" + name + "': " + e.what());
    }
  };
  const int64_t slice_cols = slice.cols < 0 ? cols - slice.col_begin : slice.cols;
  switch (type) {
    case QuantType::F32: return WeightMatrix::from_tensor(copy(at::from_blob(src, {rows, cols}, at::kFloat)));
    case QuantType::F16: return WeightMatrix::from_tensor(copy(at::from_blob(src, {rows, cols}, at::kHalf)));
    case QuantType::BF16: return WeightMatrix::from_tensor(copy(at::from_blob(src, {rows, cols}, at::kBFloat16)));
    default: break;
  }
  const int64_t row_bytes = quant_row_bytes(type, cols);
  return WeightMatrix::from_blocks(type, copy(at::from_blob(src, {rows, row_bytes}, at::kByte)), slice_cols);
}

QuantType GgufFile::stored_type(const GgufTensorInfo& t) const {
  if (!supported(t.type))
    fail(path_, "tensor '" + t.name + "' has type " + ggml_type_name(t.type) + ", which is not supported (" +
                    kSupportedTypes + ")");
  return *quant_type_from_ggml(t.type);
}

// ---------------------------------------------------------------------------------------------
// Writing

namespace {

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
void put_string(std::string& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  out += s;
}

}  // namespace

void GgufWriter::add_string(const std::string& key, const std::string& value) {
  put_string(kv_, key), put<uint32_t>(kv_, uint32_t(GgufValueType::STRING)), put_string(kv_, value);
  ++kv_count_;
}
void GgufWriter::add_u32(const std::string& key, uint32_t value) {
  put_string(kv_, key), put<uint32_t>(kv_, uint32_t(GgufValueType::U32)), put<uint32_t>(kv_, value);
  ++kv_count_;
}
void GgufWriter::add_i32(const std::string& key, int32_t value) {
  put_string(kv_, key), put<uint32_t>(kv_, uint32_t(GgufValueType::I32)), put<int32_t>(kv_, value);
  ++kv_count_;
}
void GgufWriter::add_f32(const std::string& key, float value) {
  put_string(kv_, key), put<uint32_t>(kv_, uint32_t(GgufValueType::F32)), put<float>(kv_, value);
  ++kv_count_;
}
void GgufWriter::add_bool(const std::string& key, bool value) {
  put_string(kv_, key), put<uint32_t>(kv_, uint32_t(GgufValueType::BOOL)), put<uint8_t>(kv_, value);
  ++kv_count_;
}
void GgufWriter::add_string_array(const std::string& key, const std::vector<std::string>& values) {
  put_string(kv_, key), put<uint32_t>(kv_, uint32_t(GgufValueType::ARRAY));
  put<uint32_t>(kv_, uint32_t(GgufValueType::STRING)), put<uint64_t>(kv_, values.size());
  for (const auto& v : values) put_string(kv_, v);
  ++kv_count_;
}
void GgufWriter::add_f32_array(const std::string& key, const std::vector<float>& values) {
  put_string(kv_, key), put<uint32_t>(kv_, uint32_t(GgufValueType::ARRAY));
  put<uint32_t>(kv_, uint32_t(GgufValueType::F32)), put<uint64_t>(kv_, values.size());
  for (float v : values) put<float>(kv_, v);
  ++kv_count_;
}
void GgufWriter::add_i32_array(const std::string& key, const std::vector<int32_t>& values) {
  put_string(kv_, key), put<uint32_t>(kv_, uint32_t(GgufValueType::ARRAY));
  put<uint32_t>(kv_, uint32_t(GgufValueType::I32)), put<uint64_t>(kv_, values.size());
  for (int32_t v : values) put<int32_t>(kv_, v);
  ++kv_count_;
}

void GgufWriter::add_tensor(const std::string& name, uint32_t type, const std::vector<int64_t>& ne,
                            std::string bytes) {
  tensors_.push_back({name, type, ne, std::move(bytes)});
}

void GgufWriter::add_tensor(const std::string& name, const at::Tensor& tensor) {
  const at::Tensor t = tensor.contiguous();
  uint32_t type;
  switch (t.scalar_type()) {
    case at::kFloat: type = uint32_t(GgmlType::F32); break;
    case at::kHalf: type = uint32_t(GgmlType::F16); break;
    case at::kBFloat16: type = uint32_t(GgmlType::BF16); break;
    default: throw std::invalid_argument("GGUF tensor '" + name + "': unsupported dtype");
  }
  const std::vector<int64_t> ne(t.sizes().rbegin(), t.sizes().rend());
  add_tensor(name, type, ne,
             std::string(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size()));
}

std::string GgufWriter::serialize(uint32_t alignment) const {
  std::string out;
  put<uint32_t>(out, kMagic);
  put<uint32_t>(out, kVersion);
  put<uint64_t>(out, tensors_.size());
  const bool custom_alignment = alignment != kDefaultAlignment;
  put<uint64_t>(out, kv_count_ + (custom_alignment ? 1 : 0));
  out += kv_;
  if (custom_alignment) {
    put_string(out, "general.alignment"), put<uint32_t>(out, uint32_t(GgufValueType::U32));
    put<uint32_t>(out, alignment);
  }
  auto pad = [alignment](uint64_t n) { return (n + alignment - 1) / alignment * alignment; };
  uint64_t offset = 0;
  for (const auto& t : tensors_) {
    put_string(out, t.name);
    put<uint32_t>(out, t.ne.size());
    for (int64_t n : t.ne) put<uint64_t>(out, n);
    put<uint32_t>(out, t.type);
    put<uint64_t>(out, offset);
    offset = pad(offset + t.bytes.size());
  }
  out.resize(pad(out.size()), '\0');
  for (const auto& t : tensors_) {
    out += t.bytes;
    out.resize(pad(out.size()), '\0');
  }
  return out;
}

void GgufWriter::write(const std::string& path, uint32_t alignment) const {
  const std::string bytes = serialize(alignment);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) fail(path, std::string("cannot open for writing: ") + std::strerror(errno));
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) fail(path, "write failed");
}

// ---------------------------------------------------------------------------------------------
// Model level

std::string gguf_tensor_name(const ModelConfig& cfg, const std::string& hf_name) {
  // Gemma 2's post_attention_layernorm follows attention (llama.cpp's post_attention_norm);
  // its pre_feedforward_layernorm is the norm Llama calls post_attention_layernorm.
  if (architecture(cfg.architecture).sandwich_norms) {
    static const std::vector<std::pair<std::string, std::string>> sandwich = {
        {"post_attention_layernorm.weight", "post_attention_norm.weight"},
        {"pre_feedforward_layernorm.weight", "ffn_norm.weight"},
        {"post_feedforward_layernorm.weight", "post_ffw_norm.weight"}};
    for (const auto& [hf, gguf] : sandwich)
      if (ends_with(hf_name, "." + hf)) {
        const std::string name = gguf_tensor_name(hf_name.substr(0, hf_name.size() - hf.size()) + "input_layernorm.weight");
        return name.substr(0, name.size() - std::string("attn_norm.weight").size()) + gguf;
      }
  }
  return gguf_tensor_name(hf_name);
}

std::string gguf_tensor_name(const std::string& hf_name) {
  if (hf_name == "model.embed_tokens.weight") return "token_embd.weight";
  if (hf_name == "model.norm.weight") return "output_norm.weight";
  if (hf_name == "lm_head.weight") return "output.weight";
  const std::string prefix = "model.layers.";
  if (hf_name.rfind(prefix, 0) == 0) {
    const size_t dot = hf_name.find('.', prefix.size());
    if (dot != std::string::npos) {
      const std::string index = hf_name.substr(prefix.size(), dot - prefix.size());
      const std::string suffix = layer_suffix_to_gguf(hf_name.substr(dot + 1));
      if (!index.empty() && std::all_of(index.begin(), index.end(), ::isdigit) && !suffix.empty())
        return "blk." + index + "." + suffix;
    }
  }
  throw std::invalid_argument("tensor '" + hf_name + "' has no GGUF name");
}

at::Tensor gguf_permute_rows(const at::Tensor& w, int64_t heads) {
  const int64_t rows = w.size(0), hd = rows / heads;
  std::vector<int64_t> view = {heads, 2, hd / 2};
  for (int64_t d = 1; d < w.dim(); ++d) view.push_back(w.size(d));
  return w.reshape(view).transpose(1, 2).reshape(w.sizes()).contiguous();
}

at::Tensor gguf_unpermute_rows(const at::Tensor& w, int64_t heads) {
  const int64_t rows = w.size(0), hd = rows / heads;
  std::vector<int64_t> view = {heads, hd / 2, 2};
  for (int64_t d = 1; d < w.dim(); ++d) view.push_back(w.size(d));
  return w.reshape(view).transpose(1, 2).reshape(w.sizes()).contiguous();
}

namespace {

// Gemma 2 and 3 as llama.cpp's loaders read them: Gemma 2's soft caps (50 and 30 when
// absent) and window (4096 when absent) on every even layer; Gemma 3's optional final soft
// cap, a window only where attention.sliding_window is set, on five layers of every six,
// which rotate with rope.freq_base_swa (10000 when absent); GeGLU, embeddings scaled by
// sqrt(hidden), the embedding as the LM head; attention scaled by head_dim^-0.5, or for the
// 27B models (46 and 62 layers) by (hidden / heads)^-0.5, which is HF's
// query_pre_attn_scalar for each released size.
void read_gemma_metadata(const GgufFile& f, const std::string& k, const Architecture& arch, ModelConfig& c) {
  if (f.has(k + "attention.sliding_window_pattern"))
    fail(f.path(), k + "attention.sliding_window_pattern is not supported (the architecture's own pattern only)");
  const bool gemma3 = arch.local_rope;
  if (!gemma3 && f.has(k + "rope.freq_base_swa"))
    fail(f.path(), k + "rope.freq_base_swa is not supported (one RoPE base for every layer)");
  c.attn_softcap = gemma3 ? 0.0 : f.has(k + "attn_logit_softcapping") ? f.get_float(k + "attn_logit_softcapping") : 50.0;
  c.final_softcap = f.has(k + "final_logit_softcapping") ? f.get_float(k + "final_logit_softcapping") : gemma3 ? 0.0 : 30.0;
  c.sliding_window = f.has(k + "attention.sliding_window") ? f.get_int(k + "attention.sliding_window") : gemma3 ? 0 : 4096;
  if (c.sliding_window > 0) {
    c.sliding_layers.assign(c.num_layers, false);
    for (int64_t i = 0; i < c.num_layers; ++i) c.sliding_layers[i] = (i + 1) % arch.sliding_pattern != 0;
    if (gemma3) c.local_rope_theta = f.has(k + "rope.freq_base_swa") ? f.get_float(k + "rope.freq_base_swa") : 10000.0;
  }
  if (c.sliding_window >= c.max_position) c.sliding_window = 0;
  c.gelu_tanh = true;
  c.embedding_scale = std::sqrt(static_cast<double>(c.hidden_size));
  const bool is_27b = c.num_layers == (gemma3 ? 62 : 46);
  const int64_t scale_dim = is_27b && c.num_heads > 0 ? c.hidden_size / c.num_heads : c.head_dim;
  c.attention_scale = scale_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(scale_dim)) : 0.0;
}

}  // namespace

ModelConfig gguf_config(const GgufFile& f) {
  const std::string arch = f.get_string("general.architecture");
  ModelConfig c;
  const Architecture* traits = find_gguf_architecture(arch);
  if (traits == nullptr)
    fail(f.path(), "general.architecture '" + arch + "' is not supported (" + supported_gguf_architecture_names() + ")");
  c.architecture = traits->hf_name;
  c.qkv_bias = traits->qkv_bias;
  c.qk_norm = traits->qk_norm;
  const std::string k = arch + ".";
  // llama.cpp writes Mixtral-style models as llama with experts, whose feed-forward tensors
  // kvpipe has no place for.
  if (f.has(k + "expert_count") && f.get_int(k + "expert_count") > 0)
    fail(f.path(), k + "expert_count " + std::to_string(f.get_int(k + "expert_count")) +
                       ": mixture-of-experts models are not supported");
  c.max_position = f.get_int(k + "context_length");
  c.hidden_size = f.get_int(k + "embedding_length");
  c.num_layers = f.get_int(k + "block_count");
  c.intermediate_size = f.get_int(k + "feed_forward_length");
  c.num_heads = f.get_int(k + "attention.head_count");
  // llama.cpp's defaults for the optional keys.
  c.num_kv_heads = f.has(k + "attention.head_count_kv") ? f.get_int(k + "attention.head_count_kv") : c.num_heads;
  c.head_dim = f.has(k + "attention.key_length") ? f.get_int(k + "attention.key_length")
                                                  : (c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
  if (f.has(k + "attention.value_length") && f.get_int(k + "attention.value_length") != c.head_dim)
    fail(f.path(), "attention.value_length differs from key_length (not supported)");
  if (f.has(k + "rope.dimension_count") && f.get_int(k + "rope.dimension_count") != c.head_dim) {
    // llama.cpp's converter permutes a llama head's rows for its interleaved rotation as a
    // whole, so only the architectures that rotate halves (NeoX style) can rotate a part.
    if (!supports_partial_rotary(c.architecture))
      fail(f.path(), k + "rope.dimension_count " + std::to_string(f.get_int(k + "rope.dimension_count")) +
                         " differs from the head dimension " + std::to_string(c.head_dim) +
                         " (partial rotary embedding is not supported for " + arch + ")");
    c.rotary_dim = f.get_int(k + "rope.dimension_count");
  }
  c.rope_theta = f.has(k + "rope.freq_base") ? f.get_float(k + "rope.freq_base") : 10000.0;
  c.rms_eps = f.get_float(k + "attention.layer_norm_rms_epsilon");
  // RoPE scaling as llama.cpp reads it: rope.scaling.type none, linear (with
  // rope.scaling.factor, or the older rope.scale_linear) or yarn, rope.scaling.attn_factor on
  // cos and sin, and for llama3 models the per-frequency divisors its converter writes as
  // rope_freqs.weight. Other types (longrope) and keys that change the math otherwise are
  // refused by name.
  const auto number = [&](const std::string& key, double fallback) {
    return f.has(k + key) ? f.get_float(k + key) : fallback;
  };
  const std::string scaling = f.has(k + "rope.scaling.type") ? f.get_string(k + "rope.scaling.type") : "none";
  if (scaling != "none" && scaling != "linear" && scaling != "yarn")
    fail(f.path(), k + "rope.scaling.type '" + scaling + "' is not supported (none, linear, yarn)");
  const double scale_linear = number("rope.scale_linear", 1.0);
  RopeScaling& rs = c.rope_scaling;
  if (scaling == "linear" || (scaling == "none" && scale_linear != 1.0)) {
    rs.type = "linear";
    rs.factor = number("rope.scaling.factor", scale_linear);
  } else if (scaling == "yarn") {
    // llama.cpp (llama_context's constructor): a factor of 0 means none; the attention factor
    // is yarn's mscale, from yarn_log_multiplier when the file gives it (mscale_all_dim).
    rs.type = "yarn";
    rs.factor = number("rope.scaling.factor", 0.0);
    if (rs.factor == 0) rs.factor = 1.0;
    rs.original_max_position = f.has(k + "rope.scaling.original_context_length")
                                   ? f.get_int(k + "rope.scaling.original_context_length")
                                   : c.max_position;
    rs.beta_fast = number("rope.scaling.yarn_beta_fast", 32.0);
    rs.beta_slow = number("rope.scaling.yarn_beta_slow", 1.0);
    const auto mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
    const double log_mul = number("rope.scaling.yarn_log_multiplier", 0.0);
    rs.attention_factor = log_mul != 0 ? mscale(rs.factor, 1.0) / mscale(rs.factor, log_mul) : mscale(rs.factor, 1.0);
    // llama.cpp's converter writes a config.json's explicit attention_factor here.
    rs.attention_factor = number("rope.scaling.yarn_attn_factor", rs.attention_factor);
    if (number("rope.scaling.yarn_ext_factor", 1.0) != 1.0)
      fail(f.path(), k + "rope.scaling.yarn_ext_factor other than 1 is not supported");
  }
  // yarn's keys change nothing in llama.cpp when another type is set, so they are not refused.
  if (f.has(k + "rope.scaling.alpha") && f.get_float(k + "rope.scaling.alpha") != 0.0)
    fail(f.path(), k + "rope.scaling.alpha is not supported");
  // llama.cpp multiplies cos and sin by it, whatever the scaling type.
  rs.attention_factor *= number("rope.scaling.attn_factor", 1.0);
  if (f.contains("rope_freqs.weight")) {
    int64_t count = 1;
    for (const int64_t n : f.tensor("rope_freqs.weight").ne) count *= n;
    if (count != c.rope_dim() / 2)
      fail(f.path(), "rope_freqs.weight holds " + std::to_string(count) + " factors, not one per rotated pair (" +
                         std::to_string(c.rope_dim() / 2) + ")");
    const at::Tensor factors = f.load("rope_freqs.weight").to(at::kDouble).flatten().contiguous();
    c.rope_scaling.freq_factors.assign(factors.data_ptr<double>(), factors.data_ptr<double>() + factors.numel());
  }

  // Phi-3's longrope writes its per-frequency factors as two tensors (llama.cpp picks one by
  // context length); kvpipe has no longrope.
  for (const char* name : {"rope_factors_long.weight", "rope_factors_short.weight"})
    if (f.contains(name)) fail(f.path(), std::string("tensor '") + name + "': longrope RoPE scaling is not supported");
  if (traits->gemma) {
    read_gemma_metadata(f, k, *traits, c);
  } else if (f.has(k + "attention.sliding_window")) {
    // A window on every layer is honoured by capping the context at it, as load_hf_config
    // does (llama.cpp itself runs Phi-3 without one).
    const int64_t w = f.get_int(k + "attention.sliding_window");
    if (w > 0 && w < c.max_position) c.max_position = w;
  }

  const GgufTensorInfo& embd = f.tensor("token_embd.weight");
  if (f.has(k + "vocab_size")) c.vocab_size = f.get_int(k + "vocab_size");
  else if (embd.ne.size() == 2) c.vocab_size = embd.ne[1];
  // llama.cpp's Gemma 2 reads token_embd.weight as its output whatever else the file holds.
  c.tie_embeddings = traits->gguf_head_is_embedding || !f.contains("output.weight");
  if (f.has("tokenizer.ggml.bos_token_id")) c.bos_token_id = f.get_int("tokenizer.ggml.bos_token_id");
  if (f.has("tokenizer.ggml.eos_token_id")) c.eos_token_ids = {f.get_int("tokenizer.ggml.eos_token_id")};
  // Messages name the metadata key this file holds, not its config.json counterpart.
  const std::map<std::string, std::string> keys = {
      {"vocab_size", f.has(k + "vocab_size") ? k + "vocab_size" : "token_embd.weight"},
      {"hidden_size", k + "embedding_length"},
      {"num_hidden_layers", k + "block_count"},
      {"num_attention_heads", k + "attention.head_count"},
      {"num_key_value_heads", f.has(k + "attention.head_count_kv") ? k + "attention.head_count_kv"
                                                                    : k + "attention.head_count"},
      {"head_dim", f.has(k + "attention.key_length") ? k + "attention.key_length"
                                                     : k + "embedding_length / attention.head_count"},
      {"intermediate_size", k + "feed_forward_length"},
      {"max_position_embeddings", k + "context_length"},
      {"rope_theta", k + "rope.freq_base"},
      {"rope_type", k + "rope.scaling.type"},
      {"factor", f.has(k + "rope.scaling.factor") ? k + "rope.scaling.factor" : k + "rope.scale_linear"},
      {"original_max_position_embeddings", f.has(k + "rope.scaling.original_context_length")
                                               ? k + "rope.scaling.original_context_length"
                                               : k + "context_length"},
      {"beta_fast", k + "rope.scaling.yarn_beta_fast"},
      {"beta_slow", k + "rope.scaling.yarn_beta_slow"},
      {"attention_factor", k + "rope.scaling.attn_factor"},
      {"partial_rotary_factor", k + "rope.dimension_count"},
      {"rope_freqs", "rope_freqs.weight"},
      {"rms_norm_eps", k + "attention.layer_norm_rms_epsilon"},
      {"eos_token_id", "tokenizer.ggml.eos_token_id"}};
  c.validate(f.path(), [&keys](const std::string& hf_key) {
    const auto it = keys.find(hf_key);
    return it == keys.end() ? hf_key : it->second;
  });
  return c;
}

ModelConfig load_gguf_config(const std::string& path) {
  return gguf_config(GgufFile(path));
}

namespace {

// The GGUF name of `hf_name`, whose tensor must have the shape the metadata implies.
std::string checked_tensor_name(const GgufFile& file, const ModelConfig& cfg, const std::string& hf_name,
                                const std::vector<int64_t>& expected) {
  const std::string name = gguf_tensor_name(cfg, hf_name);
  const std::vector<int64_t> actual = file.tensor(name).shape();
  if (actual != expected)
    fail(file.path(), "tensor '" + name + "' has shape " + shape_text(actual) +
                          " (ne reversed), the metadata implies " + shape_text(expected));
  return name;
}

}  // namespace

void check_gguf_tensor(const GgufFile& file, const ModelConfig& cfg, const std::string& hf_name,
                       const std::vector<int64_t>& expected) {
  file.check_loadable(checked_tensor_name(file, cfg, hf_name, expected));
}

WeightMatrix load_gguf_matrix(const GgufFile& file, const ModelConfig& cfg, const std::string& hf_name,
                              const std::vector<int64_t>& expected, const MatrixSlice& slice) {
  const std::string name = checked_tensor_name(file, cfg, hf_name, expected);
  WeightMatrix m = file.load_matrix(name, slice);
  if (architecture(cfg.architecture).gguf_permuted_qk) {
    // Whole rows move, so the permutation applies to block rows as well as to float rows; a
    // slice of whole heads holds the same rows in both orders.
    const bool q = ends_with(name, "attn_q.weight"), k = ends_with(name, "attn_k.weight");
    if (q || k) {
      if (slice.row_begin % cfg.head_dim != 0 || m.rows() % cfg.head_dim != 0)
        throw std::logic_error("a slice of " + name + " that splits a head");
      const at::Tensor order = at::arange(m.rows(), at::kLong).view({m.rows(), 1});
      return m.select_rows(gguf_unpermute_rows(order, m.rows() / cfg.head_dim).view(-1));
    }
  }
  return m;
}

at::Tensor load_gguf_tensor(const GgufFile& file, const ModelConfig& cfg, const std::string& hf_name,
                            const std::vector<int64_t>& expected) {
  const std::string name = checked_tensor_name(file, cfg, hf_name, expected);
  at::Tensor t = file.load(name);
  if (architecture(cfg.architecture).gguf_permuted_qk) {
    if (ends_with(name, "attn_q.weight")) return gguf_unpermute_rows(t, cfg.num_heads);
    if (ends_with(name, "attn_k.weight")) return gguf_unpermute_rows(t, cfg.num_kv_heads);
  }
  return t;
}

void write_gguf_file(const std::string& path, const ModelConfig& cfg,
                     const std::vector<std::pair<std::string, at::Tensor>>& hf_tensors, at::ScalarType dtype,
                     const std::function<void(GgufWriter&)>& add_tokenizer) {
  const std::string arch = arch_of(cfg), k = arch + ".";
  const bool permuted = architecture(cfg.architecture).gguf_permuted_qk;
  // Gemma's metadata and its norms' +1 are llama.cpp's converter's to write, not this one's.
  if (architecture(cfg.architecture).gemma)
    throw std::invalid_argument(path + ": writing " + cfg.architecture + " as GGUF is not supported");
  GgufWriter w;
  w.add_string("general.architecture", arch);
  w.add_string("general.name", "kvpipe-random");
  w.add_u32("general.alignment", kDefaultAlignment);
  w.add_u32("general.file_type", dtype == at::kFloat ? 0 : dtype == at::kHalf ? 1 : 32);
  w.add_u32(k + "vocab_size", cfg.vocab_size);
  w.add_u32(k + "context_length", cfg.max_position);
  w.add_u32(k + "embedding_length", cfg.hidden_size);
  w.add_u32(k + "block_count", cfg.num_layers);
  w.add_u32(k + "feed_forward_length", cfg.intermediate_size);
  w.add_u32(k + "attention.head_count", cfg.num_heads);
  w.add_u32(k + "attention.head_count_kv", cfg.num_kv_heads);
  w.add_u32(k + "attention.key_length", cfg.head_dim);
  w.add_u32(k + "attention.value_length", cfg.head_dim);
  w.add_u32(k + "rope.dimension_count", cfg.rope_dim());
  w.add_f32(k + "rope.freq_base", static_cast<float>(cfg.rope_theta));
  w.add_f32(k + "attention.layer_norm_rms_epsilon", static_cast<float>(cfg.rms_eps));

  // RoPE scaling as llama.cpp's converter writes it: linear and yarn as metadata, llama3 as
  // the per-frequency divisors (rope_freqs.weight), which llama.cpp applies to any model.
  const RopeScaling& rs = cfg.rope_scaling;
  double attn_factor = rs.attention_factor;
  if (rs.type == "linear") {
    w.add_string(k + "rope.scaling.type", "linear");
    w.add_f32(k + "rope.scaling.factor", static_cast<float>(rs.factor));
  } else if (rs.type == "yarn") {
    if (!rs.truncate) throw std::invalid_argument(path + ": yarn without truncation has no GGUF form");
    w.add_string(k + "rope.scaling.type", "yarn");
    w.add_f32(k + "rope.scaling.factor", static_cast<float>(rs.factor));
    w.add_u32(k + "rope.scaling.original_context_length", rs.original_max_position);
    w.add_f32(k + "rope.scaling.yarn_beta_fast", static_cast<float>(rs.beta_fast));
    w.add_f32(k + "rope.scaling.yarn_beta_slow", static_cast<float>(rs.beta_slow));
    // llama.cpp applies yarn's own mscale; attn_factor carries the rest.
    if (rs.factor > 1) attn_factor /= 0.1 * std::log(rs.factor) + 1.0;
  } else if (rs.type == "dynamic") {
    throw std::invalid_argument(path + ": RoPE type dynamic has no GGUF form");
  }
  if (attn_factor != 1.0) w.add_f32(k + "rope.scaling.attn_factor", static_cast<float>(attn_factor));
  add_tokenizer(w);
  if (rs.type == "llama3" || !rs.freq_factors.empty()) {
    ModelConfig plain = cfg;
    plain.rope_scaling = RopeScaling{};
    const std::vector<double> base = rope_inv_freq(plain), scaled = rope_inv_freq(cfg);
    std::vector<float> divisors(base.size());
    for (size_t i = 0; i < base.size(); ++i) divisors[i] = static_cast<float>(base[i] / scaled[i]);
    w.add_tensor("rope_freqs.weight", at::tensor(divisors, at::kFloat));
  }

  for (const auto& [hf_name, tensor] : hf_tensors) {
    const std::string name = gguf_tensor_name(cfg, hf_name);
    at::Tensor t = tensor.to(dtype);
    if (t.dim() == 1) {
      t = t.to(at::kFloat);  // llama.cpp keeps 1-D tensors (norms, biases) in F32
    } else if (permuted && ends_with(name, "attn_q.weight")) {
      t = gguf_permute_rows(t, cfg.num_heads);
    } else if (permuted && ends_with(name, "attn_k.weight")) {
      t = gguf_permute_rows(t, cfg.num_kv_heads);
    }
    w.add_tensor(name, t.contiguous());
  }
  w.write(path);
}

}  // namespace kvpipe
