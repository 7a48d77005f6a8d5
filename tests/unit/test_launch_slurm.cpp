// `kvpipe slurm`: the sbatch script of a cluster section, checked with `bash -n` and by its
// counts; no SLURM needed.
#include "launch/job_config.h"
#include "launch/slurm_script.h"
#include "tests/support/command.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;

const std::string kJob =
    "model: {path: \"dummy:tiny\"}\n"
    "runtime: {threads: 2}\n"
    "cluster:\n"
    "  nodes: 3\n"
    "  gpus_per_node: 4\n"
    "  partition: gpu\n"
    "  account: proj-1\n"
    "  time: 1-00:30:00\n"
    "  job_name: tiny\n"
    "  env: {NCCL_DEBUG: WARN, GREETING: \"it's a test\"}\n"
    "  modules: [cuda/12.1, openmpi/4.1]\n";

bool has_line(const std::string& script, const std::string& line) {
  return ("\n" + script).find("\n" + line + "\n") != std::string::npos;
}

class LaunchSlurm : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = kvpipe::testing::make_scratch_dir(); }
  void TearDown() override { fs::remove_all(dir_); }

  CommandResult run(const std::string& command) { return kvpipe::testing::run_command(command, dir_); }

  // bash -n on `script`.
  void expect_valid_bash(const std::string& script) {
    const fs::path p = dir_ / "job.sbatch";
    std::ofstream(p) << script;
    const CommandResult r = run("bash -n " + p.string());
    EXPECT_EQ(r.code, 0) << r.err << script;
  }

  fs::path dir_;
};

TEST_F(LaunchSlurm, SrunScript) {
  const JobConfig job = parse_job_config(kJob, "job.yaml", {"sampling.seed=7"});
  const std::string script =
      make_slurm_script(job, {"/abs/job.yaml", {"sampling.seed=7", "cache.memory=[1GiB, 2GiB]"}, "/usr/bin/kvpipe"});
  EXPECT_EQ(script.rfind("#!/bin/bash\n", 0), 0u);
  EXPECT_TRUE(has_line(script, "#SBATCH --nodes=3")) << script;
  EXPECT_TRUE(has_line(script, "#SBATCH --ntasks-per-node=4")) << script;
  EXPECT_TRUE(has_line(script, "#SBATCH --gpus-per-node=4")) << script;
  EXPECT_TRUE(has_line(script, "#SBATCH --partition=gpu")) << script;
  EXPECT_TRUE(has_line(script, "#SBATCH --account=proj-1")) << script;
  EXPECT_TRUE(has_line(script, "#SBATCH --time=1-00:30:00")) << script;
  EXPECT_TRUE(has_line(script, "#SBATCH --job-name=tiny")) << script;
  EXPECT_TRUE(has_line(script, "#SBATCH --output=%x-%j.out")) << script;
  EXPECT_TRUE(has_line(script, "module load cuda/12.1")) << script;
  EXPECT_TRUE(has_line(script, "module load openmpi/4.1")) << script;
  EXPECT_TRUE(has_line(script, "export NCCL_DEBUG=WARN")) << script;
  EXPECT_TRUE(has_line(script, "export GREETING='it'\\''s a test'")) << script;
  EXPECT_TRUE(has_line(script, "export OMP_NUM_THREADS=2")) << script;
  EXPECT_TRUE(has_line(script,
                       "srun --mpi=pmix --nodes=3 --ntasks=12 --ntasks-per-node=4 /usr/bin/kvpipe generate "
                       "--config /abs/job.yaml --set sampling.seed=7 --set 'cache.memory=[1GiB, 2GiB]'"))
      << script;
  expect_valid_bash(script);
}

TEST_F(LaunchSlurm, MpirunScriptBuildsAHostfile) {
  const JobConfig job = parse_job_config(kJob + "  launcher: mpirun\n  gpus: false\n  kvpipe: /opt/kv/kvpipe\n", "job.yaml");
  const std::string script = make_slurm_script(job, {"/abs/job.yaml", {}, "/usr/bin/kvpipe"});
  EXPECT_EQ(script.find("--gpus-per-node"), std::string::npos) << script;
  EXPECT_NE(script.find("scontrol show hostnames \"$SLURM_JOB_NODELIST\""), std::string::npos) << script;
  EXPECT_NE(script.find("slots=4"), std::string::npos) << script;
  EXPECT_NE(script.find("mpirun -np 12 --hostfile \"$HOSTFILE\""), std::string::npos) << script;
  EXPECT_NE(script.find("/opt/kv/kvpipe generate --config /abs/job.yaml"), std::string::npos) << script;
  EXPECT_EQ(script.find("srun"), std::string::npos) << script;
  expect_valid_bash(script);
}

TEST_F(LaunchSlurm, NoClusterSectionIsAnError) {
  const JobConfig job = parse_job_config("model: {path: m}\n", "job.yaml");
  try {
    make_slurm_script(job, {"/abs/job.yaml", {}, "kvpipe"});
    FAIL() << "did not throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cluster"), std::string::npos) << e.what();
  }
}

TEST_F(LaunchSlurm, ShellQuote) {
  EXPECT_EQ(shell_quote("plain/path-1.yaml"), "plain/path-1.yaml");
  EXPECT_EQ(shell_quote("a b"), "'a b'");
  EXPECT_EQ(shell_quote("it's"), "'it'\\''s'");
  EXPECT_EQ(shell_quote(""), "''");
  EXPECT_EQ(shell_quote("$HOME"), "'$HOME'");
}

TEST_F(LaunchSlurm, CommandPrintsAScriptForTheAbsoluteConfigPath) {
  std::ofstream(dir_ / "job.yaml") << kJob;
  const CommandResult r = run("cd " + dir_.string() + " && " + KVPIPE_BINARY +
                              " slurm --config job.yaml --set sampling.seed=3 --set 'parallel.layers=[1,1,1,1,0]'");
  // A bad override is caught before any script is written.
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("parallel.layers"), std::string::npos) << r.err;

  const CommandResult ok = run("cd " + dir_.string() + " && " + KVPIPE_BINARY + " slurm --config job.yaml --set sampling.seed=3");
  ASSERT_EQ(ok.code, 0) << ok.err;
  const std::string config = fs::canonical(dir_ / "job.yaml").string();
  EXPECT_NE(ok.out.find(" generate --config " + config + " --set sampling.seed=3"), std::string::npos) << ok.out;
  // The default binary is the running executable, by absolute path.
  EXPECT_NE(ok.out.find(fs::canonical(KVPIPE_BINARY).string() + " generate"), std::string::npos) << ok.out;
  std::smatch ntasks;
  ASSERT_TRUE(std::regex_search(ok.out, ntasks, std::regex("--ntasks=(\\d+)")));
  EXPECT_EQ(ntasks[1], "12");
  expect_valid_bash(ok.out);
}

TEST_F(LaunchSlurm, CommandWithoutClusterExitsTwo) {
  std::ofstream(dir_ / "job.yaml") << "model: {path: \"dummy:tiny\"}\n";
  const CommandResult r = run(std::string(KVPIPE_BINARY) + " slurm --config " + (dir_ / "job.yaml").string());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("cluster"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST_F(LaunchSlurm, CommandRejectsABadCluster) {
  std::ofstream(dir_ / "job.yaml") << "model: {path: \"dummy:tiny\"}\ncluster: {nodes: 2, time: \"99\"}\n";
  const CommandResult r = run(std::string(KVPIPE_BINARY) + " slurm --config " + (dir_ / "job.yaml").string());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("job.yaml:2:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("cluster.time"), std::string::npos) << r.err;
}

TEST_F(LaunchSlurm, ExampleClusterJob) {
  const fs::path config = fs::path(KVPIPE_SOURCE_DIR) / "configs" / "llama3-70b-8gpu-2node.yaml";
  const CommandResult r = run(std::string(KVPIPE_BINARY) + " slurm --config " + config.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(has_line(r.out, "#SBATCH --nodes=2")) << r.out;
  EXPECT_TRUE(has_line(r.out, "#SBATCH --ntasks-per-node=4")) << r.out;
  EXPECT_TRUE(has_line(r.out, "#SBATCH --gpus-per-node=4")) << r.out;
  EXPECT_NE(r.out.find("--ntasks=8 "), std::string::npos) << r.out;
  // Tensor parallelism inside each node, pipeline stages across nodes.
  EXPECT_NE(r.out.find("= 8 rank(s): 2 pipeline stage(s) x 4 tensor rank(s)"), std::string::npos) << r.out;
  expect_valid_bash(r.out);
}

TEST_F(LaunchSlurm, TensorGroupThatWouldSpanNodesExitsTwo) {
  // 2 nodes of 4 ranks: 8 tensor ranks divide the job but would span both nodes.
  std::string two_nodes = kJob;
  two_nodes.replace(two_nodes.find("nodes: 3"), 8, "nodes: 2");
  std::ofstream(dir_ / "job.yaml") << two_nodes << "parallel: {tensor: 8}\n";
  const CommandResult r = run(std::string(KVPIPE_BINARY) + " slurm --config " + (dir_ / "job.yaml").string());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("cluster.gpus_per_node: 4 ranks per node is not a multiple of parallel.tensor 8"),
            std::string::npos)
      << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  std::ofstream(dir_ / "job.yaml") << kJob << "parallel: {tensor: 2}\n";
  const CommandResult ok = run(std::string(KVPIPE_BINARY) + " slurm --config " + (dir_ / "job.yaml").string());
  ASSERT_EQ(ok.code, 0) << ok.err;
  EXPECT_NE(ok.out.find("12 rank(s): 6 pipeline stage(s) x 2 tensor rank(s)"), std::string::npos) << ok.out;
}

}  // namespace
}  // namespace kvpipe
