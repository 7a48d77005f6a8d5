// Stopping `mpirun -np 2 kvpipe generate` with SIGINT or SIGTERM: mpirun passes the signal
// on, kills the ranks about a second later and stops forwarding their output (possibly inside
// a line). Whatever it does, --output FILE holds only whole JSON lines, stdout only whole
// lines but perhaps the last, every request finished before
// the signal is in both, and each printed request's tokens are those of the uninterrupted
// one-rank run. A results output that cannot be written ends the two-rank job non-zero.
#include "tests/support/command.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;
using Outputs = std::map<int64_t, std::vector<int64_t>>;

constexpr int kRequests = 24;

// The whole lines of `text` (a trailing piece without its newline is not one).
std::vector<std::string> whole_lines(const std::string& text) {
  std::vector<std::string> lines;
  size_t begin = 0;
  for (size_t end; (end = text.find('\n', begin)) != std::string::npos; begin = end + 1)
    lines.push_back(text.substr(begin, end - begin));
  return lines;
}

// Parses every line of a results stream (each must be whole JSON with a new id). With
// `tail_may_be_cut`, a last line without its newline is left out: mpirun stops draining the
// ranks' output once it starts stopping them (SIGCONT, a second later SIGTERM, a second
// later SIGKILL), so what it forwarded may end inside a line kvpipe wrote whole.
Outputs parse_results(const std::string& text, const std::string& what, bool tail_may_be_cut = false) {
  Outputs out;
  if (!tail_may_be_cut)
    EXPECT_TRUE(text.empty() || text.back() == '\n') << what << " ends in half a line: " << text.substr(text.rfind('\n') + 1);
  for (const std::string& line : whole_lines(text)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      ADD_FAILURE() << what << ": not a whole JSON line: " << line;
      continue;
    }
    EXPECT_TRUE(out.emplace(j.at("id").get<int64_t>(), j.at("output_ids").get<std::vector<int64_t>>()).second)
        << what << ": request printed twice: " << line;
  }
  return out;
}

class StopMpi : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(kvpipe::testing::make_scratch_dir());
    // Requests of growing length, four at a time: they finish one after another over
    // several seconds, so that a signal lands between two of them.
    std::ofstream job(*dir_ / "stop.yaml");
    job << "model: {path: \"dummy:tiny\"}\nruntime: {threads: 1}\ncache: {memory: 16MiB}\n"
        << "scheduler: {max_batch: 4}\nsampling: {ignore_eos: true}\nrequests:\n";
    for (int i = 0; i < kRequests; ++i)
      job << "  - {prompt_ids: [" << 1 + i << ", " << 7 * i % 500 << ", 3], max_new_tokens: " << 8 + 40 * i << "}\n";
    job.close();
    const CommandResult one = kvpipe::testing::run_command(
        std::string(KVPIPE_BINARY) + " generate --log-level error --config " + config(), *dir_);
    ASSERT_EQ(one.code, 0) << one.err;
    reference_ = new Outputs(parse_results(one.out, "one rank"));
    ASSERT_EQ(reference_->size(), static_cast<size_t>(kRequests));
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
    delete reference_;
  }
  static std::string config() { return (*dir_ / "stop.yaml").string(); }
  static std::string mpirun(int ranks) {
    return std::string(KVPIPE_MPIRUN) + " --oversubscribe -np " + std::to_string(ranks) + " ";
  }

  // Runs the job on two ranks with --output, sends `signal` to mpirun once the file holds
  // two results, and checks what stdout and the file hold afterwards.
  static void stop_through_mpirun(int signal) {
    const fs::path file = *dir_ / "results.jsonl", out = *dir_ / "out.txt", err = *dir_ / "err.txt";
    fs::remove(file);
    const pid_t pid = fork();
    if (pid == 0) {
      const std::string cmd = "exec " + mpirun(2) + KVPIPE_BINARY + " generate --config " + config() +
                              " --output " + file.string() + " >" + out.string() + " 2>" + err.string() +
                              " </dev/null";
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    std::vector<std::string> seen;
    const auto t0 = std::chrono::steady_clock::now();
    while ((seen = whole_lines(kvpipe::testing::slurp(file))).size() < 2 &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(120)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    kill(pid, signal);
    const auto t1 = std::chrono::steady_clock::now();
    int status = 0;
    waitpid(pid, &status, 0);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    const std::string stdout_text = kvpipe::testing::slurp(out), file_text = kvpipe::testing::slurp(file);
    std::fprintf(stderr, "signal %d after %zu results: mpirun ended %.2f s later, status %d; %zu lines in the file, "
                 "%zu on stdout\n", signal, seen.size(), seconds, status, whole_lines(file_text).size(),
                 whole_lines(stdout_text).size());
    ASSERT_GE(seen.size(), 2u) << kvpipe::testing::slurp(err);
    EXPECT_LT(seconds, 20.0);
    EXPECT_TRUE(!WIFEXITED(status) || WEXITSTATUS(status) != 0) << "a stopped job must not exit 0";

    const Outputs from_file = parse_results(file_text, "--output");
    const Outputs from_stdout = parse_results(stdout_text, "stdout", /*tail_may_be_cut=*/true);
    EXPECT_LT(from_file.size(), static_cast<size_t>(kRequests)) << "the job ended before the signal: lengthen it";
    // Every request finished before the signal is in both, whole.
    for (const std::string& line : seen) {
      const int64_t id = nlohmann::json::parse(line).at("id").get<int64_t>();
      EXPECT_EQ(from_file.count(id), 1u) << "request " << id << " missing from --output";
      EXPECT_EQ(from_stdout.count(id), 1u) << "request " << id << " missing from stdout";
    }
    // What was printed is right.
    for (const Outputs* printed : {&from_file, &from_stdout})
      for (const auto& [id, tokens] : *printed) EXPECT_EQ(tokens, reference_->at(id)) << "request " << id;
    // No rank is left behind.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const CommandResult ps = kvpipe::testing::run_command("pgrep -f '" + dir_->string() + "/[s]top.yaml'", *dir_);
    EXPECT_NE(ps.code, 0) << "ranks still running: " << ps.out;
  }

  static fs::path* dir_;
  static Outputs* reference_;
};

fs::path* StopMpi::dir_ = nullptr;
Outputs* StopMpi::reference_ = nullptr;

TEST_F(StopMpi, SigintToMpirunKeepsEveryFinishedRequest) { stop_through_mpirun(SIGINT); }

TEST_F(StopMpi, SigtermToMpirunKeepsEveryFinishedRequest) { stop_through_mpirun(SIGTERM); }

// A results output that cannot be written fails the two-rank job, naming the output.
TEST_F(StopMpi, UnwritableOutputsFailTheTwoRankJob) {
  std::ofstream(*dir_ / "short.yaml") << "model: {path: \"dummy:tiny\"}\ncache: {memory: 4MiB}\n"
                                      << "requests: [{prompt_ids: [1, 2, 3], max_new_tokens: 4}]\n";
  const std::string base = mpirun(2) + KVPIPE_BINARY + " generate --log-level error --config " + (*dir_ / "short.yaml").string();
  for (const std::string option : {"--output", "--logprobs-out"}) {
    const CommandResult r = kvpipe::testing::run_command(base + " " + option + " /dev/full", *dir_);
    EXPECT_NE(r.code, 0) << option << ": " << r.err;
    EXPECT_NE(r.err.find("error: cannot write"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(option + " /dev/full"), std::string::npos) << r.err;
  }
  const CommandResult missing = kvpipe::testing::run_command(base + " --output " + (*dir_ / "no" / "r.jsonl").string(), *dir_);
  EXPECT_EQ(missing.code, 2) << missing.err;
  EXPECT_NE(missing.err.find("--output " + (*dir_ / "no" / "r.jsonl").string()), std::string::npos) << missing.err;
}

}  // namespace
}  // namespace kvpipe
