// The job schema beyond section 4: every problem reported at once with line and column,
// the workload and cluster sections, runtime memory shares, and checks against the rank
// count.
#include "launch/job_config.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvpipe {
namespace {

const std::string kModel = "model: {path: dummy:tiny}\n";

std::vector<ConfigProblem> problems_of(const std::string& yaml,
                                       const std::vector<std::string>& overrides = {}, int ranks = 0) {
  return validate_job_config_text(yaml, "job.yaml", overrides, ranks);
}

bool mentions(const std::vector<ConfigProblem>& problems, const std::string& path) {
  for (const ConfigProblem& p : problems) {
    if (p.path == path) return true;
  }
  return false;
}

TEST(LaunchConfigProblems, EveryProblemIsReportedInFileOrder) {
  const std::string yaml = kModel +
                           "cache:\n"
                           "  blok_size: 8\n"
                           "  memory: -1GiB\n"
                           "scheduler: {max_batch: 0, max_tokens_per_step: x}\n"
                           "sampling: {top_p: 2}\n";
  const std::vector<ConfigProblem> problems = problems_of(yaml);
  ASSERT_EQ(problems.size(), 5u);
  EXPECT_EQ(problems[0].path, "cache.blok_size");
  EXPECT_EQ(problems[0].line, 3);
  EXPECT_EQ(problems[0].column, 3);
  EXPECT_NE(problems[0].message.find("did you mean 'cache.block_size'"), std::string::npos);
  EXPECT_EQ(problems[1].path, "cache.memory");
  EXPECT_EQ(problems[1].message.rfind("job.yaml:4:11: cache.memory: ", 0), 0u) << problems[1].message;
  EXPECT_EQ(problems[2].path, "scheduler.max_batch");
  EXPECT_EQ(problems[2].line, 5);
  EXPECT_EQ(problems[2].column, 24);
  EXPECT_EQ(problems[3].path, "scheduler.max_tokens_per_step");
  EXPECT_EQ(problems[4].path, "sampling.top_p");
  for (const ConfigProblem& p : problems) {
    EXPECT_EQ(p.message.find('\n'), std::string::npos) << p.message;
    EXPECT_EQ(p.message.rfind(p.where + ": ", 0), 0u) << p.message;
  }
}

TEST(LaunchConfigProblems, ExceptionKeepsTheFirstProblemOnOneLine) {
  try {
    parse_job_config(kModel + "cache: {block_size: 0}\nscheduler: {max_batch: 0}\n", "job.yaml");
    FAIL() << "did not throw";
  } catch (const JobConfigError& e) {
    EXPECT_EQ(std::string(e.what()), e.problems().front().message);
    EXPECT_EQ(std::string(e.what()).rfind("job.yaml:2:21: cache.block_size: ", 0), 0u) << e.what();
    EXPECT_EQ(e.problems().size(), 2u);
    const std::invalid_argument& base = e;  // callers catch std::invalid_argument
    EXPECT_STREQ(base.what(), e.what());
  }
}

TEST(LaunchConfigProblems, ListElementsAreCheckedEach) {
  const auto problems = problems_of(kModel + "requests:\n  - {prompt_ids: [1, -1], max_new_tokens: 0}\n"
                                              "  - {prompt_ids: []}\n  - {max_new_tokens: 3}\n");
  ASSERT_EQ(problems.size(), 4u);
  EXPECT_EQ(problems[0].path, "requests[0].prompt_ids[1]");
  EXPECT_EQ(problems[1].path, "requests[0].max_new_tokens");
  EXPECT_EQ(problems[2].path, "requests[1].prompt_ids");
  EXPECT_EQ(problems[3].path, "requests[2]");
}

TEST(LaunchConfigProblems, OverrideProblemsComeAfterFileProblems) {
  const auto problems = problems_of(kModel + "cache: {block_size: 0}\n", {"sampling.top_k=-1"});
  ASSERT_EQ(problems.size(), 2u);
  EXPECT_EQ(problems[0].path, "cache.block_size");
  EXPECT_EQ(problems[1].where, "--set sampling.top_k");
  EXPECT_EQ(problems[1].line, 0);
}

TEST(LaunchConfigProblems, ValidFileHasNone) {
  EXPECT_TRUE(problems_of(kModel).empty());
  EXPECT_TRUE(problems_of("", {"model.path=dummy:tiny"}).empty());
}

TEST(LaunchConfigProblems, MalformedYamlGivesLineAndColumn) {
  const auto problems = problems_of(kModel + "cache: [1,\nx: 2\n");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_GT(problems[0].line, 0);
  EXPECT_NE(problems[0].message.find("malformed YAML"), std::string::npos);
}

TEST(LaunchConfigCombinations, SinksWithoutWindow) {
  const auto problems = problems_of(kModel + "cache:\n  window: {sinks: 4}\n");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].path, "cache.window.sinks");
  EXPECT_NE(problems[0].message.find("cache.window.recent"), std::string::npos);
  EXPECT_TRUE(problems_of(kModel + "cache: {window: {sinks: 4, recent: 60}}\n").empty());
  EXPECT_TRUE(problems_of(kModel + "cache: {window: {sinks: 0, recent: 0}}\n").empty());
}

// Zero cached layers is layer-level reuse taken to the end (every layer recomputed, no K/V);
// a negative count is not a count.
TEST(LaunchConfigCombinations, CachedLayersZeroIsValidNegativeIsNot) {
  EXPECT_TRUE(problems_of(kModel + "cache: {cached_layers: 0}\n").empty());
  EXPECT_TRUE(mentions(problems_of(kModel + "cache: {cached_layers: -2}\n"), "cache.cached_layers"));
}

TEST(LaunchConfigRanks, PerRankMemoryAndPinnedSplitMustMatch) {
  const JobConfig job = parse_job_config(
      kModel + "parallel: {layers: [2, 1, 1]}\ncache: {memory: [1GiB, 1GiB]}\n", "job.yaml");
  const auto two = check_job_for_ranks(job, 2);
  ASSERT_EQ(two.size(), 1u);
  EXPECT_EQ(two[0].path, "parallel.layers");
  EXPECT_EQ(two[0].message.rfind("job.yaml:2:12: parallel.layers: pins 3 stages for 2 ranks", 0), 0u)
      << two[0].message;
  EXPECT_EQ(two[0].line, 2);
  const auto three = check_job_for_ranks(job, 3);
  ASSERT_EQ(three.size(), 1u);
  EXPECT_EQ(three[0].path, "cache.memory");
  EXPECT_NE(three[0].message.find("lists 2 sizes for 3 ranks"), std::string::npos);
  EXPECT_EQ(check_job_for_ranks(job, 4).size(), 2u);
}

TEST(LaunchConfigRanks, OverridesAreNamed) {
  const JobConfig job = parse_job_config(kModel, "job.yaml", {"cache.memory=[1GiB, 1GiB]"});
  const auto problems = check_job_for_ranks(job, 1);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].message.rfind("--set cache.memory: lists 2 sizes", 0), 0u) << problems[0].message;
}

TEST(LaunchConfigRanks, ValidationUsesTheClusterRankCount) {
  const std::string yaml = kModel + "cache: {memory: [1GiB, 1GiB]}\ncluster: {nodes: 2, gpus_per_node: 2}\n";
  EXPECT_TRUE(mentions(problems_of(yaml), "cache.memory"));
  EXPECT_TRUE(problems_of(yaml, {"cluster.gpus_per_node=1"}).empty());
  EXPECT_TRUE(problems_of(kModel + "cache: {memory: [1GiB, 1GiB]}\n").empty());  // ranks unknown
  EXPECT_TRUE(mentions(problems_of(kModel + "cache: {memory: [1GiB, 1GiB]}\n", {}, 3), "cache.memory"));
}

TEST(LaunchConfigWorkload, DefaultsMatchTheDocumentedSection) {
  const JobConfig job = parse_job_config(kModel, "job.yaml");
  const WorkloadSection& w = job.workload;
  EXPECT_EQ(w.requests, 64);
  EXPECT_EQ(w.prompt_len.lo, 128);
  EXPECT_EQ(w.prompt_len.hi, 128);
  EXPECT_EQ(w.output_len.lo, 128);
  EXPECT_EQ(w.output_len.hi, 128);
  EXPECT_EQ(w.shared_prefix, 0.0);
  EXPECT_EQ(w.concurrency, 8);
  EXPECT_EQ(w.rate, 0.0);
  EXPECT_EQ(w.warmup, 2);
  EXPECT_EQ(w.seed, 0u);
}

TEST(LaunchConfigWorkload, ExactSectionAndRanges) {
  JobConfig job = parse_job_config(
      kModel + "workload: {requests: 64, prompt_len: 128, output_len: 128, shared_prefix: 0.0, "
               "concurrency: 8, rate: 0, warmup: 2, seed: 0}\n",
      "job.yaml");
  EXPECT_EQ(job.workload.prompt_len.lo, 128);
  job = parse_job_config(kModel + "workload: {requests: 3, prompt_len: [16, 512], output_len: [1, 1], "
                                  "shared_prefix: 0.5, concurrency: 2, rate: 2.5, warmup: 0, seed: 9}\n",
                         "job.yaml");
  EXPECT_EQ(job.workload.requests, 3);
  EXPECT_EQ(job.workload.prompt_len.lo, 16);
  EXPECT_EQ(job.workload.prompt_len.hi, 512);
  EXPECT_EQ(job.workload.output_len.hi, 1);
  EXPECT_DOUBLE_EQ(job.workload.shared_prefix, 0.5);
  EXPECT_DOUBLE_EQ(job.workload.rate, 2.5);
  EXPECT_EQ(job.workload.warmup, 0);
  EXPECT_EQ(job.workload.seed, 9u);
  job = parse_job_config(kModel, "job.yaml", {"workload.prompt_len=[8,9]"});
  EXPECT_EQ(job.workload.prompt_len.hi, 9);
}

TEST(LaunchConfigWorkload, BadValuesEachNamed) {
  const auto problems = problems_of(
      kModel + "workload: {requests: 0, prompt_len: [9, 8], output_len: [1, 2, 3], shared_prefix: 1, "
               "concurrency: 0, rate: -1, warmup: -1, seed: -1, burst: 3}\n");
  for (const std::string path :
       {"workload.requests", "workload.prompt_len", "workload.output_len", "workload.shared_prefix",
        "workload.concurrency", "workload.rate", "workload.warmup", "workload.seed", "workload.burst"}) {
    EXPECT_TRUE(mentions(problems, path)) << path;
  }
  EXPECT_TRUE(mentions(problems_of(kModel + "workload: {prompt_len: [0, 4]}\n"), "workload.prompt_len[0]"));
  EXPECT_TRUE(mentions(problems_of(kModel + "workload: {prompt_len: 1.5}\n"), "workload.prompt_len"));
}

TEST(LaunchConfigCluster, AbsentByDefault) {
  EXPECT_FALSE(parse_job_config(kModel, "job.yaml").cluster.present);
}

TEST(LaunchConfigCluster, EveryKey) {
  const JobConfig job = parse_job_config(
      kModel + "cluster:\n  nodes: 2\n  gpus_per_node: 4\n  gpus: false\n  partition: gpu\n"
               "  account: proj\n  time: 1-02:03:04\n  job_name: big\n  output: logs/%j.out\n"
               "  env: {NCCL_DEBUG: INFO, A_B: \"x y\"}\n  modules: [cuda/12.1, openmpi]\n"
               "  launcher: mpirun\n  kvpipe: /opt/kvpipe/bin/kvpipe\n",
      "job.yaml");
  const ClusterSection& c = job.cluster;
  EXPECT_TRUE(c.present);
  EXPECT_EQ(c.ranks(), 8);
  EXPECT_FALSE(c.gpus);
  EXPECT_EQ(c.partition, "gpu");
  EXPECT_EQ(c.account, "proj");
  EXPECT_EQ(c.time, "1-02:03:04");
  EXPECT_EQ(c.job_name, "big");
  EXPECT_EQ(c.output, "logs/%j.out");
  EXPECT_EQ(c.env.at("NCCL_DEBUG"), "INFO");
  EXPECT_EQ(c.env.at("A_B"), "x y");
  EXPECT_EQ(c.modules, (std::vector<std::string>{"cuda/12.1", "openmpi"}));
  EXPECT_EQ(c.launcher, "mpirun");
  EXPECT_EQ(c.kvpipe, "/opt/kvpipe/bin/kvpipe");
  EXPECT_TRUE(parse_job_config(kModel + "cluster:\n", "job.yaml").cluster.present);
}

TEST(LaunchConfigCluster, BadValuesEachNamed) {
  const auto problems = problems_of(
      kModel + "cluster: {nodes: 0, gpus_per_node: -1, partition: \"a b\", time: \"1:2\", "
               "env: {\"bad-name\": 1, OK: [1]}, modules: [\"\"], launcher: ssh, nodez: 1}\n");
  for (const std::string path : {"cluster.nodes", "cluster.gpus_per_node", "cluster.partition",
                                 "cluster.time", "cluster.env", "cluster.env.OK", "cluster.modules[0]",
                                 "cluster.launcher", "cluster.nodez"}) {
    EXPECT_TRUE(mentions(problems, path)) << path;
  }
}

TEST(LaunchConfigCluster, TimeLimits) {
  for (const std::string ok : {"00:30:00", "4:00:00", "120:00:00", "1-00:00:00", "7-23:59:59"})
    EXPECT_TRUE(is_valid_slurm_time(ok)) << ok;
  for (const std::string bad : {"", "30", "1:2", "00:60:00", "00:00:60", "1-24:00:00", "a:00:00",
                                "1-2", "-01:00:00", "01:00:00:00", "01::00", "01:00:"})
    EXPECT_FALSE(is_valid_slurm_time(bad)) << bad;
}

TEST(LaunchConfigRuntime, MemoryShareAndFlags) {
  JobConfig job = parse_job_config(kModel + "runtime: {memory: 90%, share_gpu: true, pin_threads: true}\n",
                                   "job.yaml");
  ASSERT_TRUE(job.runtime.memory_share.has_value());
  EXPECT_DOUBLE_EQ(*job.runtime.memory_share, 0.9);
  EXPECT_FALSE(job.runtime.memory_bytes.has_value());
  EXPECT_TRUE(job.runtime.share_gpu);
  EXPECT_TRUE(job.runtime.pin_threads);
  job = parse_job_config(kModel + "runtime: {memory: 80GiB}\n", "job.yaml");
  EXPECT_EQ(*job.runtime.memory_bytes, 80LL << 30);
  EXPECT_FALSE(job.runtime.memory_share.has_value());
  job = parse_job_config(kModel, "job.yaml");
  EXPECT_FALSE(job.runtime.share_gpu);
  EXPECT_FALSE(job.runtime.pin_threads);
  EXPECT_TRUE(mentions(problems_of(kModel + "runtime: {memory: 120%}\n"), "runtime.memory"));
  EXPECT_TRUE(mentions(problems_of(kModel + "runtime: {pin_threads: 2}\n"), "runtime.pin_threads"));
}

TEST(LaunchConfigModel, RepackIsOnByDefaultAndABoolean) {
  EXPECT_TRUE(parse_job_config(kModel, "job.yaml").model.repack);
  EXPECT_FALSE(parse_job_config("model: {path: dummy:tiny, repack: false}\n", "job.yaml").model.repack);
  EXPECT_TRUE(mentions(problems_of("model: {path: dummy:tiny, repack: sometimes}\n"), "model.repack"));
}

TEST(LaunchConfigModel, HugePagesAreOnByDefaultAndABoolean) {
  EXPECT_TRUE(parse_job_config(kModel, "job.yaml").model.huge_pages);
  EXPECT_FALSE(parse_job_config("model: {path: dummy:tiny, huge_pages: false}\n", "job.yaml").model.huge_pages);
  EXPECT_TRUE(mentions(problems_of("model: {path: dummy:tiny, huge_pages: 2MiB}\n"), "model.huge_pages"));
}

TEST(LaunchConfigWhere, KeysRememberTheirPosition) {
  const JobConfig job = parse_job_config(kModel + "cache:\n  block_size: 8\n", "job.yaml", {"sampling.seed=3"});
  EXPECT_EQ(job.where.at("cache.block_size"), "job.yaml:3:3");
  EXPECT_EQ(job.where.at("model.path"), "job.yaml:1:9");
  EXPECT_EQ(job.where.at("sampling.seed"), "--set sampling.seed");
}

}  // namespace
}  // namespace kvpipe
