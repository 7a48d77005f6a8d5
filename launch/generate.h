// `kvpipe generate`: runs a job's requests and prints one JSON line per request.
//
// Rank 0 writes each request's line the moment the request finishes (finish order; every
// line carries its "id"), as one write of the whole line, to stdout and to --output FILE
// when given: a job stopped by a signal, even one whose stdout mpirun stops forwarding, has
// already written every request finished before the signal, and no half line. Every write
// is checked: a result that cannot be written fails the command (exit 1) naming the output.
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
  std::string output;                       // --output FILE: the result lines, also written here
};

// Results go to stdout (rank 0), logs and the timing summary to stderr. Throws
// std::invalid_argument for bad input (an --output or --logprobs-out path that cannot be
// opened included: checked before the weights load), and JobFailure when a result could not
// be written or a request failed (finish_reason "error"; thrown after every other result
// is out).
void generate(const GenerateOptions& options, World& world);

}  // namespace kvpipe
