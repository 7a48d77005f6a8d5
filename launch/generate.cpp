#include "launch/generate.h"

#include "engine/engine.h"
#include "engine/model_shard.h"
#include "engine/model/model_weights.h"
#include "launch/job_config.h"
#include "launch/job_plan.h"
#include "launch/job_runner.h"
#include "engine/text/text_stream.h"
#include "launch/log.h"
#include "launch/model_text.h"
#include "launch/output.h"
#include "launch/signals.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>

namespace kvpipe {
namespace {

using ordered_json = nlohmann::ordered_json;

// The job's requests (or the one of --prompt-ids, --prompt, --chat), each refused as validate
// refuses it (check_request) and named by its option or job-file entry.
std::vector<Request> job_requests(const JobConfig& job, const JobPlan& plan, const GenerateOptions& o,
                                  const ModelText& text) {
  std::vector<RequestSpec> specs = job.requests;
  std::string from_command_line;
  RequestSpec one;
  if (!o.prompt_ids.empty()) {
    one.prompt_ids = o.prompt_ids;
    from_command_line = "--prompt-ids";
  } else if (o.prompt_text) {
    one.prompt = o.prompt_text;
    from_command_line = "--prompt";
  } else if (o.chat_text) {
    one.messages = {{"user", *o.chat_text}};
    from_command_line = "--chat";
  }
  if (!from_command_line.empty()) specs = {one};
  if (specs.empty())
    throw std::invalid_argument(job.source + ": no requests (add `requests:` or pass --prompt-ids, --prompt or --chat)");
  const LogitsProcessing processing = request_processing(job.sampling, &text, plan.model.vocab_size);
  std::vector<Request> out;
  for (size_t i = 0; i < specs.size(); ++i) {
    const std::string who = from_command_line.empty() ? request_who(job, i) : from_command_line;
    Request r;
    r.id = static_cast<int64_t>(i);
    r.prompt = text.prompt_ids(specs[i], who);
    r.max_new_tokens = o.max_new_tokens.value_or(specs[i].max_new_tokens);
    r.arrival_step = specs[i].arrival_step;
    r.sampling = request_sampling(job.sampling);
    r.processing = processing;
    r.ignore_eos = job.sampling.ignore_eos;
    check_request(job, plan, r.prompt, r.max_new_tokens, who);
    out.push_back(std::move(r));
  }
  return out;
}

// Full-vocabulary log-softmax of one row, in double for a stable sum.
// The log-sum-exp of the raw logits: log-probabilities plus it are the raw logits again.
double log_partition(const float* logits, int64_t vocab) {
  double max = logits[0];
  for (int64_t i = 1; i < vocab; ++i) max = std::max<double>(max, logits[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - max);
  return max + std::log(sum);
}

std::vector<float> log_softmax(const float* logits, int64_t vocab, double log_z) {
  std::vector<float> out(vocab);
  for (int64_t i = 0; i < vocab; ++i) out[i] = static_cast<float>(logits[i] - log_z);
  return out;
}

}  // namespace

namespace {

// Rank 0's outputs, opened before the job starts so that an unusable path is refused before
// any weight loads.
struct GenerateOutputs {
  LineOutput results = LineOutput::standard_output("results");
  std::optional<LineOutput> results_file;  // --output
  std::optional<LineOutput> logprobs;      // --logprobs-out
  std::vector<std::string> failures;       // "request ID: MESSAGE", one per failed request
};

// A finished request's result, as Engine::results() gives it, from its sequence alone: the
// line is written inside the step loop, where listing every request would cost O(requests).
RequestResult finished_result(const Sequence& s) {
  RequestResult r;
  r.id = s.request.id;
  r.prompt_ids = s.request.prompt;
  r.output_ids.assign(s.tokens.begin() + static_cast<std::ptrdiff_t>(s.request.prompt.size()), s.tokens.end());
  r.finish_reason = s.finish_reason;
  r.error = s.error;
  r.spec_drafts = s.spec_drafts;
  r.spec_draft_tokens = s.spec_draft_tokens;
  r.spec_accepted_tokens = s.spec_accepted_tokens;
  using ms = std::chrono::duration<double, std::milli>;
  if (!r.output_ids.empty()) {
    r.ttft_ms = ms(s.first_token_time - s.arrival_time).count();
    if (r.output_ids.size() > 1)
      r.tpot_ms = ms(s.last_token_time - s.first_token_time).count() / static_cast<double>(r.output_ids.size() - 1);
  }
  return r;
}

ordered_json result_line(const RequestResult& r, TextStream* stream) {
  ordered_json line;
  line["id"] = r.id;
  line["prompt_ids"] = r.prompt_ids;
  line["output_ids"] = r.output_ids;
  line["finish_reason"] = r.finish_reason;
  if (r.finish_reason == "error") line["error"] = r.error.empty() ? "failed" : r.error;
  if (stream) {
    stream->finish();
    line["text"] = stream->text();
  }
  line["ttft_ms"] = std::round(r.ttft_ms * 1000.0) / 1000.0;
  line["tpot_ms"] = std::round(r.tpot_ms * 1000.0) / 1000.0;
  if (r.spec_drafts > 0)
    line["speculative"] = {{"drafts", r.spec_drafts},
                           {"draft_tokens", r.spec_draft_tokens},
                           {"accepted_tokens", r.spec_accepted_tokens}};
  return line;
}

std::string dump_line(const ordered_json& j) {
  return j.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

// Rank 0: schedules, runs stage 0 (or the whole model), writes each result as it finishes.
void run_coordinator(const JobConfig& job, const JobPlan& plan, const ModelText& text,
                     const std::vector<Request>& requests, const ModelShard& shard, StepExecutor& executor,
                     DraftProposer* draft_model, GenerateOutputs& outputs) {
  EngineOptions eo = engine_options(job, plan, draft_model);
  eo.keep_logits = outputs.logprobs.has_value();
  eo.should_stop = [] { return stop_requested(); };
  const Tokenizer* tokenizer = text.tokenizer();
  // The tokenizer's end-of-sequence tokens end a request too.
  ModelConfig model = plan.model;
  if (tokenizer)
    for (int64_t id : tokenizer->eos_ids())
      if (std::find(model.eos_token_ids.begin(), model.eos_token_ids.end(), id) == model.eos_token_ids.end())
        model.eos_token_ids.push_back(id);
  int64_t expected_tokens = 0;
  std::map<int64_t, TextStream> streams;
  for (const Request& r : requests) {
    expected_tokens += r.max_new_tokens;
    if (tokenizer) streams.emplace(r.id, TextStream(*tokenizer, job.sampling.stop));
  }
  ProgressBar progress(expected_tokens, true);
  // On a terminal the bar shares the screen with the result lines: erase it before each.
  const bool erase_bar = ::isatty(STDOUT_FILENO) == 1;

  int64_t generated = 0, prompt_tokens = 0, finished = 0;
  std::set<int64_t> written;
  auto write_result = [&](const RequestResult& r) {
    const auto stream = streams.find(r.id);
    const std::string line = dump_line(result_line(r, stream == streams.end() ? nullptr : &stream->second));
    if (erase_bar && progress.active()) write_all(STDERR_FILENO, "\r\033[K", 4);
    // The file first: under mpirun, stdout is a pipe that mpirun may stop reading.
    if (outputs.results_file) outputs.results_file->write_line(line);
    outputs.results.write_line(line);
    if (r.finish_reason == "error")
      outputs.failures.push_back("request " + std::to_string(r.id) + ": " + (r.error.empty() ? "failed" : r.error));
    generated += static_cast<int64_t>(r.output_ids.size());
    prompt_tokens += static_cast<int64_t>(r.prompt_ids.size());
    ++finished;
  };
  eo.on_finished = [&](const Sequence& s) {
    if (written.insert(s.request.id).second) write_result(finished_result(s));
  };
  Engine engine(executor, model, plan.partition.num_blocks, eo);
  for (const Request& r : requests) engine.add(r);

  const auto t0 = Clock::now();
  engine.run([&](const TokenEvent& ev) {
    progress.advance(1);
    if (tokenizer) {
      TextStream& stream = streams.at(ev.request_id);
      stream.push(ev.token);
      if (stream.stopped()) engine.finish(ev.request_id, "stop");
    }
    if (!outputs.logprobs) return;
    ordered_json line;
    line["id"] = ev.request_id;
    line["step"] = ev.index;
    line["token"] = ev.token;
    const double log_z = log_partition(ev.logits, ev.vocab);
    line["logprobs"] = log_softmax(ev.logits, ev.vocab, log_z);
    line["log_z"] = log_z;
    outputs.logprobs->write_line(line.dump());
  });
  const double wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  progress.finish();
  // A request the engine ended without reporting it is still a result.
  for (const RequestResult& r : engine.results())
    if (!r.finish_reason.empty() && written.insert(r.id).second) write_result(r);
  if (stop_requested()) {
    log_printf(LogLevel::kWarn, "stopped by signal %d: %lld of %zu requests finished, their lines written",
               stop_signal(), static_cast<long long>(finished), requests.size());
  }
  if (outputs.results_file) outputs.results_file->close();
  if (outputs.logprobs) outputs.logprobs->close();

  const EngineStats& st = engine.stats();
  std::vector<double> steps;
  for (const StepRecord& r : st.step_records) steps.push_back(r.ms());
  std::sort(steps.begin(), steps.end());
  const double median_step = steps.empty() ? 0.0 : steps[steps.size() / 2];
  const double mean_step = std::accumulate(steps.begin(), steps.end(), 0.0) / std::max<size_t>(steps.size(), 1);
  // A decode step reads every weight but the embedding table, of which it reads one row.
  const ModelWeights& w = shard.weights();
  const bool separate_embedding =
      w.embedding.defined() && !(w.lm_head.defined() && w.lm_head.storage_id() == w.embedding.storage_id());
  const int64_t decode_bytes = w.bytes() - (separate_embedding ? w.embedding.bytes() : 0);
  log_printf(LogLevel::kInfo,
               "timing: %zu requests, %lld prompt tokens, %lld generated tokens in %.3f s "
               "(%.1f tokens/s generated), %lld micro-batch steps, step latency mean %.2f ms "
               "median %.2f ms, %lld preemptions, %lld weight bytes read per decode step on rank 0",
               engine.results().size(), static_cast<long long>(prompt_tokens),
               static_cast<long long>(generated), wall_s, generated / std::max(wall_s, 1e-9),
               static_cast<long long>(st.steps()), mean_step,
               median_step, static_cast<long long>(engine.scheduler().stats().preemptions),
               static_cast<long long>(decode_bytes));
  const SchedulerStats& ss = engine.scheduler().stats();
  const BlockManager& bm = engine.scheduler().blocks();
  log_printf(LogLevel::kInfo,
             "cache: prefix hits %lld of %lld prompt tokens looked up (%.1f%%), %lld evictions, "
             "%lld tokens computed, %lld preemptions, %lld tokens recomputed, peak %lld of %lld "
             "blocks used, %lld cached blocks at the end",
             static_cast<long long>(bm.stats().hit_tokens), static_cast<long long>(bm.stats().lookup_tokens),
             100.0 * bm.stats().hit_rate(), static_cast<long long>(bm.stats().evictions),
             static_cast<long long>(ss.computed_tokens), static_cast<long long>(ss.preemptions),
             static_cast<long long>(ss.recomputed_tokens), static_cast<long long>(ss.peak_blocks_used),
             static_cast<long long>(bm.num_blocks()), static_cast<long long>(bm.num_cached()));
  if (job.speculative.method != "off")
    log_printf(LogLevel::kInfo,
               "speculative: %lld drafts, %lld of %lld draft tokens accepted (%.1f%%), mean accepted length %.2f",
               static_cast<long long>(ss.spec_drafts), static_cast<long long>(ss.spec_accepted_tokens),
               static_cast<long long>(ss.spec_draft_tokens),
               ss.spec_draft_tokens ? 100.0 * ss.spec_accepted_tokens / ss.spec_draft_tokens : 0.0,
               ss.spec_drafts ? 1.0 + static_cast<double>(ss.spec_accepted_tokens) / ss.spec_drafts : 0.0);
}

}  // namespace

void generate(const GenerateOptions& o, World& world) {
  if (o.max_new_tokens && *o.max_new_tokens < 1)
    throw std::invalid_argument("--max-new-tokens: must be at least 1");
  const JobConfig job = load_job_config(o.config, o.overrides);
  const JobPlan plan = plan_job(job, world.size());
  // Every rank reads the requests and refuses what the engine would (a token outside the
  // vocabulary, a prompt as long as the context, more blocks than the pool), as validate
  // does, before any weight loads.
  const ModelText text(job.model.path);
  if (!text.tokenizer() && !job.sampling.stop.empty())
    throw std::invalid_argument("sampling.stop: the model " + job.model.path + " has no tokenizer to read text with");
  const std::vector<Request> requests = job_requests(job, plan, o, text);
  // Rank 0 opens its files now, after the job is known to be valid (a bad job leaves them
  // untouched) and before anything loads.
  std::optional<GenerateOutputs> outputs;
  if (world.is_coordinator()) {
    outputs.emplace();
    if (!o.output.empty()) outputs->results_file = LineOutput::open_file(o.output, "--output", "results");
    if (!o.logprobs_out.empty())
      outputs->logprobs = LineOutput::open_file(o.logprobs_out, "--logprobs-out", "log-probabilities");
  }
  const JobOutcome outcome = run_job(job, plan, world, nullptr, [&](CoordinatorContext& c) {
    run_coordinator(c.job, c.plan, text, requests, c.shard, c.executor, c.draft_model, *outputs);
  });
  for (size_t r = 0; r < outcome.times.size(); ++r) {
    const RankTimes& t = outcome.times[r];
    const double total = std::max(t.total_s, 1e-9);
    log_printf(LogLevel::kInfo, "rank %zu: busy %.1f%%, wait %.1f%%, comm %.1f%% of %.3f s (%s)", r,
               100.0 * t.compute_s / total, 100.0 * t.wait_s / total, 100.0 * t.comm_s / total, t.total_s,
               outcome.backend.c_str());
    if (t.all_reduce_calls > 0)
      log_printf(LogLevel::kInfo, "rank %zu: all-reduce %.0f calls, %.1f us per call, %.1f%% of the run; "
                 "tensor group broadcasts and gathers %.1f%%", r, t.all_reduce_calls,
                 1e6 * t.all_reduce_s / t.all_reduce_calls, 100.0 * t.all_reduce_s / total, 100.0 * t.group_s / total);
  }
  // Every other result is out: now the failed requests fail the command.
  if (outputs && !outputs->failures.empty()) {
    std::string message;
    for (const std::string& f : outputs->failures) message += (message.empty() ? "" : "\n") + f;
    throw JobFailure(message);
  }
}

}  // namespace kvpipe
