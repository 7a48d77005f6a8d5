// Fuzzes the server's request parsing (launch/serve/serve_protocol.cpp): a JSON body for
// /v1/completions, /v1/chat/completions, /tokenize or /detokenize (the first input byte picks
// which) against a served model with init-model's tokenizer and ChatML template, then the
// response a parsed request gets; or (first byte 4 or 5 mod 6) the text of a model's answer
// read as tool calls in each syntax, whole and split at every fourth byte. The server answers a bad body with an ApiError (400/404);
// any other exception is a 500 and counts as a finding here.
#include "engine/grammar/token_constraint.h"
#include "engine/text/tokenizer_builder.h"
#include "launch/model_text.h"
#include "launch/serve/serve_protocol.h"
#include "tests/fuzz/fuzz_support.h"

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

namespace {

const kvpipe::ServedModel& served_model() {
  static const kvpipe::ServedModel model = [] {
    const std::string dir = kvpipe::fuzz::scratch_dir() + "/model";
    std::filesystem::create_directories(dir);
    kvpipe::write_hf_tokenizer(kvpipe::build_byte_level_vocab(512, 1, {2}), dir);
    static const kvpipe::ModelText text(dir);
    if (!text.tokenizer() || !text.chat_template()) std::abort();
    kvpipe::ServedModel m;
    m.name = "fuzz-model";
    m.text = &text;
    m.vocab_size = text.tokenizer()->vocab_size();
    m.max_context = 256;
    m.max_request_tokens = 256;
    m.vocabulary = kvpipe::TokenVocabulary::of(*text.tokenizer(), {2});
    // Let tool requests through to the parsing and the response (the template ignores them).
    m.renders_tools = true;
    m.tool_syntax = kvpipe::ToolCallSyntax::kHermes;
    return m;
  }();
  return model;
}

void respond(const kvpipe::CompletionRequest& request, const kvpipe::ServedModel& model) {
  kvpipe::ResponseWriter writer(request, "cmpl-fuzz", 0, model.name, model.text->tokenizer());
  for (int c = 0; c < request.choices(); ++c) {
    if (request.chat) (void)writer.role_chunk(c);
    for (int64_t token : {3, 300, 2}) {
      kvpipe::ChoiceEvent event;
      event.index = c;
      event.token = token;
      event.text = model.text->tokenizer()->token_bytes(token);
      if (request.logprobs >= 0) {
        kvpipe::TokenLogprob lp;
        lp.token = token;
        lp.logprob = -1.5f;
        for (int k = 0; k < request.logprobs; ++k) lp.top.emplace_back(k, -0.1f * k);
        event.logprob = lp;
      }
      if (token == 2) {
        event.finish_reason = "stop";
        event.prompt_tokens = static_cast<int64_t>(request.prompts[c / request.n].size());
      }
      (void)writer.chunk(event);
      writer.add(event);
    }
  }
  if (request.include_usage) (void)writer.usage_chunk();
  (void)writer.response();
}

void read_tool_calls(const std::string& text, bool split) {
  using kvpipe::ToolChoice;
  for (auto syntax : {kvpipe::ToolCallSyntax::kHermes, kvpipe::ToolCallSyntax::kLlama3Json, kvpipe::ToolCallSyntax::kMistral}) {
    for (auto kind : {ToolChoice::Kind::kAuto, ToolChoice::Kind::kRequired, ToolChoice::Kind::kNamed}) {
      ToolChoice choice;
      choice.kind = kind;
      choice.function = "f";
      choice.names = {"f", "get_weather"};
      choice.syntax = syntax;
      kvpipe::ToolCallStream stream(choice, "fuzz");
      std::string seen;
      for (size_t at = 0; at < text.size(); at += split ? 4 : text.size()) {
        seen += stream.push(text.substr(at, split ? 4 : text.size())).content;
      }
      seen += stream.finish("stop").content;
      // What was released as content as it came is the stream's content in the end.
      if (seen != stream.content()) std::abort();
      for (const auto& call : stream.calls())
        if (call.name != "f" && call.name != "get_weather") std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpipe;
  if (size == 0) return 0;
  const ServedModel& model = served_model();
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (data[0] % 6) {
      case 0: respond(parse_completion_request(body, false, model, 7), model); break;
      case 1: respond(parse_completion_request(body, true, model, 7), model); break;
      case 2: (void)tokenize_response(body, model); break;
      case 3: (void)detokenize_response(body, model); break;
      case 4: read_tool_calls(body, false); break;
      case 5: read_tool_calls(body, true); break;
    }
  } catch (const ApiError& e) {
    if (e.status < 400 || e.status > 499) std::abort();
  }
  return 0;
}
