// `kvpipe serve`: an OpenAI-compatible HTTP server in front of the job's pipeline.
//
// Rank 0 listens (HttpFrontEnd) and coordinates: HTTP requests reach its step loop through
// a queue, become engine requests, and every sampled token goes back to its HTTP thread as
// text (stop strings and split UTF-8 characters held back), ids and log-probabilities. The
// other ranks run their stages as in `generate`. /health answers 503 until the weights are
// loaded. SIGINT or SIGTERM closes the door (new requests get 503), lets accepted requests
// finish for --shutdown-timeout seconds, cancels what is left, and exits 0.
#pragma once

#include "parallel/world.h"

#include <string>
#include <vector>

namespace kvpipe {

struct ServeOptions {
  std::string config;
  std::vector<std::string> overrides;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;
  std::string served_model_name;  // "" : the model file's name
  int http_threads = 512;
  int max_requests = 1024;        // unfinished engine requests (choices) before 503
  long long max_body_bytes = 8ll << 20;
  double header_timeout_s = 10.0;
  double shutdown_timeout_s = 30.0;
  std::string chat_template;      // a Jinja file replacing the model's template ("" : the model's)
  std::string tool_call_parser;   // how `tool_choice: auto` output is read ("" : from the template)
};

// Throws std::invalid_argument for bad input (config, options, a port that cannot be bound).
void serve(const ServeOptions& options, World& world);

}  // namespace kvpipe
