// A job file from configs/ under `mpirun -np 2`: results from rank 0 only, rank-prefixed
// log lines, the same tokens as one rank, and SIGTERM to mpirun stopping every rank.
#include "tests/support/command.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;

class LaunchMpi : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(kvpipe::testing::make_scratch_dir());
    // configs/tiny-2rank.yaml reads models/tiny from the working directory.
    const CommandResult r = kvpipe::testing::run_command(
        std::string(KVPIPE_BINARY) + " init-model --out " + (*dir_ / "models" / "tiny").string() + " --preset tiny",
        *dir_);
    ASSERT_EQ(r.code, 0) << r.err;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  static std::string config() { return (fs::path(KVPIPE_SOURCE_DIR) / "configs" / "tiny-2rank.yaml").string(); }
  static std::string mpirun(int ranks) {
    return std::string(KVPIPE_MPIRUN) + " --oversubscribe -np " + std::to_string(ranks) + " ";
  }
  static fs::path* dir_;
};

fs::path* LaunchMpi::dir_ = nullptr;

TEST_F(LaunchMpi, TwoRankJobFromConfigs) {
  const std::string cmd = "cd " + dir_->string() + " && ";
  const CommandResult two = kvpipe::testing::run_command(
      cmd + mpirun(2) + KVPIPE_BINARY + " generate --config " + config(), *dir_ / "models");
  ASSERT_EQ(two.code, 0) << two.err;
  const CommandResult one = kvpipe::testing::run_command(
      cmd + KVPIPE_BINARY + " generate --config " + config() + " --log-level warn", *dir_ / "models");
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_EQ(one.err, "");
  // Same requests, same greedy tokens; results (4 requests) printed once, by rank 0, each
  // as it finishes (the order may differ between the two runs).
  auto outputs = [](const std::string& text) {
    std::map<int64_t, nlohmann::json> by_id;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      const auto j = nlohmann::json::parse(line);
      EXPECT_TRUE(by_id.emplace(j["id"].get<int64_t>(), j["output_ids"]).second) << "printed twice: " << line;
    }
    return by_id;
  };
  const auto a = outputs(two.out), b = outputs(one.out);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 4u);
  // Every log line of a two-rank job names its rank.
  std::istringstream err(two.err);
  int plan_lines = 0, rank_lines = 0;
  for (std::string line; std::getline(err, line);) {
    if (line.empty() || line.rfind("kvpipe: ", 0) == 0) continue;
    EXPECT_EQ(line.rfind("[rank ", 0), 0u) << line;
    if (line.rfind("[rank 0] plan: ", 0) == 0) ++plan_lines;
    if (line.find("busy") != std::string::npos) ++rank_lines;
  }
  EXPECT_GE(plan_lines, 3) << two.err;
  EXPECT_EQ(rank_lines, 2) << two.err;
  EXPECT_NE(two.err.find("[rank 0] timing: "), std::string::npos) << two.err;

  const CommandResult quiet = kvpipe::testing::run_command(
      cmd + mpirun(2) + KVPIPE_BINARY + " generate --config " + config() + " --log-level error", *dir_ / "models");
  ASSERT_EQ(quiet.code, 0) << quiet.err;
  EXPECT_EQ(quiet.err.find("plan:"), std::string::npos) << quiet.err;
  EXPECT_EQ(quiet.err.find("timing:"), std::string::npos) << quiet.err;
  EXPECT_EQ(std::count(quiet.out.begin(), quiet.out.end(), '\n'), 4) << quiet.out;
}

TEST_F(LaunchMpi, SigtermToMpirunStopsEveryRank) {
  std::ofstream job(*dir_ / "long.yaml");
  job << "model: {path: \"dummy:tiny\"}\ncache: {memory: 16MiB}\nscheduler: {max_batch: 4}\n"
      << "sampling: {ignore_eos: true}\nrequests:\n";
  for (int i = 0; i < 6; ++i) job << "  - {prompt_ids: [" << 4 + i << ", 5, 6], max_new_tokens: 100000}\n";
  job.close();
  const fs::path out = *dir_ / "out.txt", err = *dir_ / "err.txt";
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string cmd = "exec " + mpirun(2) + KVPIPE_BINARY + " generate --config " + (*dir_ / "long.yaml").string() +
                            " >" + out.string() + " 2>" + err.string() + " </dev/null";
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  const auto t0 = std::chrono::steady_clock::now();
  while (kvpipe::testing::slurp(err).find("plan: ") == std::string::npos &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  kill(pid, SIGTERM);
  const auto t1 = std::chrono::steady_clock::now();
  int status = 0;
  waitpid(pid, &status, 0);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  EXPECT_LT(seconds, 15.0);
  std::fprintf(stderr, "mpirun stopped %.2f s after SIGTERM, status %d\n", seconds, status);
  const bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
  EXPECT_TRUE(failed) << "a stopped job must not exit 0: " << kvpipe::testing::slurp(err);
  // Whatever was printed is whole JSON lines (no request finished here).
  std::istringstream lines(kvpipe::testing::slurp(out));
  for (std::string line; std::getline(lines, line);) EXPECT_NO_THROW(nlohmann::json::parse(line)) << line;
  // No rank is left behind.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  // "[l]ong" keeps pgrep from matching the shell that runs it.
  const CommandResult ps = kvpipe::testing::run_command("pgrep -f '" + dir_->string() + "/[l]ong.yaml'", *dir_);
  EXPECT_NE(ps.code, 0) << "ranks still running: " << ps.out;
}

}  // namespace
}  // namespace kvpipe
