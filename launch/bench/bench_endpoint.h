// `kvpipe bench --endpoint URL`: the bench workload sent to an OpenAI-compatible server.
//
// Owns the HTTP client side of `kvpipe bench`: it draws the same requests as the in-process
// bench (make_workload: prompt token ids, output lengths, Poisson arrival times, shared
// prefixes, warm-up requests first) from the config's `workload:` and the vocabulary of its
// `model:` (config only: no weights are read, no MPI job is started), and sends each as a
// streaming `POST /v1/completions` (`ignore_eos`, temperature 0, usage requested) to
// kvpipe serve, llama.cpp's llama-server or vLLM, one client thread per request in flight.
//
// Guarantees: the figures are those `vllm bench serve` reports, with its definitions (TTFT
// from the request's arrival to the first streamed chunk carrying output, TPOT = (E2EL -
// TTFT) / (output tokens - 1), ITL = the gaps between chunks, E2EL to the last such chunk,
// goodput = requests meeting every SLO given, per second), computed by the pure functions
// below so tests can check them on hand-made timings. A request counts as failed, never as
// completed, when the server answers with an HTTP error, an error event or fewer tokens than
// asked; failures are counted and the first one's message kept. An endpoint that cannot be
// reached fails before anything is measured, with std::invalid_argument naming the URL.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvpipe {

struct BenchOptions;

// Runs options.config's workload against options.endpoint and writes DIR/report.json and
// DIR/requests.csv, and the summary to stdout. Throws std::invalid_argument for bad input:
// config, --goodput, an unreachable endpoint, an output directory that cannot be written.
void bench_endpoint(const BenchOptions& options);

// Server-sent events, fed in pieces as they arrive: complete events' `data:` payloads (lines
// joined with '\n'; CRLF or LF line ends; comments and other fields ignored).
class SseReader {
 public:
  std::vector<std::string> feed(std::string_view bytes);

 private:
  std::string line_;
  std::string data_;
  bool has_data_ = false;
};

// One streamed /v1/completions event.
struct CompletionChunk {
  bool done = false;            // `data: [DONE]`
  bool carries_output = false;  // text, or a token chunk that is not only a finish marker
  int64_t token_ids = 0;        // length of a token-id array in the choice, when sent
  std::string finish_reason;
  std::optional<int64_t> completion_tokens;  // from a usage object
  std::string error;                         // an {"error": ...} event's message
};

// Parses one event's data; a payload that is not JSON gives a chunk with `error` set.
CompletionChunk parse_completion_chunk(const std::string& data);

// What one request saw, in seconds from the start of the measured phase.
struct RequestTiming {
  int64_t id = 0;
  double arrival_s = 0;  // latencies count from here (send time; open loop: due time)
  double sent_s = 0;
  std::vector<double> chunk_s;  // arrival of every chunk carrying output
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;    // usage.completion_tokens, else token ids, else chunks
  int64_t expected_tokens = 0;  // max_tokens asked
  std::string finish_reason;
  std::string error;  // empty: the request completed
};

// Per-request figures of a completed request, in ms.
struct RequestFigures {
  double ttft_ms = 0, tpot_ms = 0, e2el_ms = 0, itl_max_ms = 0;
  std::vector<double> itl_ms;
  bool has_tpot = false;  // more than one output token
};
RequestFigures request_figures(const RequestTiming& t);

// Service-level objectives for goodput, in ms (`--goodput ttft:500`); unset ones do not count.
struct GoodputSlo {
  std::optional<double> ttft_ms, tpot_ms, e2el_ms;
  bool any() const { return ttft_ms || tpot_ms || e2el_ms; }
};
// Parses `--goodput KEY:MS` values (keys ttft, tpot, e2el; MS > 0); invalid_argument otherwise.
GoodputSlo parse_goodput(const std::vector<std::string>& specs);
// vLLM's rule: a completed request is good when it meets every SLO given; a request with a
// single output token has TPOT 0.
bool meets_slo(const RequestFigures& f, const GoodputSlo& slo);

struct EndpointMetrics {
  int64_t completed = 0, failed = 0, good = 0;
  int64_t prompt_tokens = 0, output_tokens = 0;  // of completed requests
  double duration_s = 0;
  std::vector<double> ttft_ms, tpot_ms, itl_ms, e2el_ms;
  double peak_output_tokens_per_s = 0;  // most output chunks' tokens in one 1 s bucket
  int64_t peak_concurrent = 0;          // most requests in flight in one 1 s bucket
  std::string first_error;              // of the first failed request, by id
};
EndpointMetrics compute_metrics(const std::vector<RequestTiming>& requests, double duration_s,
                                const GoodputSlo& slo);

}  // namespace kvpipe
