// What a job may ask for, bounded before anything is read, started or allocated: job files
// that are not regular files (or are huge), runtime.threads and the other sizes of the job,
// what a rank will allocate against runtime.memory, and `validate` refusing every request
// that `generate` would refuse. Each case runs the kvpipe binary with a time bound.
#include "launch/job_config.h"
#include "tests/support/command.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;

// Every refusal here is a check made before any work: it must come within this many seconds
// of the process starting (loading LibTorch and joining MPI alone take seconds on a busy
// machine, so that is measured once and added). A hang ends at the `timeout` each command runs under.
constexpr double kQuickSeconds = 5.0;
double startup_seconds = 0.0;

class JobBounds : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(kvpipe::testing::make_scratch_dir());
    fs::create_directories(*dir_ / "out");
    // The slowest start: generate joins an MPI job before it reads its config.
    startup_seconds = kvpipe("generate --config absent.yaml").seconds;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }

  static CommandResult kvpipe(const std::string& args) {
    return kvpipe::testing::run_command(
        "cd " + dir_->string() +
            " && env -u OMPI_COMM_WORLD_SIZE -u PMI_SIZE -u SLURM_NTASKS OMP_NUM_THREADS=1 timeout -s KILL 60 " +
            KVPIPE_BINARY + " " + args,
        *dir_ / "out");
  }

  static fs::path write(const std::string& name, const std::string& text) {
    const fs::path p = *dir_ / name;
    std::ofstream(p) << text;
    return p;
  }

  // A tiny HF model whose config.json is then edited by `edit`.
  static fs::path tiny_model(const std::string& name, const std::function<void(nlohmann::json&)>& edit = {}) {
    const fs::path model = *dir_ / name;
    const CommandResult r = kvpipe("init-model --out " + model.string() + " --preset tiny");
    EXPECT_EQ(r.code, 0) << r.err;
    if (edit) {
      nlohmann::json config;
      std::ifstream(model / "config.json") >> config;
      edit(config);
      std::ofstream(model / "config.json") << config.dump(2);
    }
    return model;
  }

  static fs::path* dir_;
};

fs::path* JobBounds::dir_ = nullptr;

void expect_refused(const CommandResult& r, const std::vector<std::string>& needles) {
  EXPECT_EQ(r.code, 2) << r.err;
  for (const std::string& needle : needles)
    EXPECT_NE(r.err.find(needle), std::string::npos) << "'" << needle << "' not in: " << r.err;
  EXPECT_LT(r.seconds, kQuickSeconds + startup_seconds) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST_F(JobBounds, FifoConfigIsRefusedWithoutBlocking) {
  const fs::path fifo = *dir_ / "job.fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string command : {"validate --config FILE", "generate --config FILE",
                                    "tokenize --config FILE --text hi", "slurm --config FILE"}) {
    SCOPED_TRACE(command);
    const std::string args = command.substr(0, command.find("FILE")) + fifo.string() + command.substr(command.find("FILE") + 4);
    expect_refused(kvpipe(args), {fifo.string(), "not a regular file"});
  }
}

TEST_F(JobBounds, DeviceConfigIsNotReadWithoutBound) {
  expect_refused(kvpipe("validate --config /dev/zero"), {"/dev/zero", "not a regular file"});
  expect_refused(kvpipe("generate --config /dev/zero"), {"/dev/zero", "not a regular file"});
}

TEST_F(JobBounds, HugeConfigIsRefusedUnread) {
  const fs::path big = *dir_ / "big.yaml";
  {
    std::ofstream out(big);
    out << "model: {path: \"dummy:tiny\"}\n";
    const std::string comment = "# " + std::string(1022, 'x') + "\n";
    for (int i = 0; i < 17 * 1024; ++i) out << comment;
  }
  expect_refused(kvpipe("validate --config " + big.string()), {big.string(), "larger than 16 MiB"});
}

TEST_F(JobBounds, DirectoryConfigIsRefused) {
  expect_refused(kvpipe("validate --config " + dir_->string()), {dir_->string(), "directory"});
}

TEST_F(JobBounds, FifoFileOfLengthsIsRefusedWithoutBlocking) {
  const fs::path fifo = *dir_ / "lengths.fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const fs::path job = write("lengths.yaml", "model: {path: \"dummy:tiny\"}\nworkload: {prompt_len: " + fifo.string() + "}\n");
  expect_refused(kvpipe("validate --config " + job.string()), {"lengths.yaml:2:", "workload.prompt_len", "not a regular file"});
}

TEST_F(JobBounds, ThreadsAreBoundedBeforeAnyStarts) {
  const fs::path job = write("threads.yaml", "model: {path: \"dummy:tiny\"}\ncache: {memory: 8MiB}\n");
  expect_refused(kvpipe("generate --config " + job.string() + " --prompt-ids 1,2,3 --set runtime.threads=100000"),
                 {"--set runtime.threads", "[1, 1024]"});
  expect_refused(kvpipe("validate --config " + job.string() + " --set runtime.threads=100000"),
                 {"--set runtime.threads"});
  // Within the schema's bound but far above this machine's cores.
  const unsigned cores = std::thread::hardware_concurrency();
  if (cores > 0 && cores < 256) {
    expect_refused(kvpipe("generate --config " + job.string() + " --prompt-ids 1,2,3 --set runtime.threads=1024"),
                   {"--set runtime.threads", "CPUs of this machine"});
  }
}

TEST_F(JobBounds, StepSizesAreBounded) {
  const fs::path job = write("sizes.yaml", "model: {path: \"dummy:tiny\"}\n");
  for (const std::string key : {"scheduler.max_batch", "scheduler.max_tokens_per_step",
                                "scheduler.max_prefill_tokens_per_step", "parallel.micro_batches",
                                "workload.requests", "workload.concurrency", "workload.warmup"}) {
    expect_refused(kvpipe("validate --config " + job.string() + " --set " + key + "=2000000000"), {"--set " + key});
  }
  // Each within its bound, together too many prompt tokens for bench to draw.
  expect_refused(kvpipe("validate --config " + job.string() +
                        " --set workload.requests=1000000 --set workload.prompt_len=2000"),
                 {"workload.requests", "prompt tokens"});
}

TEST_F(JobBounds, FixedCacheIsCheckedAgainstRuntimeMemory) {
  const fs::path job = write("memory.yaml", "model: {path: \"dummy:tiny\"}\nruntime: {memory: 256MiB}\ncache: {memory: 1GiB}\n");
  expect_refused(kvpipe("validate --config " + job.string()), {"memory.yaml:3:", "cache.memory", "runtime.memory"});
  expect_refused(kvpipe("generate --config " + job.string() + " --prompt-ids 1,2,3"), {"cache.memory", "runtime.memory"});
  // auto: the machine's memory.
  expect_refused(kvpipe("validate --config " + job.string() + " --set runtime.memory=auto --set cache.memory=64TiB"),
                 {"--set cache.memory", "runtime.memory: auto"});
  // What fits passes.
  const CommandResult ok = kvpipe("validate --config " + job.string() + " --set cache.memory=64MiB");
  EXPECT_EQ(ok.code, 0) << ok.err;
}

// A draft model's weights and KV pool live on rank 0 beside its stage's: the plan counts
// them (and prints them) against runtime.memory.
TEST_F(JobBounds, DraftModelIsCountedInRankZerosMemory) {
  const fs::path model = tiny_model("models/draft-target");
  const fs::path job = write("draft.yaml", "model: {path: " + model.string() + "}\ncache: {memory: 8MiB}\n" +
                                               "runtime: {memory: 128MiB}\n");
  const CommandResult alone = kvpipe("validate --config " + job.string());
  ASSERT_EQ(alone.code, 0) << alone.err;
  const std::string draft = " --set speculative.method=draft --set speculative.model=" + model.string();
  expect_refused(kvpipe("validate --config " + job.string() + draft),
                 {"--set speculative.model", "rank 0 would need", "draft model", "runtime.memory"});
  const CommandResult roomy = kvpipe("validate --config " + job.string() + draft + " --set runtime.memory=192MiB");
  ASSERT_EQ(roomy.code, 0) << roomy.err;
  EXPECT_NE(roomy.out.find("plan: rank 0 draft model 4 layers, weights "), std::string::npos) << roomy.out;
  // Fewer requests drafting at once: a smaller pool.
  const CommandResult one = kvpipe("validate --config " + job.string() + draft +
                                   " --set runtime.memory=192MiB --set speculative.max_batch=1 --set cache.memory=64MiB");
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_NE(one.out.find("KV 8.1 MiB, 129 blocks"), std::string::npos) << one.out;
}

TEST_F(JobBounds, StepActivationsAreCheckedAgainstRuntimeMemory) {
  const fs::path job = write("step.yaml", "model: {path: \"dummy:tiny\"}\nruntime: {memory: 1GiB}\ncache: {memory: 8MiB}\n");
  expect_refused(kvpipe("validate --config " + job.string() + " --set scheduler.max_tokens_per_step=1000000"),
                 {"--set scheduler.max_tokens_per_step", "runtime.memory"});
}

TEST_F(JobBounds, HugeContextIsRefusedBeforeItsTablesAreBuilt) {
  const fs::path job = write("context.yaml", "model: {path: models/huge-context}\ncache: {memory: 8MiB}\n");
  tiny_model("models/huge-context", [](nlohmann::json& c) { c["max_position_embeddings"] = 1000000000; });
  for (const std::string command : {"validate --config context.yaml", "generate --config context.yaml --prompt-ids 1,2,3"}) {
    SCOPED_TRACE(command);
    expect_refused(kvpipe(command), {"huge-context", "max_position_embeddings"});
  }
  // A context the model loader accepts, whose RoPE tables (about 19 GiB at 2^24 positions)
  // still exceed the rank's memory.
  tiny_model("models/long-context", [](nlohmann::json& c) { c["max_position_embeddings"] = 1 << 24; });
  expect_refused(kvpipe("generate --config context.yaml --prompt-ids 1,2,3 --set model.path=models/long-context "
                        "--set runtime.memory=2GiB"),
                 {"long-context/config.json: max_position_embeddings", "RoPE", "runtime.memory"});
}

// validate refuses exactly what generate refuses, with the same words.
TEST_F(JobBounds, ValidateRefusesTheRequestsGenerateRefuses) {
  tiny_model("models/short", [](nlohmann::json& c) { c["max_position_embeddings"] = 16; });
  struct Case {
    std::string name, yaml, words;
  };
  const std::vector<Case> cases = {
      {"vocabulary", "model: {path: \"dummy:tiny\"}\nrequests:\n  - {prompt_ids: [1, 2, 3], max_new_tokens: 2}\n"
                     "  - {prompt_ids: [1, 512], max_new_tokens: 2}\n",
       "token id 512 is outside the vocabulary (0..511)"},
      {"context", "model: {path: models/short}\nrequests:\n  - {prompt_ids: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], max_new_tokens: 2}\n",
       "prompt of 16 tokens does not fit the model's context of 16 tokens"},
      {"pool", "model: {path: \"dummy:tiny\"}\ncache: {memory: 128KiB}\nrequests:\n  - {prompt_ids: [1, 2, 3], max_new_tokens: 100}\n",
       "needs 7 KV blocks of 16 tokens but the pool has 2"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path job = write("request-" + c.name + ".yaml", c.yaml);
    const CommandResult validate = kvpipe("validate --config " + job.string());
    expect_refused(validate, {"request-" + c.name + ".yaml:", "requests[", c.words});
    // generate checks before any weight loads, naming the same entry.
    expect_refused(kvpipe("generate --config " + job.string()), {"request-" + c.name + ".yaml:", "requests[", c.words});
  }
  // A request from the command line is named by its option.
  const fs::path pool = write("pool.yaml", "model: {path: \"dummy:tiny\"}\ncache: {memory: 128KiB}\n");
  expect_refused(kvpipe("generate --config " + pool.string() + " --prompt-ids 1,2,3 --max-new-tokens 100"),
                 {"--prompt-ids: needs 7 KV blocks of 16 tokens but the pool has 2"});
}

// Text and chat requests are tokenised as generate tokenises them before they are checked.
TEST_F(JobBounds, ValidateChecksTextAndChatRequestsThroughTheTokenizer) {
  const fs::path gguf = fs::path(KVPIPE_SOURCE_DIR) / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(gguf)) GTEST_SKIP() << gguf << " is not there (scripts/setup.sh fetches it)";
  const std::string model = "model: {path: " + fs::canonical(gguf).string() + "}\ncache: {memory: 1MiB}\n";
  const fs::path text = write("request-text.yaml", model + "requests:\n  - {prompt: \"Hello there\", max_new_tokens: 100}\n");
  expect_refused(kvpipe("validate --config " + text.string()), {"request-text.yaml:", "requests[0]", "KV blocks"});
  const fs::path chat = write("request-chat.yaml",
                              model + "requests:\n  - {messages: [{role: user, content: hi}], max_new_tokens: 100}\n");
  expect_refused(kvpipe("validate --config " + chat.string()), {"request-chat.yaml:", "requests[0]", "KV blocks"});
  const CommandResult ok = kvpipe("validate --config " + text.string() + " --set requests.0.max_new_tokens=1");
  EXPECT_EQ(ok.code, 0) << ok.err;
}

}  // namespace
}  // namespace kvpipe
