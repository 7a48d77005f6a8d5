// Helpers for tests that run the kvpipe executable: a scratch directory and a command
// runner that captures the exit code, stdout and stderr.
#pragma once

#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace kvpipe::testing {

struct CommandResult {
  int code = -1;
  std::string out, err;
  double seconds = 0;
};

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline std::filesystem::path make_scratch_dir() {
  char tmpl[] = "/tmp/kvpipe_test_XXXXXX";
  return mkdtemp(tmpl);
}

// Runs `command` through the shell with stdout and stderr captured in files of `dir`.
inline CommandResult run_command(const std::string& command, const std::filesystem::path& dir) {
  const auto out = dir / "stdout.txt", err = dir / "stderr.txt";
  const std::string cmd = command + " >" + out.string() + " 2>" + err.string() + " </dev/null";
  const auto t0 = std::chrono::steady_clock::now();
  const int status = std::system(cmd.c_str());
  CommandResult r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

}  // namespace kvpipe::testing
