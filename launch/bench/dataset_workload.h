// DatasetWorkload: `kvpipe bench` requests made of real conversations (conversations.h),
// tokenised with the model's own tokenizer.
//
// - single (vLLM's ShareGPT sampling): each conversation's first user message, tokenised as
//   text (BOS as the model says, no chat template), is a prompt, and its reply's token count
//   the request's output length; a pair is kept when both have at least 4 tokens, the prompt
//   at most 1024 and both together at most 2048 and the model's context. Conversations are
//   taken in an order shuffled by the workload's seed.
// - multi_turn (MultiTurnSource): each conversation replayed turn by turn through the chat
//   template, every turn's prompt the whole history so far, its replies being the tokens the
//   model generated (what a chat client sends back); the next turn is due `turn_gap` seconds
//   after a reply ends, and `concurrency` conversations run at once. Turn k + 1's prompt is
//   turn k's prompt, then its reply, then the template's text up to the next generation
//   prompt, so it starts with exactly the tokens turn k left in the cache; its text is the
//   template's rendering of the history.
#pragma once

#include "engine/engine.h"
#include "launch/bench/conversations.h"
#include "launch/bench/workload.h"
#include "launch/model_text.h"

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace kvpipe {

// What the report says of the data a workload came from.
struct DatasetSummary {
  std::string path;
  int64_t conversations = 0;       // complete conversations in the file
  int64_t skipped = 0;             // without an answered user message
  bool truncated = false;          // the file ended inside a conversation
  int64_t truncated_bytes = 0;
  int64_t filtered = 0;            // looked at and left out (lengths, too few turns, context)
  int64_t used = 0;                // conversations the workload took (warm-up included)
  int64_t turns_cut = 0;           // multi_turn: turns left out because the context was full
};

// A dataset workload read and tokenised before the job starts (on every rank, so that bad
// input is exit 2 everywhere before any rank waits on another).
struct DatasetWorkload {
  DatasetSummary summary;
  std::unique_ptr<ModelText> text;
  std::vector<WorkloadRequest> requests;     // single: the warm-up's first, then the measured ones
  std::vector<Conversation> conversations;   // multi_turn: likewise
};

// Reads the job's workload.dataset for requests of at most `context` tokens (prompt and output:
// the model's context, or less where the KV pool holds less); std::invalid_argument
// naming the job file and key (or the data file and its line) for bad input.
DatasetWorkload load_dataset_workload(const JobConfig& job, int64_t context);

// The conversation order of `seed` (a permutation of [0, n)).
std::vector<size_t> conversation_order(size_t n, uint64_t seed);

// single: `total` valid pairs in the seed's order (the warm-up's first, then the measured
// ones). Throws std::invalid_argument naming `where` when the file holds too few.
std::vector<WorkloadRequest> single_turn_requests(const ConversationFile& file, const ModelText& text,
                                                  int64_t context, uint64_t seed, int64_t total,
                                                  const std::string& where, DatasetSummary& summary);

// The turn a measured request was.
struct TurnRef {
  int64_t conversation = 0;  // index among the workload's conversations
  int64_t turn = 0;          // 0 for the first
};

struct MultiTurnOptions {
  int64_t concurrency = 1;
  double turn_gap_s = 0.0;
  int64_t context = 0;
  int64_t first_id = 0;      // request ids count up from here
  SamplingParams sampling;
  LogitsProcessing processing;
};

// multi_turn: `total` conversations of at least `min_turns` turns in the seed's order (the
// warm-up's first). Throws std::invalid_argument naming `where` when the file holds too few.
std::vector<Conversation> multi_turn_conversations(const ConversationFile& file, uint64_t seed, int64_t min_turns,
                                                   int64_t total, const std::string& where,
                                                   DatasetSummary& summary);

class MultiTurnSource : public RequestSource {
 public:
  MultiTurnSource(std::vector<Conversation> conversations, const ModelText& text, MultiTurnOptions options,
                  DatasetSummary& summary);
  void poll(Engine& engine, Clock::time_point now) override;
  bool exhausted() const override;
  std::optional<Clock::time_point> next_arrival() const override;
  // A turn's request finished: its generated tokens become the reply in the history.
  void on_finished(const Sequence& sequence);

  const std::map<int64_t, TurnRef>& turns() const { return turns_; }
  // The output tokens of every turn, were all of them to run (the progress bar's total).
  int64_t planned_output_tokens() const;

  // The prompt of the turn after `previous_prompt` + `reply` (the tokens of the turn before):
  // both, then the template's text between that reply and the next generation prompt.
  // `history` holds the conversation's messages up to and including the next user message, the
  // reply's own message being the one before it. Public for the tests.
  static std::vector<int64_t> next_prompt(const ModelText& text, const std::vector<int64_t>& previous_prompt,
                                          const std::vector<int64_t>& reply, std::vector<RequestMessage> history);

 private:
  struct State {
    Conversation conversation;
    std::vector<int64_t> output_len;      // each turn's: its reply's token count (at least 1)
    std::vector<RequestMessage> history;  // rendered messages so far (replies as generated)
    std::vector<int64_t> prompt;          // the last turn's prompt
    std::vector<int64_t> reply;           // and the tokens generated for it
    int64_t next_turn = 0;
    bool running = false;                 // a turn is in the engine
    bool done = false;
    Clock::time_point due{};              // when the next turn may be sent
  };

  bool start_turn(State& s, Engine& engine);

  std::vector<State> states_;
  const ModelText& text_;
  MultiTurnOptions options_;
  DatasetSummary& summary_;
  size_t next_conversation_ = 0;
  int64_t active_ = 0;
  int64_t next_id_;
  std::map<int64_t, TurnRef> turns_;
  std::map<int64_t, size_t> running_;  // request id -> state
};

}  // namespace kvpipe
