// Results are never lost behind exit 0: every output a command writes (stdout, --output,
// --logprobs-out, init-model's files) is checked, a failed write is a non-zero exit with one
// line naming the output, and a path that cannot be used is refused before the job runs.
#include "launch/output.h"
#include "tests/support/command.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <thread>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;

size_t count_lines(const std::string& text) { return static_cast<size_t>(std::count(text.begin(), text.end(), '\n')); }

// --- LineOutput in-process --------------------------------------------------------------

TEST(OutputLines, EachLineIsWrittenWhole) {
  EXPECT_EQ(LineOutput::standard_output("results").name(), "stdout");
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  {
    LineOutput file = LineOutput::open_file((dir / "r.jsonl").string(), "--output", "results");
    EXPECT_EQ(file.name(), "--output " + (dir / "r.jsonl").string());
    file.write_line(R"({"id":0})");
    file.write_line(std::string(100000, 'x'));  // larger than a pipe's buffer or a page
    file.close();
  }
  EXPECT_EQ(kvpipe::testing::slurp(dir / "r.jsonl"), std::string("{\"id\":0}\n") + std::string(100000, 'x') + "\n");
  fs::remove_all(dir);
}

TEST(OutputLines, FullDeviceIsAFailureNamingTheOutput) {
  LineOutput out = LineOutput::open_file("/dev/full", "--output", "results");
  try {
    out.write_line("{}");
    FAIL() << "a write to /dev/full succeeded";
  } catch (const JobFailure& e) {
    EXPECT_EQ(std::string(e.what()), "cannot write results to --output /dev/full: No space left on device");
  }
  EXPECT_THROW(write_text_file("/dev/full", "x", "--out", "the report"), JobFailure);
}

TEST(OutputLines, UnusablePathsAreBadInputAndNeverBlock) {
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  try {
    (void)LineOutput::open_file((dir / "missing" / "r.jsonl").string(), "--output", "results");
    FAIL() << "opened a file in a missing directory";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--output " + (dir / "missing" / "r.jsonl").string()), std::string::npos)
        << e.what();
  }
  EXPECT_THROW((void)LineOutput::open_file(dir.string(), "--output", "results"), std::invalid_argument);
  // A FIFO nobody reads would block open() forever.
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW((void)LineOutput::open_file((dir / "fifo").string(), "--output", "results"), std::invalid_argument);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  fs::remove_all(dir);
}

// --- through the binary -----------------------------------------------------------------

class OutputChecks : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = kvpipe::testing::make_scratch_dir();
    job_ = dir_ / "job.yaml";
    std::ofstream(job_) << "model: {path: \"dummy:tiny\"}\ncache: {memory: 4MiB}\n"
                        << "sampling: {ignore_eos: true}\nrequests:\n"
                        << "  - {prompt_ids: [1, 2, 3], max_new_tokens: 6}\n"
                        << "  - {prompt_ids: [4, 5], max_new_tokens: 2}\n"
                        << "  - {prompt_ids: [6, 7, 8, 9], max_new_tokens: 4, arrival_step: 3}\n";
  }
  void TearDown() override { fs::remove_all(dir_); }

  CommandResult kvpipe(const std::string& args) {
    return kvpipe::testing::run_command(std::string("OMP_NUM_THREADS=1 ") + KVPIPE_BINARY + " " + args, dir_);
  }
  // Runs with the command's own stdout sent to /dev/full (the runner's capture applies to
  // the subshell around it).
  CommandResult kvpipe_to_full(const std::string& args) {
    return kvpipe::testing::run_command(std::string("( OMP_NUM_THREADS=1 ") + KVPIPE_BINARY + " " + args + " >/dev/full )",
                                        dir_);
  }
  // Exactly one `kvpipe: error:` line, containing every needle.
  static void expect_error_line(const CommandResult& r, const std::vector<std::string>& needles) {
    size_t errors = 0;
    std::istringstream lines(r.err);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("kvpipe: error: ", 0) != 0) continue;
      ++errors;
      for (const std::string& n : needles) EXPECT_NE(line.find(n), std::string::npos) << n << " not in: " << line;
    }
    EXPECT_EQ(errors, 1u) << r.err;
  }

  fs::path dir_, job_;
};

TEST_F(OutputChecks, GenerateToFullStdoutFails) {
  const CommandResult r = kvpipe_to_full("generate --config " + job_.string() + " --log-level error");
  EXPECT_EQ(r.code, 1) << r.err;
  expect_error_line(r, {"cannot write results to stdout", "No space left on device"});
}

TEST_F(OutputChecks, LogprobsOutToFullDeviceFails) {
  const CommandResult r = kvpipe("generate --config " + job_.string() + " --log-level error --logprobs-out /dev/full");
  EXPECT_EQ(r.code, 1) << r.err;
  expect_error_line(r, {"--logprobs-out /dev/full", "No space left on device"});
}

TEST_F(OutputChecks, OutputToFullDeviceFails) {
  const CommandResult r = kvpipe("generate --config " + job_.string() + " --log-level error --output /dev/full");
  EXPECT_EQ(r.code, 1) << r.err;
  expect_error_line(r, {"--output /dev/full", "No space left on device"});
}

TEST_F(OutputChecks, UnusableOutputPathsAreBadInputBeforeTheJobRuns) {
  for (const std::string option : {"--output", "--logprobs-out"}) {
    const std::string path = (dir_ / "missing" / "r.jsonl").string();
    const CommandResult r = kvpipe("generate --config " + job_.string() + " " + option + " " + path);
    EXPECT_EQ(r.code, 2) << r.err;
    expect_error_line(r, {option + " " + path});
    EXPECT_EQ(r.out, "") << option;
    EXPECT_EQ(r.err.find("plan: "), std::string::npos) << "refused only after planning: " << r.err;
    EXPECT_LT(r.seconds, 30.0);
  }
  // A bad job leaves an existing --output file as it was.
  std::ofstream(dir_ / "keep.jsonl") << "old\n";
  const CommandResult bad = kvpipe("generate --config " + job_.string() + " --set cache.block_size=0 --output " +
                                   (dir_ / "keep.jsonl").string());
  EXPECT_EQ(bad.code, 2) << bad.err;
  EXPECT_EQ(kvpipe::testing::slurp(dir_ / "keep.jsonl"), "old\n");
}

// --output gets exactly stdout's lines; each line is a whole request in finish order.
TEST_F(OutputChecks, OutputFileHoldsTheResultLines) {
  const fs::path file = dir_ / "results.jsonl";
  const CommandResult r = kvpipe("generate --config " + job_.string() + " --log-level error --output " + file.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(kvpipe::testing::slurp(file), r.out);
  std::istringstream lines(r.out);
  std::set<int64_t> ids;
  std::vector<int64_t> order;
  for (std::string line; std::getline(lines, line);) {
    const auto j = nlohmann::json::parse(line);
    ids.insert(j.at("id").get<int64_t>());
    order.push_back(j.at("id").get<int64_t>());
  }
  EXPECT_EQ(ids, (std::set<int64_t>{0, 1, 2}));
  // Request 1 (2 tokens) finishes before request 0 (6 tokens) and is printed first.
  EXPECT_LT(std::find(order.begin(), order.end(), 1) - order.begin(),
            std::find(order.begin(), order.end(), 0) - order.begin()) << r.out;
}

// A finished request's line is on stdout while the job still runs, not at its end.
TEST_F(OutputChecks, EachLineIsPrintedAsItsRequestFinishes) {
  std::ofstream(dir_ / "long.yaml") << "model: {path: \"dummy:tiny\"}\ncache: {memory: 16MiB}\n"
                                    << "sampling: {ignore_eos: true}\nrequests:\n"
                                    << "  - {prompt_ids: [1, 2, 3], max_new_tokens: 2}\n"
                                    << "  - {prompt_ids: [4, 5, 6], max_new_tokens: 100000}\n";
  const fs::path out = dir_ / "out.txt";
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string cmd = std::string("exec env OMP_NUM_THREADS=1 ") + KVPIPE_BINARY + " generate --log-level error --config " +
                            (dir_ / "long.yaml").string() + " >" + out.string() + " </dev/null";
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  const auto t0 = std::chrono::steady_clock::now();
  int status = 0;
  bool exited = false;
  while (count_lines(kvpipe::testing::slurp(out)) < 1 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60)) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const std::string printed = kvpipe::testing::slurp(out);
  EXPECT_FALSE(exited) << "the job ended on its own";
  if (!exited) {
    ::kill(pid, SIGINT);
    ::waitpid(pid, &status, 0);
  }
  ASSERT_EQ(count_lines(printed), 1u) << printed;
  EXPECT_EQ(nlohmann::json::parse(printed).at("id"), 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 130) << status;
  EXPECT_EQ(kvpipe::testing::slurp(out), printed) << "the unfinished request was printed";
}

TEST_F(OutputChecks, TokenizeAndValidateToFullStdoutFail) {
  const fs::path m = dir_ / "m";
  ASSERT_EQ(kvpipe("init-model --out " + m.string() + " --hidden 64 --layers 1 --heads 4 --kv-heads 2"
                   " --intermediate 96 --vocab 300 --max-position 64").code, 0);
  std::ofstream(dir_ / "text.yaml") << "model: {path: " << m.string() << "}\ncache: {memory: 1MiB}\n";
  const CommandResult tok = kvpipe_to_full("tokenize --config " + (dir_ / "text.yaml").string() + " --text hello");
  EXPECT_EQ(tok.code, 1) << tok.err;
  expect_error_line(tok, {"stdout", "No space left on device"});
  const CommandResult val = kvpipe_to_full("validate --config " + job_.string());
  EXPECT_EQ(val.code, 1) << val.err;
  expect_error_line(val, {"stdout", "No space left on device"});
  // The same commands with a working stdout.
  EXPECT_EQ(kvpipe("tokenize --config " + (dir_ / "text.yaml").string() + " --text hello").code, 0);
  EXPECT_EQ(kvpipe("validate --config " + job_.string()).code, 0);
}

// A request that fails (here: NaN weights give non-finite logits) is printed with its
// error; the command exits 1 once every line is out, naming each failed request.
TEST_F(OutputChecks, FailedRequestsArePrintedThenExit1) {
  const fs::path m = dir_ / "nan";
  ASSERT_EQ(kvpipe("init-model --out " + m.string() + " --hidden 64 --layers 1 --heads 4 --kv-heads 2"
                   " --intermediate 96 --vocab 128 --max-position 64").code, 0);
  {
    // Poison the final norm: every logit becomes NaN.
    std::fstream st(m / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    uint64_t header_len = 0;
    st.read(reinterpret_cast<char*>(&header_len), 8);
    std::string header(header_len, '\0');
    st.read(header.data(), static_cast<std::streamsize>(header_len));
    const auto offsets = nlohmann::json::parse(header).at("model.norm.weight").at("data_offsets");
    const float nan = std::numeric_limits<float>::quiet_NaN();
    st.seekp(static_cast<std::streamoff>(8 + header_len + offsets[0].get<uint64_t>()));
    for (uint64_t at = offsets[0]; at < offsets[1].get<uint64_t>(); at += 4) st.write(reinterpret_cast<const char*>(&nan), 4);
    ASSERT_TRUE(st.good());
  }
  std::ofstream(dir_ / "nan.yaml") << "model: {path: " << m.string() << "}\ncache: {memory: 1MiB}\n"
                                   << "requests: [{prompt_ids: [1, 2, 3], max_new_tokens: 3}]\n";
  const fs::path file = dir_ / "results.jsonl";
  const CommandResult r = kvpipe("generate --log-level error --config " + (dir_ / "nan.yaml").string() +
                                 " --output " + file.string());
  EXPECT_EQ(r.code, 1) << r.err;
  expect_error_line(r, {"request 0: ", "non-finite"});
  ASSERT_EQ(count_lines(r.out), 1u) << r.out;
  const auto line = nlohmann::json::parse(r.out);
  EXPECT_EQ(line.at("id"), 0);
  EXPECT_EQ(line.at("finish_reason"), "error");
  EXPECT_NE(line.at("error").get<std::string>().find("non-finite"), std::string::npos) << r.out;
  EXPECT_EQ(kvpipe::testing::slurp(file), r.out);
}

TEST_F(OutputChecks, BenchSummaryAndReportFilesAreChecked) {
  const std::string bench = "bench --log-level error --config " + std::string(KVPIPE_SOURCE_DIR) +
                            "/configs/bench-tiny.yaml --set workload.requests=2 --set workload.warmup=0 --out ";
  const CommandResult full = kvpipe_to_full(bench + (dir_ / "b1").string());
  EXPECT_EQ(full.code, 1) << full.err;
  expect_error_line(full, {"bench summary", "stdout", "No space left on device"});
  // report.json cannot be written: bad input naming it.
  fs::create_directories(dir_ / "b2" / "report.json");
  const CommandResult blocked = kvpipe(bench + (dir_ / "b2").string());
  EXPECT_EQ(blocked.code, 2) << blocked.err;
  expect_error_line(blocked, {(dir_ / "b2" / "report.json").string()});
}

TEST_F(OutputChecks, InitModelToFullDeviceFails) {
  const CommandResult r = kvpipe("init-model --format gguf --preset tiny --layers 1 --out /dev/full");
  EXPECT_NE(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("/dev/full"), std::string::npos) << r.err;
  EXPECT_EQ(count_lines(r.err), 1u) << r.err;
}

}  // namespace
}  // namespace kvpipe
