// `kvpipe validate` end to end: the malformed-config corpus of tests/data/bad_configs (each
// file's first line says `# expect: <substring>`), every job in configs/, the plan it prints
// and the rank count it plans for.
#include "tests/support/command.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;

class LaunchValidate : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(kvpipe::testing::make_scratch_dir());
    // The CPU jobs of configs/ name models/tiny, models/SmolLM2-... (linked by
    // scripts/setup.sh) and configs/models/..., relative to the working directory: give them
    // all in a scratch directory.
    const CommandResult r = kvpipe::testing::run_command(
        std::string(KVPIPE_BINARY) + " init-model --out " + (*dir_ / "models" / "tiny").string() + " --preset tiny",
        *dir_);
    ASSERT_EQ(r.code, 0) << r.err;
    fs::create_directory_symlink(fs::path(KVPIPE_SOURCE_DIR) / "configs", *dir_ / "configs");
    const std::string smollm2 = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    fs::create_symlink(fs::canonical(fs::path(KVPIPE_SOURCE_DIR) / smollm2), *dir_ / smollm2);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }

  // Runs kvpipe in the scratch directory, with no launcher variables in the environment.
  static CommandResult kvpipe(const std::string& args, const std::string& env = "") {
    return kvpipe::testing::run_command(
        "cd " + dir_->string() +
            " && env -u OMPI_COMM_WORLD_SIZE -u PMI_SIZE -u SLURM_NTASKS OMP_NUM_THREADS=1 " + env + " " +
            KVPIPE_BINARY + " " + args,
        *dir_ / "out");
  }

  static fs::path write(const std::string& name, const std::string& text) {
    const fs::path p = *dir_ / name;
    std::ofstream(p) << text;
    return p;
  }

  static fs::path* dir_;
};

fs::path* LaunchValidate::dir_ = nullptr;

std::vector<fs::path> files_in(const fs::path& dir, const std::string& extension) {
  std::vector<fs::path> out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_regular_file() && entry.path().extension() == extension) out.push_back(entry.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST_F(LaunchValidate, BadConfigCorpus) {
  fs::create_directories(*dir_ / "out");
  const auto files = files_in(fs::path(KVPIPE_SOURCE_DIR) / "tests" / "data" / "bad_configs", ".yaml");
  ASSERT_GE(files.size(), 20u);
  for (const fs::path& file : files) {
    std::ifstream in(file);
    std::string first;
    std::getline(in, first);
    const std::string tag = "# expect: ";
    ASSERT_EQ(first.rfind(tag, 0), 0u) << file << " has no `# expect:` line";
    const std::string expected = first.substr(tag.size());
    const CommandResult r = kvpipe("validate --config " + file.string());
    EXPECT_EQ(r.code, 2) << file.filename() << ": " << r.err;
    EXPECT_NE(r.err.find(expected), std::string::npos)
        << file.filename() << ": '" << expected << "' not in: " << r.err;
    EXPECT_NE(r.err.find("error"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(file.filename().string()), std::string::npos)
        << file.filename() << ": the message does not name the file: " << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
}

TEST_F(LaunchValidate, EveryConfigInConfigsPasses) {
  fs::create_directories(*dir_ / "out");
  const auto files = files_in(fs::path(KVPIPE_SOURCE_DIR) / "configs", ".yaml");
  ASSERT_GE(files.size(), 5u);
  for (const fs::path& file : files) {
    const std::string name = file.filename().string();
    // GPU jobs say their rank count in the file name; validate plans them with --ranks.
    std::string ranks;
    if (name.find("2gpu") != std::string::npos) ranks = " --ranks 2";
    if (name.find("2rank") != std::string::npos) ranks = " --ranks 2";
    if (name.find("3rank") != std::string::npos) ranks = " --ranks 3";
    const CommandResult r = kvpipe("validate --config configs/" + name + ranks);
    EXPECT_EQ(r.code, 0) << name << ": " << r.err;
    EXPECT_NE(r.out.find("concurrent tokens"), std::string::npos) << name << ": " << r.out;
  }
}

TEST_F(LaunchValidate, PrintsThePlanPerRank) {
  fs::create_directories(*dir_ / "out");
  const CommandResult r = kvpipe("validate --config configs/tiny-3rank.yaml --ranks 3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("plan: 3 rank(s), 4 layers, split [2, 1, 1]"), std::string::npos) << r.out;
  for (const std::string rank : {"plan: rank 0 layers 0..1", "plan: rank 1 layers 2..2", "plan: rank 2 layers 3..3"})
    EXPECT_NE(r.out.find(rank), std::string::npos) << r.out;
  // 32 MiB on rank 0 for 2 layers of 4 KV heads x 32 dims, K and V, float32: 1024 blocks of 16.
  EXPECT_NE(r.out.find("1024 blocks"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("at most 16384 concurrent tokens"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("weights"), std::string::npos);
  EXPECT_NE(r.out.find("KV"), std::string::npos);
  // 16384 pool tokens hold a whole 2048-token context: the model's context sets the limit.
  EXPECT_NE(r.out.find("plan: a request may hold at most 2048 tokens (prompt + output), set by the model's "
                       "context length"),
            std::string::npos)
      << r.out;
}

TEST_F(LaunchValidate, ThePlanSaysWhenTheKvPoolLimitsARequest) {
  // 64 blocks of 16 tokens hold 1024 tokens, less than the model's 2048; a request may have one
  // token more, its last output, which is never fed back and so never stored.
  fs::create_directories(*dir_ / "out");
  const CommandResult r =
      kvpipe("validate --config configs/tiny-3rank.yaml --ranks 3 --set cache.memory=2MiB");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("64 blocks"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("plan: a request may hold at most 1025 tokens (prompt + output), set by cache.memory"),
            std::string::npos)
      << r.out;
}

TEST_F(LaunchValidate, RankCountFromLauncherThenClusterThenOne) {
  fs::create_directories(*dir_ / "out");
  const fs::path job = write("ranks.yaml", "model: {path: \"dummy:tiny\"}\ncache: {memory: 8MiB}\n");
  EXPECT_NE(kvpipe("validate --config " + job.string()).out.find("plan: 1 rank(s)"), std::string::npos);
  EXPECT_NE(kvpipe("validate --config " + job.string(), "OMPI_COMM_WORLD_SIZE=2").out.find("plan: 2 rank(s)"),
            std::string::npos);
  EXPECT_NE(kvpipe("validate --config " + job.string(), "SLURM_NTASKS=4").out.find("plan: 4 rank(s)"),
            std::string::npos);
  EXPECT_NE(kvpipe("validate --config " + job.string() + " --set cluster.nodes=2 --set cluster.gpus_per_node=2")
                .out.find("plan: 4 rank(s)"),
            std::string::npos);
  EXPECT_NE(kvpipe("validate --config " + job.string() + " --ranks 2", "PMI_SIZE=4").out.find("plan: 2 rank(s)"),
            std::string::npos);
  // More ranks than layers cannot start.
  const CommandResult r = kvpipe("validate --config " + job.string() + " --ranks 5");
  EXPECT_EQ(r.code, 2) << r.err;
}

TEST_F(LaunchValidate, PrintsEveryProblem) {
  fs::create_directories(*dir_ / "out");
  const fs::path job = write("many.yaml",
                             "model: {path: \"dummy:tiny\"}\n"
                             "cache: {blok_size: 8, memory: [1MiB, 1MiB]}\n"
                             "scheduler: {max_batch: 0}\n"
                             "workload: {concurrency: 0}\n");
  const CommandResult r = kvpipe("validate --config " + job.string() + " --ranks 3 --set sampling.top_p=7");
  EXPECT_EQ(r.code, 2);
  for (const std::string needle :
       {"many.yaml:2:9: unknown key 'cache.blok_size'", "many.yaml:2:", "cache.memory: lists 2 sizes for 3 ranks",
        "many.yaml:3:24: scheduler.max_batch", "many.yaml:4:25: workload.concurrency", "--set sampling.top_p"}) {
    EXPECT_NE(r.err.find(needle), std::string::npos) << "'" << needle << "' not in: " << r.err;
  }
  EXPECT_NE(r.err.find("5 problems"), std::string::npos) << r.err;
}

TEST_F(LaunchValidate, GenerateStopsAtTheFirstProblemOnOneLine) {
  fs::create_directories(*dir_ / "out");
  const fs::path job = write("two.yaml", "model: {path: \"dummy:tiny\"}\ncache: {block_size: 0}\nscheduler: {max_batch: 0}\n");
  const CommandResult r = kvpipe("generate --config " + job.string());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("two.yaml:2:21: cache.block_size"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

}  // namespace
}  // namespace kvpipe
