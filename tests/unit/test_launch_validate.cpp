// `kvpipe validate` end to end: the malformed-config corpus of tests/data/bad_configs (each
// file's first line says `# expect: <substring>`), every job in configs/, the plan it prints,
// the rank count it plans for, and model files it refuses with generate's own message.
#include "engine/model/gguf.h"
#include "engine/model/model_config.h"
#include "engine/model/model_weights.h"
#include "engine/model/safetensors.h"
#include "tests/support/command.h"

#include <ATen/ATen.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
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

TEST_F(LaunchValidate, PrintsTheTensorGridWithEachRanksHeadsAndKvBytes) {
  fs::create_directories(*dir_ / "out");
  const std::string job = "validate --config configs/smollm2.yaml --set cache.memory=16MiB";
  const CommandResult one = kvpipe(job + " --ranks 2");
  const CommandResult grid = kvpipe(job + " --ranks 6 --set parallel.tensor=3");
  ASSERT_EQ(one.code, 0) << one.err;
  ASSERT_EQ(grid.code, 0) << grid.err;
  EXPECT_NE(grid.out.find("plan: 6 rank(s) = 2 stage(s) x 3 tensor ranks, 30 layers, split [15, 15]"),
            std::string::npos)
      << grid.out;
  // SmolLM2's 9 heads and 3 KV heads, 1536 MLP units and 49152 tokens, in thirds.
  EXPECT_NE(grid.out.find("plan: rank 4 (stage 1, tensor rank 1: heads 3..5, KV heads 1..1, MLP units 512..1023, "
                          "vocabulary 16384..32767) layers 15..29"),
            std::string::npos)
      << grid.out;
  // Each rank caches one KV head of three: the same 16 MiB hold three times the blocks (45.5 -> 136.5).
  EXPECT_NE(one.out.find(" 45 blocks of 16 tokens"), std::string::npos) << one.out;
  EXPECT_NE(grid.out.find(" 136 blocks of 16 tokens"), std::string::npos) << grid.out;
  // A grid the model cannot split is exit 2 naming the key and the numbers.
  const CommandResult bad = kvpipe(job + " --ranks 4 --set parallel.tensor=2");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("parallel.tensor: 2 does not divide the model's 9 attention heads"), std::string::npos)
      << bad.err;
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

// Model files whose header parses but whose weights generate cannot load: validate must refuse
// each with exit 2 and the one line generate prints, before any rank reads a weight.
TEST_F(LaunchValidate, RefusesWhatGenerateRefusesWithTheSameMessage) {
  fs::create_directories(*dir_ / "out");
  ModelConfig cfg = preset_config("tiny");
  cfg.intermediate_size = 512;  // whole 256-value blocks for the retyped matrix below
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, shape] : hf_tensor_layout(cfg)) tensors.emplace_back(name, random_tensor(name, shape, 3, 0.05));
  auto without = [&](const std::string& dropped) {
    std::vector<std::pair<std::string, at::Tensor>> kept;
    for (const auto& t : tensors)
      if (t.first != dropped) kept.push_back(t);
    return kept;
  };
  const std::string down = "model.layers.1.mlp.down_proj.weight";
  const struct {
    std::string file;
    std::function<void(const fs::path&)> make;
    std::vector<std::string> says;
  } cases[] = {
      {"iq2_xxs.gguf",
       [&](const fs::path& p) {
         // IQ2_XXS: 66 bytes per 256 values, a type kvpipe has no kernel for.
         write_gguf_file(p.string(), cfg, without(down), at::kFloat, [&](GgufWriter& w) {
           w.add_tensor("blk.1.ffn_down.weight", 16, {cfg.intermediate_size, cfg.hidden_size},
                        std::string(cfg.hidden_size * (cfg.intermediate_size / 256) * 66, '\0'));
         });
       },
       {"tensor 'blk.1.ffn_down.weight' has type IQ2_XXS, which is not supported"}},
      {"missing.gguf",
       [&](const fs::path& p) {
         write_gguf_file(p.string(), cfg, without("model.layers.1.mlp.gate_proj.weight"), at::kFloat,
                         [](GgufWriter&) {});
       },
       {"blk.1.ffn_gate.weight"}},
      {"moe.gguf",
       [&](const fs::path& p) {
         write_gguf_file(p.string(), cfg, tensors, at::kFloat, [](GgufWriter& w) { w.add_u32("llama.expert_count", 8); });
       },
       {"llama.expert_count 8: mixture-of-experts models are not supported"}},
      {"longrope.gguf",
       [&](const fs::path& p) {
         write_gguf_file(p.string(), cfg, tensors, at::kFloat,
                         [](GgufWriter& w) { w.add_string("llama.rope.scaling.type", "longrope"); });
       },
       {"llama.rope.scaling.type 'longrope' is not supported"}},
      {"hf_missing",
       [&](const fs::path& p) {
         fs::create_directories(p);
         write_hf_config(cfg, p.string(), "float32");
         write_safetensors((p / "model.safetensors").string(), without(down));
       },
       {"model.layers.1.mlp.down_proj.weight"}},
      {"hf_shape",
       [&](const fs::path& p) {
         fs::create_directories(p);
         write_hf_config(cfg, p.string(), "float32");
         std::vector<std::pair<std::string, at::Tensor>> wrong = without(down);
         wrong.emplace_back(down, at::zeros({cfg.hidden_size, cfg.intermediate_size / 2}));
         write_safetensors((p / "model.safetensors").string(), wrong);
       },
       {"tensor 'model.layers.1.mlp.down_proj.weight' has shape [256, 256], config.json implies [256, 512]"}},
  };
  for (const auto& c : cases) {
    const fs::path model = *dir_ / c.file;
    c.make(model);
    const fs::path job = write(c.file + ".yaml", "model: {path: \"" + model.string() +
                                                     "\"}\ncache: {memory: 4MiB}\n"
                                                     "requests: [{prompt_ids: [1, 2, 3], max_new_tokens: 2}]\n");
    const CommandResult v = kvpipe("validate --config " + job.string());
    const CommandResult g = kvpipe("generate --config " + job.string());
    EXPECT_EQ(v.code, 2) << c.file << "\n" << v.out << v.err;
    EXPECT_EQ(g.code, 2) << c.file << "\n" << g.err;
    for (const std::string& part : c.says) EXPECT_NE(v.err.find(part), std::string::npos) << c.file << ": " << v.err;
    EXPECT_NE(v.err.find(model.string()), std::string::npos) << c.file << ": " << v.err;
    EXPECT_EQ(std::count(v.err.begin(), v.err.end(), '\n'), 1) << c.file << ": " << v.err;
    EXPECT_EQ(v.err, g.err) << c.file;
  }
}

}  // namespace
}  // namespace kvpipe
