// parallel.timeout under `mpirun -np 2`: a rank stopped with SIGSTOP ends the whole job,
// non-zero and naming the silent rank, within the timeout and a few seconds; a job that
// idles between requests, or whose ranks finish at different times, is no false alarm. And a
// poisoned weight on the last stage fails its request, not the pipeline.
#include "tests/support/command.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;
using Clock = std::chrono::steady_clock;

std::string mpirun(int ranks) {
  return std::string(KVPIPE_MPIRUN) + " --oversubscribe -np " + std::to_string(ranks) + " ";
}

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The pid of world rank `rank` among mpirun's children (Open MPI puts the rank in each
// process's environment); -1 when it is not running (yet).
pid_t rank_pid(pid_t mpirun_pid, int rank) {
  const std::string want = "OMPI_COMM_WORLD_RANK=" + std::to_string(rank);
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string stat = kvpipe::testing::slurp(entry.path() / "stat");
    const size_t paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream fields(stat.substr(paren + 2));
    std::string state;
    pid_t ppid = 0;
    fields >> state >> ppid;
    if (ppid != mpirun_pid) continue;
    const std::string env = kvpipe::testing::slurp(entry.path() / "environ");
    size_t at = 0;
    for (size_t end; (end = env.find('\0', at)) != std::string::npos; at = end + 1)
      if (env.compare(at, end - at, want) == 0) return static_cast<pid_t>(std::stol(name));
  }
  return -1;
}

// A job launched in the background, killed with whatever it left running when the test ends.
class BackgroundJob {
 public:
  BackgroundJob(const std::string& command, const fs::path& out, const fs::path& err) : err_(err) {
    pid_ = fork();
    if (pid_ == 0) {
      const std::string cmd = "exec " + command + " >" + out.string() + " 2>" + err.string() + " </dev/null";
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
  }
  ~BackgroundJob() {
    for (const pid_t p : stopped_) {
      kill(p, SIGCONT);
      kill(p, SIGKILL);
    }
    if (!reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  std::string err() const { return kvpipe::testing::slurp(err_); }
  void stop(pid_t p) {
    stopped_.push_back(p);
    kill(p, SIGSTOP);
  }
  // True, with its exit status, once it ends within `seconds`.
  bool wait_for(double seconds, int* status) {
    const auto t0 = Clock::now();
    while (since(t0) < seconds) {
      const pid_t r = waitpid(pid_, status, WNOHANG);
      if (r == pid_) {
        reaped_ = true;
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

 private:
  pid_t pid_ = -1;
  fs::path err_;
  std::vector<pid_t> stopped_;
  bool reaped_ = false;
};

class WatchdogMpi : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = kvpipe::testing::make_scratch_dir(); }
  void TearDown() override { fs::remove_all(dir_); }

  // A job that runs until it is stopped.
  fs::path long_job() {
    const fs::path p = dir_ / "long.yaml";
    std::ofstream job(p);
    job << "model: {path: \"dummy:tiny\"}\ncache: {memory: 16MiB}\nscheduler: {max_batch: 4}\n"
        << "sampling: {ignore_eos: true}\nrequests:\n";
    for (int i = 0; i < 4; ++i) job << "  - {prompt_ids: [" << 4 + i << ", 5, 6], max_new_tokens: 100000}\n";
    return p;
  }

  // Stops rank `silent` once the job runs, and expects the other rank to end the job.
  void expect_stopped_rank_ends_job(int silent, const std::string& args = "") {
    constexpr double kTimeout = 3.0;
    BackgroundJob job(mpirun(2) + KVPIPE_BINARY + " generate --config " + long_job().string() +
                          " --set parallel.timeout=3" + args,
                      dir_ / "out.txt", dir_ / "err.txt");
    // Rank 0 prints the plan after the watchdog started on every rank (it starts collectively).
    const auto t0 = Clock::now();
    while (job.err().find("plan: ") == std::string::npos && since(t0) < 60) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_NE(job.err().find("plan: "), std::string::npos) << job.err();
    std::this_thread::sleep_for(std::chrono::seconds(1));  // well into the generation
    const pid_t target = rank_pid(job.pid(), silent);
    ASSERT_GT(target, 0) << "rank " << silent << " not found among mpirun's children";
    job.stop(target);
    const auto stopped_at = Clock::now();
    int status = 0;
    const bool ended = job.wait_for(kTimeout + 30, &status);
    const double seconds = since(stopped_at);
    ASSERT_TRUE(ended) << "the job still runs " << seconds << " s after rank " << silent << " stopped: " << job.err();
    std::fprintf(stderr, "job ended %.2f s after rank %d stopped\n", seconds, silent);
    EXPECT_LT(seconds, kTimeout + 10);
    EXPECT_GE(seconds, kTimeout - 1.0);
    EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "a job with a stopped rank must not exit 0";
    const std::string line = "kvpipe: rank " + std::to_string(1 - silent) + ": error: rank " + std::to_string(silent) +
                             " has been silent for ";
    const std::string err = job.err();
    EXPECT_NE(err.find(line), std::string::npos) << err;
    EXPECT_NE(err.find("(parallel.timeout): stopping the job"), std::string::npos) << err;
    // Whatever was printed is whole JSON lines.
    std::istringstream lines(kvpipe::testing::slurp(dir_ / "out.txt"));
    for (std::string l; std::getline(lines, l);) EXPECT_NO_THROW(nlohmann::json::parse(l)) << l;
  }

  fs::path dir_;
};

TEST_F(WatchdogMpi, StoppedLastRankEndsTheJobNamingIt) { expect_stopped_rank_ends_job(1); }

TEST_F(WatchdogMpi, StoppedCoordinatorEndsTheJobNamingIt) { expect_stopped_rank_ends_job(0); }

// Two tensor ranks of one stage: the stopped one leaves its partner blocked in an all-reduce,
// from which the watchdog still ends the job.
TEST_F(WatchdogMpi, StoppedTensorRankEndsTheJobNamingIt) {
  expect_stopped_rank_ends_job(1, " --set parallel.tensor=2");
}

// A timeout of 1 s on jobs that run far longer than that, with requests that arrive late,
// with rank 0 idle between arrivals (bench in open loop), and ranks finishing at different
// times: no false alarm, exit 0.
TEST_F(WatchdogMpi, NoFalseAlarmOnIdleAndUnevenFinish) {
  {
    std::ofstream job(dir_ / "staggered.yaml");
    job << "model: {path: \"dummy:tiny\"}\ncache: {memory: 16MiB}\nscheduler: {max_batch: 4}\n"
        << "parallel: {timeout: 1}\nsampling: {ignore_eos: true}\nrequests:\n";
    for (int i = 0; i < 6; ++i)
      job << "  - {prompt_ids: [" << 4 + i << ", 5, 6], max_new_tokens: " << 40 + 20 * i
          << ", arrival_step: " << 30 * i << "}\n";
  }
  const CommandResult gen = kvpipe::testing::run_command(
      mpirun(2) + KVPIPE_BINARY + " generate --config " + (dir_ / "staggered.yaml").string(), dir_);
  EXPECT_EQ(gen.code, 0) << gen.err;
  EXPECT_EQ(gen.err.find("silent"), std::string::npos) << gen.err;
  EXPECT_EQ(std::count(gen.out.begin(), gen.out.end(), '\n'), 6) << gen.out;

  {
    std::ofstream job(dir_ / "idle.yaml");
    job << "model: {path: \"dummy:tiny\"}\ncache: {memory: 16MiB}\nparallel: {timeout: 1}\n"
        << "workload: {requests: 3, prompt_len: 8, output_len: 4, concurrency: 1, rate: 0.5, warmup: 0, seed: 3}\n";
  }
  const CommandResult bench = kvpipe::testing::run_command(
      mpirun(2) + KVPIPE_BINARY + " bench --config " + (dir_ / "idle.yaml").string() + " --out " +
          (dir_ / "bench").string(),
      dir_);
  EXPECT_EQ(bench.code, 0) << bench.err;
  EXPECT_EQ(bench.err.find("silent"), std::string::npos) << bench.err;
}

// Token `token`'s embedding row of an HF model's safetensors file set to NaN.
void poison_embedding_row(const fs::path& file, int64_t token) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t header_len = 0;
  f.read(reinterpret_cast<char*>(&header_len), 8);
  std::string header(header_len, '\0');
  f.read(header.data(), static_cast<std::streamsize>(header_len));
  const nlohmann::json h = nlohmann::json::parse(header);
  const nlohmann::json& t = h.at("model.embed_tokens.weight");
  ASSERT_EQ(t.at("dtype"), "F32");
  const int64_t hidden = t.at("shape")[1];
  const int64_t begin = t.at("data_offsets")[0];
  f.seekp(static_cast<std::streamoff>(8 + header_len + begin + token * hidden * 4));
  const std::vector<float> nan(hidden, std::numeric_limits<float>::quiet_NaN());
  f.write(reinterpret_cast<const char*>(nan.data()), static_cast<std::streamsize>(hidden * 4));
  ASSERT_TRUE(f.good());
}

// Sampling happens on rank 1, the coordinator is rank 0: the failure travels back with the
// tokens and ends that request only.
TEST_F(WatchdogMpi, NonFiniteLogitsOnTheLastStageFailTheRequestOnly) {
  const fs::path model = dir_ / "tiny";
  const CommandResult init = kvpipe::testing::run_command(
      std::string(KVPIPE_BINARY) + " init-model --out " + model.string() + " --preset tiny", dir_);
  ASSERT_EQ(init.code, 0) << init.err;
  fs::path weights;
  for (const auto& e : fs::directory_iterator(model))
    if (e.path().extension() == ".safetensors") weights = e.path();
  ASSERT_FALSE(weights.empty());
  poison_embedding_row(weights, 13);
  {
    std::ofstream job(dir_ / "poisoned.yaml");
    job << "model: {path: \"" << model.string() << "\"}\ncache: {memory: 16MiB}\n"
        << "sampling: {ignore_eos: true}\nrequests:\n"
        << "  - {prompt_ids: [5, 6, 7], max_new_tokens: 8}\n"
        << "  - {prompt_ids: [5, 13, 7], max_new_tokens: 8}\n";
  }
  const CommandResult r = kvpipe::testing::run_command(
      mpirun(2) + KVPIPE_BINARY + " generate --config " + (dir_ / "poisoned.yaml").string(), dir_);
  std::istringstream lines(r.out);
  std::map<int64_t, nlohmann::json> results;  // by request id: lines come in finishing order
  for (std::string l; std::getline(lines, l);) {
    const nlohmann::json j = nlohmann::json::parse(l);
    results[j.at("id").get<int64_t>()] = j;
  }
  ASSERT_EQ(results.size(), 2u) << r.out << r.err;
  EXPECT_EQ(results[0]["finish_reason"], "length") << r.out;
  EXPECT_EQ(results[0]["output_ids"].size(), 8u);
  EXPECT_EQ(results[1]["finish_reason"], "error") << r.out;
  EXPECT_TRUE(results[1]["output_ids"].empty()) << r.out;
  if (results[1].contains("error")) {
    EXPECT_EQ(results[1]["error"], "non-finite logits at step 0");
  }
  EXPECT_EQ(r.err.find("silent"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace kvpipe
