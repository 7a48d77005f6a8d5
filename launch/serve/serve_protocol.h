// ServeProtocol: OpenAI's HTTP API as `kvpipe serve` speaks it.
//
// Owns the translation between JSON bodies and what the engine runs: a completion or chat
// request is checked field by field and becomes prompts (token ids) plus sampling settings;
// the engine's per-token events become OpenAI's responses and stream chunks. Guarantees: a
// bad body is an ApiError whose message names the field (400), an unknown model is 404, and
// a field kvpipe does not implement is a 400 naming it (never silently ignored: the client
// would believe it got what it asked for), save a few that change nothing in the answer
// (`user`, `metadata`, `store`, `service_tier`); every JSON written is valid UTF-8 (token
// pieces that split a character are written with U+FFFD).
#pragma once

#include "engine/logits_processor.h"
#include "engine/step_batch.h"
#include "launch/serve/tool_calls.h"

#include <nlohmann/json_fwd.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {

class ModelText;
class Tokenizer;
struct TokenVocabulary;
class ConstraintCache;

// An error as the client sees it: an HTTP status and OpenAI's error object.
struct ApiError : std::runtime_error {
  ApiError(int status, const std::string& message, std::string param = "", std::string code = "")
      : std::runtime_error(message), status(status), param(std::move(param)), code(std::move(code)) {}
  int status;
  std::string param;  // the offending field, "" for none
  std::string code;   // OpenAI's code ("model_not_found", "invalid_api_key", ...), "" for null
};

// {"error": {"message", "type", "param", "code"}} for `status`.
std::string error_body(int status, const std::string& message, const std::string& param = "",
                       const std::string& code = "");

// What a request can ask of the served model.
struct ServedModel {
  std::string name;
  const ModelText* text = nullptr;  // tokenizer and chat template (the tokenizer may be absent)
  // Every token's bytes, for structured outputs (null without a tokenizer).
  std::shared_ptr<const TokenVocabulary> vocabulary;
  // Compiled constraints shared by the requests that ask for the same pattern (null: each
  // request compiles its own).
  std::shared_ptr<ConstraintCache> constraints;
  int64_t vocab_size = 0;
  int64_t max_context = 0;          // prompt + output tokens
  int64_t max_request_tokens = 0;   // prompt + max_tokens that the KV pool can hold
  // Tool calls: whether the chat template shows the model its tools, and the syntax in
  // which `tool_choice: auto` output is read (--tool-call-parser, or the template's).
  bool renders_tools = false;
  ToolCallSyntax tool_syntax = ToolCallSyntax::kNone;

  // The longest request (prompt + output) this model serves: the smaller of the two, as
  // /v1/models' max_model_len says and the context-length refusals name.
  int64_t max_model_len() const { return std::min(max_context, max_request_tokens); }
  // What sets it: "cache.memory" (the KV pool) or "the model's context length".
  std::string max_model_len_limit() const {
    return max_request_tokens < max_context ? "cache.memory" : "the model's context length";
  }
};

struct CompletionRequest {
  bool chat = false;
  std::vector<std::vector<int64_t>> prompts;  // completions may send several; chat sends one
  int64_t max_tokens = 16;
  SamplingParams sampling;      // seed: the request's, or a fresh random one
  LogitsProcessing processing;  // structured output, logit_bias, penalties, min_tokens, bad_words
  int n = 1;                    // choices per prompt
  std::vector<std::string> stop;
  bool ignore_eos = false;
  int logprobs = -1;            // top alternatives per token; -1: no log-probabilities
  bool stream = false;
  bool include_usage = false;   // stream_options.include_usage
  bool return_token_ids = false;  // vLLM's extension: prompt and output ids in each choice
  ToolChoice tools;             // chat: how the output is read as tool calls
  int choices() const { return static_cast<int>(prompts.size()) * n; }
};

// Parses a /v1/completions (`chat` false) or /v1/chat/completions body. `random_seed` seeds
// requests that give none. Throws ApiError.
CompletionRequest parse_completion_request(const std::string& body, bool chat, const ServedModel& model,
                                           uint64_t random_seed);

// A generated token's log-probability and its most likely alternatives (from the raw logits).
struct TokenLogprob {
  int64_t token = 0;
  float logprob = 0.0f;
  std::vector<std::pair<int64_t, float>> top;  // most likely first
};

// From one row of logits: `token`'s log-probability and the `top` most likely tokens.
TokenLogprob token_logprob(const float* logits, int64_t vocab, int64_t token, int top);

// What a choice produced since the last event; `finish_reason` set on its last event.
struct ChoiceEvent {
  int index = 0;
  std::optional<int64_t> token;       // absent on a final event that adds no token
  std::string text;                   // text released with this event (may be empty)
  std::optional<TokenLogprob> logprob;
  std::string finish_reason;
  // Set on the final event: prompt tokens and how many of them came from the prefix cache.
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;
  // The request failed in the engine (the message, as a 400 error).
  std::string error;
};

// Shapes responses for one request (its id, creation time, model name and kind).
class ResponseWriter {
 public:
  ResponseWriter(const CompletionRequest& request, std::string id, int64_t created, std::string model,
                 const Tokenizer* tokenizer);

  // The stream chunk of an event (without "data: "), or "" when it has nothing to show.
  std::string chunk(const ChoiceEvent& event);
  // The chunk that opens a chat choice (delta.role), before its first token.
  std::string role_chunk(int index) const;
  // The final usage chunk.
  std::string usage_chunk() const;
  // Records an event for the non-streaming response (and the usage).
  void add(const ChoiceEvent& event);
  // The whole response once every choice has finished.
  std::string response() const;

 private:
  nlohmann::json logprobs_json(const std::vector<TokenLogprob>& lps, size_t text_offset) const;
  nlohmann::json usage_json() const;
  nlohmann::json envelope(const char* object) const;
  // Records an event; returns what the client sees of it (content and tool calls).
  ToolCallStream::Update record(const ChoiceEvent& event);

  const CompletionRequest& request_;
  std::string id_;
  int64_t created_;
  std::string model_;
  const Tokenizer* tokenizer_;
  struct Choice {
    std::string text;
    std::vector<int64_t> tokens;
    std::vector<TokenLogprob> logprobs;
    std::string finish_reason;
    std::optional<ToolCallStream> tool_calls;  // chat requests with tools
  };
  std::vector<Choice> choices_;
  int64_t prompt_tokens_ = 0, cached_tokens_ = 0, completion_tokens_ = 0;
};

// /tokenize and /detokenize bodies (vLLM's shapes); Throws ApiError.
std::string tokenize_response(const std::string& body, const ServedModel& model);
std::string detokenize_response(const std::string& body, const ServedModel& model);
// GET /v1/models.
std::string models_response(const ServedModel& model, int64_t created);

// JSON text of `j` with invalid UTF-8 replaced by U+FFFD.
std::string dump_json(const nlohmann::json& j);

}  // namespace kvpipe
