// `kvpipe bench`: the report arithmetic on known inputs (percentiles, per-rank breakdowns,
// the Chrome trace), the workload generator, and whole runs checked for consistency:
// report.json against the workload and against requests.csv, closed- and open-loop
// arrivals, prefix reuse, the operator profile, and bad workloads (exit 2 naming the key).
#include "launch/bench/bench_report.h"
#include "launch/job_config.h"
#include "launch/bench/workload.h"
#include "tests/support/command.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;
using nlohmann::json;

TEST(BenchStats, PercentilesInterpolateLikeNumpy) {
  const std::vector<double> v = {1, 2, 3, 4};
  EXPECT_DOUBLE_EQ(percentile(v, 0.5), 2.5);
  EXPECT_NEAR(percentile(v, 0.9), 3.7, 1e-12);
  EXPECT_NEAR(percentile(v, 0.99), 3.97, 1e-12);
  EXPECT_DOUBLE_EQ(percentile(v, 0.0), 1);
  EXPECT_DOUBLE_EQ(percentile(v, 1.0), 4);
  EXPECT_DOUBLE_EQ(percentile({7}, 0.99), 7);
  EXPECT_DOUBLE_EQ(percentile({}, 0.5), 0);

  std::vector<double> hundred;
  for (int i = 100; i >= 1; --i) hundred.push_back(i);  // unsorted on purpose
  const Distribution d = summarize(hundred);
  EXPECT_EQ(d.count, 100);
  EXPECT_DOUBLE_EQ(d.mean, 50.5);
  EXPECT_DOUBLE_EQ(d.median, 50.5);
  EXPECT_NEAR(d.p90, 90.1, 1e-9);
  EXPECT_NEAR(d.p99, 99.01, 1e-9);
  EXPECT_EQ(d.min, 1);
  EXPECT_EQ(d.max, 100);
  EXPECT_EQ(summarize({}).count, 0);
}

TEST(BenchStats, BreakdownClipsSpansToTheWindowAndSumsToOne) {
  const std::vector<TraceSpan> spans = {
      {SpanKind::kWait, 0, 0, 200},      // half inside [100, 1100)
      {SpanKind::kCompute, 0, 200, 300},  // compute is what is left
      {SpanKind::kRecv, 0, 500, 50},
      {SpanKind::kSend, 1, 550, 50},
      {SpanKind::kIdle, -1, 600, 200},
      {SpanKind::kWait, 2, 1000, 500},   // 100 inside
      {SpanKind::kWait, 3, 2000, 100},   // outside
  };
  const RankBreakdown b = breakdown(spans, 100, 1100);
  EXPECT_NEAR(b.total_s, 1e-3, 1e-12);
  EXPECT_NEAR(b.wait, 0.2, 1e-12);
  EXPECT_NEAR(b.comm, 0.1, 1e-12);
  EXPECT_NEAR(b.idle, 0.2, 1e-12);
  EXPECT_NEAR(b.compute, 0.5, 1e-12);
  EXPECT_NEAR(b.compute + b.comm + b.wait + b.idle, 1.0, 1e-12);
}

TEST(BenchStats, ChromeTraceHasOneNamedTrackPerRank) {
  const std::vector<std::vector<TraceSpan>> ranks = {
      {{SpanKind::kCompute, 0, 10, 5}, {SpanKind::kWait, 0, 15, 5}},
      {{SpanKind::kWait, 0, 0, 15}, {SpanKind::kCompute, 0, 15, 4}, {SpanKind::kSend, 0, 19, 1}},
      {{SpanKind::kRecv, 0, 20, 1}}};
  const auto trace = chrome_trace(ranks, {"layers 0..1", "layers 2..3", "layers 4..5"},
                                  {{0, 10, 25, 3}, {1, 12, 30, 4}}, 5, 40);
  const json doc = json::parse(trace.dump());  // round trip: valid JSON
  std::map<int, std::string> names;
  std::set<int> pids_with_spans;
  int async_begin = 0, async_end = 0, counters = 0;
  for (const json& e : doc.at("traceEvents")) {
    const std::string ph = e.at("ph");
    if (ph == "M" && e.at("name") == "process_name") names[e.at("pid")] = e.at("args").at("name");
    if (ph == "X") {
      pids_with_spans.insert(e.at("pid").get<int>());
      EXPECT_GE(e.at("dur").get<double>(), 0);
    }
    async_begin += ph == "b";
    async_end += ph == "e";
    counters += ph == "C";
  }
  EXPECT_EQ(names, (std::map<int, std::string>{{0, "rank 0"}, {1, "rank 1"}, {2, "rank 2"}}));
  EXPECT_EQ(pids_with_spans, (std::set<int>{0, 1, 2}));
  EXPECT_EQ(async_begin, 2);
  EXPECT_EQ(async_end, 2);
  EXPECT_EQ(counters, 2);
}

WorkloadSection workload(const std::string& yaml) {
  return parse_job_config("model: {path: 'dummy:tiny'}\nworkload: " + yaml + "\n", "test.yaml").workload;
}

TEST(BenchWorkload, LengthsTokensAndSharedPrefix) {
  const WorkloadSection w =
      workload("{requests: 40, prompt_len: [8, 40], output_len: [2, 5], shared_prefix: 0.5, seed: 3}");
  const auto reqs = make_workload(w, 512, 0, 40);
  ASSERT_EQ(reqs.size(), 40u);
  std::set<size_t> prompt_lengths;
  for (const WorkloadRequest& r : reqs) {
    ASSERT_GE(r.prompt.size(), 8u);
    ASSERT_LE(r.prompt.size(), 40u);
    ASSERT_GE(r.output_len, 2);
    ASSERT_LE(r.output_len, 5);
    EXPECT_EQ(r.arrival_s, 0.0);  // closed loop
    for (int64_t t : r.prompt) ASSERT_TRUE(t >= 0 && t < 512);
    prompt_lengths.insert(r.prompt.size());
  }
  EXPECT_GT(prompt_lengths.size(), 10u) << "lengths are not drawn from the range";
  // The first floor(0.5 * len) tokens are common to every request; the rest differ.
  for (const WorkloadRequest& a : reqs) {
    for (const WorkloadRequest& b : reqs) {
      const size_t shared = std::min(a.prompt.size(), b.prompt.size()) / 2;
      for (size_t k = 0; k < shared; ++k) ASSERT_EQ(a.prompt[k], b.prompt[k]) << k;
    }
  }
  EXPECT_NE(std::vector<int64_t>(reqs[0].prompt.end() - 4, reqs[0].prompt.end()),
            std::vector<int64_t>(reqs[1].prompt.end() - 4, reqs[1].prompt.end()));
  // Same seed, same requests; request i does not depend on which others are drawn with it.
  const auto again = make_workload(w, 512, 10, 5);
  for (size_t i = 0; i < again.size(); ++i) {
    EXPECT_EQ(again[i].prompt, reqs[10 + i].prompt);
    EXPECT_EQ(again[i].output_len, reqs[10 + i].output_len);
  }
  WorkloadSection other = w;
  other.seed = 4;
  EXPECT_NE(make_workload(other, 512, 0, 1)[0].prompt, reqs[0].prompt);
}

TEST(BenchWorkload, OpenLoopArrivalsArePoissonAtTheRate) {
  const WorkloadSection w = workload("{requests: 2000, prompt_len: 4, output_len: 1, rate: 50}");
  const auto reqs = make_workload(w, 100, 0, 2000);
  EXPECT_EQ(reqs[0].arrival_s, 0.0);
  double prev = 0;
  for (const WorkloadRequest& r : reqs) {
    ASSERT_GE(r.arrival_s, prev);
    prev = r.arrival_s;
  }
  const double mean_gap = reqs.back().arrival_s / 1999.0;
  EXPECT_NEAR(mean_gap, 1.0 / 50, 0.1 / 50);  // 2000 exponential gaps: ~2% standard error
}

TEST(BenchWorkload, LengthsFromAFileCycle) {
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  std::ofstream(dir / "lens.txt") << "# prompt lengths\n5\n\n9  # long\n7\n";
  const std::string yaml = "model: {path: 'dummy:tiny'}\nworkload: {prompt_len: " + (dir / "lens.txt").string() + "}\n";
  const WorkloadSection w = parse_job_config(yaml, "test.yaml").workload;
  EXPECT_EQ(w.prompt_len.values, (std::vector<int>{5, 9, 7}));
  EXPECT_EQ(w.prompt_len.lo, 5);
  EXPECT_EQ(w.prompt_len.hi, 9);
  const auto reqs = make_workload(w, 100, 0, 7);
  std::vector<size_t> lens;
  for (const auto& r : reqs) lens.push_back(r.prompt.size());
  EXPECT_EQ(lens, (std::vector<size_t>{5, 9, 7, 5, 9, 7, 5}));

  std::ofstream(dir / "bad.txt") << "5\nten\n";
  for (const std::string& file : {(dir / "bad.txt").string(), (dir / "missing.txt").string()}) {
    try {
      parse_job_config("model: {path: 'dummy:tiny'}\nworkload: {output_len: " + file + "}\n", "test.yaml");
      ADD_FAILURE() << file << " was accepted";
    } catch (const JobConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("workload.output_len"), std::string::npos) << e.what();
    }
  }
  fs::remove_all(dir);
}

// Whole runs of `kvpipe bench` on the tiny model made in memory.
class BenchRun : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = kvpipe::testing::make_scratch_dir(); }
  void TearDown() override { fs::remove_all(dir_); }

  CommandResult bench(const std::string& out, const std::string& args) {
    return kvpipe::testing::run_command(std::string(KVPIPE_BINARY) + " bench --config " + KVPIPE_SOURCE_DIR +
                                            "/configs/bench-tiny.yaml --out " + (dir_ / out).string() + " " + args,
                                        dir_);
  }
  json report(const std::string& out) { return json::parse(kvpipe::testing::slurp(dir_ / out / "report.json")); }

  struct Row {
    int64_t id, prompt, output;
    double arrival, ttft, tpot, e2e;
  };
  std::vector<Row> rows(const std::string& out) {
    std::istringstream in(kvpipe::testing::slurp(dir_ / out / "requests.csv"));
    std::string line;
    std::getline(in, line);
    EXPECT_EQ(line,
              "id,arrival_ms,prompt_tokens,output_tokens,ttft_ms,tpot_ms,e2e_ms,itl_max_ms,preemptions,finish_reason,"
              "cached_tokens,conversation,turn");
    std::vector<Row> out_rows;
    while (std::getline(in, line)) {
      Row r{};
      std::replace(line.begin(), line.end(), ',', ' ');
      std::istringstream f(line);
      f >> r.id >> r.arrival >> r.prompt >> r.output >> r.ttft >> r.tpot >> r.e2e;
      out_rows.push_back(r);
    }
    return out_rows;
  }

  fs::path dir_;
};

void expect_ordered(const json& d, const std::string& what) {
  ASSERT_GT(d.at("count").get<int64_t>(), 0) << what;
  const double min = d.at("min"), median = d.at("median"), p90 = d.at("p90"), p99 = d.at("p99"), max = d.at("max"),
               mean = d.at("mean");
  EXPECT_LE(min, median) << what;
  EXPECT_LE(median, p90) << what;
  EXPECT_LE(p90, p99) << what;
  EXPECT_LE(p99, max) << what;
  EXPECT_LE(min, mean) << what;
  EXPECT_LE(mean, max) << what;
  EXPECT_GE(min, 0) << what;
}

TEST_F(BenchRun, ReportHasEveryFieldAndConsistentNumbers) {
  const CommandResult r = bench("a", "--set workload.requests=12 --set workload.prompt_len=[8,40] "
                                     "--set workload.output_len=6 --set workload.concurrency=3 --set workload.warmup=2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("throughput:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("TTFT"), std::string::npos) << r.out;
  const json rep = report("a");
  for (const char* key : {"kvpipe", "machine", "world_size", "backend", "threads_per_rank", "oversubscribed", "config",
                          "workload", "requests", "duration_s", "throughput", "latency_ms", "steps",
                          "decode_weight_bytes", "kv_bytes_per_token", "engine", "ranks", "kv_cache", "files"})
    EXPECT_TRUE(rep.contains(key)) << key;
  for (const char* key : {"version", "git", "build_type", "compiler", "torch", "nccl", "nccl_version", "cpu_blas"})
    EXPECT_TRUE(rep["kvpipe"].contains(key)) << key;
  for (const char* key : {"hostname", "cpu", "cpu_features", "cpu_kernels", "cpu_float_kernels", "cpu_prompt_kernels", "cores", "memory_bytes", "gpus"}) EXPECT_TRUE(rep["machine"].contains(key)) << key;
  EXPECT_EQ(rep["world_size"], 1);
  EXPECT_EQ(rep["workload"]["mode"], "closed");
  EXPECT_EQ(rep["workload"]["prompt_len"], json::array({8, 40}));

  // Token counts match the workload (EOS is ignored) and the per-request CSV.
  const auto rs = rows("a");
  ASSERT_EQ(rs.size(), 12u);
  EXPECT_EQ(rep["requests"]["completed"], 12);
  EXPECT_EQ(rep["requests"]["output_tokens"], 12 * 6);
  int64_t prompt_tokens = 0;
  std::set<int64_t> ids;
  for (const Row& row : rs) {
    prompt_tokens += row.prompt;
    ids.insert(row.id);
    EXPECT_EQ(row.output, 6);
    EXPECT_GE(row.prompt, 8);
    EXPECT_LE(row.prompt, 40);
    EXPECT_LE(row.ttft, row.e2e);
    EXPECT_NEAR(row.e2e, row.ttft + 5 * row.tpot, 0.01);
  }
  EXPECT_EQ(rep["requests"]["prompt_tokens"], prompt_tokens);
  EXPECT_EQ(*ids.begin(), 2) << "warm-up requests (ids 0, 1) are not measured";
  // Closed loop: never more than `concurrency` requests unfinished at once.
  for (const Row& a : rs) {
    int overlapping = 0;
    for (const Row& b : rs) overlapping += b.arrival <= a.arrival && a.arrival < b.arrival + b.e2e;
    EXPECT_LE(overlapping, 3) << "request " << a.id;
  }

  const json& lat = rep["latency_ms"];
  for (const char* key : {"ttft", "tpot", "itl", "e2e", "step", "decode_step"}) expect_ordered(lat[key], key);
  EXPECT_EQ(lat["ttft"]["count"], 12);
  EXPECT_EQ(lat["tpot"]["count"], 12);
  EXPECT_EQ(lat["itl"]["count"], 12 * 5);
  EXPECT_LE(lat["ttft"]["max"].get<double>(), lat["e2e"]["max"].get<double>());
  // Decode steps are a subset of the steps; their tokens plus the prompt tokens computed
  // make up every token computed in the measured phase.
  EXPECT_LE(lat["decode_step"]["count"].get<int64_t>(), lat["step"]["count"].get<int64_t>());
  EXPECT_GE(lat["decode_step_full_batch"]["count"].get<int64_t>(), 1);
  EXPECT_LE(lat["decode_step_full_batch"]["count"].get<int64_t>(), lat["decode_step"]["count"].get<int64_t>());
  EXPECT_GE(rep["steps"]["decode_full_batch"].get<int64_t>(), 1);
  EXPECT_LE(rep["steps"]["decode_full_batch"].get<int64_t>(), 3);
  EXPECT_GT(rep["kv_bytes_per_token"].get<int64_t>(), 0);
  EXPECT_EQ(rep["steps"]["count"], lat["step"]["count"]);
  EXPECT_EQ(rep["steps"]["decode_tokens"], 12 * 5);
  EXPECT_EQ(rep["steps"]["prompt_tokens"].get<int64_t>() + rep["steps"]["decode_tokens"].get<int64_t>(),
            rep["kv_cache"]["computed_tokens"].get<int64_t>());
  // What the measured steps ran on: on the CPU every cached layer of every step on the paged
  // kernels, no graphs; the outputs' digest is there to compare runs.
  const json& eng = rep["engine"];
  EXPECT_EQ(eng["cached_layers"], 4);
  EXPECT_EQ(eng["attention_calls"]["paged"].get<int64_t>(), 4 * rep["steps"]["count"].get<int64_t>());
  EXPECT_EQ(eng["attention_calls"]["per_sequence"], 0);
  EXPECT_EQ(eng["attention_calls"]["varlen"], 0);
  EXPECT_EQ(eng["cuda_graphs"]["enabled"], false);
  EXPECT_EQ(eng["cuda_graphs"]["replayed_steps"], 0);
  EXPECT_EQ(eng["output_digest"].get<std::string>().size(), 16u);

  const double duration = rep["duration_s"];
  EXPECT_GT(duration, 0);
  EXPECT_NEAR(rep["throughput"]["output_tokens_per_s"].get<double>(), 72 / duration, 0.01 * 72 / duration + 0.01);
  EXPECT_NEAR(rep["throughput"]["total_tokens_per_s"].get<double>(), (72 + prompt_tokens) / duration,
              0.01 * (72 + prompt_tokens) / duration + 0.01);
  EXPECT_NEAR(rep["throughput"]["requests_per_s"].get<double>(), 12 / duration, 0.01 * 12 / duration + 0.01);

  ASSERT_EQ(rep["ranks"].size(), 1u);
  const json& rank = rep["ranks"][0];
  EXPECT_NEAR(rank["compute"].get<double>() + rank["comm"].get<double>() + rank["wait"].get<double>() +
                  rank["idle"].get<double>(),
              1.0, 1e-3);
  EXPECT_EQ(rank["num_layers"], 4);

  const json& kv = rep["kv_cache"];
  EXPECT_GT(kv["peak_blocks_used"].get<int64_t>(), 0);
  EXPECT_LE(kv["peak_blocks_used"].get<int64_t>(), kv["num_blocks"].get<int64_t>());
  EXPECT_LE(kv["mean_blocks_used"].get<double>(), kv["peak_blocks_used"].get<double>());
  EXPECT_FALSE(kv["blocks_used"].empty());
  EXPECT_EQ(kv["preemptions"], 0);
  // tiny: 4 layers, hidden 256, vocab 512, ff 688, 8 heads of 32, 4 KV heads.
  const int64_t layer = 256 * 256 + 2 * 256 * 128 + 256 * 256 + 3 * 256 * 688 + 2 * 256;
  EXPECT_EQ(rep["decode_weight_bytes"], 4 * (4 * layer + 256 + 512 * 256));

  const json trace = json::parse(kvpipe::testing::slurp(dir_ / "a" / "trace.json"));
  std::set<int> pids;
  for (const json& e : trace["traceEvents"])
    if (e["ph"] == "X") pids.insert(e["pid"].get<int>());
  EXPECT_EQ(pids, std::set<int>{0});
}

TEST_F(BenchRun, SpeculativeSectionCountsDraftsWithVllmMeanings) {
  const CommandResult off = bench("off", "--set workload.requests=4 --set workload.output_len=24 --set workload.warmup=0 "
                                             "--set workload.concurrency=1");
  ASSERT_EQ(off.code, 0) << off.err;
  EXPECT_EQ(report("off")["speculative"]["drafts"], 0);
  const CommandResult r = bench("spec", "--set workload.requests=4 --set workload.output_len=24 --set workload.warmup=0 "
                                        "--set workload.concurrency=1 "
                                        "--set speculative.method=ngram --set speculative.num_tokens=4");
  ASSERT_EQ(r.code, 0) << r.err;
  const json rep = report("spec");
  const json& s = rep["speculative"];
  EXPECT_EQ(s["method"], "ngram");
  EXPECT_EQ(rep["config"]["speculative"]["num_tokens"], 4);
  EXPECT_EQ(rep["requests"]["output_tokens"], 4 * 24);  // never a token more than asked
  const int64_t drafts = s["drafts"], drafted = s["draft_tokens"], accepted = s["accepted_tokens"];
  EXPECT_GT(drafts, 0);
  EXPECT_LE(drafted, 4 * drafts);
  EXPECT_LE(accepted, drafted);
  EXPECT_NEAR(s["acceptance_rate"].get<double>(), drafted ? double(accepted) / drafted : 0.0, 1e-3);
  EXPECT_NEAR(s["mean_accepted_length"].get<double>(), 1.0 + double(accepted) / drafts, 1e-3);
  const std::vector<double> by_position = s["acceptance_rate_by_position"];
  EXPECT_LE(by_position.size(), 4u);
  for (size_t p = 1; p < by_position.size(); ++p) EXPECT_LE(by_position[p], by_position[p - 1]);
  // One request at a time (greedy, the same workload seed): the outputs of the run without.
  EXPECT_EQ(rep["engine"]["output_digest"], report("off")["engine"]["output_digest"]);
}

TEST_F(BenchRun, OpenLoopPrefixReuseAndProfile) {
  const CommandResult r = bench("b", "--profile --set workload.requests=10 --set workload.rate=400 "
                                     "--set workload.prompt_len=64 --set workload.shared_prefix=0.75 "
                                     "--set workload.output_len=4 --set workload.warmup=0 --log-level error");
  ASSERT_EQ(r.code, 0) << r.err;
  const json rep = report("b");
  EXPECT_EQ(rep["workload"]["mode"], "open");
  EXPECT_EQ(rep["requests"]["completed"], 10);
  // 48 shared tokens are 3 full blocks: every request after the first finds them cached.
  EXPECT_GT(rep["kv_cache"]["prefix_hit_rate"].get<double>(), 0.4);
  EXPECT_GE(rep["kv_cache"]["prefix_hit_tokens"].get<int64_t>(), 9 * 48);
  // Arrivals follow the Poisson schedule, not the engine's pace: the first is due at once,
  // the rest spread over ~10 / 400 s.
  const auto rs = rows("b");
  ASSERT_EQ(rs.size(), 10u);
  double last = 0;
  for (const Row& row : rs) last = std::max(last, row.arrival);
  EXPECT_LT(rs[0].arrival, 1.0);
  EXPECT_GT(last, 1.0);
  EXPECT_EQ(rep["files"]["profile"], "profile_rank0.json");
  const json profile = json::parse(kvpipe::testing::slurp(dir_ / "b" / "profile_rank0.json"));
  EXPECT_FALSE(profile.empty());
  ASSERT_FALSE(rep["profile_top_ops"].empty());
  EXPECT_EQ(rep["profile_top_ops"][0]["name"].get<std::string>().rfind("aten::", 0), 0u);
  EXPECT_NE(r.out.find("top operators"), std::string::npos);
}

TEST_F(BenchRun, BadWorkloadsExitTwoNamingTheKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--set workload.requests=0", "workload.requests"},
      {"--set workload.concurrency=0", "workload.concurrency"},
      {"--set workload.rate=-1", "workload.rate"},
      {"--set workload.shared_prefix=1.0", "workload.shared_prefix"},
      {"--set workload.prompt_len=[9,3]", "workload.prompt_len"},
      {"--set workload.output_len=no-such-file.txt", "workload.output_len"},
      {"--set workload.warmup=-2", "workload.warmup"},
      {"--set workload.seed=x", "workload.seed"},
      {"--set workload.bogus=1", "workload.bogus"},
      // The tiny model's context is 2048 tokens.
      {"--set workload.prompt_len=2000 --set workload.output_len=100", "workload.prompt_len"},
  };
  for (const auto& [args, key] : cases) {
    const CommandResult r = bench("bad", args);
    EXPECT_EQ(r.code, 2) << args << ": " << r.err;
    EXPECT_NE(r.err.find(key), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << ": " << r.err;
    EXPECT_FALSE(fs::exists(dir_ / "bad" / "report.json")) << args;
  }
  const CommandResult missing_out = kvpipe::testing::run_command(
      std::string(KVPIPE_BINARY) + " bench --config " + KVPIPE_SOURCE_DIR + "/configs/bench-tiny.yaml", dir_);
  EXPECT_EQ(missing_out.code, 2);
  EXPECT_NE(missing_out.err.find("--out"), std::string::npos) << missing_out.err;
}

// The sweep tool end to end: a two-point sweep of real `kvpipe bench` runs, collected into
// one CSV, with its plot.
TEST(BenchSweep, TwoPointSweepEndToEnd) {
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  const std::string src = KVPIPE_SOURCE_DIR;
  const CommandResult r = kvpipe::testing::run_command(
      "python3 " + src + "/benchmarks/sweep run " + src + "/benchmarks/sweeps/ci.toml --out " + (dir / "sweep").string() +
          " --kvpipe " + KVPIPE_BINARY,
      dir);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  std::istringstream csv(kvpipe::testing::slurp(dir / "sweep" / "sweep.csv"));
  std::vector<std::string> lines;
  for (std::string line; std::getline(csv, line);)
    if (!line.empty()) lines.push_back(line);
  ASSERT_EQ(lines.size(), 3u) << "a header and two points";
  EXPECT_NE(lines[0].find("output_tokens_per_s"), std::string::npos) << lines[0];
  size_t pngs = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir / "sweep"))
    pngs += e.path().extension() == ".png" && fs::file_size(e.path()) > 0;
  EXPECT_GE(pngs, 1u) << "no plot drawn";
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvpipe
