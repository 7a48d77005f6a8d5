// The peer tests' account of a reference run: a reference that dies of a signal (a llama.cpp
// built for instructions the processor cannot run) is reported as a crash with its signal,
// not as a bare exit code.
#include "tests/support/command.h"

#include <gtest/gtest.h>

#include <string>

namespace kvpipe {
namespace {

using testing::CommandResult;
using testing::reference_ran;
using testing::run_command;

class ReferenceCrash : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::make_scratch_dir(); }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

TEST_F(ReferenceCrash, ProgramKilledBySignalIsACrash) {
  // The shell runs a program that dies of SIGSEGV, as python does when llama.cpp faults.
  const CommandResult r = run_command("sh -c 'echo loading >&2; kill -SEGV $$'", dir_);
  EXPECT_EQ(r.signal, 11);
  EXPECT_EQ(r.status(), "killed by signal 11 (SIGSEGV)");
  const ::testing::AssertionResult verdict = reference_ran(r, "llama.cpp", "python llama_logprobs.py");
  ASSERT_FALSE(verdict);
  const std::string message = verdict.message();
  EXPECT_NE(message.find("the llama.cpp reference crashed: killed by signal 11 (SIGSEGV)"), std::string::npos)
      << message;
  EXPECT_NE(message.find("python llama_logprobs.py"), std::string::npos) << message;
  EXPECT_NE(message.find("loading"), std::string::npos) << message;  // its stderr
}

TEST_F(ReferenceCrash, FailureAndSuccessAreNotCrashes) {
  const CommandResult failed = run_command("sh -c 'echo no module named llama_cpp >&2; exit 1'", dir_);
  EXPECT_EQ(failed.signal, 0);
  const ::testing::AssertionResult verdict = reference_ran(failed, "llama.cpp");
  ASSERT_FALSE(verdict);
  EXPECT_NE(std::string(verdict.message()).find("the llama.cpp reference failed: exit 1"), std::string::npos)
      << verdict.message();
  EXPECT_TRUE(reference_ran(run_command("true", dir_), "llama.cpp"));
}

}  // namespace
}  // namespace kvpipe
