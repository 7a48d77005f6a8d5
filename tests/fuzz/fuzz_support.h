// Shared by the libFuzzer targets of tests/fuzz: a scratch folder for parsers that read files,
// and the contract every target checks.
//
// The contract: a parser may refuse its input only with std::invalid_argument (kvpipe's "bad
// input", exit 2; the server's ApiError where a target says so). Any other exception escapes
// LLVMFuzzerTestOneInput and aborts, so libFuzzer reports it as a crash together with the
// exception's type and message; a crash, a hang, a leak or a sanitizer report is a finding too.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

namespace kvpipe::fuzz {

// A private folder under $TMPDIR (or /tmp), removed when the process exits normally. Each
// target writes its input there, because the parsers under test take paths, as kvpipe does.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base && *base ? base : "/tmp") + "/kvpipe-fuzz-XXXXXX";
    if (!mkdtemp(pattern.data())) {
      std::perror("kvpipe fuzz: mkdtemp");
      std::abort();
    }
    static const std::string keep = pattern;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(keep, ec);
    });
    return pattern;
  }();
  return dir;
}

// Replaces `path` with exactly `size` bytes of `data`.
inline void write_file(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  out.close();
  if (!out) {
    std::perror(("kvpipe fuzz: cannot write " + path).c_str());
    std::abort();
  }
}

inline void write_file(const std::string& path, const std::string& text) {
  write_file(path, reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

// Runs `step`, accepting a refusal as std::invalid_argument only: anything else propagates.
template <typename F>
bool accepts(F&& step) {
  try {
    step();
    return true;
  } catch (const std::invalid_argument&) {
    return false;
  }
}

}  // namespace kvpipe::fuzz
