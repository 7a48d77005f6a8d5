#include "engine/model/safetensors.h"

#include "engine/model/mapped_file.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <utility>

namespace kvpipe {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr const char* kMetadataKey = "__metadata__";
constexpr size_t kLengthBytes = 8;
constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";
// The index of a 405B model is about 100 KiB.
constexpr uint64_t kMaxIndexBytes = uint64_t{64} << 20;

// Messages quote tensor names and parser output, either of which may hold a newline; callers
// rely on one-line messages.
[[noreturn]] void fail(const std::string& where, const std::string& what) {
  std::string message = where + ": " + what;
  std::replace_if(
      message.begin(), message.end(), [](char c) { return c == '\n' || c == '\r'; }, ' ');
  throw std::invalid_argument(message);
}

std::string single_quoted(const std::string& name) {
  return "'" + name + "'";
}

std::string tensor_label(const std::string& name) {
  return "tensor " + single_quoted(name);
}

// nlohmann prefixes every message with its exception id, which means nothing to a user.
std::string json_reason(const json::exception& e) {
  std::string what = e.what();
  const size_t tag_end = what.find("] ");
  return tag_end == std::string::npos ? what : what.substr(tag_end + 2);
}

size_t element_size(const std::string& dtype) {
  static const std::map<std::string, size_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
      {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

std::optional<at::ScalarType> loadable_type(const std::string& dtype) {
  if (dtype == "F32") return at::kFloat;
  if (dtype == "F16") return at::kHalf;
  if (dtype == "BF16") return at::kBFloat16;
  return std::nullopt;
}

const char* writable_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return "F32";
    case at::kHalf:
      return "F16";
    case at::kBFloat16:
      return "BF16";
    default:
      return nullptr;
  }
}

std::string format_shape(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i != 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

// The length prefix is little-endian on disk whatever the host's byte order.
uint64_t read_le64(const uint8_t* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

void write_le64(uint64_t value, char* out) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
}

SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const json& spec,
                             uint64_t data_size) {
  const std::string where = path + ": " + tensor_label(name);
  if (!spec.is_object()) fail(where, "entry is not a JSON object");
  const auto field = [&](const char* key) -> const json& {
    const auto it = spec.find(key);
    if (it == spec.end()) fail(where, std::string("missing \"") + key + "\"");
    return *it;
  };

  SafetensorsEntry entry;
  const json& dtype = field("dtype");
  if (!dtype.is_string()) fail(where, "\"dtype\" is not a string: " + dtype.dump());
  entry.dtype = dtype.get<std::string>();
  const size_t elem_size = element_size(entry.dtype);
  if (elem_size == 0) fail(where, "unknown dtype " + single_quoted(entry.dtype));

  const json& shape = field("shape");
  if (!shape.is_array()) fail(where, "\"shape\" is not an array of integers: " + shape.dump());
  for (const json& dim : shape) {
    if (!dim.is_number_integer() ||
        (dim.is_number_unsigned() &&
         dim.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))) {
      fail(where, "\"shape\" is not an array of integers: " + shape.dump());
    }
    entry.shape.push_back(dim.get<int64_t>());
  }
  for (int64_t dim : entry.shape) {
    if (dim < 0) {
      fail(where,
           "negative dimension " + std::to_string(dim) + " in shape " + format_shape(entry.shape));
    }
  }

  const json& offsets = field("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    fail(where, "\"data_offsets\" is not a pair of non-negative integers: " + offsets.dump());
  }
  entry.begin = offsets[0].get<uint64_t>();
  entry.end = offsets[1].get<uint64_t>();
  if (entry.begin > entry.end) {
    fail(where, "data_offsets begin " + std::to_string(entry.begin) + " is after end " +
                    std::to_string(entry.end));
  }
  if (entry.end > data_size) {
    fail(where, "data_offsets end " + std::to_string(entry.end) +
                    " runs past the end of the data section (" + std::to_string(data_size) +
                    " bytes)");
  }

  const bool empty = std::find(entry.shape.begin(), entry.shape.end(), 0) != entry.shape.end();
  uint64_t needed = empty ? 0 : elem_size;
  for (int64_t dim : entry.shape) {
    if (!empty && __builtin_mul_overflow(needed, static_cast<uint64_t>(dim), &needed)) {
      fail(where, "shape " + format_shape(entry.shape) + " is too large");
    }
  }
  if (entry.end - entry.begin != needed) {
    fail(where, "byte count " + std::to_string(entry.end - entry.begin) + " does not match " +
                    entry.dtype + " shape " + format_shape(entry.shape) + " (" +
                    std::to_string(needed) + " bytes)");
  }
  return entry;
}

std::map<std::string, std::string> parse_metadata(const std::string& path, const json& spec) {
  const std::string where = path + ": \"" + kMetadataKey + "\"";
  if (!spec.is_object()) fail(where, "is not a JSON object");
  std::map<std::string, std::string> metadata;
  for (const auto& [key, value] : spec.items()) {
    if (!value.is_string()) fail(where, "value of " + single_quoted(key) + " is not a string");
    metadata.emplace(key, value.get<std::string>());
  }
  return metadata;
}

// The tensors must tile the data section: no overlap, no gap, nothing after the last, as the
// reference implementation (the `safetensors` crate's validate) requires. A header length off
// by a few bytes would otherwise shift every tensor silently. Zero-byte tensors occupy no
// range, so they may sit anywhere inside the section.
void check_layout(const std::string& path, const std::map<std::string, SafetensorsEntry>& entries,
                  uint64_t data_size) {
  std::vector<const std::pair<const std::string, SafetensorsEntry>*> ranges;
  for (const auto& item : entries) {
    if (item.second.end > item.second.begin) ranges.push_back(&item);
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const auto* a, const auto* b) { return a->second.begin < b->second.begin; });
  const std::pair<const std::string, SafetensorsEntry>* furthest = nullptr;
  for (const auto* range : ranges) {
    if (furthest != nullptr && range->second.begin < furthest->second.end) {
      const auto describe = [](const auto* r) {
        return tensor_label(r->first) + " [" + std::to_string(r->second.begin) + ", " +
               std::to_string(r->second.end) + ")";
      };
      fail(path, describe(furthest) + " and " + describe(range) + " overlap");
    }
    const uint64_t covered = furthest == nullptr ? 0 : furthest->second.end;
    if (range->second.begin > covered)
      fail(path, "bytes [" + std::to_string(covered) + ", " + std::to_string(range->second.begin) +
                     ") of the data section belong to no tensor");
    if (furthest == nullptr || range->second.end > furthest->second.end) furthest = range;
  }
  const uint64_t covered = furthest == nullptr ? 0 : furthest->second.end;
  if (covered != data_size)
    fail(path, "the data section holds " + std::to_string(data_size) + " bytes but its tensors end at " +
                   std::to_string(covered) + " (a wrong header length, or bytes appended)");
}

std::map<std::string, std::string> read_weight_map(const std::string& index_path) {
  const std::string text = read_regular_file(index_path, kMaxIndexBytes);
  json index;
  try {
    index = json::parse(text);
  } catch (const json::exception& e) {  // out_of_range too: a number such as 1e999
    fail(index_path, "not valid JSON: " + json_reason(e));
  }
  if (!index.is_object()) fail(index_path, "not a JSON object");
  const auto map_it = index.find("weight_map");
  if (map_it == index.end()) fail(index_path, "missing \"weight_map\"");
  if (!map_it->is_object()) fail(index_path, "\"weight_map\" is not a JSON object");
  if (map_it->empty()) fail(index_path, "\"weight_map\" lists no tensors");

  std::map<std::string, std::string> weight_map;
  for (const auto& [tensor, file] : map_it->items()) {
    if (!file.is_string()) {
      fail(index_path, "\"weight_map\" entry for " + tensor_label(tensor) + " is not a file name");
    }
    const std::string name = file.get<std::string>();
    // A shard is a file of the model's own folder: an index may not make a rank read
    // whatever else a path reaches (`../`, an absolute path). Symbolic links are followed,
    // since the Hugging Face cache links every snapshot file to a blob outside the folder.
    const fs::path shard(name);
    const bool plain = !name.empty() && shard.is_relative() && shard.has_filename() &&
                       std::none_of(shard.begin(), shard.end(), [](const fs::path& part) {
                         return part == ".." || part == ".";
                       }) &&
                       name.find('\0') == std::string::npos;
    if (!plain) {
      fail(index_path, "\"weight_map\" puts " + tensor_label(tensor) + " in " + single_quoted(name) +
                           ", which is not a file inside the model's folder");
    }
    weight_map.emplace(tensor, name);
  }
  return weight_map;
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  file_ = std::make_unique<MappedFile>(path);
  const uint64_t size = file_->size();
  if (size < kLengthBytes) {
    fail(path, "file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  }
  const uint8_t* bytes = file_->data();
  const uint64_t header_size = read_le64(bytes);
  if (header_size > size - kLengthBytes) {
    fail(path, "header length " + std::to_string(header_size) +
                   " runs past the end of the file (" + std::to_string(size) + " bytes)");
  }
  const auto* header_text = reinterpret_cast<const char*>(bytes + kLengthBytes);
  json header;
  try {
    header = json::parse(header_text, header_text + header_size);
  } catch (const json::exception& e) {  // out_of_range too: a number such as 1e999
    fail(path, "header is not valid JSON: " + json_reason(e));
  }
  if (!header.is_object()) {
    fail(path, std::string("header is not a JSON object (found ") + header.type_name() + ")");
  }

  data_ = bytes + kLengthBytes + header_size;
  const uint64_t data_size = size - kLengthBytes - header_size;
  for (const auto& [name, spec] : header.items()) {
    if (name == kMetadataKey) {
      metadata_ = parse_metadata(path, spec);
    } else {
      entries_.emplace(name, parse_entry(path, name, spec, data_size));
    }
  }
  check_layout(path, entries_, data_size);
}

SafetensorsFile::~SafetensorsFile() = default;

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) fail(path_, "missing " + tensor_label(name));
  return it->second;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> names;
  names.reserve(entries_.size());
  for (const auto& item : entries_) names.push_back(item.first);
  return names;
}

at::ScalarType SafetensorsFile::loadable_dtype(const std::string& name) const {
  const SafetensorsEntry& spec = entry(name);
  const std::optional<at::ScalarType> source = loadable_type(spec.dtype);
  if (!source) {
    fail(path_, tensor_label(name) + ": cannot load dtype " + spec.dtype +
                    " (only F32, F16 and BF16 are supported)");
  }
  return *source;
}

at::Tensor SafetensorsFile::load(const std::string& name, at::ScalarType dtype, const MatrixSlice& slice) const {
  const SafetensorsEntry& spec = entry(name);
  const at::ScalarType source = loadable_dtype(name);
  const auto target_options = at::TensorOptions().dtype(dtype);
  if (spec.end == spec.begin) return at::empty(spec.shape, target_options);

  const uint8_t* bytes = data_ + spec.begin;
  const auto source_options = at::TensorOptions().dtype(source);
  // The header length is arbitrary, so the bytes may be misaligned for the element type.
  const bool aligned = reinterpret_cast<uintptr_t>(bytes) % element_size(spec.dtype) == 0;
  at::Tensor raw;
  if (aligned) {
    raw = at::from_blob(const_cast<uint8_t*>(bytes), spec.shape, source_options);
  } else {
    raw = at::empty(spec.shape, source_options);
    std::memcpy(raw.data_ptr(), bytes, spec.end - spec.begin);
  }
  if (!slice.whole()) {
    if (raw.dim() != 2) fail(path_, tensor_label(name) + " is sliced but is not a matrix");
    try {
      raw = slice_stored(raw, quant_type_of(source), raw.size(1), slice);
    } catch (const std::invalid_argument& e) {
      fail(path_, tensor_label(name) + ": " + e.what());
    }
    return raw.to(dtype).clone(at::MemoryFormat::Contiguous);
  }
  // A from_blob tensor aliases the read-only mapping, so it must always be copied out; the
  // realigned buffer is already ours.
  return raw.to(dtype, /*non_blocking=*/false, /*copy=*/aligned);
}

SafetensorsModel::SafetensorsModel(const std::string& dir) : dir_(dir) {
  const fs::path root(dir);
  const fs::path index_path = root / kIndexName;
  const fs::path single_path = root / kSingleName;
  std::error_code ec;

  if (!fs::exists(index_path, ec)) {
    if (!fs::exists(single_path, ec)) {
      fail(dir, std::string("no ") + kSingleName + " or " + kIndexName);
    }
    files_.push_back(std::make_unique<SafetensorsFile>(single_path.string()));
    for (const std::string& name : files_.front()->names()) owner_.emplace(name, 0);
    return;
  }

  index_ = index_path.string();
  // Shards are mapped and validated when a tensor of theirs is first loaded, so that a
  // pipeline rank touches only the shards of its own layers.
  std::map<std::string, size_t> shard_of_file;
  for (const auto& [tensor, file] : read_weight_map(index_)) {
    auto [it, inserted] = shard_of_file.emplace(file, shard_paths_.size());
    if (inserted) {
      const fs::path shard_path = root / file;
      if (!fs::exists(shard_path, ec)) fail(index_, "shard " + single_quoted(file) + " does not exist");
      shard_paths_.push_back(shard_path.string());
      files_.emplace_back();
    }
    owner_.emplace(tensor, it->second);
  }
}

bool SafetensorsModel::contains(const std::string& name) const {
  return owner_.count(name) != 0;
}

std::vector<int64_t> SafetensorsModel::shape(const std::string& name) const {
  return file_of(name).entry(name).shape;
}

at::ScalarType SafetensorsModel::stored_dtype(const std::string& name) const {
  const SafetensorsFile& file = file_of(name);
  const std::optional<at::ScalarType> t = loadable_type(file.entry(name).dtype);
  // A dtype the loader refuses is refused by load(), naming it; float32 is only a placeholder.
  return t ? *t : at::kFloat;
}

void SafetensorsModel::check_loadable(const std::string& name) const { file_of(name).loadable_dtype(name); }

at::Tensor SafetensorsModel::load(const std::string& name, at::ScalarType dtype, const MatrixSlice& slice) const {
  return file_of(name).load(name, dtype, slice);
}

const SafetensorsFile& SafetensorsModel::file_of(const std::string& name) const {
  const auto it = owner_.find(name);
  if (it == owner_.end()) fail(dir_, "missing " + tensor_label(name));
  std::unique_ptr<SafetensorsFile>& file = files_[it->second];
  if (!file) file = std::make_unique<SafetensorsFile>(shard_paths_[it->second]);
  if (!file->contains(name))
    fail(index_, "\"weight_map\" puts " + tensor_label(name) + " in " + single_quoted(fs::path(file->path()).filename().string()) +
                     ", which does not hold it");
  return *file;
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  std::vector<at::Tensor> payload;
  payload.reserve(tensors.size());
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const std::string where = path + ": " + tensor_label(name);
    if (name == kMetadataKey) fail(where, "the name is reserved for the header's metadata");
    if (header.contains(name)) fail(where, "appears twice");
    if (!tensor.defined()) fail(where, "is undefined");
    if (!tensor.device().is_cpu()) fail(where, "is on " + tensor.device().str() + ", not the CPU");
    if (tensor.layout() != at::kStrided) fail(where, "is not a dense tensor");
    const char* dtype = writable_dtype(tensor.scalar_type());
    if (dtype == nullptr) {
      fail(where, std::string("cannot write dtype ") + c10::toString(tensor.scalar_type()) +
                      " (only Float, Half and BFloat16 are supported)");
    }
    at::Tensor dense = tensor.contiguous();
    const uint64_t bytes = dense.nbytes();
    header[name] = {{"dtype", dtype},
                    {"shape", dense.sizes().vec()},
                    {"data_offsets", json::array({offset, offset + bytes})}};
    offset += bytes;
    payload.push_back(std::move(dense));
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;

  std::string text;
  try {
    text = header.dump();
  } catch (const json::type_error& e) {
    fail(path, "tensor names and metadata must be valid UTF-8: " + json_reason(e));
  }
  // The length prefix is 8 bytes, so padding the JSON to a multiple of 8 with spaces (still
  // valid JSON) starts the data section 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  char length[kLengthBytes];
  write_le64(text.size(), length);

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail(path, "cannot open for writing");
  out.write(length, sizeof(length));
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const at::Tensor& dense : payload) {
    if (dense.nbytes() == 0) continue;
    out.write(static_cast<const char*>(dense.data_ptr()),
              static_cast<std::streamsize>(dense.nbytes()));
  }
  out.close();
  if (!out) fail(path, "write failed");
}

}  // namespace kvpipe
