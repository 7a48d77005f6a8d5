// `kvpipe generate`: runs a job's requests and prints one JSON line per request.
#pragma once

#include "parallel/world.h"

#include <optional>
#include <string>
#include <vector>

namespace kvpipe {

struct GenerateOptions {
  std::string config;
  std::vector<std::string> overrides;
  // One of these replaces the config's requests when given.
  std::vector<int64_t> prompt_ids;
  std::optional<std::string> prompt_text;   // tokenised as `kvpipe tokenize` does
  std::optional<std::string> chat_text;     // one user message through the chat template
  std::optional<int> max_new_tokens;        // applies to every request
  std::string logprobs_out;
};

// Results go to stdout (rank 0), logs and the timing summary to stderr. Throws
// std::invalid_argument for bad input.
void generate(const GenerateOptions& options, World& world);

}  // namespace kvpipe
