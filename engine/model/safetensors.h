// Safetensors: memory-mapped reading and writing of HF safetensors files.
//
// A SafetensorsFile maps one file and validates its whole header up front (length, JSON,
// dtypes, shapes, byte counts, offsets inside the data and not overlapping), so a malformed
// file fails before any tensor is used. Tensor bytes are only touched when a tensor is
// loaded, which is what lets a pipeline rank read just its own layers. A SafetensorsModel is
// a model directory: `model.safetensors`, or shards listed by `model.safetensors.index.json`,
// each a plain file name inside that directory (never `../` or an absolute path).
// Every problem with a file is a std::invalid_argument whose message names the file (and
// the tensor where there is one).
#pragma once

#include "engine/model/weight_matrix.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kvpipe {

class MappedFile;

struct SafetensorsEntry {
  std::string dtype;             // "F32", "F16", "BF16", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0;            // offsets relative to the start of the data section
  uint64_t end = 0;
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  const SafetensorsEntry& entry(const std::string& name) const;
  std::vector<std::string> names() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // A copy of the tensor converted to `dtype` (F32, F16 and BF16 are supported sources);
  // with `slice` (2-D tensors), a copy of its rows and columns only.
  at::Tensor load(const std::string& name, at::ScalarType dtype, const MatrixSlice& slice = {}) const;
  // The source dtype load() converts from; refuses, as load() would, one it cannot load.
  at::ScalarType loadable_dtype(const std::string& name) const;

 private:
  std::string path_;
  std::unique_ptr<MappedFile> file_;
  const uint8_t* data_ = nullptr;  // start of the data section
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

class SafetensorsModel {
 public:
  // `dir` holds model.safetensors.index.json (sharded) or model.safetensors.
  explicit SafetensorsModel(const std::string& dir);

  bool contains(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  // The tensor's dtype in the file (F32, F16, BF16; float32 for a dtype load() refuses).
  at::ScalarType stored_dtype(const std::string& name) const;
  // Throws std::invalid_argument naming the tensor and the directory when it is missing.
  at::Tensor load(const std::string& name, at::ScalarType dtype, const MatrixSlice& slice = {}) const;
  // Refuses, as load would, a missing tensor or one of a dtype it cannot load; reads no data.
  void check_loadable(const std::string& name) const;

 private:
  const SafetensorsFile& file_of(const std::string& name) const;

  std::string dir_;
  std::string index_;                     // the index file, when sharded
  std::vector<std::string> shard_paths_;  // when sharded, parallel to files_
  mutable std::vector<std::unique_ptr<SafetensorsFile>> files_;  // opened on first use
  std::map<std::string, size_t> owner_;   // tensor name -> index in files_
};

// Writes `tensors` (contiguous CPU tensors of F32, F16 or BF16) in order, with `metadata`
// in the header's "__metadata__". Output is byte-for-byte deterministic.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace kvpipe
