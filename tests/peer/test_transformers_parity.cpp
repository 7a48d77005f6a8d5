// Parity with Hugging Face transformers (float64, full recompute at every step) on the HF
// models that `kvpipe init-model` writes: Llama with untied and tied embeddings, grouped-query
// attention, Mistral, and Qwen2 with q/k/v biases. kvpipe on one and two ranks must give, at
// every greedy step, full-vocabulary log-probabilities within 1e-4 of transformers' while the
// chosen tokens agree (a near-tie, top two within 1e-3, may diverge). The same weights written
// as GGUF by the `gguf` package (llama.cpp's own writer) must match the HF twin as well.
// Models made and saved by transformers itself check RoPE as config.json defines it today
// (`rope_parameters`) and before transformers 5 (`rope_theta` + `rope_scaling`): plain with
// another theta, llama3 (Llama 3.1/3.2), yarn and linear scaling, over prompts longer than the
// original context, and dynamic scaling up to the end of the context; llama3's GGUF twin
// carries rope_freqs.weight and yarn's its rope.scaling.* keys, which llama.cpp applies too.
// Qwen3 (q/k RMSNorm per head, heads wider than hidden / heads, tied and untied) and Phi-3
// (fused qkv_proj and gate_up_proj), made and saved by transformers with every norm weight
// drawn away from 1, are checked the same way, their GGUF twins through llama.cpp too; so is
// Gemma 2 (GeGLU, the four norms of (1 + weight), embeddings scaled by sqrt(hidden), soft-capped
// attention and logits, sliding-window layers of 8 positions between full ones, over 48+24
// positions, so that every decode step's local layers mask), and Gemma 3 (Gemma 2's layer
// without soft caps, with q/k norms, five sliding layers with a RoPE base of their own to one
// full layer).
#include "tests/support/command.h"
#include "tests/support/logprob_compare.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;
using kvpipe::testing::LogprobComparison;
using kvpipe::testing::LogprobStep;
using kvpipe::testing::reference_ran;
using kvpipe::testing::run_command;

namespace {

constexpr int kSteps = 24;
constexpr double kLogprobTolerance = 1e-4;
constexpr double kTieTolerance = 1e-3;
const char* kPrompt = "1,17,42,99,5,300,12,7,250,251,3,64,8,9";
// 48 tokens: beyond the 32 positions that the scaled models below call their original context.
std::string long_prompt() {
  std::string p;
  for (int i = 0; i < 48; ++i) p += (i ? "," : "") + std::to_string((i * 37) % 500 + 3);
  return p;
}
const char* kLlama3 = R"("rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, )"
                      R"("high_freq_factor": 4.0, "original_max_position_embeddings": 32)";

class TransformersParity : public ::testing::Test {
 protected:
  void SetUp() override {
    const CommandResult probe = run_command(
        std::string(KVPIPE_PYTHON) + " -c 'import transformers, gguf, safetensors'", fs::temp_directory_path());
    ASSERT_EQ(probe.code, 0) << "transformers, gguf or safetensors is not importable by " << KVPIPE_PYTHON
                             << ": run scripts/setup.sh --references\n" << probe.err;
    dir_ = kvpipe::testing::make_scratch_dir();
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  std::string python(const std::string& script, const std::string& args) {
    return std::string(KVPIPE_PYTHON) + " " + KVPIPE_SOURCE_DIR + "/tests/peer/" + script + " " + args;
  }

  void init_model(const std::string& flags) {
    const CommandResult r = run_command(std::string(KVPIPE_BINARY) + " init-model --format hf --out " +
                                            (dir_ / "model_hf").string() + " " + flags, dir_);
    ASSERT_EQ(r.code, 0) << r.err;
    kvpipe::testing::write_greedy_job(dir_, (dir_ / "model_hf").string(), prompt_, kSteps);
  }

  // A random model made and saved by transformers (tests/peer/hf_save_random.py) with the
  // rope_parameters object `rope`; `legacy` rewrites its config.json in the pre-5 layout;
  // `flags` go to the script as they are (--architecture, --tie-embeddings, --seed).
  void save_with_transformers(const std::string& rope, bool legacy, const std::string& flags = "") {
    prompt_ = long_prompt();
    const CommandResult r = run_command(python("hf_save_random.py", "--out " + (dir_ / "model_hf").string() +
                                                                        " --rope '{" + rope + "}'" +
                                                                        (legacy ? " --legacy " : " ") + flags),
                                        dir_);
    ASSERT_TRUE(reference_ran(r, "transformers (save_pretrained)"));
    kvpipe::testing::write_greedy_job(dir_, (dir_ / "model_hf").string(), prompt_, kSteps);
  }

  std::vector<LogprobStep> kvpipe_run(const std::string& model, int ranks) {
    const auto run = kvpipe::testing::run_kvpipe_logprobs(KVPIPE_BINARY, KVPIPE_MPIRUN, dir_, model, ranks);
    EXPECT_EQ(run.result.code, 0) << run.command << "\n" << run.result.err;
    return run.steps;
  }


  // Compares kvpipe's runs of the HF directory (1 and 2 ranks) and, with `gguf_twin`, of its
  // gguf-py conversion (1 and 2 ranks) against transformers on the HF directory; with
  // `llama_cpp`, also kvpipe on the twin against llama.cpp on it, within `llama_cpp_tolerance`.
  void check_all(const std::string& label, bool gguf_twin, bool llama_cpp = false,
                 double llama_cpp_tolerance = kLogprobTolerance) {
    const std::string hf = (dir_ / "model_hf").string();
    const CommandResult ref_run = run_command(
        python("hf_logprobs.py", "--model " + hf + " --prompt " + prompt_ + " --steps " + std::to_string(kSteps)),
        dir_);
    ASSERT_TRUE(reference_ran(ref_run, "transformers (float64)"));
    const std::vector<LogprobStep> ref = kvpipe::testing::parse_logprob_steps(ref_run.out);
    ASSERT_EQ(ref.size(), static_cast<size_t>(kSteps)) << "transformers gave no usable output";

    struct Run {
      std::string name, model;
      int ranks;
    };
    std::vector<Run> runs = {{"hf, 1 rank", hf, 1}, {"hf, 2 ranks", hf, 2}};
    if (gguf_twin) {
      const std::string gguf = (dir_ / "twin.gguf").string();
      const CommandResult w = run_command(
          python("gguf_from_hf.py", "--model " + hf + " --out " + gguf + (llama_cpp ? " --placeholder-vocab" : "")),
          dir_);
      ASSERT_TRUE(reference_ran(w, "gguf writer"));
      runs.push_back({"gguf-py twin, 1 rank", gguf, 1});
      runs.push_back({"gguf-py twin, 2 ranks", gguf, 2});
      if (llama_cpp) {
        const std::string cmd = std::string(KVPIPE_PYTHON) + " " + KVPIPE_SOURCE_DIR +
                                "/tests/peer/llama_logprobs.py --model " + gguf + " --prompt " + prompt_ +
                                " --steps " + std::to_string(kSteps) + " --threads 1";
        const CommandResult l = run_command(cmd, dir_);
        ASSERT_TRUE(reference_ran(l, "llama.cpp", cmd));
        const LogprobComparison c = kvpipe::testing::compare_logprob_steps(
            kvpipe_run(gguf, 1), kvpipe::testing::parse_logprob_steps(l.out), kSteps, llama_cpp_tolerance,
            kTieTolerance);
        std::printf("[ parity ] llama.cpp, %s, gguf-py twin, 1 rank: %s\n", label.c_str(),
                    kvpipe::testing::summary(c).c_str());
        EXPECT_TRUE(c.failure.empty()) << label << ", llama.cpp: " << c.failure;
        EXPECT_GE(c.compared, 8) << label << ", llama.cpp";
      }
    }
    for (const Run& run : runs) {
      const LogprobComparison c = kvpipe::testing::compare_logprob_steps(
          kvpipe_run(run.model, run.ranks), ref, kSteps, kLogprobTolerance, kTieTolerance);
      std::printf("[ parity ] transformers, %s, %s: %s\n", label.c_str(), run.name.c_str(),
                  kvpipe::testing::summary(c).c_str());
      EXPECT_TRUE(c.failure.empty()) << label << ", " << run.name << ": " << c.failure;
      EXPECT_GE(c.compared, 8) << label << ", " << run.name;
    }
  }

  fs::path dir_;
  std::string prompt_ = kPrompt;
};

TEST_F(TransformersParity, LlamaUntied) {
  init_model("--preset tiny --std 0.05");
  check_all("llama", true);
}

TEST_F(TransformersParity, LlamaTiedGqaHeadDim64) {
  init_model("--preset tiny --hidden 512 --layers 6 --heads 8 --kv-heads 2 --head-dim 64 "
             "--rope-theta 500000 --std 0.05 --seed 7 --tie-embeddings");
  check_all("llama tied gqa", true);
}

TEST_F(TransformersParity, Mistral) {
  init_model("--preset tiny --architecture MistralForCausalLM --std 0.05 --seed 3");
  check_all("mistral", false);
}

TEST_F(TransformersParity, Qwen2WithQkvBiases) {
  init_model("--preset tiny --architecture Qwen2ForCausalLM --std 0.05 --seed 5 --tie-embeddings");
  check_all("qwen2", true);
}

TEST_F(TransformersParity, SavedByTransformersWithAnotherTheta) {
  // transformers 5 keeps rope_theta inside rope_parameters only.
  save_with_transformers(R"("rope_type": "default", "rope_theta": 500000.0)", false);
  check_all("saved by transformers, theta 500000", true);
}

TEST_F(TransformersParity, Llama3RopeScaling) {
  save_with_transformers(kLlama3, false);
  check_all("llama3 rope", true, true);
}

TEST_F(TransformersParity, Llama3RopeScalingPreTransformers5Layout) {
  save_with_transformers(kLlama3, true);
  check_all("llama3 rope, rope_scaling layout", false);
}

TEST_F(TransformersParity, LinearRopeScaling) {
  save_with_transformers(R"("rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0)", false);
  check_all("linear rope", true);
}

TEST_F(TransformersParity, YarnRopeScaling) {
  save_with_transformers(R"("rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, )"
                         R"("original_max_position_embeddings": 32)",
                         false);
  check_all("yarn rope", true, true);
}

TEST_F(TransformersParity, DynamicRopeUpToTheEndOfTheContext) {
  // 48 prompt tokens and 24 steps fill 72 of the 80 positions: transformers' dynamic NTK
  // changes nothing until a sequence passes them, and kvpipe serves no longer one.
  save_with_transformers(R"("rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0)", false, "--max-position 80");
  check_all("dynamic rope", false);
}

const char* kDefaultRope = R"("rope_type": "default", "rope_theta": 1000000.0)";

TEST_F(TransformersParity, Qwen3TiedWithQkNorms) {
  save_with_transformers(kDefaultRope, false, "--architecture qwen3 --tie-embeddings --seed 11");
  check_all("qwen3 tied", true, true);
}

TEST_F(TransformersParity, Qwen3Untied) {
  save_with_transformers(kDefaultRope, false, "--architecture qwen3 --seed 12");
  check_all("qwen3 untied", false);
}

TEST_F(TransformersParity, Phi3PartialRotary) {
  // Half of each 32-wide head rotates (phi-4-mini's layout: partial_rotary_factor < 1).
  save_with_transformers(R"("rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5)", false,
                         "--architecture phi3 --seed 14");
  check_all("phi3 partial rotary", true, true);
}

TEST_F(TransformersParity, Phi3FusedProjections) {
  save_with_transformers(R"("rope_type": "default", "rope_theta": 10000.0)", false, "--architecture phi3 --seed 13");
  check_all("phi3", true, true);
}

TEST_F(TransformersParity, Gemma2SlidingWindowsAndSoftCaps) {
  save_with_transformers(R"("rope_type": "default", "rope_theta": 10000.0)", false,
                         "--architecture gemma2 --tie-embeddings --seed 14");
  // ggml's CPU GELU rounds its input to float16 and reads a float16 table (GGML_GELU_FP16 in
  // ggml-cpu/vec.h): llama.cpp itself is ~6e-4 from transformers' float64 on this model, so
  // kvpipe is held to 1e-4 against transformers and to 2e-3 against llama.cpp.
  check_all("gemma2", true, true, 2e-3);
}

TEST_F(TransformersParity, Gemma3LocalRopeAndQkNorms) {
  save_with_transformers(R"("rope_type": "default", "rope_theta": 10000.0)", false,
                         "--architecture gemma3 --tie-embeddings --seed 15");
  // llama.cpp's float16 GELU table again (see Gemma 2): ~9e-4 from transformers itself.
  check_all("gemma3", true, true, 2e-3);
}

}  // namespace
