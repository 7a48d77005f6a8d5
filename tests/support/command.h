// Helpers for tests that run the kvpipe executable: a scratch directory and a command
// runner that captures the exit code, stdout and stderr, and tells a crash from a failure.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace kvpipe::testing {

struct CommandResult {
  int code = -1;   // the exit code (the shell's 128 + N for a program killed by signal N); -1 if the shell was
  int signal = 0;  // the signal that killed the command or the program its shell ran, else 0
  std::string out, err;
  double seconds = 0;

  // "exit 2", or "killed by signal 11 (SIGSEGV)".
  std::string status() const {
    if (signal == 0) return "exit " + std::to_string(code);
    const char* abbrev = sigabbrev_np(signal);
    return "killed by signal " + std::to_string(signal) + " (" + (abbrev ? "SIG" + std::string(abbrev) : "?") + ")";
  }
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
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  // The shell reports a program it ran that died of signal N as exit 128 + N.
  if (r.code > 128 && r.code <= 128 + SIGRTMAX) r.signal = r.code - 128;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

// For a reference program's run (llama.cpp, transformers, ...): success, or a failure that
// says whether the reference itself crashed (a broken build, an instruction the processor
// cannot run) rather than a bare exit code; the command and its stderr follow.
inline ::testing::AssertionResult reference_ran(const CommandResult& r, const std::string& reference,
                                                const std::string& command = "") {
  if (r.code == 0) return ::testing::AssertionSuccess();
  auto failure = ::testing::AssertionFailure();
  if (r.signal != 0)
    failure << "the " << reference << " reference crashed: " << r.status() << "\n";
  else
    failure << "the " << reference << " reference failed: " << r.status() << "\n";
  if (!command.empty()) failure << command << "\n";
  return failure << r.err;
}

}  // namespace kvpipe::testing
