#include "engine/engine.h"

#include "engine/sampler.h"

#include <ATen/ATen.h>

namespace kvpipe {

StepOutput sample_batch(const StepBatch& batch, const at::Tensor& logits) {
  StepOutput out;
  const at::Tensor l = logits.contiguous();
  const int64_t vocab = l.size(1);
  const float* base = l.data_ptr<float>();
  int64_t row = 0;
  for (const SeqStep& s : batch.seqs) {
    if (!s.sample) continue;
    out.request_ids.push_back(s.request_id);
    out.tokens.push_back(sample_token(base + row * vocab, vocab, s.sampling, s.request_id, s.output_index));
    ++row;
  }
  if (batch.want_logits) out.logits = l;
  return out;
}

StepOutput LocalExecutor::execute(const StepBatch& batch) {
  const StepContext ctx = make_step_context(batch, pool_.block_size());
  const at::Tensor ids = at::tensor(batch.token_ids, at::kLong);
  const at::Tensor hidden = shard_.forward(shard_.embed(ids), batch, ctx, pool_);
  return sample_batch(batch, shard_.logits(hidden.index_select(0, ctx.sample_rows)));
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
  std::vector<Sequence*> seqs;
  for (int64_t step = 0; !scheduler_.done(); ++step) {
    StepBatch batch = scheduler_.schedule(step, seqs);
    if (batch.seqs.empty()) continue;  // nothing arrived yet
    batch.want_logits = options_.keep_logits;
    const auto t0 = Clock::now();
    const StepOutput out = executor_.execute(batch);
    stats_.step_ms_total += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    ++stats_.steps;
    for (const SeqStep& s : batch.seqs) (s.sample ? stats_.decode_tokens : stats_.prefill_tokens) += s.num_new;
    if (on_token) {
      size_t row = 0;
      for (const SeqStep& s : batch.seqs) {
        if (!s.sample) continue;
        TokenEvent ev;
        ev.request_id = s.request_id;
        ev.index = s.output_index;
        ev.token = out.tokens[row];
        if (out.logits.defined()) {
          ev.vocab = out.logits.size(1);
          ev.logits = out.logits.data_ptr<float>() + row * ev.vocab;
        }
        on_token(ev);
        ++row;
      }
    }
    scheduler_.update(batch, seqs, out, model_.eos_token_ids);
  }
}

std::vector<RequestResult> Engine::results() const {
  std::vector<RequestResult> out;
  for (const auto& s : scheduler_.sequences()) {
    RequestResult r;
    r.id = s->request.id;
    r.prompt_ids = s->request.prompt;
    r.output_ids.assign(s->tokens.begin() + s->request.prompt.size(), s->tokens.end());
    r.finish_reason = s->finish_reason;
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
