// Parity of kvpipe's chat-template interpreter with Python's jinja2 as transformers'
// apply_chat_template runs it (tests/peer/chat_template_reference.py calls transformers'
// render_jinja_template): every real template of tests/data/chat_templates on every
// conversation of conversations.json must render byte for byte the same, or raise in both.
//
// The templates are byte-exact copies of each model's `chat_template`:
//   llama-3.1-8b-instruct, llama-3.2-3b-instruct, qwen2.5-7b-instruct, gemma-2-2b-it,
//   phi-3.5-mini-instruct: llama.cpp's models/templates (fetched from the Hub's
//   tokenizer_config.json by its scripts/get_chat_template.py);
//   smollm2-135m-instruct: tokenizer.chat_template of the SmolLM2-135M-Instruct GGUF that
//   scripts/smollm2_path.sh names;
//   llama-3-8b-instruct, qwen2-7b-instruct (as Qwen2-0.5B/7B-Instruct), mistral-7b-instruct-v0.1,
//   mistral-7b-instruct-v0.3 and llama-2-13b-chat: the tokenizer_config.json `chat_template`
//   of meta-llama/Meta-Llama-3-8B-Instruct, Qwen/Qwen2-7B-Instruct,
//   mistralai/Mistral-7B-Instruct-v0.1, mistralai/Mistral-7B-Instruct-v0.3 (as its GGUF
//   carries it) and meta-llama/Llama-2-13b-chat-hf, as quoted in public code.
#include "tests/support/command.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <string>

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;
using kvpipe::testing::reference_ran;
using kvpipe::testing::run_command;

namespace {

class ChatTemplateParity : public ::testing::Test {
 protected:
  void SetUp() override {
    const CommandResult probe = run_command(
        std::string(KVPIPE_PYTHON) + " -c 'import jinja2, transformers.utils.chat_template_utils'",
        fs::temp_directory_path());
    ASSERT_EQ(probe.code, 0) << "jinja2 or transformers is not importable by " << KVPIPE_PYTHON
                             << ": run scripts/setup.sh --references\n" << probe.err;
    dir_ = kvpipe::testing::make_scratch_dir();
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  fs::path dir_;
};

TEST_F(ChatTemplateParity, RealTemplatesRenderAsJinja2Does) {
  const std::string data = std::string(KVPIPE_SOURCE_DIR) + "/tests/data/chat_templates";
  const fs::path out = dir_ / "reference";
  const CommandResult ref =
      run_command(std::string(KVPIPE_PYTHON) + " " + KVPIPE_SOURCE_DIR + "/tests/peer/chat_template_reference.py " +
                      data + " " + data + "/conversations.json " + out.string(),
                  dir_);
  ASSERT_TRUE(reference_ran(ref, "jinja2"));
  const auto manifest = nlohmann::json::parse(kvpipe::testing::slurp(out / "manifest.json"));

  // Per template: cases that rendered and cases that raised, so that a template whose every
  // case raises (both sides failing the same way) cannot pass unnoticed.
  std::map<std::string, std::pair<int, int>> counts;
  const fs::path scratch = dir_ / "run";
  fs::create_directories(scratch);
  for (const auto& c : manifest) {
    const std::string name = c["template"].get<std::string>() + " / " + c["conversation"].get<std::string>();
    const CommandResult r = run_command(std::string(KVPIPE_CHAT_TEMPLATE_TOOL) + " '" + data + "/" +
                                            c["template"].get<std::string>() + "' '" + c["context"].get<std::string>() + "'",
                                        scratch);
    auto& [rendered, raised] = counts[c["template"].get<std::string>()];
    if (c.contains("error")) {
      ++raised;
      EXPECT_EQ(r.code, 2) << name << ": jinja2 raised (" << c["error"].get<std::string>()
                           << ") but kvpipe rendered:\n" << r.out;
      EXPECT_NE(r.err.find(c["template"].get<std::string>()), std::string::npos)
          << name << ": the error must name the template: " << r.err;
    } else {
      ++rendered;
      EXPECT_EQ(r.code, 0) << name << ": " << r.err;
      EXPECT_EQ(r.out, kvpipe::testing::slurp(c["expected"].get<std::string>())) << name;
    }
  }
  EXPECT_GE(counts.size(), 10u);
  for (const auto& [tmpl, n] : counts) EXPECT_GE(n.first, 4) << tmpl << " rendered too few conversations";
  // The cases each required family must get right, beyond plain chats.
  const auto expect_case = [&](const std::string& tmpl, const std::string& conv, bool raises) {
    bool found = false;
    for (const auto& c : manifest)
      if (c["template"] == tmpl && c["conversation"] == conv) {
        found = true;
        EXPECT_EQ(c.contains("error"), raises) << tmpl << " / " << conv;
      }
    EXPECT_TRUE(found) << tmpl << " / " << conv;
  };
  expect_case("mistral-7b-instruct-v0.1.jinja", "roles_do_not_alternate", true);
  expect_case("mistral-7b-instruct-v0.3.jinja", "roles_do_not_alternate", true);
  expect_case("mistral-7b-instruct-v0.3.jinja", "tool_call_round_trip", false);
  expect_case("llama-3.1-8b-instruct.jinja", "tool_call_round_trip", false);
  expect_case("llama-3.1-8b-instruct.jinja", "builtin_tools", false);
  expect_case("qwen2.5-7b-instruct.jinja", "tool_call_then_answer", false);
}

}  // namespace
