// Conversations (launch/bench/conversations.h): ShareGPT's JSON read as a stream and cut at
// every byte, conversations JSONL with bad lines, the dataset's file, and the seed's order.
#include "launch/bench/conversations.h"
#include "launch/bench/dataset_workload.h"
#include "tests/support/command.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;

// Five conversations: braces, brackets, quotes and escapes inside strings; a system prompt; a
// reply that breaks the alternation; one with no answered user message (skipped).
const char* const kShareGpt = R"([
  {"id": "a", "conversations": [{"from": "human", "value": "What is {this} \"thing\" [x]?"},
                                {"from": "gpt", "value": "A brace: } and a backslash: \\"}]},
  {"id": "b", "conversations": [{"from": "system", "value": "Be brief."},
                                {"from": "human", "value": "one"}, {"from": "gpt", "value": "1"},
                                {"from": "human", "value": "two"}, {"from": "gpt", "value": "2"}]},
  {"id": "c", "conversations": [{"from": "gpt", "value": "I speak first"}, {"from": "human", "value": "no"}]},
  {"id": "d", "conversations": [{"from": "human", "value": "hi"}, {"from": "bing", "value": "hello"},
                                {"from": "human", "value": "again"}, {"from": "human", "value": "twice"}]},
  {"id": "e", "conversations": [{"from": "human", "value": "last \u00e9"}, {"from": "gpt", "value": "end"}]}
]
)";

class Conversations : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = kvpipe::testing::make_scratch_dir(); }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary) << text;
    return p.string();
  }
  fs::path dir_;
};

TEST_F(Conversations, ShareGptIsNormalised) {
  const ConversationFile f = read_conversations(write("s.json", kShareGpt));
  EXPECT_FALSE(f.truncated);
  EXPECT_EQ(f.skipped, 1);  // "c": no user message answered
  ASSERT_EQ(f.conversations.size(), 4u);
  EXPECT_EQ(f.conversations[0].id, "a");
  ASSERT_EQ(f.conversations[0].turns.size(), 1u);
  EXPECT_EQ(f.conversations[0].turns[0].first, "What is {this} \"thing\" [x]?");
  EXPECT_EQ(f.conversations[0].turns[0].second, "A brace: } and a backslash: \\");
  ASSERT_EQ(f.conversations[1].system.size(), 1u);
  EXPECT_EQ(f.conversations[1].system[0].content, "Be brief.");
  EXPECT_EQ(f.conversations[1].turns.size(), 2u);
  ASSERT_EQ(f.conversations[2].turns.size(), 1u);  // "d": up to the unanswered "again"
  EXPECT_EQ(f.conversations[2].turns[0].second, "hello");
  EXPECT_EQ(f.conversations[3].turns[0].first, "last \xc3\xa9");
}

// Cut anywhere after the '[': every conversation closed before the cut is kept, the broken
// tail dropped and counted, and nothing throws.
TEST_F(Conversations, ShareGptCutAtEveryByteKeepsTheCompleteConversations) {
  const std::string text = kShareGpt;
  const std::vector<std::string> ids = {"a", "b", "c", "d", "e"};
  std::vector<size_t> closes;  // where each conversation's object ends
  for (const std::string& id : ids) {
    const size_t next = text.find("{\"id\": \"" + std::string(1, static_cast<char>(id[0] + 1)) + "\"");
    const size_t end = next == std::string::npos ? text.rfind(']') : next;
    closes.push_back(text.rfind('}', end));
  }
  for (size_t cut = text.find('[') + 1; cut < text.size(); ++cut) {
    const std::string path = write("cut.json", text.substr(0, cut));
    ConversationFile f;
    ASSERT_NO_THROW(f = read_conversations(path)) << "cut at " << cut;
    size_t complete = 0;
    for (const size_t c : closes) complete += c < cut;
    const size_t skipped = complete >= 3 ? 1 : 0;  // "c"
    ASSERT_EQ(f.conversations.size() + static_cast<size_t>(f.skipped), complete) << "cut at " << cut;
    ASSERT_EQ(static_cast<size_t>(f.skipped), skipped) << "cut at " << cut;
    const bool closed = text.find(']', closes.back()) < cut;
    ASSERT_EQ(f.truncated, !closed) << "cut at " << cut;
    // Bytes are dropped when the cut falls inside a conversation, none when between two.
    const size_t last = complete > 0 ? closes[complete - 1] : text.find('[');
    const bool inside = text.substr(last + 1, cut - last - 1).find('{') != std::string::npos;
    ASSERT_EQ(f.truncated_bytes > 0, inside) << "cut at " << cut;
  }
}

TEST_F(Conversations, BrokenShareGptIsRefusedByConversation) {
  EXPECT_THROW(read_conversations(write("o.json", R"({"id": "x"})")), std::invalid_argument);
  try {
    read_conversations(write("b.json", R"([{"id": "a", "conversations": []}, {"id": "b", "conversations": [1, 2]}])"));
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("b.json: conversation 2"), std::string::npos) << e.what();
  }
  try {
    read_conversations(write("j.json", R"([{"id": "a", "conversations": [}])"));
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("conversation 1: not valid JSON"), std::string::npos) << e.what();
  }
}

TEST_F(Conversations, JsonlLinesAreConversationsAndBadLinesAreNamed) {
  const std::string good = write("c.jsonl",
                                 "[{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]\n"
                                 "\n"
                                 "{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", "
                                 "\"content\": \"q\"}, {\"role\": \"assistant\", \"content\": \"a\"}]}\n"
                                 "[{\"role\": \"user\", \"content\": \"unanswered\"}]\n"
                                 "[{\"role\": \"assistant\", \"content\": \"an earlier reply\"}, {\"role\": "
                                 "\"user\", \"content\": \"q2\"}, {\"role\": \"assistant\", \"content\": \"a2\"}]\n");
  const ConversationFile f = read_conversations(good);
  ASSERT_EQ(f.conversations.size(), 3u);
  EXPECT_EQ(f.skipped, 1);
  EXPECT_EQ(f.conversations[1].id, "line 3");
  EXPECT_EQ(f.conversations[1].system.size(), 1u);
  // A conversation that opens with a reply starts at its first question.
  ASSERT_EQ(f.conversations[2].turns.size(), 1u);
  EXPECT_EQ(f.conversations[2].turns[0].first, "q2");
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"[{\"role\": \"user\", \"content\": \"hi\"}]\n{not json\n", ":2: not valid JSON"},
      {"[{\"role\": \"user\"}]\n", ":1: a message without"},
      {"\n\n[{\"role\": \"robot\", \"content\": \"x\"}]\n", ":3: unknown role 'robot'"},
      {"{\"text\": \"x\"}\n", ":1: expected a list of messages"}};
  for (const auto& [text, want] : bad) {
    try {
      read_conversations(write("bad.jsonl", text));
      FAIL() << "no error for " << text;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("bad.jsonl" + want), std::string::npos) << e.what();
    }
  }
}

TEST_F(Conversations, SharegptNamesItsFileOrSaysWhereItLooked) {
  const std::string file = write("share.json", "[]");
  setenv("KVPIPE_SHAREGPT", file.c_str(), 1);
  EXPECT_EQ(dataset_path("sharegpt", "job.yaml: workload.dataset"), file);
  setenv("KVPIPE_SHAREGPT", (dir_ / "absent.json").c_str(), 1);
  try {
    dataset_path("sharegpt", "job.yaml: workload.dataset");
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("job.yaml: workload.dataset: sharegpt: "), std::string::npos) << e.what();
  }
  unsetenv("KVPIPE_SHAREGPT");
  EXPECT_EQ(dataset_path(file, "w"), file);
  EXPECT_THROW(dataset_path((dir_ / "none.jsonl").string(), "w"), std::invalid_argument);
}

TEST(ConversationOrder, IsAPermutationFixedBySeed) {
  const std::vector<size_t> a = conversation_order(100, 7), b = conversation_order(100, 7), c = conversation_order(100, 8);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  std::vector<size_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) ASSERT_EQ(sorted[i], i);
}

}  // namespace
}  // namespace kvpipe
