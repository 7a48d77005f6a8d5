#include "launch/bench/bench_endpoint.h"

#include "launch/bench/bench.h"
#include "launch/bench/bench_report.h"
#include "launch/job_config.h"
#include "launch/job_plan.h"
#include "launch/log.h"
#include "launch/output.h"
#include "launch/signals.h"
#include "launch/bench/workload.h"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <tuple>

namespace kvpipe {

using ordered_json = nlohmann::ordered_json;

std::vector<std::string> SseReader::feed(std::string_view bytes) {
  std::vector<std::string> events;
  for (const char c : bytes) {
    if (c != '\n') {
      line_ += c;
      continue;
    }
    if (!line_.empty() && line_.back() == '\r') line_.pop_back();
    if (line_.empty()) {  // a blank line ends the event
      if (has_data_) events.push_back(data_);
      data_.clear();
      has_data_ = false;
    } else if (line_.rfind("data:", 0) == 0) {
      std::string_view value(line_);
      value.remove_prefix(5);
      if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
      if (has_data_) data_ += '\n';
      data_ += value;
      has_data_ = true;
    }
    line_.clear();
  }
  return events;
}

CompletionChunk parse_completion_chunk(const std::string& data) {
  CompletionChunk c;
  if (data == "[DONE]") {
    c.done = true;
    return c;
  }
  const nlohmann::json j = nlohmann::json::parse(data, nullptr, false);
  if (!j.is_object()) {
    c.error = "not a JSON event: " + data.substr(0, 200);
    return c;
  }
  if (const auto e = j.find("error"); e != j.end()) {
    c.error = e->is_object() && e->contains("message") && (*e)["message"].is_string()
                  ? (*e)["message"].get<std::string>()
                  : e->dump();
    return c;
  }
  if (const auto choices = j.find("choices");
      choices != j.end() && choices->is_array() && !choices->empty()) {
    const nlohmann::json& choice = choices->front();
    const auto text = choice.find("text");
    const bool has_text =
        text != choice.end() && text->is_string() && !text->get<std::string>().empty();
    for (const char* key : {"token_ids", "tokens"}) {
      const auto ids = choice.find(key);
      if (ids != choice.end() && ids->is_array()) c.token_ids += static_cast<int64_t>(ids->size());
    }
    const auto finish = choice.find("finish_reason");
    if (finish != choice.end() && finish->is_string()) c.finish_reason = finish->get<std::string>();
    // A chunk without a finish reason is a token (its text may be empty, as for a special
    // token); the closing chunk counts only when it brings text or tokens of its own.
    c.carries_output = has_text || c.token_ids > 0 || c.finish_reason.empty();
  }
  if (const auto usage = j.find("usage"); usage != j.end() && usage->is_object()) {
    const auto n = usage->find("completion_tokens");
    if (n != usage->end() && n->is_number_integer()) c.completion_tokens = n->get<int64_t>();
  }
  return c;
}

RequestFigures request_figures(const RequestTiming& t) {
  RequestFigures f;
  if (t.chunk_s.empty()) return f;
  f.ttft_ms = (t.chunk_s.front() - t.arrival_s) * 1e3;
  f.e2el_ms = (t.chunk_s.back() - t.arrival_s) * 1e3;
  for (size_t k = 1; k < t.chunk_s.size(); ++k) {
    f.itl_ms.push_back((t.chunk_s[k] - t.chunk_s[k - 1]) * 1e3);
    f.itl_max_ms = std::max(f.itl_max_ms, f.itl_ms.back());
  }
  if (t.output_tokens > 1) {
    f.has_tpot = true;
    f.tpot_ms = (f.e2el_ms - f.ttft_ms) / static_cast<double>(t.output_tokens - 1);
  }
  return f;
}

GoodputSlo parse_goodput(const std::vector<std::string>& specs) {
  GoodputSlo slo;
  for (const std::string& spec : specs) {
    const size_t colon = spec.find(':');
    const std::string key = spec.substr(0, colon);
    double ms = 0;
    size_t used = 0;
    try {
      if (colon != std::string::npos) ms = std::stod(spec.substr(colon + 1), &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (colon == std::string::npos || used == 0 || colon + 1 + used != spec.size() || !(ms > 0) ||
        !std::isfinite(ms))
      throw std::invalid_argument("--goodput: '" + spec +
                                  "' is not KEY:MS with MS > 0 (keys ttft, tpot, e2el)");
    if (key == "ttft")
      slo.ttft_ms = ms;
    else if (key == "tpot")
      slo.tpot_ms = ms;
    else if (key == "e2el")
      slo.e2el_ms = ms;
    else
      throw std::invalid_argument("--goodput: unknown key '" + key + "' (keys ttft, tpot, e2el)");
  }
  return slo;
}

bool meets_slo(const RequestFigures& f, const GoodputSlo& slo) {
  return (!slo.ttft_ms || f.ttft_ms <= *slo.ttft_ms) &&
         (!slo.tpot_ms || f.tpot_ms <= *slo.tpot_ms) && (!slo.e2el_ms || f.e2el_ms <= *slo.e2el_ms);
}

EndpointMetrics compute_metrics(const std::vector<RequestTiming>& requests, double duration_s,
                                const GoodputSlo& slo) {
  EndpointMetrics m;
  m.duration_s = duration_s;
  std::map<int64_t, int64_t> tokens_per_second, concurrent_per_second;
  int64_t first_failed = -1;
  for (const RequestTiming& t : requests) {
    if (!t.error.empty()) {
      ++m.failed;
      if (first_failed < 0 || t.id < first_failed) first_failed = t.id, m.first_error = t.error;
      continue;
    }
    ++m.completed;
    m.prompt_tokens += t.prompt_tokens;
    m.output_tokens += t.output_tokens;
    const RequestFigures f = request_figures(t);
    m.ttft_ms.push_back(f.ttft_ms);
    m.e2el_ms.push_back(f.e2el_ms);
    if (f.has_tpot) m.tpot_ms.push_back(f.tpot_ms);
    m.itl_ms.insert(m.itl_ms.end(), f.itl_ms.begin(), f.itl_ms.end());
    if (slo.any() && meets_slo(f, slo)) ++m.good;
    // vLLM's peaks: chunks per whole second of the run, requests active in each second.
    for (const double s : t.chunk_s) ++tokens_per_second[static_cast<int64_t>(std::floor(s))];
    const double end = t.chunk_s.empty() ? t.sent_s : t.chunk_s.back();
    for (auto b = static_cast<int64_t>(std::floor(t.sent_s));
         b <= static_cast<int64_t>(std::floor(end)); ++b)
      ++concurrent_per_second[b];
  }
  for (const auto& [second, n] : tokens_per_second)
    m.peak_output_tokens_per_s = std::max(m.peak_output_tokens_per_s, static_cast<double>(n));
  for (const auto& [second, n] : concurrent_per_second)
    m.peak_concurrent = std::max(m.peak_concurrent, n);
  return m;
}

namespace {

using Seconds = std::chrono::duration<double>;

// The error of a request cut short by SIGINT/SIGTERM: neither completed nor failed.
const char* const kStopped = "stopped";

// The server: scheme://host:port for the client, and a path prefix (without a trailing /v1).
struct Target {
  std::string url;
  std::string host;
  std::string base;
  std::string api_key;
  std::string model;
};

Target parse_endpoint(const std::string& url) {
  Target t;
  t.url = url;
  const size_t scheme_end = url.find("://");
  const std::string scheme = scheme_end == std::string::npos ? "" : url.substr(0, scheme_end);
  const size_t path_start =
      scheme_end == std::string::npos ? std::string::npos : url.find('/', scheme_end + 3);
  t.host = url.substr(0, path_start);
  if ((scheme != "http" && scheme != "https") || t.host.size() <= scheme.size() + 3)
    throw std::invalid_argument("--endpoint: '" + url + "' is not an http://host:port URL");
  t.base = path_start == std::string::npos ? "" : url.substr(path_start);
  while (!t.base.empty() && t.base.back() == '/') t.base.pop_back();
  if (t.base.size() >= 3 && t.base.compare(t.base.size() - 3, 3, "/v1") == 0)
    t.base.resize(t.base.size() - 3);
  return t;
}

std::unique_ptr<httplib::Client> make_client(const Target& t) {
  auto client = std::make_unique<httplib::Client>(t.host);
  if (!client->is_valid())
    throw std::invalid_argument("--endpoint " + t.url + ": cannot make an HTTP client for it");
  client->set_connection_timeout(10);
  client->set_read_timeout(600);
  client->set_write_timeout(60);
  // A new connection per request: a kept-alive one the server has closed (llama-server closes
  // them after a few requests) would fail the next request before it is sent.
  client->set_keep_alive(false);
  if (!t.api_key.empty()) client->set_bearer_token_auth(t.api_key);
  return client;
}

// Fails fast when the server cannot be reached; returns --model or the first model it serves.
std::string discover_model(const Target& t) {
  const auto client = make_client(t);
  client->set_connection_timeout(5);
  client->set_read_timeout(30);
  const httplib::Result res = client->Get(t.base + "/v1/models");
  if (!res)
    throw std::invalid_argument(
        "--endpoint " + t.url +
        ": no server answers there (HTTP client error: " + httplib::to_string(res.error()) + ")");
  if (res->status == 401 || res->status == 403)
    throw std::invalid_argument("--endpoint " + t.url + ": GET /v1/models answered HTTP " +
                                std::to_string(res->status) + " (wrong or missing --api-key?)");
  if (!t.model.empty()) return t.model;
  const nlohmann::json j = nlohmann::json::parse(res->body, nullptr, false);
  if (res->status == 200 && j.is_object() && j.contains("data") && j["data"].is_array() &&
      !j["data"].empty() && j["data"][0].contains("id") && j["data"][0]["id"].is_string())
    return j["data"][0]["id"].get<std::string>();
  throw std::invalid_argument("--endpoint " + t.url + ": GET " + t.base + "/v1/models (HTTP " +
                              std::to_string(res->status) + ") names no model; give --model");
}

// Sends one request and records when its output arrives. `on_chunk` runs on every chunk
// that carries output.
RequestTiming send_request(httplib::Client& client, const Target& t, const WorkloadRequest& w,
                           int64_t id, Clock::time_point start, Clock::time_point arrival,
                           const std::function<void()>& on_chunk) {
  const auto since = [start](Clock::time_point p) { return Seconds(p - start).count(); };
  RequestTiming r;
  r.id = id;
  r.arrival_s = since(arrival);
  r.prompt_tokens = static_cast<int64_t>(w.prompt.size());
  r.expected_tokens = w.output_len;
  const nlohmann::json body = {{"model", t.model},
                               {"prompt", w.prompt},
                               {"max_tokens", w.output_len},
                               {"ignore_eos", true},
                               {"temperature", 0},
                               {"stream", true},
                               {"stream_options", {{"include_usage", true}}}};
  httplib::Request req;
  req.method = "POST";
  req.path = t.base + "/v1/completions";
  req.set_header("Accept", "text/event-stream");
  req.set_header("Accept-Encoding", "identity");  // compressed SSE would arrive in bursts
  req.set_header("Content-Type", "application/json");
  req.body = body.dump();
  int status = 0;
  std::string error_body;
  SseReader sse;
  int64_t token_ids = 0;
  std::optional<int64_t> usage_tokens;
  req.response_handler = [&](const httplib::Response& res) {
    status = res.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    const double now = since(Clock::now());
    if (status != 200) {
      error_body.append(data, std::min<size_t>(size, 4096));
      return error_body.size() < 4096;
    }
    for (const std::string& event : sse.feed(std::string_view(data, size))) {
      const CompletionChunk c = parse_completion_chunk(event);
      if (!c.error.empty() && r.error.empty()) r.error = "server: " + c.error;
      if (c.carries_output) {
        r.chunk_s.push_back(now);
        on_chunk();
      }
      token_ids += c.token_ids;
      if (c.completion_tokens) usage_tokens = c.completion_tokens;
      if (!c.finish_reason.empty()) r.finish_reason = c.finish_reason;
    }
    return !stop_requested();
  };
  r.sent_s = since(Clock::now());
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool ok = client.send(req, res, err);
  r.output_tokens = usage_tokens    ? *usage_tokens
                    : token_ids > 0 ? token_ids
                                    : static_cast<int64_t>(r.chunk_s.size());
  if (!r.error.empty()) return r;
  if (status != 0 && status != 200) {
    const nlohmann::json j = nlohmann::json::parse(error_body, nullptr, false);
    const std::string detail = j.is_object() && j.contains("error")
                                   ? parse_completion_chunk(error_body).error
                                   : error_body;
    r.error = "HTTP " + std::to_string(status) + ": " + detail.substr(0, 300);
  } else if (!ok) {
    r.error = stop_requested() ? kStopped : "request failed (" + httplib::to_string(err) + ")";
  } else if (r.output_tokens < r.expected_tokens) {
    r.error = std::to_string(r.output_tokens) + " output tokens of " +
              std::to_string(r.expected_tokens) + " asked" +
              (r.finish_reason.empty() ? "" : " (finish_reason " + r.finish_reason + ")");
  } else if (r.chunk_s.empty()) {
    r.error = "no output arrived";
  }
  return r;
}

// Sends `requests` with at most `concurrency` in flight: closed loop (each as soon as a
// client is free) or, with `open_loop`, each at its arrival_s, measured from then.
std::vector<RequestTiming> run_phase(const Target& t, const std::vector<WorkloadRequest>& requests,
                                     int64_t first_id, int concurrency, bool open_loop,
                                     Clock::time_point start,
                                     const std::function<void()>& on_chunk) {
  std::vector<RequestTiming> out(requests.size());
  std::atomic<size_t> next{0};
  std::mutex chunk_mutex;
  const auto counted = [&] {
    const std::lock_guard<std::mutex> lock(chunk_mutex);
    on_chunk();
  };
  const auto worker = [&] {
    const auto client = make_client(t);
    for (size_t i = next++; i < requests.size() && !stop_requested(); i = next++) {
      Clock::time_point arrival = Clock::now();
      if (open_loop) {
        const Clock::time_point due =
            start + std::chrono::duration_cast<Clock::duration>(Seconds(requests[i].arrival_s));
        std::this_thread::sleep_until(due);
        arrival = due;
      }
      out[i] = send_request(*client, t, requests[i], first_id + static_cast<int64_t>(i), start,
                            arrival, counted);
    }
  };
  std::vector<std::thread> threads;
  const size_t n = std::min(requests.size(), static_cast<size_t>(std::max(concurrency, 1)));
  for (size_t k = 0; k < n; ++k) threads.emplace_back(worker);
  for (std::thread& th : threads) th.join();
  // Requests never sent or cut short by a stop signal are neither completed nor failed.
  const auto unsent = [](const RequestTiming& r) {
    return r.expected_tokens == 0 || r.error == kStopped;
  };
  out.erase(std::remove_if(out.begin(), out.end(), unsent), out.end());
  return out;
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (const char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c == '\n' ? ' ' : c);
  return q + "\"";
}

void write_requests_csv(const std::string& path, const std::vector<RequestTiming>& rows) {
  std::ostringstream out;
  out << "id,arrival_ms,sent_ms,prompt_tokens,output_tokens,chunks,ttft_ms,tpot_ms,e2e_ms,itl_max_"
         "ms,finish_reason,"
         "error\n";
  char line[512];
  for (const RequestTiming& r : rows) {
    const RequestFigures f = request_figures(r);
    std::snprintf(line, sizeof(line), "%lld,%.3f,%.3f,%lld,%lld,%zu,%.3f,%.3f,%.3f,%.3f,",
                  static_cast<long long>(r.id), r.arrival_s * 1e3, r.sent_s * 1e3,
                  static_cast<long long>(r.prompt_tokens), static_cast<long long>(r.output_tokens),
                  r.chunk_s.size(), f.ttft_ms, f.tpot_ms, f.e2el_ms, f.itl_max_ms);
    out << line << csv_field(r.finish_reason) << "," << csv_field(r.error) << "\n";
  }
  write_text_file(path, out.str(), "--out", "the request table");
}

ordered_json make_report(const BenchOptions& o, const JobConfig& job, const ModelConfig& model,
                         const Target& t, const EndpointMetrics& m, const GoodputSlo& slo,
                         bool stopped) {
  ordered_json report;
  report["kvpipe"] = bench_build_json();
  report["machine"] = bench_machine_json();
  report["endpoint"] = {{"url", t.url}, {"model", t.model}, {"api_key", !t.api_key.empty()}};
  report["config"] = {{"file", o.config},
                      {"overrides", o.overrides},
                      {"model",
                       {{"path", job.model.path},
                        {"vocab_size", model.vocab_size},
                        {"max_position", model.max_position}}}};
  report["workload"] = workload_json(job.workload);
  report["stopped"] = stopped;
  report["requests"] = {
      {"completed", m.completed},
      {"failed", m.failed},
      {"prompt_tokens", m.prompt_tokens},
      {"output_tokens", m.output_tokens},
      {"first_error", m.first_error.empty() ? ordered_json(nullptr) : ordered_json(m.first_error)}};
  report["duration_s"] = round6(m.duration_s);
  const double d = std::max(m.duration_s, 1e-9);
  report["throughput"] = {{"output_tokens_per_s", round3(m.output_tokens / d)},
                          {"total_tokens_per_s", round3((m.prompt_tokens + m.output_tokens) / d)},
                          {"requests_per_s", round3(static_cast<double>(m.completed) / d)},
                          {"peak_output_tokens_per_s", round3(m.peak_output_tokens_per_s)},
                          {"peak_concurrent_requests", m.peak_concurrent}};
  ordered_json slo_ms = ordered_json::object();
  if (slo.ttft_ms) slo_ms["ttft"] = *slo.ttft_ms;
  if (slo.tpot_ms) slo_ms["tpot"] = *slo.tpot_ms;
  if (slo.e2el_ms) slo_ms["e2el"] = *slo.e2el_ms;
  report["goodput"] =
      slo.any() ? ordered_json{{"slo_ms", slo_ms},
                               {"good_requests", m.good},
                               {"requests_per_s", round3(static_cast<double>(m.good) / d)}}
                : ordered_json(nullptr);
  report["latency_ms"] = {{"ttft", to_json(summarize(m.ttft_ms))},
                          {"tpot", to_json(summarize(m.tpot_ms))},
                          {"itl", to_json(summarize(m.itl_ms))},
                          {"e2e", to_json(summarize(m.e2el_ms))}};
  report["files"] = {{"requests_csv", "requests.csv"}};
  return report;
}

// The summary `vllm bench serve` prints, from report.json.
void print_summary(std::ostream& os, const ordered_json& r, const std::string& dir) {
  char buf[256];
  const auto row = [&](const std::string& label, const std::string& value) {
    std::snprintf(buf, sizeof(buf), "%-40s %s\n", label.c_str(), value.c_str());
    os << buf;
  };
  const auto num = [&](double v, const char* format = "%.2f") {
    char s[64];
    std::snprintf(s, sizeof(s), format, v);
    return std::string(s);
  };
  const auto rule = [&](const std::string& title, char fill) {
    const size_t width = 50, left = (width - std::min(width, title.size())) / 2;
    os << std::string(left, fill) << title
       << std::string(width - left - std::min(width, title.size()), fill) << "\n";
  };
  const auto& w = r["workload"];
  const auto& t = r["throughput"];
  const auto& q = r["requests"];
  rule(" Serving Benchmark Result ", '=');
  row("Endpoint:", r["endpoint"]["url"].get<std::string>() + " (" +
                       r["endpoint"]["model"].get<std::string>() + ")");
  row("Successful requests:", std::to_string(q["completed"].get<int64_t>()));
  row("Failed requests:", std::to_string(q["failed"].get<int64_t>()));
  row("Maximum request concurrency:", std::to_string(w["concurrency"].get<int>()));
  row("Request rate configured (RPS):",
      w["mode"] == "open" ? num(w["rate"].get<double>()) : "inf (closed loop)");
  row("Benchmark duration (s):", num(r["duration_s"].get<double>()));
  row("Total input tokens:", std::to_string(q["prompt_tokens"].get<int64_t>()));
  row("Total generated tokens:", std::to_string(q["output_tokens"].get<int64_t>()));
  row("Request throughput (req/s):", num(t["requests_per_s"].get<double>()));
  if (!r["goodput"].is_null())
    row("Request goodput (req/s):", num(r["goodput"]["requests_per_s"].get<double>()));
  row("Output token throughput (tok/s):", num(t["output_tokens_per_s"].get<double>()));
  row("Peak output token throughput (tok/s):", num(t["peak_output_tokens_per_s"].get<double>()));
  row("Peak concurrent requests:", std::to_string(t["peak_concurrent_requests"].get<int64_t>()));
  row("Total token throughput (tok/s):", num(t["total_tokens_per_s"].get<double>()));
  for (const auto& [key, name, title] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"ttft", "TTFT", "Time to First Token"},
           {"tpot", "TPOT", "Time per Output Token (excl. 1st token)"},
           {"itl", "ITL", "Inter-token Latency"},
           {"e2e", "E2EL", "End-to-end Latency"}}) {
    const auto& d = r["latency_ms"][key];
    rule(title, '-');
    row("Mean " + name + " (ms):", num(d["mean"].get<double>()));
    row("Median " + name + " (ms):", num(d["median"].get<double>()));
    row("P90 " + name + " (ms):", num(d["p90"].get<double>()));
    row("P99 " + name + " (ms):", num(d["p99"].get<double>()));
  }
  rule("", '=');
  if (!q["first_error"].is_null())
    os << "first error: " << q["first_error"].get<std::string>() << "\n";
  os << "files: " << dir << "/report.json, requests.csv\n";
}

}  // namespace

void bench_endpoint(const BenchOptions& o) {
  if (o.out_dir.empty()) throw std::invalid_argument("--out: an output directory is required");
  if (o.profile)
    throw std::invalid_argument("--profile: profiles the engine in-process; not with --endpoint");
  const GoodputSlo slo = parse_goodput(o.goodput);
  const JobConfig job = load_job_config(o.config, o.overrides);
  if (job.workload.dataset != "random")
    throw std::invalid_argument(job.source + ": workload.dataset: --endpoint sends random token ids only; a dataset "
                                "workload runs in-process (drop --endpoint)");
  const ModelConfig model = load_job_model_config(job);  // the vocabulary and context; no weights
  check_workload_fits(job, model.max_position);
  Target target = parse_endpoint(o.endpoint);
  target.api_key = o.api_key;
  target.model = o.model;
  target.model = discover_model(target);
  std::error_code ec;
  std::filesystem::create_directories(o.out_dir, ec);
  if (ec || !std::filesystem::is_directory(o.out_dir))
    throw std::invalid_argument("--out: cannot create the directory " + o.out_dir);

  const WorkloadSection& w = job.workload;
  if (w.warmup > 0) {
    log_printf(LogLevel::kInfo, "bench: %d warm-up request(s) to %s", w.warmup, target.url.c_str());
    const std::vector<RequestTiming> warm =
        run_phase(target, make_workload(w, model.vocab_size, 0, w.warmup), 0, w.concurrency, false,
                  Clock::now(), [] {});
    for (const RequestTiming& r : warm) {
      if (!r.error.empty() && !stop_requested())
        log_printf(LogLevel::kWarn, "bench: warm-up request %lld failed: %s",
                   static_cast<long long>(r.id), r.error.c_str());
    }
  }
  const std::vector<WorkloadRequest> drawn =
      make_workload(w, model.vocab_size, w.warmup, w.requests);
  log_printf(LogLevel::kInfo, "bench: %d measured request(s) to %s (model %s), %s", w.requests,
             target.url.c_str(), target.model.c_str(),
             w.rate > 0 ? ("open loop at " + std::to_string(w.rate) + " requests/s").c_str()
                        : ("closed loop, concurrency " + std::to_string(w.concurrency)).c_str());
  int64_t expected = 0;
  for (const WorkloadRequest& r : drawn) expected += r.output_len;
  ProgressBar progress(expected, w.output_len.lo == w.output_len.hi);
  const Clock::time_point start = Clock::now();
  const std::vector<RequestTiming> timings = run_phase(
      target, drawn, w.warmup, w.concurrency, w.rate > 0, start, [&] { progress.advance(1); });
  const double duration_s = Seconds(Clock::now() - start).count();
  progress.finish();
  const bool stopped = stop_requested();
  if (stopped)
    log_printf(LogLevel::kWarn, "stopped by signal %d: reporting the requests finished so far",
               stop_signal());

  const EndpointMetrics m = compute_metrics(timings, duration_s, slo);
  const ordered_json report = make_report(o, job, model, target, m, slo, stopped);
  const std::filesystem::path dir(o.out_dir);
  write_requests_csv((dir / "requests.csv").string(), timings);
  write_json((dir / "report.json").string(), report, 2);
  print_summary(std::cout, report, o.out_dir);
  flush_stdout("the bench summary");
}

}  // namespace kvpipe
