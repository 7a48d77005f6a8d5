// The kvpipe executable end to end: init-model, generate's output lines, and the exit-code
// contract for bad input (2, with a one-line message naming the file or key).
#include "engine/model/model_config.h"
#include "engine/model/model_weights.h"
#include "engine/model/safetensors.h"
#include "tests/support/command.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;

using kvpipe::testing::CommandResult;
using kvpipe::testing::slurp;

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = kvpipe::testing::make_scratch_dir();
  }
  void TearDown() override { fs::remove_all(dir_); }

  CommandResult kvpipe(const std::string& args) {
    return kvpipe::testing::run_command(std::string("OMP_NUM_THREADS=1 ") + KVPIPE_BINARY + " " + args, dir_);
  }

  // A small random model in HF layout.
  fs::path make_model(const std::string& name, const std::string& extra = "") {
    const fs::path m = dir_ / name;
    const CommandResult r = kvpipe("init-model --out " + m.string() +
                                   " --hidden 64 --layers 2 --heads 4 --kv-heads 2 --intermediate 96"
                                   " --vocab 128 --max-position 256 " + extra);
    EXPECT_EQ(r.code, 0) << r.err;
    return m;
  }

  fs::path write_job(const std::string& model_path, const std::string& extra = "") {
    const fs::path job = dir_ / "job.yaml";
    std::ofstream(job) << "model: {path: " << model_path << "}\n"
                       << "cache: {block_size: 4, memory: 1MiB}\n"
                       << "sampling: {ignore_eos: true}\n"
                       << "requests:\n"
                       << "  - {prompt_ids: [1, 2, 3, 4, 5], max_new_tokens: 6}\n"
                       << "  - {prompt_ids: [9, 8, 7], max_new_tokens: 4, arrival_step: 2}\n"
                       << extra;
    return job;
  }

  // Expects exit 2 and a single-line message on stderr containing each of `needles`.
  void expect_bad_input(const CommandResult& r, const std::vector<std::string>& needles) {
    EXPECT_EQ(r.code, 2) << r.err;
    std::string last = r.err;
    while (!last.empty() && last.back() == '\n') last.pop_back();
    last = last.substr(last.rfind('\n') == std::string::npos ? 0 : last.rfind('\n') + 1);
    EXPECT_NE(last.find("error"), std::string::npos) << r.err;
    for (const std::string& n : needles) EXPECT_NE(last.find(n), std::string::npos) << "'" << n << "' not in: " << r.err;
  }

  fs::path dir_;
};

TEST_F(CliTest, InitModelIsDeterministicPerSeed) {
  const fs::path a = make_model("a", "--seed 5"), b = make_model("b", "--seed 5"), c = make_model("c", "--seed 6");
  EXPECT_EQ(slurp(a / "model.safetensors"), slurp(b / "model.safetensors"));
  EXPECT_NE(slurp(a / "model.safetensors"), slurp(c / "model.safetensors"));
  EXPECT_EQ(slurp(a / "config.json"), slurp(b / "config.json"));
}

TEST_F(CliTest, InitModelRoundTripsThroughTheLoader) {
  for (const std::string dtype : {"float32", "float16", "bfloat16"}) {
    const fs::path m = make_model("m_" + dtype, "--seed 3 --std 0.05 --dtype " + dtype);
    const ModelConfig cfg = load_hf_config(m.string());
    EXPECT_EQ(cfg.num_kv_heads, 2);
    SafetensorsModel files(m.string());
    const at::ScalarType st = parse_dtype(dtype, "test");
    for (const auto& [name, shape] : hf_tensor_layout(cfg)) {
      const at::Tensor expected = random_tensor(name, shape, 3, 0.05).to(st).to(at::kFloat);
      EXPECT_TRUE(at::equal(files.load(name, at::kFloat), expected)) << dtype << " " << name;
    }
    // A stage loads only its layers.
    const ModelWeights w = load_weights(m.string(), cfg, {{1, 2}, false, true, {}}, at::kFloat);
    EXPECT_EQ(w.layer.size(), 1u);
    EXPECT_FALSE(w.embedding.defined());
    EXPECT_TRUE(w.lm_head.defined());
  }
}

TEST_F(CliTest, GeneratePrintsOneJsonLinePerRequestAndLogprobs) {
  const fs::path m = make_model("m");
  const fs::path job = write_job(m.string());
  const fs::path lp = dir_ / "logprobs.jsonl";
  const CommandResult r = kvpipe("generate --config " + job.string() + " --logprobs-out " + lp.string());
  ASSERT_EQ(r.code, 0) << r.err;
  std::istringstream lines(r.out);
  std::string line;
  std::vector<nlohmann::ordered_json> results;
  while (std::getline(lines, line)) results.push_back(nlohmann::ordered_json::parse(line));
  ASSERT_EQ(results.size(), 2u);
  // Lines come in finish order; each names its request.
  std::sort(results.begin(), results.end(), [](const auto& a, const auto& b) { return a["id"] < b["id"]; });
  EXPECT_EQ(results[0]["id"], 0);
  const std::vector<std::string> keys = {"id", "prompt_ids", "output_ids", "finish_reason", "ttft_ms", "tpot_ms"};
  for (const auto& j : results) {
    std::vector<std::string> got;
    for (auto it = j.begin(); it != j.end(); ++it) got.push_back(it.key());
    EXPECT_EQ(got, keys);
  }
  EXPECT_EQ(results[0]["output_ids"].size(), 6u);
  EXPECT_EQ(results[1]["output_ids"].size(), 4u);
  EXPECT_EQ(results[0]["finish_reason"], "length");

  std::ifstream in(lp);
  int count = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    const auto lps = j["logprobs"].get<std::vector<double>>();
    ASSERT_EQ(lps.size(), 128u);
    double z = 0;
    for (double x : lps) z += std::exp(x);
    EXPECT_NEAR(z, 1.0, 1e-4);
    // Greedy: the chosen token is the most probable one.
    const int64_t argmax = std::max_element(lps.begin(), lps.end()) - lps.begin();
    EXPECT_EQ(j["token"].get<int64_t>(), argmax);
    const auto& out = results[j["id"].get<int>()]["output_ids"];
    EXPECT_EQ(out[j["step"].get<int>()].get<int64_t>(), argmax);
    ++count;
  }
  EXPECT_EQ(count, 10);
}

// model.huge_pages moves the loaded matrices onto 2 MiB pages: the log says how much (or why
// not), and the job's log-probabilities are the same bits as on 4 KiB pages.
TEST_F(CliTest, HugePagesChangeNoNumber) {
  const fs::path job = write_job("dummy:tiny");
  auto run = [&](const std::string& on) {
    const fs::path lp = dir_ / ("huge_" + on + ".jsonl");
    const CommandResult r = kvpipe("generate --config " + job.string() + " --set model.huge_pages=" + on +
                                   " --logprobs-out " + lp.string());
    EXPECT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.err.find("model.huge_pages: ") != std::string::npos, on == "true") << r.err;
    return slurp(lp);
  };
  const std::string on = run("true"), off = run("false");
  EXPECT_FALSE(on.empty());
  EXPECT_EQ(on, off);
}

TEST_F(CliTest, DummyPresetIsTheInitModelPreset) {
  const fs::path m = dir_ / "tiny";
  ASSERT_EQ(kvpipe("init-model --preset tiny --out " + m.string()).code, 0);
  const CommandResult from_files = kvpipe("generate --config " + write_job(m.string()).string());
  const CommandResult dummy = kvpipe("generate --config " + write_job("dummy:tiny").string());
  ASSERT_EQ(from_files.code, 0) << from_files.err;
  ASSERT_EQ(dummy.code, 0) << dummy.err;
  auto outputs = [](const std::string& text) {
    std::istringstream lines(text);
    std::map<int64_t, std::string> by_id;
    for (std::string line; std::getline(lines, line);) {
      const auto j = nlohmann::json::parse(line);
      by_id[j["id"].get<int64_t>()] = j["output_ids"].dump();
    }
    return by_id;
  };
  EXPECT_EQ(outputs(from_files.out), outputs(dummy.out));
}

TEST_F(CliTest, HelpForEverySubcommand) {
  for (const std::string sub : {"", "init-model ", "generate ", "validate "}) {
    const CommandResult r = kvpipe(sub + "--help");
    EXPECT_EQ(r.code, 0) << sub;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << sub << r.out;
  }
}

TEST_F(CliTest, BadCommandLines) {
  expect_bad_input(kvpipe(""), {});
  expect_bad_input(kvpipe("generate --config"), {"--config"});
  expect_bad_input(kvpipe("generate --config x.yaml --frobnicate"), {"frobnicate"});
  expect_bad_input(kvpipe("generate --config " + (dir_ / "none.yaml").string()), {"none.yaml"});
  const fs::path m = make_model("m");
  const fs::path job = write_job(m.string());
  expect_bad_input(kvpipe("generate --config " + job.string() + " --set cache.blok_size=4"), {"--set", "cache.blok_size"});
  expect_bad_input(kvpipe("generate --config " + job.string() + " --prompt-ids 1,x"), {"--prompt-ids"});
  expect_bad_input(kvpipe("generate --config " + job.string() + " --prompt-ids 1,2,128"), {"vocabulary"});
  std::string long_prompt = "0";
  for (int i = 1; i < 300; ++i) long_prompt += ",1";
  expect_bad_input(kvpipe("generate --config " + job.string() + " --prompt-ids " + long_prompt), {"context"});
  // init-model's sizes: 0 would silently mean "the preset's value".
  for (const std::string option : {"--vocab 0", "--layers -2", "--hidden 0", "--rms-eps 0", "--heads abc"}) {
    SCOPED_TRACE(option);
    expect_bad_input(kvpipe("init-model --out " + (dir_ / "sized").string() + " " + option),
                     {option.substr(0, option.find(' ')), "greater than 0"});
  }
  EXPECT_FALSE(fs::exists(dir_ / "sized"));
}

// Text in and out on an init-model model (its byte-level BPE tokenizer): `tokenize` gives the
// ids `generate --prompt` runs, output lines carry "text", and a stop string ends the text
// where it begins (the stop is taken from the unstopped run's own text).
TEST_F(CliTest, TextPromptsTokenizeAndStopStrings) {
  const fs::path m = dir_ / "t";
  ASSERT_EQ(kvpipe("init-model --out " + m.string() + " --hidden 64 --layers 2 --heads 4 --kv-heads 2"
                   " --intermediate 96 --vocab 512 --max-position 256").code, 0);
  const fs::path job = write_job(m.string());
  const CommandResult tok = kvpipe("tokenize --config " + job.string() + " --text 'the cat sat'");
  ASSERT_EQ(tok.code, 0) << tok.err;
  const nlohmann::json ids = nlohmann::json::parse(tok.out).at("ids");
  ASSERT_FALSE(ids.empty());

  const CommandResult run = kvpipe("generate --config " + job.string() + " --prompt 'the cat sat' --max-new-tokens 24");
  ASSERT_EQ(run.code, 0) << run.err;
  const nlohmann::json line = nlohmann::json::parse(run.out.substr(0, run.out.find('\n')));
  EXPECT_EQ(line.at("prompt_ids"), ids);
  const std::string text = line.at("text").get<std::string>();
  ASSERT_GE(text.size(), 4u) << line.dump();

  // A stop string from the middle of that text: the text ends right before it.
  const size_t at = text.size() / 2;
  const std::string stop = text.substr(at, 2);
  const size_t first = text.find(stop);
  nlohmann::json stop_set = nlohmann::json::array({stop});
  std::ofstream(dir_ / "stop.yaml") << "model: {path: " << m.string() << "}\n"
                                    << "cache: {block_size: 4, memory: 1MiB}\n"
                                    << "sampling: {ignore_eos: true, stop: " << stop_set.dump() << "}\n";
  const CommandResult stopped = kvpipe("generate --config " + (dir_ / "stop.yaml").string() +
                                       " --prompt 'the cat sat' --max-new-tokens 24");
  ASSERT_EQ(stopped.code, 0) << stopped.err;
  const nlohmann::json s = nlohmann::json::parse(stopped.out.substr(0, stopped.out.find('\n')));
  EXPECT_EQ(s.at("text"), text.substr(0, first)) << "stop " << nlohmann::json(stop).dump();
  EXPECT_EQ(s.at("finish_reason"), "stop");
  EXPECT_LT(s.at("output_ids").size(), line.at("output_ids").size());

  // A model without a tokenizer refuses text by name.
  const fs::path dummy = write_job("dummy:tiny");
  expect_bad_input(kvpipe("generate --config " + dummy.string() + " --prompt hello"), {"--prompt", "no tokenizer"});
  expect_bad_input(kvpipe("tokenize --config " + dummy.string() + " --text hello"), {"--text", "no tokenizer"});
  expect_bad_input(kvpipe("generate --config " + job.string() + " --prompt a --prompt-ids 1"), {"--prompt"});
}

TEST_F(CliTest, BadConfigFiles) {
  const fs::path m = make_model("m");
  const fs::path job = dir_ / "bad.yaml";
  std::ofstream(job) << "model: {path: " << m.string() << "}\ncache: {block_size: [1, 2}\n";
  expect_bad_input(kvpipe("generate --config " + job.string()), {"bad.yaml"});
  std::ofstream(job) << "model: {path: " << m.string() << "}\ncache:\n  block_size: 0\n";
  expect_bad_input(kvpipe("generate --config " + job.string()), {"bad.yaml:3", "cache.block_size"});
  std::ofstream(job) << "model: {path: " << m.string() << "}\nschedulr: {max_batch: 2}\n";
  expect_bad_input(kvpipe("generate --config " + job.string()), {"bad.yaml:2", "schedulr"});
}

TEST_F(CliTest, BadModelDirectories) {
  const fs::path empty = dir_ / "empty";
  fs::create_directories(empty);
  expect_bad_input(kvpipe("generate --config " + write_job(empty.string()).string()), {"config.json"});

  const fs::path m = make_model("m");
  std::string cfg = slurp(m / "config.json");
  const std::string arch = "LlamaForCausalLM";
  std::ofstream(m / "config.json") << std::string(cfg).replace(cfg.find(arch), arch.size(), "GPT2LMHeadModel");
  expect_bad_input(kvpipe("generate --config " + write_job(m.string()).string()), {"config.json", "GPT2LMHeadModel"});
  const std::string rope_type = "\"rope_type\": \"default\"";
  ASSERT_NE(cfg.find(rope_type), std::string::npos) << cfg;
  std::ofstream(m / "config.json") << std::string(cfg).replace(cfg.find(rope_type), rope_type.size(),
                                                               "\"rope_type\": \"longrope\"");
  expect_bad_input(kvpipe("generate --config " + write_job(m.string()).string()), {"rope_parameters", "longrope"});
  std::ofstream(m / "config.json") << "{ not json";
  expect_bad_input(kvpipe("generate --config " + write_job(m.string()).string()), {"config.json"});
}

TEST_F(CliTest, BadCacheValues) {
  const fs::path m = make_model("m");
  const std::string gen = "generate --config " + write_job(m.string()).string();
  expect_bad_input(kvpipe(gen + " --set cache.memory=-1MiB"), {"cache.memory"});
  expect_bad_input(kvpipe(gen + " --set cache.block_size=0"), {"cache.block_size"});
  expect_bad_input(kvpipe(gen + " --set 'cache.window={sinks: 0, recent: 100000}'"), {"cache.window.recent"});
  expect_bad_input(kvpipe(gen + " --set cache.memory=[1MiB,1MiB]"), {"cache.memory"});
  expect_bad_input(kvpipe(gen + " --set cache.cached_layers=9"), {"cache.cached_layers"});
  expect_bad_input(kvpipe(gen + " --set cache.memory=1KiB"), {"cache.memory"});
}

// Malformed safetensors in an otherwise valid model directory.
TEST_F(CliTest, BadSafetensorsFiles) {
  const fs::path m = make_model("m");
  const fs::path st = m / "model.safetensors";
  const std::string good = slurp(st);
  const fs::path job = write_job(m.string());
  auto write_raw = [&](uint64_t header_len, const std::string& header, const std::string& data) {
    std::ofstream out(st, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(&header_len), 8);
    out << header << data;
  };
  auto generate = [&] { return kvpipe("generate --config " + job.string()); };

  write_raw(1 << 30, "{}", "");
  expect_bad_input(generate(), {"model.safetensors", "header length"});
  write_raw(9, "{not json", "");
  expect_bad_input(generate(), {"model.safetensors", "JSON"});
  const std::string out_of_range = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,64]}})";
  write_raw(out_of_range.size(), out_of_range, std::string(8, '\0'));
  expect_bad_input(generate(), {"model.safetensors", "'a'"});
  const std::string overlap = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  write_raw(overlap.size(), overlap, std::string(12, '\0'));
  expect_bad_input(generate(), {"model.safetensors", "overlap"});
  const std::string mismatch = R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,8]}})";
  write_raw(mismatch.size(), mismatch, std::string(8, '\0'));
  expect_bad_input(generate(), {"model.safetensors", "'a'"});

  // A valid file without one of the model's tensors.
  std::ofstream(st, std::ios::binary | std::ios::trunc) << good;
  {
    SafetensorsFile f(st.string());
    std::vector<std::pair<std::string, at::Tensor>> kept;
    for (const std::string& name : f.names())
      if (name != "model.layers.1.mlp.up_proj.weight") kept.emplace_back(name, f.load(name, at::kFloat));
    write_safetensors((m / "partial.safetensors").string(), kept);
  }
  fs::rename(m / "partial.safetensors", st);
  expect_bad_input(generate(), {"model.layers.1.mlp.up_proj.weight"});

  // A tensor whose shape disagrees with config.json.
  std::ofstream(st, std::ios::binary | std::ios::trunc) << good;
  std::string cfg = slurp(m / "config.json");
  std::ofstream(m / "config.json") << std::string(cfg).replace(cfg.find("\"intermediate_size\": 96"), 23, "\"intermediate_size\": 80");
  expect_bad_input(generate(), {"mlp", "shape"});
}

}  // namespace
}  // namespace kvpipe
