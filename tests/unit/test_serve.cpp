// kvpipe serve's parts that need no socket: the OpenAI request parser and response shapes,
// log-probabilities against a double-precision recompute, the Prometheus text, the queue
// between HTTP threads and the coordinator, and the scheduler's prefill budget. The live
// server is tested with real clients in tests/server/.
#include "engine/scheduler.h"
#include "launch/serve/serve_metrics.h"
#include "launch/serve/serve_protocol.h"
#include "launch/serve/serve_queue.h"
#include "tests/support/engine_run.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <thread>

namespace kvpipe {
namespace {

using json = nlohmann::json;
using kvpipe::testing::make_request;

ServedModel id_only_model() {
  ServedModel m;
  m.name = "tiny";
  m.vocab_size = 100;
  m.max_context = 64;
  m.max_request_tokens = 48;
  return m;
}

int status_of(const std::string& body, bool chat = false, std::string* param = nullptr) {
  try {
    parse_completion_request(body, chat, id_only_model(), 5);
  } catch (const ApiError& e) {
    if (param) *param = e.param;
    return e.status;
  }
  return 200;
}

TEST(ServeProtocol, TheAdvertisedContextIsTheOneServed) {
  // The KV pool holds 48 tokens of one request, the model 64: 48 is what /v1/models says,
  // what /tokenize says, and what a refusal names, with the key that sets it.
  const ServedModel m = id_only_model();
  EXPECT_EQ(json::parse(models_response(m, 0))["data"][0]["max_model_len"], 48);
  std::vector<int64_t> prompt(48, 7);
  try {
    parse_completion_request(json{{"prompt", prompt}}.dump(), false, m, 5);
    FAIL() << "a 48-token prompt leaves no room in 48 tokens";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_NE(std::string(e.what()).find("maximum context length is 48 tokens (set by cache.memory)"),
              std::string::npos)
        << e.what();
  }
  prompt.resize(40);
  try {
    parse_completion_request(json{{"prompt", prompt}, {"max_tokens", 9}}.dump(), false, m, 5);
    FAIL() << "40 + 9 tokens exceed 48";
  } catch (const ApiError& e) {
    EXPECT_NE(std::string(e.what()).find("48 tokens (set by cache.memory). However, you requested 49 tokens"),
              std::string::npos)
        << e.what();
  }
  ServedModel roomy = m;
  roomy.max_request_tokens = 1000;
  EXPECT_EQ(json::parse(models_response(roomy, 0))["data"][0]["max_model_len"], 64);
  EXPECT_EQ(roomy.max_model_len_limit(), "the model's context length");
}

TEST(ServeProtocol, CompletionDefaultsFollowOpenAI) {
  const CompletionRequest r = parse_completion_request(R"({"prompt": [1, 2, 3], "user": "u", "metadata": {"x": 1}})",
                                                       false, id_only_model(), 77);
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0], (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(r.max_tokens, 16);
  EXPECT_DOUBLE_EQ(r.sampling.temperature, 1.0);
  EXPECT_EQ(r.sampling.seed, 77u);  // no seed given: the server's fresh one
  EXPECT_EQ(r.n, 1);
  EXPECT_EQ(r.logprobs, -1);
  EXPECT_FALSE(r.stream);
}

TEST(ServeProtocol, FieldsAreReadAndChecked) {
  const CompletionRequest r = parse_completion_request(
      R"({"prompt": [[1, 2], [3]], "n": 2, "seed": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "max_tokens": 40,
          "logprobs": 3, "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": true})",
      false, id_only_model(), 1);
  EXPECT_EQ(r.prompts.size(), 2u);
  EXPECT_EQ(r.choices(), 4);
  EXPECT_EQ(r.sampling.seed, 9u);
  EXPECT_EQ(r.sampling.top_k, 5);
  EXPECT_EQ(r.max_tokens, 40);
  EXPECT_EQ(r.logprobs, 3);
  EXPECT_TRUE(r.include_usage);
  EXPECT_TRUE(r.ignore_eos);
  std::string param;
  EXPECT_EQ(status_of(R"({"prompt": [1], "max_tokens": 48})", false, &param), 400);  // 1 + 48 > 48
  EXPECT_EQ(param, "max_tokens");
  EXPECT_EQ(status_of(R"({"prompt": [1], "max_tokens": 47})"), 200);
  EXPECT_EQ(status_of(R"({"prompt": "text needs a tokenizer"})", false, &param), 400);
  EXPECT_EQ(param, "prompt");
  EXPECT_EQ(status_of(R"({"prompt": [1], "stop": ["x"]})", false, &param), 400);
  EXPECT_EQ(param, "stop");
  EXPECT_EQ(status_of(R"({"prompt": [100]})"), 400);
  EXPECT_EQ(status_of(R"({"prompt": [1], "model": "other"})"), 404);
  EXPECT_EQ(status_of(R"({"prompt": [1], "model": "tiny"})"), 200);
  EXPECT_EQ(status_of(R"({"prompt": [1], "n": 1.5})", false, &param), 400);
  EXPECT_EQ(param, "n");
  EXPECT_EQ(status_of(R"({"prompt": [1], "temperature": 1e999})"), 400);
  EXPECT_EQ(status_of(R"({"prompt": [1], "seed": 18446744073709551615})"), 200);
  EXPECT_EQ(status_of(R"({"messages": [{"role": "user", "content": "hi"}]})", true, &param), 400);
  EXPECT_EQ(param, "messages");  // no chat template without a tokenizer
}

TEST(ServeProtocol, ErrorBodyHasOpenAIShape) {
  const json e = json::parse(error_body(400, "max_tokens: bad", "max_tokens"))["error"];
  EXPECT_EQ(e["message"], "max_tokens: bad");
  EXPECT_EQ(e["type"], "invalid_request_error");
  EXPECT_EQ(e["param"], "max_tokens");
  EXPECT_EQ(e["code"], 400);
  EXPECT_TRUE(json::parse(error_body(503, "busy"))["error"]["param"].is_null());
}

TEST(ServeProtocol, LogprobsMatchADoubleRecompute) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, -1.0f, 3.0f};
  const TokenLogprob lp = token_logprob(logits.data(), 5, 2, 3);
  double z = 0;
  for (float x : logits) z += std::exp(static_cast<double>(x));
  EXPECT_NEAR(lp.logprob, 2.0 - std::log(z), 1e-6);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].first, 1);  // ties: the lower id first
  EXPECT_EQ(lp.top[1].first, 4);
  EXPECT_EQ(lp.top[2].first, 2);
  EXPECT_NEAR(lp.top[0].second, 3.0 - std::log(z), 1e-6);
  const std::vector<float> ruled_out = {0.0f, -INFINITY};
  EXPECT_EQ(token_logprob(ruled_out.data(), 2, 1, 0).logprob, -9999.0f);
}

TEST(ServeProtocol, FieldsKvpipeDoesNotImplementAreRefusedByName) {
  for (const std::string field : {"unknown_field", "messages_unused", "guided_json", "stop_token_ids", "echo_prompt"}) {
    try {
      parse_completion_request(R"({"prompt": [1], ")" + field + R"(": 1})", false, id_only_model(), 1);
      ADD_FAILURE() << field << " was accepted";
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400);
      EXPECT_EQ(e.param, field);
    }
  }
  // Chat-only fields on completions, and the reverse.
  EXPECT_THROW(parse_completion_request(R"({"prompt": [1], "messages": []})", false, id_only_model(), 1), ApiError);
  EXPECT_THROW(parse_completion_request(R"({"prompt": [1], "top_logprobs": 1})", false, id_only_model(), 1), ApiError);
  // Penalties and bias reach the request; a constraint needs a tokenizer.
  const CompletionRequest r = parse_completion_request(
      R"({"prompt": [1], "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.1, "min_p": 0.2,
          "min_tokens": 3, "logit_bias": {"5": -100, "7": 2}})",
      false, id_only_model(), 1);
  EXPECT_DOUBLE_EQ(r.processing.presence_penalty, 0.5);
  EXPECT_DOUBLE_EQ(r.processing.frequency_penalty, -1.0);
  EXPECT_DOUBLE_EQ(r.processing.repetition_penalty, 1.1);
  EXPECT_DOUBLE_EQ(r.sampling.min_p, 0.2);
  EXPECT_EQ(r.processing.min_tokens, 3);
  EXPECT_EQ(r.processing.logit_bias, (std::vector<std::pair<int64_t, float>>{{5, -100.0f}, {7, 2.0f}}));
  try {
    parse_completion_request(R"({"prompt": [1], "structured_outputs": {"regex": "a+"}})", false, id_only_model(), 1);
    ADD_FAILURE() << "a regex without a tokenizer was accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param, "structured_outputs.regex");
  }
}

TEST(ServeProtocol, ChunksAndUsageCountEachPromptOnce) {
  const CompletionRequest r = parse_completion_request(R"({"store": false, "prompt": [1, 2, 3], "n": 2,
                                                          "stream": true, "return_token_ids": true})",
                                                       false, id_only_model(), 1);
  ResponseWriter w(r, "cmpl-1", 123, "tiny", nullptr);
  ChoiceEvent tok;
  tok.index = 1;
  tok.token = 42;
  const json chunk = json::parse(w.chunk(tok));
  EXPECT_EQ(chunk["object"], "text_completion");
  EXPECT_EQ(chunk["choices"][0]["index"], 1);
  EXPECT_EQ(chunk["choices"][0]["token_ids"], json::array({42}));
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
  for (int i = 0; i < 2; ++i) {
    ChoiceEvent end;
    end.index = i;
    end.finish_reason = "length";
    end.prompt_tokens = 3;
    end.cached_tokens = 1;
    EXPECT_EQ(json::parse(w.chunk(end))["choices"][0]["finish_reason"], "length");
  }
  const json usage = json::parse(w.usage_chunk())["usage"];
  EXPECT_EQ(usage["prompt_tokens"], 3);
  EXPECT_EQ(usage["completion_tokens"], 1);
  EXPECT_EQ(usage["total_tokens"], 4);
  EXPECT_EQ(usage["prompt_tokens_details"]["cached_tokens"], 1);
  const json whole = json::parse(w.response());
  EXPECT_EQ(whole["choices"][1]["token_ids"], json::array({42}));
  EXPECT_EQ(whole["choices"][0]["prompt_token_ids"], json::array({1, 2, 3}));
}

TEST(ServeMetrics, PrometheusTextHasCumulativeBuckets) {
  ServeMetrics m("a\"b");
  m.observe_first_token(0.03);
  m.observe_first_token(7.0);
  m.add_generation_token(-1.0);
  m.add_generation_token(0.02);
  m.observe_finished("stop", 1.2, 0.1);
  ServeMetrics::Gauges g;
  g.kv_blocks_used = 5;
  g.kv_blocks_total = 20;
  m.set_gauges(g);
  const std::string text = m.render();
  const std::string l = "model_name=\"a\\\"b\"";
  EXPECT_NE(text.find("kvpipe:time_to_first_token_seconds_bucket{" + l + ",le=\"0.04\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvpipe:time_to_first_token_seconds_bucket{" + l + ",le=\"10\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("kvpipe:time_to_first_token_seconds_bucket{" + l + ",le=\"+Inf\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("kvpipe:time_to_first_token_seconds_count{" + l + "} 2\n"), std::string::npos);
  EXPECT_NE(text.find("kvpipe:generation_tokens_total{" + l + "} 2\n"), std::string::npos);
  EXPECT_NE(text.find("kvpipe:inter_token_latency_seconds_count{" + l + "} 1\n"), std::string::npos);
  EXPECT_NE(text.find("kvpipe:kv_cache_usage_perc{" + l + "} 0.25\n"), std::string::npos);
  EXPECT_NE(text.find("kvpipe:request_success_total{" + l + ",finished_reason=\"stop\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE kvpipe:e2e_request_latency_seconds histogram\n"), std::string::npos);
}

TEST(ServeQueue, BoundsUnfinishedRequestsAndClosesOnShutdown) {
  ServeQueue q(3);
  Submission a, b, c;
  EXPECT_EQ(q.submit(a, 2), ServeQueue::Admission::kAccepted);
  EXPECT_EQ(q.submit(b, 2), ServeQueue::Admission::kFull);
  EXPECT_EQ(q.submit(c, 1), ServeQueue::Admission::kAccepted);
  EXPECT_NE(a.id, c.id);
  std::vector<Submission> got;
  std::vector<uint64_t> cancelled;
  q.cancel(a.id);
  q.take(got, cancelled);
  EXPECT_EQ(got.size(), 2u);
  EXPECT_EQ(cancelled, std::vector<uint64_t>{a.id});
  q.finished(2);
  EXPECT_EQ(q.unfinished(), 1);
  q.close();
  EXPECT_EQ(q.submit(b, 1), ServeQueue::Admission::kClosed);
}

TEST(ServeQueue, ChannelEndsAfterEveryChoiceFinished) {
  ResponseChannel ch(2);
  std::thread coordinator([&] {
    for (int i = 0; i < 2; ++i) {
      ChoiceEvent tok;
      tok.index = i;
      tok.token = 7;
      ch.push(tok);
      ChoiceEvent end;
      end.index = i;
      end.finish_reason = "stop";
      ch.push(end);
    }
  });
  std::vector<ChoiceEvent> all;
  while (ch.wait(all, std::chrono::milliseconds(1000))) {
  }
  coordinator.join();
  EXPECT_EQ(all.size(), 4u);
}

// --- the scheduler's prefill budget ------------------------------------------------------

// One step: schedules, then returns token 1 for every sampled sequence.
StepBatch step(Scheduler& s, int64_t k) {
  std::vector<Sequence*> seqs;
  StepBatch b = s.schedule(k, seqs);
  StepOutput out;
  for (const SeqStep& st : b.seqs)
    if (st.sample) {
      out.request_ids.push_back(st.request_id);
      out.tokens.push_back(1);
    }
  s.update(b, seqs, out, {});
  return b;
}

int64_t prompt_tokens_of(const StepBatch& b, int64_t id) {
  for (const SeqStep& st : b.seqs)
    if (st.request_id == id) return st.num_new;
  return 0;
}

SchedulerOptions scheduler_options(int64_t max_prefill) {
  SchedulerOptions o;
  o.block_size = 16;
  o.max_context = 4096;
  o.max_prefill_tokens_per_step = max_prefill;
  return o;
}

TEST(SchedulerPrefillBudget, LongPromptsGoInChunksWhileOthersDecode) {
  Scheduler s(scheduler_options(32), 256);
  s.add(make_request(0, {5, 6, 7}, 100));
  EXPECT_EQ(prompt_tokens_of(step(s, 0), 0), 3);  // alone: its whole prompt
  s.add(make_request(1, std::vector<int64_t>(200, 9), 2));
  int64_t computed = 0, steps = 0;
  while (computed < 200) {
    const StepBatch b = step(s, 1 + steps++);
    EXPECT_EQ(prompt_tokens_of(b, 0), 1) << "the decoding request must get its token every step";
    const int64_t n = prompt_tokens_of(b, 1);
    EXPECT_LE(n, 32);
    ASSERT_GT(n, 0);
    computed += n;
  }
  EXPECT_EQ(steps, 7);  // ceil(200 / 32)

  // With nothing decoding, a prompt takes the whole step budget.
  Scheduler idle(scheduler_options(32), 256);
  idle.add(make_request(2, std::vector<int64_t>(200, 9), 2));
  EXPECT_EQ(prompt_tokens_of(step(idle, 0), 2), 200);
}

TEST(SchedulerPrefillBudget, ZeroMeansOnlyTheStepBudget) {
  Scheduler s(scheduler_options(0), 256);
  s.add(make_request(0, {5}, 10));
  step(s, 0);
  s.add(make_request(1, std::vector<int64_t>(300, 4), 16));
  EXPECT_EQ(prompt_tokens_of(step(s, 1), 1), 300);
}

TEST(SchedulerLimits, MaxRequestTokensIsWhatAddAccepts) {
  Scheduler s(scheduler_options(0), 10);  // 160 tokens
  const int64_t most = s.max_request_tokens();
  EXPECT_EQ(most, 161);  // the last token is never fed back
  EXPECT_NO_THROW(s.add(make_request(0, std::vector<int64_t>(100, 1), most - 100)));
  EXPECT_THROW(s.add(make_request(1, std::vector<int64_t>(100, 1), most - 99)), std::invalid_argument);
}

}  // namespace
}  // namespace kvpipe
