// Per-rank devices and cores with fake machines, the log helper and progress bar, and a
// one-rank job stopped by SIGINT/SIGTERM.
#include "launch/device_plan.h"
#include "launch/log.h"
#include "launch/signals.h"
#include "tests/support/command.h"
#include "tests/support/logprob_compare.h"

#include <ATen/Context.h>
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
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;

TEST(LaunchDevice, CpuWhenNoGpuIsVisible) {
  EXPECT_EQ(choose_device(0, 1, 0, false), "cpu");
  EXPECT_EQ(choose_device(3, 4, 0, false), "cpu");  // many CPU ranks share the host: fine
}

TEST(LaunchDevice, LocalRankPicksTheGpu) {
  EXPECT_EQ(choose_device(0, 4, 4, false), "cuda:0");
  EXPECT_EQ(choose_device(3, 4, 4, false), "cuda:3");
  EXPECT_EQ(choose_device(1, 2, 8, false), "cuda:1");
}

TEST(LaunchDevice, SharingAGpuIsAnErrorUnlessIntended) {
  try {
    choose_device(2, 3, 2, false);
    FAIL() << "did not throw";
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("runtime.share_gpu"), std::string::npos) << message;
    EXPECT_NE(message.find("cuda:0"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos);
  }
  EXPECT_THROW(choose_device(0, 2, 1, false), std::invalid_argument);
  EXPECT_EQ(choose_device(2, 3, 2, true), "cuda:0");  // modulo the visible count
  EXPECT_EQ(choose_device(1, 3, 2, true), "cuda:1");
}

TEST(LaunchDevice, CudaVisibleDevices) {
  EXPECT_EQ(count_visible_devices(nullptr), -1);
  EXPECT_EQ(count_visible_devices(""), 0);
  EXPECT_EQ(count_visible_devices("0"), 1);
  EXPECT_EQ(count_visible_devices("2,3"), 2);
  EXPECT_EQ(count_visible_devices("0,1,-1,2"), 2);
  EXPECT_EQ(count_visible_devices("-1"), 0);
}

TEST(LaunchDevice, DisjointCoresPerRank) {
  const std::vector<int> allowed = {0, 1, 2, 3, 8, 9, 10, 11};
  EXPECT_EQ(cores_for_rank(allowed, 0, 2, 4), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(cores_for_rank(allowed, 1, 2, 4), (std::vector<int>{8, 9, 10, 11}));
  EXPECT_EQ(cores_for_rank(allowed, 2, 4, 2), (std::vector<int>{8, 9}));
  EXPECT_TRUE(cores_for_rank(allowed, 0, 3, 4).empty());  // 12 cores needed, 8 allowed
  EXPECT_TRUE(cores_for_rank(allowed, 2, 2, 1).empty());
  EXPECT_TRUE(cores_for_rank({}, 0, 1, 1).empty());
}

TEST(LaunchDevice, AllowedCpusAndPinning) {
  const std::vector<int> cpus = allowed_cpus();
  ASSERT_FALSE(cpus.empty());
  // Pin a helper thread (affinity is per thread) to the first allowed CPU.
  bool pinned = false;
  std::thread([&] {
    pinned = pin_to_cores({cpus[0]});
    if (pinned) {
      EXPECT_EQ(allowed_cpus(), std::vector<int>{cpus[0]});
    }
  }).join();
  EXPECT_TRUE(pinned);
  EXPECT_FALSE(pin_to_cores({}));
}

TEST(LaunchDevice, LauncherEnvironment) {
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  ::unsetenv("PMI_SIZE");
  ::unsetenv("SLURM_NTASKS");
  EXPECT_EQ(world_size_from_env(), 0);
  ::setenv("SLURM_NTASKS", "6", 1);
  EXPECT_EQ(world_size_from_env(), 6);
  ::setenv("OMPI_COMM_WORLD_SIZE", "3", 1);
  EXPECT_EQ(world_size_from_env(), 3);
  ::setenv("OMPI_COMM_WORLD_SIZE", "x", 1);
  EXPECT_EQ(world_size_from_env(), 6);
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  ::unsetenv("SLURM_NTASKS");
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  ::unsetenv("MPI_LOCALNRANKS");
  ::unsetenv("SLURM_NTASKS_PER_NODE");
  EXPECT_EQ(local_rank_count_from_env(), 1);
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4", 1);
  EXPECT_EQ(local_rank_count_from_env(), 4);
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
}

TEST(LaunchLog, Levels) {
  EXPECT_EQ(parse_log_level("error"), LogLevel::kError);
  EXPECT_EQ(parse_log_level("warn"), LogLevel::kWarn);
  EXPECT_EQ(parse_log_level("info"), LogLevel::kInfo);
  EXPECT_EQ(parse_log_level("debug"), LogLevel::kDebug);
  EXPECT_THROW(parse_log_level("verbose"), std::invalid_argument);
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kWarn);
  EXPECT_TRUE(log_enabled(LogLevel::kError));
  EXPECT_TRUE(log_enabled(LogLevel::kWarn));
  EXPECT_FALSE(log_enabled(LogLevel::kInfo));
  set_log_level(saved);
}

TEST(LaunchLog, RankPrefixOnlyWithSeveralRanks) {
  set_log_rank(1, 2);
  EXPECT_EQ(log_prefix(), "[rank 1] ");
  set_log_rank(0, 1);
  EXPECT_EQ(log_prefix(), "");
}

TEST(LaunchLog, ProgressBarText) {
  EXPECT_EQ(ProgressBar::render(50, 100, 5.0, 10), "[#####     ] 50/100 tokens, 10.0 tokens/s, ETA 5 s");
  EXPECT_EQ(ProgressBar::render(0, 100, 0.0, 4), "[    ] 0/100 tokens, -- tokens/s, ETA --");
  EXPECT_EQ(ProgressBar::render(100, 100, 2.0, 4), "[####] 100/100 tokens, 50.0 tokens/s, ETA 0 s");
}

TEST(LaunchLog, NoProgressBarWithoutATerminal) {
  // The test's stderr may be a terminal when run by hand; only check the pipe case there.
  if (::isatty(2)) GTEST_SKIP() << "stderr is a terminal";
  ProgressBar bar(100, true);
  EXPECT_FALSE(bar.active());
}

TEST(LaunchSignals, FlagAndExitCode) {
  request_stop(0);
  EXPECT_FALSE(stop_requested());
  EXPECT_EQ(stop_exit_code(), 0);
  request_stop(SIGINT);
  EXPECT_TRUE(stop_requested());
  EXPECT_EQ(stop_exit_code(), 130);
  request_stop(SIGTERM);
  EXPECT_EQ(stop_exit_code(), 143);
  request_stop(0);
}

class LaunchJob : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = kvpipe::testing::make_scratch_dir(); }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(LaunchJob, LogLevelErrorHidesPlanAndTiming) {
  std::ofstream(dir_ / "job.yaml") << "model: {path: \"dummy:tiny\"}\ncache: {memory: 4MiB}\n"
                                   << "requests: [{prompt_ids: [1, 2, 3], max_new_tokens: 3}]\n";
  const std::string base = std::string("OMP_NUM_THREADS=1 ") + KVPIPE_BINARY + " generate --config " +
                           (dir_ / "job.yaml").string();
  const CommandResult info = kvpipe::testing::run_command(base, dir_);
  ASSERT_EQ(info.code, 0) << info.err;
  EXPECT_NE(info.err.find("plan: "), std::string::npos) << info.err;
  EXPECT_NE(info.err.find("timing: "), std::string::npos) << info.err;
  EXPECT_EQ(info.err.find("[rank "), std::string::npos) << info.err;  // one rank: no prefix
  EXPECT_EQ(info.err.find('\r'), std::string::npos) << "progress bar on a pipe";
  const CommandResult quiet = kvpipe::testing::run_command(base + " --log-level error", dir_);
  ASSERT_EQ(quiet.code, 0) << quiet.err;
  EXPECT_EQ(quiet.err, "");
  EXPECT_EQ(std::count(quiet.out.begin(), quiet.out.end(), '\n'), 1);
  const CommandResult bad = kvpipe::testing::run_command(base + " --log-level loud", dir_);
  EXPECT_EQ(bad.code, 2) << bad.err;
  EXPECT_NE(bad.err.find("--log-level"), std::string::npos) << bad.err;
}

// runtime.device: cpu runs anywhere; cuda runs where a GPU is and is refused with exit 2 and
// the reason where none is (also when runtime.memory is a size, so that the plan needs no
// GPU); auto is the GPU where one is, else the CPU.
TEST_F(LaunchJob, RuntimeDevice) {
  std::ofstream(dir_ / "job.yaml") << "model: {path: \"dummy:tiny\"}\ncache: {memory: 4MiB}\n"
                                   << "requests: [{prompt_ids: [1, 2, 3], max_new_tokens: 2}]\n";
  const std::string base = std::string("OMP_NUM_THREADS=1 ") + KVPIPE_BINARY + " generate --config " +
                           (dir_ / "job.yaml").string() + " --log-level error --set runtime.device=";
  for (const char* device : {"cpu", "auto"}) {
    const CommandResult ok = kvpipe::testing::run_command(base + device, dir_);
    EXPECT_EQ(ok.code, 0) << device << ": " << ok.err;
    EXPECT_EQ(std::count(ok.out.begin(), ok.out.end(), '\n'), 1) << device;
  }
  const CommandResult cuda = kvpipe::testing::run_command(base + "cuda", dir_);
  if (at::hasCUDA()) {
    EXPECT_EQ(cuda.code, 0) << cuda.err;
    EXPECT_EQ(std::count(cuda.out.begin(), cuda.out.end(), '\n'), 1) << cuda.out;
  } else {
    EXPECT_EQ(cuda.code, 2) << cuda.err;
    EXPECT_NE(cuda.err.find("runtime.device: cuda"), std::string::npos) << cuda.err;
    EXPECT_NE(cuda.err.find("job.yaml"), std::string::npos) << cuda.err;
    EXPECT_EQ(std::count(cuda.err.begin(), cuda.err.end(), '\n'), 1) << cuda.err;
    EXPECT_EQ(cuda.out, "");
  }
  for (const std::string memory : {"", " --set runtime.memory=2GiB"}) {
    const CommandResult hidden =
        kvpipe::testing::run_command("CUDA_VISIBLE_DEVICES= " + base + "cuda" + memory, dir_);
    EXPECT_EQ(hidden.code, 2) << memory << ": " << hidden.err;
    EXPECT_NE(hidden.err.find("runtime.device: cuda"), std::string::npos) << hidden.err;
    EXPECT_NE(hidden.err.find("cannot use a GPU"), std::string::npos) << hidden.err;
    EXPECT_EQ(std::count(hidden.err.begin(), hidden.err.end(), '\n'), 1) << hidden.err;
  }
  // CUDA graphs are a GPU's: on the CPU the key is ignored with a warning, and tokens do not change.
  const CommandResult graphs = kvpipe::testing::run_command(
      std::string("CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 ") + KVPIPE_BINARY + " generate --config " +
          (dir_ / "job.yaml").string() + " --log-level warn --set runtime.cuda_graphs=true",
      dir_);
  EXPECT_EQ(graphs.code, 0) << graphs.err;
  EXPECT_NE(graphs.err.find("runtime.cuda_graphs"), std::string::npos) << graphs.err;
  const CommandResult plain = kvpipe::testing::run_command("CUDA_VISIBLE_DEVICES= " + base + "cpu", dir_);
  const auto tokens = [](const std::string& line) { return nlohmann::json::parse(line).at("output_ids"); };
  EXPECT_EQ(tokens(graphs.out), tokens(plain.out));
  const CommandResult bad = kvpipe::testing::run_command(base + "tpu", dir_);
  EXPECT_EQ(bad.code, 2) << bad.err;
  EXPECT_NE(bad.err.find("runtime.device"), std::string::npos) << bad.err;
}

// cache.dtype: the plan counts the stored bytes (q8_0 holds 3.76x the tokens of float32 in one
// budget, the tiny preset's head_dim being 32), the job runs, its greedy tokens follow the
// float32 run's and its log-probabilities stay close; a bad value or a head_dim q8_0 cannot
// group is exit 2 naming the key.
TEST_F(LaunchJob, CacheDtype) {
  std::ofstream(dir_ / "job.yaml") << "model: {path: \"dummy:tiny\"}\ncache: {memory: 4MiB}\n"
                                   << "sampling: {ignore_eos: true}\n"
                                   << "requests: [{prompt_ids: [1, 2, 3, 4, 5, 6, 7, 8], max_new_tokens: 6}]\n";
  const std::string base = std::string("OMP_NUM_THREADS=1 ") + KVPIPE_BINARY + " generate --config " +
                           (dir_ / "job.yaml").string() + " --set cache.dtype=";
  std::map<std::string, std::string> blocks, outputs;
  for (const char* dtype : {"auto", "float32", "float16", "bfloat16", "q8_0"}) {
    const CommandResult r = kvpipe::testing::run_command(
        base + dtype + " --logprobs-out " + (dir_ / (std::string(dtype) + ".jsonl")).string(), dir_);
    ASSERT_EQ(r.code, 0) << dtype << ": " << r.err;
    const size_t at = r.err.find(" blocks of 16 tokens");
    ASSERT_NE(at, std::string::npos) << r.err;
    blocks[dtype] = r.err.substr(r.err.rfind(' ', at - 1) + 1, at - r.err.rfind(' ', at - 1) - 1);
    EXPECT_NE(r.err.find(std::string("KV cache ") + (std::string(dtype) == "auto" ? "float32" : dtype)),
              std::string::npos) << r.err;
    outputs[dtype] = r.out.substr(r.out.find("\"output_ids\""), r.out.find(']', r.out.find("\"output_ids\"")) -
                                                                     r.out.find("\"output_ids\""));
  }
  EXPECT_EQ(blocks["auto"], blocks["float32"]);
  EXPECT_EQ(std::stoll(blocks["float16"]), 2 * std::stoll(blocks["float32"]));
  EXPECT_EQ(std::stoll(blocks["bfloat16"]), 2 * std::stoll(blocks["float32"]));
  EXPECT_EQ(std::stoll(blocks["q8_0"]), std::stoll(blocks["float32"]) * 128 / 34);
  EXPECT_EQ(outputs["auto"], outputs["float32"]);
  for (const char* dtype : {"float16", "bfloat16", "q8_0"}) {
    // Random tiny weights give near-flat logits; the stored K/V move log-probabilities by
    // well under 1e-2 there.
    const auto ours = kvpipe::testing::parse_logprob_steps(kvpipe::testing::slurp(dir_ / (std::string(dtype) + ".jsonl")));
    const auto ref = kvpipe::testing::parse_logprob_steps(kvpipe::testing::slurp(dir_ / "float32.jsonl"));
    const auto c = kvpipe::testing::compare_logprob_steps(ours, ref, 6, 1e-2, 1e-3);
    EXPECT_TRUE(c.failure.empty()) << dtype << ": " << c.failure;
  }
  const CommandResult bad = kvpipe::testing::run_command(base + "int4", dir_);
  EXPECT_EQ(bad.code, 2) << bad.err;
  EXPECT_NE(bad.err.find("cache.dtype"), std::string::npos) << bad.err;
  const CommandResult init = kvpipe::testing::run_command(
      std::string(KVPIPE_BINARY) + " init-model --format gguf --preset tiny --layers 1 --heads 4 --kv-heads 2 "
      "--head-dim 48 --out " + (dir_ / "odd.gguf").string(), dir_);
  ASSERT_EQ(init.code, 0) << init.err;
  const CommandResult odd =
      kvpipe::testing::run_command(base + "q8_0 --set model.path=" + (dir_ / "odd.gguf").string(), dir_);
  EXPECT_EQ(odd.code, 2) << odd.err;
  EXPECT_NE(odd.err.find("cache.dtype: q8_0 needs a head dimension"), std::string::npos) << odd.err;
}

// Starts a long one-rank job, signals it once it has printed its plan, and returns what it
// wrote and its exit status.
CommandResult stop_long_job(const fs::path& dir, int signal) {
  std::ofstream job(dir / "long.yaml");
  job << "model: {path: \"dummy:tiny\"}\ncache: {memory: 16MiB}\nscheduler: {max_batch: 4}\n"
      << "sampling: {ignore_eos: true}\nrequests:\n"
      << "  - {prompt_ids: [1, 2, 3], max_new_tokens: 2}\n";
  for (int i = 0; i < 6; ++i) job << "  - {prompt_ids: [" << 4 + i << ", 5, 6], max_new_tokens: 100000}\n";
  job.close();
  const fs::path out = dir / "out.txt", err = dir / "err.txt";
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string cmd = std::string("exec env OMP_NUM_THREADS=1 ") + KVPIPE_BINARY + " generate --config " +
                            (dir / "long.yaml").string() + " >" + out.string() + " 2>" + err.string() +
                            " </dev/null";
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // Wait for the plan, then for the short request to finish.
  const auto t0 = std::chrono::steady_clock::now();
  while (kvpipe::testing::slurp(err).find("plan: ") == std::string::npos &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  kill(pid, signal);
  const auto t1 = std::chrono::steady_clock::now();
  int status = 0;
  waitpid(pid, &status, 0);
  CommandResult r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
  r.out = kvpipe::testing::slurp(out);
  r.err = kvpipe::testing::slurp(err);
  return r;
}

TEST_F(LaunchJob, SigintStopsTheJobAndPrintsFinishedRequests) {
  const CommandResult r = stop_long_job(dir_, SIGINT);
  EXPECT_EQ(r.code, 130) << r.err;
  EXPECT_LT(r.seconds, 10.0);
  std::istringstream lines(r.out);
  std::string line;
  int count = 0;
  while (std::getline(lines, line)) {
    const auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["id"], 0) << line;  // only the short request finished
    EXPECT_EQ(j["output_ids"].size(), 2u);
    ++count;
  }
  EXPECT_EQ(count, 1) << r.out;
  EXPECT_NE(r.err.find("stopped by signal"), std::string::npos) << r.err;
}

TEST_F(LaunchJob, SigtermExits143) {
  const CommandResult r = stop_long_job(dir_, SIGTERM);
  EXPECT_EQ(r.code, 143) << r.err;
  EXPECT_LT(r.seconds, 10.0);
}

}  // namespace
}  // namespace kvpipe
