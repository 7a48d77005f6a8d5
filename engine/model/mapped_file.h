// MappedFile and read_regular_file: how model files are opened, so that a hostile path can
// neither block the process nor kill it without a word.
//
// A path is opened without blocking and refused, naming it, unless it is a regular file: a
// FIFO would block the reader until some writer appears, and a device or /proc entry may
// never end. Reads of whole files are bounded. A MappedFile keeps its mapping in a
// process-wide table that a SIGBUS handler consults: when a mapped file shrinks under a
// running job, the next touch of a page past its new end raises SIGBUS, and the handler
// writes one line naming the file (`kvpipe: error: FILE: the file was truncated or changed
// while mapped`) and exits with code 2 instead of the process dying of the signal. Faults
// outside the registered mappings go to the handler installed before (MPI's, a sanitizer's)
// or take the default action.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvpipe {

class MappedFile {
 public:
  // Maps the whole regular file `path` read-only; an empty file maps to no bytes.
  // std::invalid_argument naming `path` when it is missing, not a regular file or cannot be
  // mapped.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  int slot_ = -1;  // in the SIGBUS table; -1 when the table was full or nothing is mapped
};

// Opens `path` for reading without ever blocking and returns the descriptor (close-on-exec,
// in blocking mode); std::invalid_argument naming `path` when it cannot be opened or is not a
// regular file (a directory, FIFO, socket or device).
int open_regular_file(const std::string& path);

// The whole content of the regular file `path`; std::invalid_argument naming `path` when
// open_regular_file refuses it or it holds more than `max_bytes` bytes.
std::string read_regular_file(const std::string& path, uint64_t max_bytes);

}  // namespace kvpipe
