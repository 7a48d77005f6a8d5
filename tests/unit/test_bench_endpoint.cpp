// `kvpipe bench --endpoint`: the pure parts of the client on hand-made inputs: server-sent
// events split anywhere, completion chunks as llama-server, vLLM and kvpipe serve send them,
// and the figures (TTFT, TPOT, ITL, E2EL, percentiles, goodput, failures) from known timings.
// tests/server/test_bench_endpoint.py runs the whole client against a real `kvpipe serve`.
#include "launch/bench/bench_endpoint.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

TEST(BenchEndpointSse, EventsSurviveAnySplitOfTheStream) {
  const std::string stream =
      ": a comment\r\n"
      "data: {\"a\":1}\r\n\r\n"
      "event: message\n"
      "data: {\"b\":\n"
      "data: 2}\n\n"
      "data:[DONE]\n\n"
      "data: partial";  // no blank line yet: not an event
  const std::vector<std::string> expected = {"{\"a\":1}", "{\"b\":\n2}", "[DONE]"};
  for (size_t piece = 1; piece <= stream.size(); ++piece) {
    SseReader reader;
    std::vector<std::string> events;
    for (size_t at = 0; at < stream.size(); at += piece) {
      for (std::string& e : reader.feed(std::string_view(stream).substr(at, piece)))
        events.push_back(e);
    }
    EXPECT_EQ(events, expected) << "pieces of " << piece << " bytes";
  }
}

TEST(BenchEndpointSse, CompletionChunksOfEachServer) {
  // llama-server: one chunk per token, then a closing chunk with an empty text, the finish
  // reason and usage in the same event.
  CompletionChunk c = parse_completion_chunk(
      R"({"choices":[{"text":" a","index":0,"logprobs":null,"finish_reason":null}],"object":"text_completion"})");
  EXPECT_TRUE(c.carries_output);
  EXPECT_FALSE(c.done);
  EXPECT_FALSE(c.completion_tokens);
  c = parse_completion_chunk(
      R"({"choices":[{"text":"","index":0,"finish_reason":"length"}],"usage":{"completion_tokens":4,"prompt_tokens":5}})");
  EXPECT_FALSE(c.carries_output) << "a closing chunk with no text is not a token";
  EXPECT_EQ(c.finish_reason, "length");
  ASSERT_TRUE(c.completion_tokens);
  EXPECT_EQ(*c.completion_tokens, 4);
  // vLLM: the last token's text comes with its finish reason; usage alone, with no choices.
  c = parse_completion_chunk(R"({"choices":[{"text":"end","index":0,"finish_reason":"length"}]})");
  EXPECT_TRUE(c.carries_output);
  c = parse_completion_chunk(R"({"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":8}})");
  EXPECT_FALSE(c.carries_output);
  EXPECT_EQ(c.completion_tokens.value_or(-1), 8);
  // A special token streams as an empty text without a finish reason: still a token.
  EXPECT_TRUE(
      parse_completion_chunk(R"({"choices":[{"text":"","finish_reason":null}]})").carries_output);
  // Token ids sent with the chunk are counted.
  c = parse_completion_chunk(
      R"({"choices":[{"text":"","token_ids":[5,6,7],"finish_reason":"length"}]})");
  EXPECT_TRUE(c.carries_output);
  EXPECT_EQ(c.token_ids, 3);
  EXPECT_TRUE(parse_completion_chunk("[DONE]").done);
  EXPECT_EQ(parse_completion_chunk(
                R"({"error":{"message":"context full","type":"invalid_request_error"}})")
                .error,
            "context full");
  EXPECT_NE(parse_completion_chunk("{not json").error, "");
}

RequestTiming timing(int64_t id, double arrival_s, std::vector<double> chunks, int64_t tokens) {
  RequestTiming t;
  t.id = id;
  t.arrival_s = t.sent_s = arrival_s;
  t.chunk_s = std::move(chunks);
  t.prompt_tokens = 10;
  t.output_tokens = t.expected_tokens = tokens;
  return t;
}

TEST(BenchEndpointMetrics, PerRequestFiguresFollowVllm) {
  // Arrived at 1.0 s; first chunk at 1.1, then 1.15, 1.25, 1.3: four tokens.
  const RequestFigures f = request_figures(timing(0, 1.0, {1.1, 1.15, 1.25, 1.3}, 4));
  EXPECT_NEAR(f.ttft_ms, 100, 1e-9);
  EXPECT_NEAR(f.e2el_ms, 300, 1e-9);
  EXPECT_TRUE(f.has_tpot);
  EXPECT_NEAR(f.tpot_ms, 200.0 / 3, 1e-9);
  ASSERT_EQ(f.itl_ms.size(), 3u);
  EXPECT_NEAR(f.itl_ms[0], 50, 1e-9);
  EXPECT_NEAR(f.itl_ms[1], 100, 1e-9);
  EXPECT_NEAR(f.itl_ms[2], 50, 1e-9);
  EXPECT_NEAR(f.itl_max_ms, 100, 1e-9);
  // Two chunks carrying three tokens each: TPOT divides by the tokens, ITL has one gap.
  const RequestFigures g = request_figures(timing(1, 0.0, {0.2, 0.5}, 6));
  EXPECT_NEAR(g.tpot_ms, 300.0 / 5, 1e-9);
  EXPECT_EQ(g.itl_ms.size(), 1u);
  // One token: no TPOT (and 0 for goodput, as vLLM counts it).
  const RequestFigures h = request_figures(timing(2, 0.0, {0.05}, 1));
  EXPECT_FALSE(h.has_tpot);
  EXPECT_EQ(h.tpot_ms, 0);
  EXPECT_NEAR(h.ttft_ms, h.e2el_ms, 1e-12);
}

TEST(BenchEndpointMetrics, AggregatesGoodputAndFailures) {
  std::vector<RequestTiming> rs;
  rs.push_back(timing(5, 0.0, {0.1, 0.2, 0.3}, 3));    // TTFT 100, TPOT 100, E2EL 300
  rs.push_back(timing(6, 0.0, {0.4, 0.45, 0.5}, 3));   // TTFT 400, TPOT 50, E2EL 500
  rs.push_back(timing(7, 1.0, {1.05, 1.1, 1.15}, 3));  // TTFT 50, TPOT 50, E2EL 150
  RequestTiming failed = timing(9, 0.0, {}, 0);
  failed.expected_tokens = 3;
  failed.error = "HTTP 400: later";
  rs.push_back(failed);
  failed.id = 8;
  failed.error = "HTTP 503: first";
  rs.push_back(failed);

  GoodputSlo slo = parse_goodput({"ttft:200", "tpot:80"});
  const EndpointMetrics m = compute_metrics(rs, 2.0, slo);
  EXPECT_EQ(m.completed, 3);
  EXPECT_EQ(m.failed, 2);
  EXPECT_EQ(m.first_error, "HTTP 503: first") << "the first failed request by id";
  EXPECT_EQ(m.prompt_tokens, 30);
  EXPECT_EQ(m.output_tokens, 9);
  EXPECT_EQ(m.good, 1) << "request 5 misses tpot, 6 misses ttft, 7 meets both";
  ASSERT_EQ(m.ttft_ms.size(), 3u);
  ASSERT_EQ(m.tpot_ms.size(), 3u);
  EXPECT_EQ(m.itl_ms.size(), 6u);
  EXPECT_EQ(m.e2el_ms.size(), 3u);
  // Chunks per whole second: 6 in [0, 1), 3 in [1, 2); requests 5 and 6 active in second 0.
  EXPECT_EQ(m.peak_output_tokens_per_s, 6);
  EXPECT_EQ(m.peak_concurrent, 2);
  EXPECT_EQ(compute_metrics(rs, 2.0, parse_goodput({"e2el:400"})).good, 2);
  EXPECT_EQ(compute_metrics(rs, 2.0, GoodputSlo{}).good, 0) << "no SLO: goodput not computed";
}

TEST(BenchEndpointMetrics, GoodputSpecsAreChecked) {
  const GoodputSlo slo = parse_goodput({"ttft:250.5", "e2el:1000"});
  EXPECT_EQ(slo.ttft_ms.value_or(0), 250.5);
  EXPECT_FALSE(slo.tpot_ms);
  EXPECT_EQ(slo.e2el_ms.value_or(0), 1000);
  EXPECT_TRUE(slo.any());
  EXPECT_FALSE(parse_goodput({}).any());
  for (const char* bad : {"ttft", "ttft:", "ttft:0", "ttft:-5", "ttft:5ms", "itl:5", ":5"})
    EXPECT_THROW(parse_goodput({bad}), std::invalid_argument) << bad;
}

}  // namespace
}  // namespace kvpipe
