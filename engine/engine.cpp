#include "engine/engine.h"

#include "engine/decode_graphs.h"
#include "engine/logits_processor.h"
#include "engine/sampler.h"
#include "engine/speculative/ngram_proposer.h"
#include "engine/speculative/rejection_sampler.h"
#include "engine/step_arena.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <thread>

namespace kvpipe {

namespace {

bool all_greedy(const StepBatch& batch) {
  for (const SeqStep& s : batch.seqs)
    if (s.sample && s.sampling.temperature > 0.0) return false;
  return true;
}

// Rows whose request asks for logits processing take the token drawn here, from their raw
// logits processed with the sequence's tokens so far, instead of the one their last stage
// drew from the raw logits (the processing reads what only the coordinator holds).
// A verified draft's row r is processed with the draft's first r tokens appended, the tokens
// it follows.
void redraw_processed_rows(const StepBatch& batch, const std::vector<Sequence*>& seqs, StepOutput& out,
                           const std::vector<int64_t>& stop_ids) {
  std::vector<float> row;
  std::vector<int64_t> history;
  int64_t k = 0;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const SeqStep& s = batch.seqs[i];
    if (!s.sample) continue;
    const int64_t first = k;
    k += s.num_sampled;
    const Request& request = seqs[i]->request;
    // A draft model's sampled draft is verified by rejection (verify_sampled_drafts), which
    // processes its rows itself.
    if (!request.processing.active() || !seqs[i]->draft_probs.empty()) continue;
    // The batch asked for them (Engine::run): a step without them would drop the processing.
    if (!out.logits.defined()) throw std::logic_error("a processed row came back without its logits");
    const int64_t vocab = out.logits.size(1);
    const float* base = out.logits.data_ptr<float>();
    for (int64_t r = 0; r < s.num_sampled; ++r) {
      const int64_t at = first + r;
      if (r > 0) {
        // Rows after the first one the draft missed are never kept (accepted_length).
        if (out.tokens[at - 1] != seqs[i]->draft.at(r - 1)) break;
        if (r == 1) history = seqs[i]->tokens;
        history.push_back(seqs[i]->draft[r - 1]);
      }
      if (out.tokens[at] == kNonFiniteToken) continue;
      row.assign(base + at * vocab, base + (at + 1) * vocab);
      apply_logits_processing(row.data(), vocab, request.processing, r == 0 ? seqs[i]->tokens : history,
                              static_cast<int64_t>(request.prompt.size()), stop_ids, request.max_new_tokens);
      out.tokens[at] = sample_token(row.data(), vocab, s.sampling, s.request_id, s.output_index + r);
    }
  }
}

// A sampled request's draft from a draft model, whose tokens were drawn from q (not one-hot):
// row r keeps the draft token with probability min(1, p/q), else takes a draw from the
// residual and ends the run (engine/speculative/rejection_sampler.h). p is the row's
// distribution after the request's logits processing and sampling parameters. Rows after
// the whole draft keep the model's own draw.
void verify_sampled_drafts(const StepBatch& batch, const std::vector<Sequence*>& seqs, StepOutput& out,
                           const std::vector<int64_t>& stop_ids) {
  std::vector<float> row;
  int64_t k = 0;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const SeqStep& s = batch.seqs[i];
    if (!s.sample) continue;
    const int64_t first = k;
    k += s.num_sampled;
    const Sequence& seq = *seqs[i];
    if (seq.draft_probs.empty()) continue;
    if (!out.logits.defined()) throw std::logic_error("a sampled draft came back without its logits");
    const int64_t vocab = out.logits.size(1);
    const float* base = out.logits.data_ptr<float>();
    const Request& request = seq.request;
    std::vector<int64_t> history = seq.tokens;
    for (int64_t r = 0; r < s.num_sampled; ++r) {
      const int64_t at = first + r;
      row.assign(base + at * vocab, base + (at + 1) * vocab);
      if (!logits_usable(row.data(), vocab)) {
        out.tokens[at] = kNonFiniteToken;
        break;
      }
      if (request.processing.active())
        apply_logits_processing(row.data(), vocab, request.processing, history,
                                static_cast<int64_t>(request.prompt.size()), stop_ids, request.max_new_tokens);
      if (r == static_cast<int64_t>(seq.draft.size())) {
        out.tokens[at] = sample_token(row.data(), vocab, s.sampling, s.request_id, s.output_index + r);
        break;
      }
      const Candidates p = sampling_candidates(row.data(), vocab, s.sampling);
      const VerifiedToken v =
          verify_draft_token(p, seq.draft_probs.at(r), seq.draft[r], s.sampling, s.request_id, s.output_index + r);
      out.tokens[at] = v.token;
      if (!v.accepted) break;  // the residual never holds the draft token: the run ends here
      history.push_back(v.token);
    }
  }
}

}  // namespace

StepOutput sample_greedy_rows(const StepBatch& batch, const at::Tensor& logits) {
  const at::Tensor unusable = (at::isnan(logits) | at::isposinf(logits)).any(1) | at::isneginf(logits).all(1);
  const at::Tensor ids = at::where(unusable, at::full({}, kNonFiniteToken, logits.options().dtype(at::kLong)),
                                   logits.argmax(1));
  const at::Tensor host = ids.to(at::kCPU);
  const int64_t* id = host.data_ptr<int64_t>();
  StepOutput out;
  int64_t row = 0;
  for (const SeqStep& s : batch.seqs) {
    if (!s.sample) continue;
    for (int64_t r = 0; r < s.num_sampled; ++r) {
      out.request_ids.push_back(s.request_id);
      out.tokens.push_back(id[row++]);
    }
  }
  return out;
}

StepOutput sample_batch(const StepBatch& batch, const at::Tensor& logits) {
  if (!logits.is_cpu() && !batch.want_logits && all_greedy(batch)) return sample_greedy_rows(batch, logits);
  StepOutput out;
  const at::Tensor l = logits.to(at::kCPU).contiguous();
  const int64_t vocab = l.size(1);
  const float* base = l.data_ptr<float>();
  int64_t row = 0;
  for (const SeqStep& s : batch.seqs) {
    if (!s.sample) continue;
    for (int64_t r = 0; r < s.num_sampled; ++r, ++row) {
      out.request_ids.push_back(s.request_id);
      out.tokens.push_back(
          sample_token(base + row * vocab, vocab, s.sampling, s.request_id, s.output_index + r));
    }
  }
  if (batch.want_logits) out.logits = l;
  return out;
}

StageResult run_stage(const ModelShard& shard, BlockPool& pool, const StepBatch& batch,
                      const at::Tensor& hidden, DecodeGraphs* graphs) {
  // The step's tensors reuse the blocks of the step before (engine/step_arena.h).
  std::optional<StepArena::Scope> arena;
  if (shard.device().is_cpu()) arena.emplace();
  // Per-key indices grow with every sequence's context: built only for a path that reads them.
  const StepContext ctx =
      make_step_context(batch, pool.block_size(), shard.device(), shard.step_reads_keys(pool, batch));
  if (graphs != nullptr && graphs->handles(batch, ctx)) {
    StageResult r;
    const at::Tensor out = graphs->run(ctx, hidden);
    if (shard.has_head()) r.output = sample_batch(batch, out);
    else r.hidden = out;
    return r;
  }
  // A stage's input from host memory (ranks sharing a GPU) crosses without waiting for the
  // device: the copy is staged, and the step's kernels queue behind it.
  const at::Tensor input = shard.has_embedding() ? shard.embed(ctx.token_ids)
                                                 : hidden.to(shard.device(), /*non_blocking=*/true);
  StageResult r;
  r.hidden = shard.forward(input, batch, ctx, pool);
  if (shard.has_head()) {
    // Tensor ranks other than the leader get no logits: the leader samples the whole vocabulary.
    const at::Tensor logits = shard.logits(r.hidden.index_select(0, ctx.sample_rows));
    if (logits.defined()) r.output = sample_batch(batch, logits);
  }
  return r;
}

void LocalExecutor::submit(const StepBatch& batch) {
  const ScopedSpan span(trace_, SpanKind::kCompute, next_id_++);
  done_.push_back(run_stage(shard_, pool_, batch, {}, graphs_).output);
}

StepOutput LocalExecutor::wait() {
  StepOutput out = std::move(done_.front());
  done_.pop_front();
  return out;
}

Engine::Engine(StepExecutor& executor, const ModelConfig& model, int64_t num_blocks,
               const EngineOptions& options)
    : executor_(executor), model_(model), options_(options), scheduler_(options.scheduler, num_blocks) {}

void Engine::add(const Request& r) {
  for (int64_t id : r.prompt)
    if (id < 0 || id >= model_.vocab_size)
      throw std::invalid_argument("request " + std::to_string(r.id) + ": token id " +
                                  std::to_string(id) + " is outside the vocabulary (0.." +
                                  std::to_string(model_.vocab_size - 1) + ")");
  scheduler_.add(r);
}

void Engine::run(const std::function<void(const TokenEvent&)>& on_token) {
  struct InFlight {
    StepBatch batch;
    std::vector<Sequence*> seqs;
    StepRecord record;
  };
  RequestSource* const source = options_.source;
  std::deque<InFlight> flight;
  int64_t step = 0;
  for (;;) {
    const bool stopping = options_.should_stop && options_.should_stop();
    if (source && !stopping) source->poll(*this, Clock::now());
    if (scheduler_.done() && (!source || source->exhausted() || stopping)) break;
    if (stopping && flight.empty()) break;
    while (!stopping && flight.size() < executor_.max_in_flight()) {
      InFlight f;
      f.batch = scheduler_.schedule(step, f.seqs, static_cast<int64_t>(executor_.max_in_flight()));
      if (f.batch.seqs.empty()) break;
      ++step;
      f.batch.want_logits = options_.keep_logits || std::any_of(f.seqs.begin(), f.seqs.end(), [](const Sequence* s) {
                              return s->request.want_logits || s->request.processing.active() ||
                                     !s->draft_probs.empty();
                            });
      f.record.micro_batch = submitted_++;
      f.record.sequences = static_cast<int64_t>(f.batch.seqs.size());
      for (const SeqStep& s : f.batch.seqs) {
        // A verified draft's rows decode too.
        const bool decoding = s.sample && s.output_index > 0 && s.num_new == s.num_sampled;
        (decoding ? f.record.decode_tokens : f.record.prompt_tokens) += s.num_new;
      }
      f.record.submitted = Clock::now();
      executor_.submit(f.batch);
      flight.push_back(std::move(f));
    }
    if (flight.empty()) {
      if (scheduler_.done() && source) {
        // Everything added has finished and the next request is not due yet.
        const std::optional<Clock::time_point> next = source->next_arrival();
        if (!next) throw std::logic_error("request source is idle with nothing in flight and nothing due");
        const Clock::time_point begin = Clock::now();
        source->wait_until(*next);
        if (options_.trace) options_.trace->record(SpanKind::kIdle, -1, begin, Clock::now());
        continue;
      }
      ++step;  // nothing has arrived yet
      continue;
    }
    StepOutput out = executor_.wait();
    InFlight f = std::move(flight.front());
    flight.pop_front();
    redraw_processed_rows(f.batch, f.seqs, out, model_.eos_token_ids);
    verify_sampled_drafts(f.batch, f.seqs, out, model_.eos_token_ids);
    // The tokens are host values here, so the work that produced them has finished on
    // whatever device ran it: this clock reading is the end-to-end step latency.
    f.record.done = Clock::now();
    // What each sequence keeps (accepted_length() of a verified draft), announced token by
    // token; a callback that ends its request (a stop string) cuts the rest.
    std::vector<std::vector<int64_t>> kept = Scheduler::kept_tokens(f.batch, f.seqs, out);
    size_t row = 0;
    for (size_t i = 0; i < f.seqs.size(); ++i) {
      const SeqStep& s = f.batch.seqs[i];
      if (!s.sample) continue;
      const Sequence& seq = *f.seqs[i];
      const size_t first = row;
      row += static_cast<size_t>(s.num_sampled);
      std::vector<int64_t>& tokens = kept[i];
      for (size_t r = 0; r < tokens.size(); ++r) {
        const int64_t token = tokens[r];
        // A failed row is no token: the request ends with its error (on_finished, results()).
        const bool eos = std::find(model_.eos_token_ids.begin(), model_.eos_token_ids.end(), token) !=
                         model_.eos_token_ids.end();
        if (token != kNonFiniteToken && on_token) {
          TokenEvent ev;
          ev.request_id = s.request_id;
          ev.index = s.output_index + static_cast<int64_t>(r);
          ev.token = token;
          if (out.logits.defined()) {
            ev.vocab = out.logits.size(1);
            ev.logits = out.logits.data_ptr<float>() + (first + r) * ev.vocab;
          }
          on_token(ev);
        }
        if (token == kNonFiniteToken || !seq.finish_requested.empty() || (eos && !seq.request.ignore_eos)) {
          tokens.resize(r + 1);
          break;
        }
      }
    }
    scheduler_.update(f.batch, f.seqs, kept, model_.eos_token_ids);
    if (options_.on_finished)
      for (const Sequence* s : f.seqs)
        if (s->finished()) options_.on_finished(*s);
    f.record.blocks_used = scheduler_.blocks().num_used();
    stats_.step_records.push_back(f.record);
  }
}

bool Engine::finish(int64_t request_id, const std::string& reason) {
  const Sequence* target = nullptr;
  for (const auto& s : scheduler_.sequences())
    if (s->request.id == request_id && !s->finished()) target = s.get();
  if (target == nullptr || !scheduler_.finish(request_id, reason)) return false;
  // In flight, it ends when its micro-batch returns (run() reports it then).
  if (options_.on_finished && target->finished()) options_.on_finished(*target);
  return true;
}

std::vector<RequestResult> Engine::results() const {
  std::vector<RequestResult> out;
  for (const auto& s : scheduler_.sequences()) {
    RequestResult r;
    r.id = s->request.id;
    r.prompt_ids = s->request.prompt;
    r.output_ids.assign(s->tokens.begin() + s->request.prompt.size(), s->tokens.end());
    r.finish_reason = s->finish_reason;
    r.error = s->error;
    r.spec_drafts = s->spec_drafts;
    r.spec_draft_tokens = s->spec_draft_tokens;
    r.spec_accepted_tokens = s->spec_accepted_tokens;
    using ms = std::chrono::duration<double, std::milli>;
    if (!r.output_ids.empty()) {
      r.ttft_ms = ms(s->first_token_time - s->arrival_time).count();
      if (r.output_ids.size() > 1)
        r.tpot_ms = ms(s->last_token_time - s->first_token_time).count() /
                    static_cast<double>(r.output_ids.size() - 1);
    }
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace kvpipe
