// `kvpipe bench` under mpirun: rank 0 alone writes the outputs, the trace has one track per
// rank, each rank's time fractions sum to one, the token counts equal the one-rank run's,
// and a workload that cannot run stops every rank with exit 2.
#include "tests/support/command.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <set>
#include <string>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;
using nlohmann::json;

std::string mpirun(int ranks) { return std::string(KVPIPE_MPIRUN) + " --oversubscribe -np " + std::to_string(ranks) + " "; }

std::string bench_args(const fs::path& out) {
  return std::string(KVPIPE_BINARY) + " bench --config " + KVPIPE_SOURCE_DIR + "/configs/bench-tiny.yaml --out " +
         out.string() + " --set workload.requests=10 --set workload.output_len=8 --set workload.concurrency=4";
}

TEST(BenchMpi, ThreeRanksTraceBreakdownAndCountsMatchOneRank) {
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  const CommandResult one = kvpipe::testing::run_command(bench_args(dir / "one"), dir);
  ASSERT_EQ(one.code, 0) << one.err;
  const CommandResult three = kvpipe::testing::run_command(mpirun(3) + bench_args(dir / "three"), dir);
  ASSERT_EQ(three.code, 0) << three.err;
  EXPECT_EQ(three.out.find("[rank 1]"), std::string::npos) << "only rank 0 prints the summary";
  EXPECT_NE(three.out.find("3 rank(s) (mpi"), std::string::npos) << three.out;

  const json a = json::parse(kvpipe::testing::slurp(dir / "one" / "report.json"));
  const json b = json::parse(kvpipe::testing::slurp(dir / "three" / "report.json"));
  EXPECT_EQ(b["world_size"], 3);
  EXPECT_EQ(b["backend"], "mpi");
  EXPECT_EQ(b["config"]["parallel"]["micro_batches"], 3);
  EXPECT_EQ(a["requests"], b["requests"]) << "same workload, same token counts";
  EXPECT_EQ(a["decode_weight_bytes"], b["decode_weight_bytes"]);
  ASSERT_EQ(b["ranks"].size(), 3u);
  int64_t layers = 0;
  for (const json& r : b["ranks"]) {
    const double sum = r["compute"].get<double>() + r["comm"].get<double>() + r["wait"].get<double>() +
                       r["idle"].get<double>();
    EXPECT_NEAR(sum, 1.0, 1e-3) << r.dump();
    EXPECT_GT(r["compute"].get<double>(), 0.0) << r.dump();
    layers += r["num_layers"].get<int64_t>();
  }
  EXPECT_EQ(layers, 4);
  // Stages past the first wait for their input at some point in a pipelined run.
  EXPECT_GT(b["ranks"][2]["wait"].get<double>(), 0.0);

  const json trace = json::parse(kvpipe::testing::slurp(dir / "three" / "trace.json"));
  std::map<int, std::set<std::string>> kinds;
  std::map<int, std::string> names;
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] == "X") kinds[e["pid"].get<int>()].insert(e["name"].get<std::string>());
    if (e["ph"] == "M" && e["name"] == "process_name") names[e["pid"].get<int>()] = e["args"]["name"];
  }
  EXPECT_EQ(names, (std::map<int, std::string>{{0, "rank 0"}, {1, "rank 1"}, {2, "rank 2"}}));
  ASSERT_EQ(kinds.size(), 3u);
  for (auto& [pid, k] : kinds) {
    for (const char* kind : {"compute", "send", "receive", "wait"})
      EXPECT_TRUE(k.count(kind)) << "rank " << pid << " has no " << kind << " span";
  }
  fs::remove_all(dir);
}

TEST(BenchMpi, AWorkloadBeyondTheContextStopsEveryRankWithExitTwo) {
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  const CommandResult r = kvpipe::testing::run_command(
      mpirun(2) + bench_args(dir / "bad") + " --set workload.prompt_len=2040 --set workload.output_len=16", dir);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("workload.prompt_len"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 60);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvpipe
