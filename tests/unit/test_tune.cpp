// `kvpipe tune`: the search space for a job, the search on synthetic figures (the SLO is never
// broken by the winner, the budget is never overrun, a scale is walked until it stops helping,
// close candidates are rerun), the lossy cost's arithmetic, the reports, and whole tunes of the
// tiny model (within the budget, tuned.yaml valid and equal to the winner's configuration,
// no lossy strategy unless allowed, bad options exit 2).
#include "launch/job_config.h"
#include "launch/job_plan.h"
#include "launch/tune/candidate_runner.h"
#include "launch/tune/lossy_cost.h"
#include "launch/tune/tune_report.h"
#include "launch/tune/tune_search.h"
#include "launch/tune/tune_space.h"
#include "tests/support/command.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;

const char* const kTinyJob = R"(model:     {path: "dummy:tiny", dtype: float32}
runtime:   {threads: 1}
cache:     {block_size: 16, memory: 32MiB, prefix_reuse: true}
scheduler: {max_batch: 8, max_tokens_per_step: 512}
sampling:  {temperature: 0.0, seed: 0}
workload:  {requests: 8, prompt_len: [16, 48], output_len: 8, concurrency: 4, warmup: 1, seed: 0}
)";

ModelConfig four_layers() {
  ModelConfig m;
  m.num_layers = 4;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  return m;
}

const TuneKnob* knob(const std::vector<TuneKnob>& knobs, const std::string& key) {
  for (const TuneKnob& k : knobs)
    if (k.key == key) return &k;
  return nullptr;
}

std::vector<std::string> yamls(const TuneKnob& k) {
  std::vector<std::string> out;
  for (const TuneValue& v : k.values) out.push_back(v.yaml);
  return out;
}

TEST(TuneSpace, KnobsForOneRankWithoutLossyStrategies) {
  const JobConfig job = parse_job_config(kTinyJob, "job.yaml");
  TuneSpaceInputs in;
  in.job = &job;
  in.model = four_layers();
  in.longest_request = 4096;
  const std::vector<TuneKnob> knobs = tune_space(in);
  ASSERT_FALSE(knobs.empty());
  EXPECT_EQ(knobs.front().key, "cache.prefix_reuse") << "token-level reuse is visited first";
  for (const TuneKnob& k : knobs) {
    EXPECT_EQ(k.values[k.current].yaml, job_value_yaml(job, k.key)) << k.key << ": the job's own value is current";
    for (const TuneValue& v : k.values) EXPECT_FALSE(v.lossy) << k.key << "=" << v.yaml;
    EXPECT_NE(k.key, "cache.dtype");
    EXPECT_NE(k.key, "cache.window");
    EXPECT_EQ(k.key.rfind("parallel.", 0), std::string::npos) << "one rank has no split to tune";
  }
  const TuneKnob* batch = knob(knobs, "scheduler.max_batch");
  ASSERT_NE(batch, nullptr);
  EXPECT_TRUE(batch->ordered);
  // Four requests in flight: the ladder stops at 4 (which runs as the job's own 8 does: the
  // search measures one of the two, run_fingerprint).
  EXPECT_EQ(yamls(*batch), (std::vector<std::string>{"1", "2", "4", "8"}));
  EXPECT_EQ(batch->values[batch->current].yaml, "8");
  const JobConfig small = parse_job_config(kTinyJob, "job.yaml", {"scheduler.max_batch=2"});
  in.job = &small;
  const std::vector<TuneKnob> small_knobs = tune_space(in);
  const TuneKnob* up = knob(small_knobs, "scheduler.max_batch");
  ASSERT_NE(up, nullptr);
  EXPECT_EQ(yamls(*up), (std::vector<std::string>{"1", "2", "4"})) << "up to the requests in flight";
  const TuneKnob* cached = knob(knobs, "cache.cached_layers");
  ASSERT_NE(cached, nullptr);
  EXPECT_EQ(yamls(*cached), (std::vector<std::string>{"all", "2", "1"}));
  const TuneKnob* draft_tokens = knob(knobs, "speculative.num_tokens");
  ASSERT_NE(draft_tokens, nullptr);
  EXPECT_EQ(draft_tokens->unless_key, "speculative.method");
  EXPECT_EQ(draft_tokens->unless_job, "off") << "the job's own method, for --keys speculative.num_tokens alone";
}

// Configurations that run alike share a fingerprint; any change in how they run does not.
TEST(TuneSpace, RunFingerprintResolvesAutoAndNoOpValues) {
  auto print = [](const std::vector<std::string>& sets, int ranks) {
    const JobConfig job = parse_job_config(kTinyJob, "job.yaml", sets);
    return run_fingerprint(job, plan_job(job, ranks));
  };
  const std::string job = print({}, 1);
  // Four requests in flight: any limit of 4 or more seats them all.
  EXPECT_EQ(print({"scheduler.max_batch=4"}, 1), job);
  EXPECT_NE(print({"scheduler.max_batch=2"}, 1), job);
  // A prefill limit at or above the step's own limit (512) limits nothing.
  EXPECT_EQ(print({"scheduler.max_prefill_tokens_per_step=512"}, 1), job);
  EXPECT_NE(print({"scheduler.max_prefill_tokens_per_step=64"}, 1), job);
  // Draft settings while speculative decoding is off; `auto` is the compute dtype.
  EXPECT_EQ(print({"speculative.num_tokens=8"}, 1), job);
  EXPECT_NE(print({"speculative.method=ngram"}, 1), job);
  EXPECT_NE(print({"speculative.method=ngram", "speculative.num_tokens=8"}, 1), print({"speculative.method=ngram"}, 1));
  EXPECT_EQ(print({"cache.dtype=float32"}, 1), job);
  EXPECT_NE(print({"cache.dtype=q8_0"}, 1), job);
  EXPECT_NE(print({"cache.block_size=32"}, 1), job);
  EXPECT_NE(print({"cache.prefix_reuse=false"}, 1), job);
  EXPECT_EQ(print({"cache.cached_layers=4"}, 1), job) << "dummy:tiny has 4 layers: all of them";
  EXPECT_NE(print({"cache.cached_layers=2"}, 1), job);
  EXPECT_NE(print({"cache.window={sinks: 4, recent: 16}"}, 1), job);
  // Two ranks: auto is the even split and as many micro-batches as stages.
  const std::string two = print({}, 2);
  EXPECT_EQ(print({"parallel.layers=[2, 2]"}, 2), two);
  EXPECT_NE(print({"parallel.layers=[1, 3]"}, 2), two);
  EXPECT_EQ(print({"parallel.micro_batches=2"}, 2), two);
  EXPECT_NE(print({"parallel.micro_batches=1"}, 2), two);
  EXPECT_NE(print({"parallel.tensor=2"}, 2), two);
  EXPECT_EQ(print({"parallel.micro_batches=2"}, 1), job) << "one stage has one micro-batch";
}

TEST(TuneSpace, LossyStrategiesOnlyWhenAllowedAndMarked) {
  const JobConfig job = parse_job_config(kTinyJob, "job.yaml");
  TuneSpaceInputs in;
  in.job = &job;
  in.model = four_layers();
  in.allow_lossy = true;
  in.longest_request = 600;
  const std::vector<TuneKnob> knobs = tune_space(in);
  const TuneKnob* dtype = knob(knobs, "cache.dtype");
  ASSERT_NE(dtype, nullptr);
  // On the CPU the compute dtype is float32: auto is float32, the 16-bit and 8-bit caches lose.
  std::map<std::string, bool> lossy;
  for (const TuneValue& v : dtype->values) lossy[v.yaml] = v.lossy;
  EXPECT_EQ(lossy.count("float32"), 0u) << "auto and float32 are one candidate here";
  EXPECT_FALSE(lossy.at("auto"));
  EXPECT_TRUE(lossy.at("float16"));
  EXPECT_TRUE(lossy.at("bfloat16"));
  EXPECT_TRUE(lossy.at("q8_0"));
  const TuneKnob* window = knob(knobs, "cache.window");
  ASSERT_NE(window, nullptr);
  // Only windows shorter than the longest request: 256 drops tokens of a 600-token request, 1024 none.
  EXPECT_EQ(yamls(*window), (std::vector<std::string>{"{sinks: 0, recent: 0}", "{sinks: 4, recent: 256}"}));
  EXPECT_TRUE(window->values[1].lossy);
}

TEST(TuneSpace, TwoRanksAddTheSplitMicroBatchesAndTensorParallelism) {
  const JobConfig job = parse_job_config(std::string(kTinyJob) + "parallel: {layers: auto}\n", "job.yaml");
  TuneSpaceInputs in;
  in.job = &job;
  in.model = four_layers();
  in.ranks = 2;
  in.longest_request = 4096;
  const std::vector<TuneKnob> knobs = tune_space(in);
  const TuneKnob* layers = knob(knobs, "parallel.layers");
  ASSERT_NE(layers, nullptr);
  EXPECT_EQ(yamls(*layers), (std::vector<std::string>{"auto", "[2, 2]", "[1, 3]", "[3, 1]"}));
  ASSERT_NE(knob(knobs, "parallel.micro_batches"), nullptr);
  const TuneKnob* tensor = knob(knobs, "parallel.tensor");
  ASSERT_NE(tensor, nullptr);
  EXPECT_EQ(yamls(*tensor), (std::vector<std::string>{"1", "2"}));
  // Another tensor count changes the stages: its candidates split the layers automatically.
  EXPECT_EQ(tensor->reset_key, "parallel.layers");
  EXPECT_EQ(tensor->reset_value, "auto");
  EXPECT_EQ(tensor->reset_job, "auto");
  const JobConfig pinned = parse_job_config(std::string(kTinyJob) + "parallel: {layers: [1, 3]}\n", "job.yaml");
  in.job = &pinned;
  EXPECT_EQ(knob(tune_space(in), "parallel.tensor")->reset_job, "[1, 3]");
}

TEST(TuneOptions, ObjectiveAndSloParseOrNameTheBadItem) {
  EXPECT_EQ(parse_tune_objective("ttft"), TuneObjective::kTtft);
  EXPECT_EQ(parse_tune_objective("throughput"), TuneObjective::kThroughput);
  EXPECT_THROW(parse_tune_objective("latency"), std::invalid_argument);
  const TuneSlo slo = parse_tune_slo("ttft_p99=500,tpot_p99=50.5");
  EXPECT_EQ(slo.ttft_p99_ms, 500);
  EXPECT_EQ(slo.tpot_p99_ms, 50.5);
  EXPECT_EQ(slo.e2e_p99_ms, 0);
  EXPECT_EQ(slo_text(slo), "ttft_p99=500,tpot_p99=50.5");
  for (const char* bad : {"", "ttft=5", "ttft_p99=", "ttft_p99=-1", "ttft_p99=5ms", "ttft_p99=1,ttft_p99=2", "tpot_p99=nan"}) {
    try {
      parse_tune_slo(bad);
      ADD_FAILURE() << "accepted --slo '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--slo"), std::string::npos) << e.what();
    }
  }
  TuneFigures f;
  f.ttft_p99_ms = 600;
  f.tpot_p99_ms = 40;
  EXPECT_NE(slo_breach(f, slo).find("TTFT"), std::string::npos);
  f.ttft_p99_ms = 500;
  EXPECT_EQ(slo_breach(f, slo), "") << "a figure at its limit meets it";
}

// A synthetic machine: every candidate's figures a function of its settings, each run taking
// `run_s` seconds of a simulated clock.
struct Landscape {
  std::vector<TuneKnob> knobs;
  double clock = 0.0;
  double run_s = 10.0;
  std::map<std::string, int> runs_of;  // by label
  std::map<std::string, double> wall_of;  // a run's time by label, when not run_s
  std::function<double(const TuneCandidate&, int)> jitter = [](const TuneCandidate&, int) { return 0.0; };

  Landscape() {
    TuneKnob batch;
    batch.key = "scheduler.max_batch";
    batch.ordered = true;
    batch.values = {{"1", false}, {"2", false}, {"4", false}, {"8", false}};
    batch.current = 3;
    TuneKnob reuse;
    reuse.key = "cache.prefix_reuse";
    reuse.values = {{"true", false}, {"false", false}};
    TuneKnob block;
    block.key = "cache.block_size";
    block.ordered = true;
    block.values = {{"8", false}, {"16", false}, {"32", false}, {"64", false}};
    block.current = 1;
    knobs = {batch, reuse, block};
  }

  static std::string value(const TuneCandidate& c, const std::string& key, const std::string& fallback) {
    for (const auto& [k, v] : c.settings)
      if (k == key) return v;
    return fallback;
  }

  // mean E2E: best at batch 4 (which breaks a 55 ms TPOT limit), then 2; reuse off costs 20;
  // block 32 saves 3. TPOT grows with the batch.
  TuneFigures figures(const TuneCandidate& c) {
    const std::map<std::string, double> e2e{{"1", 130}, {"2", 90}, {"4", 80}, {"8", 100}};
    const std::map<std::string, double> tpot{{"1", 20}, {"2", 40}, {"4", 60}, {"8", 80}};
    const std::map<std::string, double> block{{"8", 5}, {"16", 0}, {"32", -3}, {"64", 10}};
    const std::string b = value(c, "scheduler.max_batch", "8");
    TuneFigures f;
    f.e2e_mean_ms = e2e.at(b) + (value(c, "cache.prefix_reuse", "true") == "false" ? 20 : 0) +
                    block.at(value(c, "cache.block_size", "16"));
    f.tpot_p99_ms = tpot.at(b);
    f.ttft_p99_ms = 10;
    f.output_tokens_per_s = 1000.0 / f.e2e_mean_ms;
    f.kv_peak_mib = std::stod(b);
    f.wall_s = run_s;
    return f;
  }

  TuneSearchHooks hooks() {
    TuneSearchHooks h;
    h.elapsed_s = [this] { return clock; };
    h.run = [this](const TuneCandidate& c, double deadline_s) {
      TuneRunResult r;
      const double wall = wall_of.count(c.label()) ? wall_of.at(c.label()) : c.phase == "full" ? run_s * 4 : run_s;
      if (clock + wall > deadline_s) {
        clock = deadline_s;
        r.timed_out = true;
        r.error = "past its deadline";
        return r;
      }
      clock += wall;
      r.ok = true;
      r.figures = figures(c);
      r.figures.e2e_mean_ms += jitter(c, runs_of[c.label() + c.phase]++);
      r.figures.wall_s = wall;
      r.dir = "runs/x";
      return r;
    };
    return h;
  }
};

TEST(TuneSearch, WinnerNeverBreaksTheSloAndTheScaleIsWalkedUntilItStopsHelping) {
  Landscape land;
  TuneSearchOptions o;
  o.slo.tpot_p99_ms = 55;
  o.budget_s = 10000;
  const TuneOutcome out = tune_search(land.knobs, o, land.hooks());
  ASSERT_GE(out.winner, 0);
  const TuneCandidate& w = out.candidates[static_cast<size_t>(out.winner)];
  EXPECT_EQ(w.label(), "scheduler.max_batch=2, cache.block_size=32");
  EXPECT_TRUE(slo_breach(w.median(), o.slo).empty());
  EXPECT_EQ(out.end_reason, "searched every knob");
  // The best mean E2E seen (batch 4, 80 ms) breaks the TPOT limit and is not reported.
  double best_seen = 1e9;
  for (const TuneCandidate& c : out.candidates)
    if (c.measured()) best_seen = std::min(best_seen, c.median().e2e_mean_ms);
  EXPECT_EQ(best_seen, 80);
  // Down from 8: 4 (better, both over the limit), 2 (meets it), 1 (worse: the walk stops);
  // block sizes: up from 16, 32 helps, 64 does not, so 8 is never tried.
  std::vector<std::string> labels;
  for (const TuneCandidate& c : out.candidates) labels.push_back(c.label());
  for (const char* tried : {"scheduler.max_batch=4", "scheduler.max_batch=2", "scheduler.max_batch=1",
                            "scheduler.max_batch=2, cache.block_size=64"})
    EXPECT_NE(std::find(labels.begin(), labels.end(), tried), labels.end()) << tried;
  EXPECT_EQ(std::find(labels.begin(), labels.end(), "scheduler.max_batch=2, cache.block_size=8"), labels.end());
  // Screening is the whole workload here: the final comparison reuses those runs.
  EXPECT_EQ(out.final_winner, out.winner);
  EXPECT_NEAR(out.gain, (100.0 - 87.0) / 100.0, 1e-12);
  EXPECT_EQ(out.gain_pairs, 3);
}

// A value that runs as the best so far is not measured, and the walk goes on past it.
TEST(TuneSearch, ConfigurationsThatRunAlikeAreMeasuredOnce) {
  Landscape land;
  // A limit of 4 seats as many as 8: one configuration (give both the figures of 8).
  auto alike = [](TuneSettings settings) {
    for (auto& kv : settings)
      if (kv.first == "scheduler.max_batch" && kv.second == "4") kv.second = "8";
    settings.erase(std::remove(settings.begin(), settings.end(), std::make_pair(std::string("scheduler.max_batch"),
                                                                                std::string("8"))),
                   settings.end());
    TuneCandidate c;
    c.settings = settings;
    return c.label();
  };
  TuneSearchOptions o;
  o.budget_s = 10000;
  TuneSearchHooks h = land.hooks();
  h.check = [&](const TuneSettings& settings) {
    TuneCheck check;
    check.fingerprint = alike(settings);
    return check;
  };
  const TuneOutcome out = tune_search(land.knobs, o, h);
  const TuneCandidate* four = nullptr;
  for (const TuneCandidate& c : out.candidates)
    if (c.label() == "scheduler.max_batch=4") four = &c;
  ASSERT_NE(four, nullptr) << "the value is considered";
  EXPECT_FALSE(four->measured());
  EXPECT_EQ(four->status.rfind("same as #0: runs alike (job as given)", 0), 0u) << four->status;
  EXPECT_EQ(land.runs_of.count("scheduler.max_batch=4screen"), 0u);
  // The walk down went on past it to 2 (90 ms), which wins: 1 is worse.
  ASSERT_GE(out.winner, 0);
  EXPECT_EQ(out.candidates[static_cast<size_t>(out.winner)].label(), "scheduler.max_batch=2, cache.block_size=32");
  int ones = 0;
  for (const TuneCandidate& c : out.candidates) ones += c.label() == "scheduler.max_batch=1";
  EXPECT_EQ(ones, 1);
}

// A check that finds a candidate invalid keeps it from running, and the search goes on.
TEST(TuneSearch, InvalidCandidatesAreListedNotRun) {
  Landscape land;
  TuneSearchOptions o;
  o.budget_s = 10000;
  TuneSearchHooks h = land.hooks();
  h.check = [](const TuneSettings& settings) {
    TuneCheck check;
    for (const auto& kv : settings)
      if (kv.first == "cache.prefix_reuse") check.problem = "job.yaml: cache.prefix_reuse: not here";
    TuneCandidate c;
    c.settings = settings;
    check.fingerprint = c.label();
    return check;
  };
  const TuneOutcome out = tune_search(land.knobs, o, h);
  bool listed = false;
  for (const TuneCandidate& c : out.candidates)
    if (c.label().find("cache.prefix_reuse=false") != std::string::npos) {
      listed = true;
      EXPECT_FALSE(c.measured());
      EXPECT_EQ(c.status, "invalid: job.yaml: cache.prefix_reuse: not here");
    }
  EXPECT_TRUE(listed);
  EXPECT_EQ(out.end_reason, "searched every knob");
}

// A job with a pinned split: the search tries the other tensor count with the layers split
// automatically (a pinned split is for the job's stage count, invalid for another), even after
// a pinned split won on its own.
TEST(TuneSearch, AnotherTensorCountIsTriedWithTheLayersSplitAutomatically) {
  Landscape land;
  TuneKnob layers;
  layers.key = "parallel.layers";
  layers.values = {{"auto", false}, {"[2, 2]", false}, {"[1, 3]", false}};
  layers.current = 1;
  TuneKnob tensor;
  tensor.key = "parallel.tensor";
  tensor.values = {{"1", false}, {"2", false}};
  tensor.reset_key = "parallel.layers";
  tensor.reset_value = "auto";
  tensor.reset_job = "[2, 2]";
  land.knobs = {layers, tensor};
  // [1, 3] is the best split on one tensor rank (a smaller batch stands in for it).
  TuneSearchHooks h = land.hooks();
  const auto run = h.run;
  h.run = [run](const TuneCandidate& c, double deadline_s) {
    TuneRunResult r = run(c, deadline_s);
    if (Landscape::value(c, "parallel.layers", "[2, 2]") == "[1, 3]") r.figures.e2e_mean_ms -= 10;
    return r;
  };
  h.check = [](const TuneSettings& settings) {
    TuneCheck check;
    std::string layers_value = "[2, 2]", tensor_value = "1";
    for (const auto& kv : settings) {
      if (kv.first == "parallel.layers") layers_value = kv.second;
      if (kv.first == "parallel.tensor") tensor_value = kv.second;
    }
    if (tensor_value == "2" && layers_value != "auto")
      check.problem = "job.yaml: parallel.layers: a pinned split for 2 stages on 1 stage";
    TuneCandidate c;
    c.settings = settings;
    check.fingerprint = c.label();
    return check;
  };
  TuneSearchOptions o;
  o.budget_s = 10000;
  const TuneOutcome out = tune_search(land.knobs, o, h);
  bool tried = false;
  for (const TuneCandidate& c : out.candidates) {
    if (c.label().find("parallel.tensor=2") == std::string::npos) continue;
    EXPECT_EQ(Landscape::value(c, "parallel.layers", "[2, 2]"), "auto") << c.label();
    EXPECT_TRUE(c.status.rfind("invalid", 0) != 0) << c.label() << ": " << c.status;
    tried = tried || c.measured();
  }
  EXPECT_TRUE(tried) << "no candidate with two tensor ranks was run";
}

TEST(TuneSearch, NoCandidateMeetingTheSloMeansNoWinner) {
  Landscape land;
  TuneSearchOptions o;
  o.slo.tpot_p99_ms = 5;  // no batch size gets there
  const TuneOutcome out = tune_search(land.knobs, o, land.hooks());
  EXPECT_EQ(out.winner, -1);
  TuneReportInputs in;
  in.config = "job.yaml";
  in.search = o;
  EXPECT_EQ(tuned_yaml(out, in), "");
  EXPECT_NE(tune_report_markdown(out, in).find("No configuration met the SLO"), std::string::npos);
}

TEST(TuneSearch, TheBudgetIsNeverOverrunAndWhatWasLeftIsNamed) {
  for (double budget : {25.0, 75.0}) {
    Landscape land;
    TuneSearchOptions o;
    o.budget_s = budget;
    o.full_over_screen = 2.0;  // full runs take 4 x here (the hook's), more than tune estimates
    const TuneOutcome out = tune_search(land.knobs, o, land.hooks());
    EXPECT_LE(land.clock, budget) << "budget " << budget;
    EXPECT_FALSE(out.knobs_left.empty()) << "budget " << budget;
    EXPECT_NE(out.end_reason, "searched every knob") << "budget " << budget;
  }
  // Enough for every knob, not for the full runs (longer than estimated): the deadline stops
  // the comparison, and the screening winner stands without a gain.
  Landscape land;
  TuneSearchOptions o;
  o.budget_s = 135;
  o.full_over_screen = 2.0;
  const TuneOutcome out = tune_search(land.knobs, o, land.hooks());
  EXPECT_LE(land.clock, 135);
  EXPECT_TRUE(out.knobs_left.empty());
  ASSERT_GE(out.winner, 0);
  EXPECT_EQ(out.candidates[static_cast<size_t>(out.winner)].label(), "scheduler.max_batch=4, cache.block_size=32");
  EXPECT_FALSE(out.winner_is_job);
  EXPECT_EQ(out.gain_pairs, 0);
  EXPECT_NE(out.end_reason.find("cut short"), std::string::npos) << out.end_reason;
}

TEST(TuneSearch, AScreeningRunFarSlowerThanTheJobsIsStoppedAndTheSearchGoesOn) {
  Landscape land;
  land.wall_of["scheduler.max_batch=1"] = 1000;  // e.g. most layers recomputed at every step
  TuneSearchOptions o;
  o.budget_s = 10000;
  o.slo.tpot_p99_ms = 55;  // so that the walk down the batch sizes reaches 1
  const TuneOutcome out = tune_search(land.knobs, o, land.hooks());
  bool cut = false;
  for (const TuneCandidate& c : out.candidates)
    if (c.label() == "scheduler.max_batch=1") {
      cut = true;
      EXPECT_FALSE(c.measured());
      EXPECT_EQ(c.status.rfind("too slow", 0), 0u) << c.status;
    }
  EXPECT_TRUE(cut);
  EXPECT_EQ(out.end_reason, "searched every knob");
  // 2 job runs, batch 4, 2, 1 (stopped at 3 x 10 s), reuse off, block 32 and 64, 3 pairs.
  EXPECT_LT(land.clock, 200);
}

TEST(TuneSearch, CandidatesWithinNoiseAreRerunAndComparedByMedians) {
  Landscape land;
  // Every run of the job is 100 +- 6 ms; max_batch=4 measures 94, 106, 98: within noise of the
  // job at first, so both get their three runs; its median (98) then beats the job's (100).
  land.jitter = [](const TuneCandidate& c, int run) {
    if (c.settings.empty()) return std::vector<double>{-6, 6, 0, 0, 0}[static_cast<size_t>(run)];
    if (c.label() == "scheduler.max_batch=4") return std::vector<double>{14, 26, 18}[static_cast<size_t>(run)];
    return 0.0;
  };
  TuneSearchOptions o;
  o.budget_s = 100000;
  o.final_pairs = 0;
  const TuneOutcome out = tune_search(land.knobs, o, land.hooks());
  EXPECT_NEAR(out.noise, 0.12, 1e-9);
  for (const TuneCandidate& c : out.candidates) {
    EXPECT_LE(c.runs.size(), 3u) << c.label();
    if (c.label() == "scheduler.max_batch=4") {
      EXPECT_EQ(c.runs.size(), 3u);
    }
  }
  EXPECT_EQ(out.candidates[0].runs.size(), 3u);
}

TEST(TuneSearch, FullRunsOfTheJobAndTheWinnerAlternateForTheGain) {
  Landscape land;
  TuneSearchOptions o;
  o.budget_s = 100000;
  o.full_over_screen = 4.0;
  const TuneOutcome out = tune_search(land.knobs, o, land.hooks());
  ASSERT_GE(out.final_winner, 0);
  const TuneCandidate& b = out.candidates[static_cast<size_t>(out.final_baseline)];
  const TuneCandidate& w = out.candidates[static_cast<size_t>(out.final_winner)];
  EXPECT_EQ(b.phase, "full");
  EXPECT_EQ(w.phase, "full");
  EXPECT_TRUE(b.settings.empty());
  EXPECT_EQ(w.settings, out.candidates[static_cast<size_t>(out.winner)].settings);
  EXPECT_EQ(b.runs.size(), 3u);
  EXPECT_EQ(w.runs.size(), 3u);
  EXPECT_NEAR(out.gain, (100.0 - 77.0) / 100.0, 1e-12) << "batch 4 and block 32 without an SLO";
}

// A screening winner that does worse than the job on the whole workload is not reported:
// the job as given stands, with the measured loss.
TEST(TuneSearch, AWinnerThatLosesOnTheWholeWorkloadLeavesTheJobAsGiven) {
  Landscape land;
  land.jitter = [](const TuneCandidate& c, int) { return c.phase == "full" && !c.settings.empty() ? 30.0 : 0.0; };
  TuneSearchOptions o;
  o.budget_s = 100000;
  o.full_over_screen = 4.0;
  const TuneOutcome out = tune_search(land.knobs, o, land.hooks());
  ASSERT_GE(out.rejected_winner, 0);
  EXPECT_EQ(out.candidates[static_cast<size_t>(out.rejected_winner)].label(),
            "scheduler.max_batch=4, cache.block_size=32");
  EXPECT_EQ(out.winner, out.baseline);
  EXPECT_TRUE(out.winner_is_job);
  EXPECT_EQ(out.gain_pairs, 3);
  EXPECT_NEAR(out.gain, (100.0 - 107.0) / 100.0, 1e-12);
  TuneReportInputs in;
  in.config = "job.yaml";
  in.search = o;
  const std::string md = tune_report_markdown(out, in);
  EXPECT_NE(md.find("**Nothing beat the job as given** on the whole workload: the screening winner, "
                    "scheduler.max_batch=4, cache.block_size=32, gained -7.0%"),
            std::string::npos)
      << md;
  // Its full runs are listed, not marked as the winner.
  EXPECT_EQ(md.find("| **scheduler.max_batch=4, cache.block_size=32** |"), std::string::npos) << md;
}

std::vector<std::pair<int64_t, std::vector<ProbeToken>>> generation(std::vector<std::vector<double>> probs,
                                                                    std::vector<int64_t> tokens) {
  std::vector<ProbeToken> out;
  for (size_t i = 0; i < tokens.size(); ++i) {
    ProbeToken t;
    t.token = tokens[i];
    for (double p : probs[i]) t.logprobs.push_back(std::log(p));
    out.push_back(t);
  }
  return {{0, out}};
}

TEST(TuneLossyCost, KlWhileTheContextsAgreeAndTheShareOfTokensBeforeTheFirstDifference) {
  const auto job = generation({{0.7, 0.2, 0.1}, {0.6, 0.3, 0.1}, {0.5, 0.4, 0.1}, {0.9, 0.05, 0.05}}, {0, 0, 0, 0});
  const LossyCost same = compare_generations(job, job);
  EXPECT_EQ(same.kl_mean, 0.0);
  EXPECT_EQ(same.token_agreement, 1.0);
  EXPECT_EQ(same.tokens, 4);
  // The candidate agrees on the first token, then picks another at step 1: steps 0 and 1 are
  // compared (same context), step 2 on is not (its context differs).
  const auto cand = generation({{0.7, 0.2, 0.1}, {0.4, 0.5, 0.1}, {0.1, 0.1, 0.8}, {0.1, 0.1, 0.8}}, {0, 1, 2, 2});
  const LossyCost c = compare_generations(job, cand);
  const double kl1 = 0.6 * std::log(0.6 / 0.4) + 0.3 * std::log(0.3 / 0.5) + 0.1 * std::log(0.1 / 0.1);
  EXPECT_EQ(c.tokens, 2);
  EXPECT_NEAR(c.kl_mean, kl1 / 2, 1e-12);
  EXPECT_NEAR(c.kl_max, kl1, 1e-12);
  EXPECT_DOUBLE_EQ(c.token_agreement, 1.0 / 4.0);
}

TEST(TuneReport, TunedYamlIsTheJobWithTheWinnersSettingsAndTheCsvOneLinePerCandidate) {
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  const std::string config = (dir / "job.yaml").string();
  std::ofstream(config) << "# a comment\n" << kTinyJob;
  Landscape land;
  TuneSearchOptions o;
  o.slo.tpot_p99_ms = 55;
  const TuneOutcome out = tune_search(land.knobs, o, land.hooks());
  TuneReportInputs in;
  in.config = config;
  in.overrides = {"runtime.threads=1", "cache.block_size=64"};
  in.search = o;
  const std::string tuned = tuned_yaml(out, in);
  EXPECT_TRUE(validate_job_config_text(tuned, "tuned.yaml").empty()) << tuned;
  const JobConfig job = parse_job_config(tuned, "tuned.yaml");
  EXPECT_EQ(job.scheduler.max_batch, 2);
  EXPECT_EQ(job.cache.block_size, 32) << "the winner's value after the user's --set";
  EXPECT_EQ(job.workload.requests, 8) << "the workload as given";

  const std::vector<std::string> written = write_tune_report(dir.string(), out, in);
  EXPECT_EQ(written.size(), 4u);
  std::istringstream csv(kvpipe::testing::slurp(dir / "candidates.csv"));
  std::vector<std::string> lines;
  for (std::string line; std::getline(csv, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), out.candidates.size() + 1);
  EXPECT_EQ(lines[0].rfind("id,phase,settings,runs,", 0), 0u);
  EXPECT_NE(lines[1 + static_cast<size_t>(out.winner)].find("\"scheduler.max_batch=2, cache.block_size=32\""),
            std::string::npos)
      << "settings with commas are quoted";
  const std::string svg = kvpipe::testing::slurp(dir / "plot.svg");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("block_size=32"), std::string::npos) << "points are labelled";
  fs::remove_all(dir);
}

std::vector<std::map<std::string, std::string>> read_csv(const fs::path& path) {
  std::ifstream in(path);
  std::vector<std::vector<std::string>> rows;
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> fields(1);
    bool quoted = false;
    for (size_t i = 0; i < line.size(); ++i) {
      const char ch = line[i];
      if (quoted && ch == '"' && i + 1 < line.size() && line[i + 1] == '"') {
        fields.back() += '"';
        ++i;
      } else if (ch == '"') {
        quoted = !quoted;
      } else if (ch == ',' && !quoted) {
        fields.emplace_back();
      } else {
        fields.back() += ch;
      }
    }
    rows.push_back(fields);
  }
  std::vector<std::map<std::string, std::string>> out;
  for (size_t r = 1; r < rows.size(); ++r) {
    std::map<std::string, std::string> row;
    for (size_t c = 0; c < rows[0].size() && c < rows[r].size(); ++c) row[rows[0][c]] = rows[r][c];
    out.push_back(row);
  }
  return out;
}

// The settings of a candidate from its label ("key=value, key=value"; values hold no ", "
// except inside a window's braces).
std::vector<std::string> settings_of(const std::string& label) {
  std::vector<std::string> out;
  if (label == "job as given") return out;
  size_t start = 0;
  int depth = 0;
  for (size_t i = 0; i < label.size(); ++i) {
    if (label[i] == '{' || label[i] == '[') ++depth;
    if (label[i] == '}' || label[i] == ']') --depth;
    if (depth == 0 && label.compare(i, 2, ", ") == 0) {
      out.push_back(label.substr(start, i - start));
      start = i + 2;
    }
  }
  out.push_back(label.substr(start));
  return out;
}

TEST(TuneCommand, TinyModelWithinTheBudgetTunedYamlReproducesTheWinner) {
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  const std::string config = (dir / "job.yaml").string();
  std::ofstream(config) << kTinyJob;
  const double budget_min = 0.4;
  const CommandResult r = kvpipe::testing::run_command(
      std::string(KVPIPE_BINARY) + " tune --config " + config + " --out " + (dir / "tune").string() +
          " --budget " + std::to_string(budget_min) + " --slo tpot_p99=1000 --objective e2e",
      dir);
  ASSERT_EQ(r.code, 0) << r.status() << "\n" << r.err;
  // The budget bounds every run; what is left is writing the reports.
  EXPECT_LT(r.seconds, budget_min * 60 + 10) << r.err;
  EXPECT_NE(r.err.find("tune ["), std::string::npos) << "a progress bar on stderr";
  for (const char* name : {"report.md", "candidates.csv", "plot.svg", "tuned.yaml"})
    EXPECT_TRUE(fs::exists(dir / "tune" / name)) << name;

  const auto rows = read_csv(dir / "tune" / "candidates.csv");
  ASSERT_GE(rows.size(), 2u);
  const std::map<std::string, std::string>* winner = nullptr;
  for (const auto& row : rows) {
    EXPECT_EQ(row.at("settings").find("cache.dtype"), std::string::npos) << "lossy without --allow-lossy";
    EXPECT_EQ(row.at("settings").find("cache.window"), std::string::npos) << "lossy without --allow-lossy";
    EXPECT_EQ(row.at("lossy"), "false");
    if (row.at("winner") == "true" && row.at("phase") == "screen") winner = &row;
    if (row.at("status").rfind("over SLO", 0) == 0) {
      EXPECT_EQ(row.at("winner"), "false");
    }
  }
  ASSERT_NE(winner, nullptr);
  EXPECT_EQ(winner->at("status"), "ok");
  EXPECT_LE(std::stod(winner->at("tpot_p99_ms")), 1000);

  // tuned.yaml validates, and every tuned key has the value the winner's runs had.
  const std::string tuned = (dir / "tune" / "tuned.yaml").string();
  EXPECT_TRUE(validate_job_config_file(tuned).empty()) << kvpipe::testing::slurp(tuned);
  const JobConfig tuned_job = load_job_config(tuned);
  const JobConfig winner_job = load_job_config(config, settings_of(winner->at("settings")));
  for (const char* key : {"cache.prefix_reuse", "cache.block_size", "cache.cached_layers", "scheduler.max_batch",
                          "scheduler.max_tokens_per_step", "scheduler.max_prefill_tokens_per_step",
                          "speculative.method", "speculative.num_tokens"})
    EXPECT_EQ(job_value_yaml(tuned_job, key), job_value_yaml(winner_job, key)) << key;
  // The winner's run used that configuration: its report's config says so.
  const std::string run_dir = winner->at("run_dirs").substr(0, winner->at("run_dirs").find(' '));
  const nlohmann::json report = nlohmann::json::parse(kvpipe::testing::slurp(dir / "tune" / run_dir / "report.json"));
  EXPECT_EQ(report["config"]["scheduler"]["max_batch"].get<int>(), tuned_job.scheduler.max_batch) << report["config"];
  fs::remove_all(dir);
}

TEST(TuneCommand, AllowLossyMeasuresTheCostOfWhatChangesOutputs) {
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  const std::string config = (dir / "job.yaml").string();
  std::ofstream(config) << kTinyJob;
  // Only the cache's dtype and window are searched, so the budget reaches them.
  const CommandResult r = kvpipe::testing::run_command(
      std::string(KVPIPE_BINARY) + " tune --config " + config + " --out " + (dir / "tune").string() +
          " --budget 0.5 --allow-lossy --set workload.prompt_len=[300,400] --set workload.requests=4"
          " --set scheduler.max_batch=1 --set workload.concurrency=1 --keys cache.window,cache.dtype",
      dir);
  ASSERT_EQ(r.code, 0) << r.status() << "\n" << r.err;
  bool q8 = false, window = false;
  for (const auto& row : read_csv(dir / "tune" / "candidates.csv")) {
    if (row.at("lossy") != "true" || row.at("runs") == "0") continue;
    q8 |= row.at("settings").find("cache.dtype=q8_0") != std::string::npos;
    window |= row.at("settings").find("cache.window") != std::string::npos;
    EXPECT_FALSE(row.at("kl_mean").empty()) << row.at("settings") << ": " << row.at("status");
    EXPECT_GE(std::stod(row.at("kl_mean")), 0.0);
    const double agree = std::stod(row.at("token_agreement"));
    EXPECT_TRUE(agree >= 0 && agree <= 1) << agree;
  }
  EXPECT_TRUE(q8 || window) << kvpipe::testing::slurp(dir / "tune" / "report.md");
  fs::remove_all(dir);
}

TEST(TuneCommand, BadOptionsAreExit2NamingTheOption) {
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  const std::string config = (dir / "job.yaml").string();
  std::ofstream(config) << kTinyJob;
  const std::string tune = std::string(KVPIPE_BINARY) + " tune --out " + (dir / "out").string() + " ";
  const std::vector<std::pair<std::string, std::string>> cases{
      {tune + "--config " + config + " --slo ttft=5", "--slo"},
      {tune + "--config " + config + " --objective fast", "--objective"},
      {tune + "--config " + config + " --budget 0", "--budget"},
      {tune + "--config " + config + " --ranks 0", "--ranks"},
      {tune + "--config " + config + " --keys cache.size", "--keys"},
      {tune + "--config " + config + " --keys cache.dtype", "--allow-lossy"},
      {tune + "--config " + config + " --keys parallel.tensor", "--keys"},
      {tune + "--config " + config + " --set cache.block_size=0", "cache.block_size"},
      {tune + "--config " + (dir / "missing.yaml").string(), "missing.yaml"},
      {"OMPI_COMM_WORLD_SIZE=2 " + tune + "--config " + config, "mpirun"},
  };
  for (const auto& [command, named] : cases) {
    const CommandResult r = kvpipe::testing::run_command(command, dir);
    EXPECT_EQ(r.code, 2) << command << "\n" << r.err;
    EXPECT_NE(r.err.find(named), std::string::npos) << command << "\n" << r.err;
    EXPECT_FALSE(fs::exists(dir / "out" / "runs")) << "nothing ran: " << command;
  }
  fs::remove_all(dir);
}

TEST(TuneRunner, AProcessPastItsDeadlineIsStoppedWithItsGroup) {
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  const ProcessOutcome p = run_process({"sh", "-c", "sleep 30 & sleep 30"}, (dir / "o").string(), (dir / "e").string(), 0.5);
  EXPECT_TRUE(p.started);
  EXPECT_TRUE(p.killed);
  EXPECT_LT(p.wall_s, 5.0);
  const ProcessOutcome q = run_process({"sh", "-c", "echo hi; exit 3"}, (dir / "o").string(), (dir / "e").string(), 10);
  EXPECT_FALSE(q.killed);
  EXPECT_EQ(q.exit_code, 3);
  EXPECT_EQ(kvpipe::testing::slurp(dir / "o"), "hi\n");
  const ProcessOutcome none = run_process({"/nonexistent/kvpipe"}, (dir / "o").string(), (dir / "e").string(), 10);
  EXPECT_FALSE(none.started);
  EXPECT_NE(none.error.find("/nonexistent/kvpipe"), std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvpipe
