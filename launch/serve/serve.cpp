#include "launch/serve/serve.h"

#include "engine/grammar/token_constraint.h"

#include "engine/engine.h"
#include "engine/text/text_stream.h"
#include "engine/text/tokenizer.h"
#include "launch/job_config.h"
#include "launch/job_plan.h"
#include "launch/job_runner.h"
#include "launch/log.h"
#include "launch/model_text.h"
#include "launch/serve/serve_http.h"
#include "launch/serve/serve_metrics.h"
#include "launch/serve/serve_protocol.h"
#include "launch/serve/serve_queue.h"
#include "launch/signals.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace kvpipe {
namespace {

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The coordinator's side of the server: a RequestSource the engine polls between steps,
// and the engine's token and finish callbacks turned into each HTTP request's events.
class ServeLoop : public RequestSource {
 public:
  ServeLoop(ServeQueue& queue, ServeMetrics& metrics, const ServedModel& model, double shutdown_timeout_s)
      : queue_(queue), metrics_(metrics), model_(model), shutdown_timeout_(shutdown_timeout_s) {}

  void attach(Engine& engine) { engine_ = &engine; }

  void poll(Engine& engine, Clock::time_point now) override {
    if (stop_requested() && !draining_) {
      draining_ = true;
      queue_.close();
      deadline_ = now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(shutdown_timeout_));
      log_printf(LogLevel::kInfo, "stopping (signal %d): %zu request(s) in flight get %.0f s to finish", stop_signal(),
                 live_.size(), shutdown_timeout_);
    }
    if (draining_ && now >= deadline_ && !live_.empty()) {
      std::vector<int64_t> ids;
      for (const auto& [id, live] : live_) ids.push_back(id);
      for (int64_t id : ids) engine.finish(id, "abort");
    }
    std::vector<Submission> submissions;
    std::vector<uint64_t> cancellations;
    queue_.take(submissions, cancellations);
    for (uint64_t sid : cancellations) {
      const auto it = by_submission_.find(sid);
      if (it == by_submission_.end()) continue;
      const std::vector<int64_t> ids = it->second;  // finishing edits the map
      for (int64_t id : ids) engine.finish(id, "abort");
    }
    for (Submission& s : submissions) admit(engine, s);

    const Scheduler& sched = engine.scheduler();
    const BlockManager& blocks = sched.blocks();
    ServeMetrics::Gauges g;
    g.running = sched.num_running();
    g.waiting = sched.num_waiting();
    g.kv_blocks_used = blocks.num_used();
    g.kv_blocks_total = blocks.num_blocks();
    g.prefix_queries = blocks.stats().lookup_tokens;
    g.prefix_hits = blocks.stats().hit_tokens;
    g.preemptions = sched.stats().preemptions;
    g.spec_drafts = sched.stats().spec_drafts;
    g.spec_draft_tokens = sched.stats().spec_draft_tokens;
    g.spec_accepted_tokens = sched.stats().spec_accepted_tokens;
    g.spec_accepted_at = sched.stats().spec_accepted_at;
    metrics_.set_gauges(g);
    engine.erase_finished();
  }

  bool exhausted() const override { return draining_ && live_.empty(); }
  // Wakes at least this often while idle, to notice a stop signal.
  std::optional<Clock::time_point> next_arrival() const override { return Clock::now() + std::chrono::milliseconds(100); }
  void wait_until(Clock::time_point until) override { queue_.wait_until(until); }

  void on_token(const TokenEvent& ev) {
    const auto it = live_.find(ev.request_id);
    if (it == live_.end()) return;
    Live& live = it->second;
    const Clock::time_point now = Clock::now();
    ChoiceEvent e;
    e.index = live.index;
    e.token = ev.token;
    if (live.text) {
      e.text = live.text->push(ev.token);
      if (live.text->stopped()) engine_->finish(ev.request_id, "stop");
    }
    if (live.request->logprobs >= 0 && ev.logits) e.logprob = token_logprob(ev.logits, ev.vocab, ev.token, live.request->logprobs);
    if (live.tokens == 0) {
      metrics_.observe_first_token(seconds(now - live.arrival));
      metrics_.add_generation_token(-1.0);
    } else {
      metrics_.add_generation_token(seconds(now - live.last_token));
    }
    ++live.tokens;
    live.last_token = now;
    live.channel->push(std::move(e));
  }

  void on_finished(const Sequence& s) {
    const auto it = live_.find(s.request.id);
    if (it == live_.end()) return;
    Live& live = it->second;
    ChoiceEvent e;
    e.index = live.index;
    if (live.text) e.text = live.text->finish();
    e.finish_reason = s.finish_reason;
    // The client sees finish_reason "error" on the choice (what it got so far stays valid);
    // the why goes to the server's log, since it is no fault of the request.
    if (s.finish_reason == "error")
      log_printf(LogLevel::kError, "request %lld failed: %s", static_cast<long long>(s.request.id), s.error.c_str());
    e.prompt_tokens = static_cast<int64_t>(s.request.prompt.size());
    e.cached_tokens = s.cached_tokens;
    const Clock::time_point now = Clock::now();
    metrics_.observe_finished(s.finish_reason, seconds(now - live.arrival),
                              s.scheduled_time == Clock::time_point{} ? -1.0 : seconds(s.scheduled_time - live.arrival));
    live.channel->push(std::move(e));
    queue_.finished(1);
    auto& ids = by_submission_[live.submission];
    ids.erase(std::remove(ids.begin(), ids.end(), s.request.id), ids.end());
    if (ids.empty()) by_submission_.erase(live.submission);
    live_.erase(it);
  }

 private:
  struct Live {
    std::shared_ptr<const CompletionRequest> request;
    std::shared_ptr<ResponseChannel> channel;
    uint64_t submission = 0;
    int index = 0;
    std::optional<TextStream> text;
    Clock::time_point arrival, last_token;
    int64_t tokens = 0;
  };

  void admit(Engine& engine, const Submission& s) {
    const CompletionRequest& req = *s.request;
    const Tokenizer* tokenizer = model_.text ? model_.text->tokenizer() : nullptr;
    for (int c = 0; c < req.choices(); ++c) {
      Request r;
      r.id = next_id_++;
      r.prompt = req.prompts[c / req.n];
      r.max_new_tokens = req.max_tokens;
      r.sampling = req.sampling;
      r.sampling.stream = c % req.n;  // equal seeds give equal choices, whatever the request's id
      r.processing = req.processing;
      r.ignore_eos = req.ignore_eos;
      r.want_logits = req.logprobs >= 0;
      r.arrival_time = s.arrival;
      try {
        engine.add(r);
      } catch (const std::invalid_argument& e) {
        // The HTTP side checked the context and the pool; anything else still gets an answer.
        for (int rest = c; rest < req.choices(); ++rest) {
          ChoiceEvent failed;
          failed.index = rest;
          failed.finish_reason = "error";
          failed.error = e.what();
          s.channel->push(std::move(failed));
        }
        queue_.finished(req.choices() - c);
        const auto added = by_submission_.find(s.id);
        if (added != by_submission_.end()) {
          const std::vector<int64_t> ids = added->second;
          for (int64_t id : ids) engine.finish(id, "abort");
        }
        return;
      }
      Live live;
      live.request = s.request;
      live.channel = s.channel;
      live.submission = s.id;
      live.index = c;
      if (tokenizer) live.text.emplace(*tokenizer, req.stop);
      live.arrival = s.arrival;
      live_.emplace(r.id, std::move(live));
      by_submission_[s.id].push_back(r.id);
      metrics_.add_prompt_tokens(static_cast<int64_t>(r.prompt.size()));
    }
  }

  ServeQueue& queue_;
  ServeMetrics& metrics_;
  const ServedModel& model_;
  double shutdown_timeout_;
  Engine* engine_ = nullptr;
  std::unordered_map<int64_t, Live> live_;
  std::unordered_map<uint64_t, std::vector<int64_t>> by_submission_;
  int64_t next_id_ = 0;
  bool draining_ = false;
  Clock::time_point deadline_{};
};

std::string default_model_name(const std::string& path) {
  std::filesystem::path p(path);
  if (!p.has_filename()) p = p.parent_path();
  return p.filename().string();
}

void check_options(const ServeOptions& o) {
  if (o.port < 0 || o.port > 65535) throw std::invalid_argument("--port: must be 0..65535, got " + std::to_string(o.port));
  if (o.http_threads < 2 || o.http_threads > 8192)
    throw std::invalid_argument("--http-threads: must be 2..8192, got " + std::to_string(o.http_threads));
  if (o.max_requests < 1) throw std::invalid_argument("--max-requests: must be at least 1");
  if (o.max_body_bytes < 1024) throw std::invalid_argument("--max-body-bytes: must be at least 1024");
  if (!(o.header_timeout_s > 0.0) || o.header_timeout_s > 3600.0)
    throw std::invalid_argument("--header-timeout: must be more than 0 and at most 3600 seconds");
  if (!(o.shutdown_timeout_s >= 0.0) || o.shutdown_timeout_s > 86400.0)
    throw std::invalid_argument("--shutdown-timeout: must be 0..86400 seconds");
  if (!o.tool_call_parser.empty()) {
    try {
      tool_call_syntax_named(o.tool_call_parser);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("--tool-call-parser: ") + e.what());
    }
  }
}

// --chat-template: the file's template in place of the model's.
void replace_chat_template(ModelText& text, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument("--chat-template: cannot read " + path);
  std::ostringstream source;
  source << in.rdbuf();
  if (!text.tokenizer()) throw std::invalid_argument("--chat-template: the model has no tokenizer to render chats with");
  text.set_chat_template(source.str(), path);  // a template that does not parse names the file and line
}

}  // namespace

void serve(const ServeOptions& o, World& world) {
  check_options(o);
  const JobConfig job = load_job_config(o.config, o.overrides);
  const JobPlan plan = plan_job(job, world.size());

  // Rank 0 only: the HTTP side, listening while the weights load (/health says 503).
  std::unique_ptr<ModelText> text;
  ServedModel served;
  std::unique_ptr<ServeMetrics> metrics;
  std::unique_ptr<ServeQueue> queue;
  std::unique_ptr<HttpFrontEnd> http;
  if (world.is_coordinator()) {
    ::signal(SIGPIPE, SIG_IGN);  // a client that went away is a failed write, not a dead server
    text = std::make_unique<ModelText>(job.model.path);
    if (!o.chat_template.empty()) replace_chat_template(*text, o.chat_template);
    served.renders_tools = template_renders_tools(text->chat_template_source());
    served.tool_syntax = o.tool_call_parser.empty() ? tool_call_syntax_of_template(text->chat_template_source())
                                                    : tool_call_syntax_named(o.tool_call_parser);
    served.name = o.served_model_name.empty() ? default_model_name(job.model.path) : o.served_model_name;
    served.text = text.get();
    served.vocab_size = plan.model.vocab_size;
    served.max_context = plan.model.max_position;
    served.max_request_tokens = plan.longest_request;
    if (const Tokenizer* tokenizer = text->tokenizer()) {
      std::vector<int64_t> eos = tokenizer->eos_ids();
      for (int64_t id : plan.model.eos_token_ids)
        if (std::find(eos.begin(), eos.end(), id) == eos.end()) eos.push_back(id);
      served.vocabulary = TokenVocabulary::of(*tokenizer, eos);
      served.constraints = std::make_shared<ConstraintCache>(served.vocabulary);
    }
    metrics = std::make_unique<ServeMetrics>(served.name);
    if (served.constraints) metrics->set_constraint_stats(served.constraints->stats());
    queue = std::make_unique<ServeQueue>(o.max_requests);
    HttpOptions ho;
    ho.host = o.host;
    ho.port = o.port;
    ho.api_key = o.api_key;
    ho.threads = o.http_threads;
    ho.max_body_bytes = static_cast<size_t>(o.max_body_bytes);
    ho.header_timeout_s = o.header_timeout_s;
    http = std::make_unique<HttpFrontEnd>(ho, served, *queue, *metrics);
    const int port = http->start();
    // The pid: under mpirun, SIGTERM to this process (not to mpirun, which aborts the job)
    // is the graceful stop.
    log_printf(LogLevel::kInfo, "listening on http://%s:%d (pid %d, model %s, %lld tokens per request at most)",
               o.host.c_str(), port, static_cast<int>(::getpid()), served.name.c_str(),
               static_cast<long long>(served.max_model_len()));
  }
  run_job(job, plan, world, nullptr, [&](CoordinatorContext& c) {
    EngineOptions eo = engine_options(c.job, c.plan, c.draft_model);
    ModelConfig model = c.plan.model;
    if (const Tokenizer* tokenizer = text->tokenizer())
      for (int64_t id : tokenizer->eos_ids())
        if (std::find(model.eos_token_ids.begin(), model.eos_token_ids.end(), id) == model.eos_token_ids.end())
          model.eos_token_ids.push_back(id);
    ServeLoop loop(*queue, *metrics, served, o.shutdown_timeout_s);
    eo.source = &loop;
    eo.on_finished = [&loop](const Sequence& s) { loop.on_finished(s); };
    Engine engine(c.executor, model, c.plan.partition.num_blocks, eo);
    loop.attach(engine);
    http->set_ready(true);
    log_printf(LogLevel::kInfo, "ready");
    engine.run([&loop](const TokenEvent& ev) { loop.on_token(ev); });
    http->set_ready(false);
  });
  if (http) {
    http->stop();
    log_printf(LogLevel::kInfo, "stopped");
  }
}

}  // namespace kvpipe
