#include "launch/bench/dataset_workload.h"

#include "engine/sampler.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <stdexcept>

namespace kvpipe {
namespace {

// vLLM's ShareGPT filter (benchmarks: too short to measure, or too long for its 2048-token
// models), here also within the model's context.
constexpr int64_t kMinTokens = 4, kMaxPromptTokens = 1024, kMaxTotalTokens = 2048;

const Tokenizer& tokenizer_of(const ModelText& text, const std::string& where) {
  if (text.tokenizer() == nullptr)
    throw std::invalid_argument(where + ": a dataset is tokenised with the model's tokenizer, and the model has none");
  return *text.tokenizer();
}

std::string too_few(const std::string& where, const DatasetSummary& s, int64_t found, int64_t total,
                    const std::string& what) {
  return where + ": " + s.path + " holds " + std::to_string(found) + " " + what + ", the workload needs " +
         std::to_string(total) + " (requests + warmup)";
}

}  // namespace

std::vector<size_t> conversation_order(size_t n, uint64_t seed) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  // Fisher-Yates with our own draws: the same order from every standard library.
  std::mt19937_64 rng(splitmix64(seed ^ 0x5348415245475054ULL));
  for (size_t i = n; i > 1; --i) std::swap(order[i - 1], order[rng() % i]);
  return order;
}

std::vector<WorkloadRequest> single_turn_requests(const ConversationFile& file, const ModelText& text,
                                                  int64_t context, uint64_t seed, int64_t total,
                                                  const std::string& where, DatasetSummary& summary) {
  const Tokenizer& tok = tokenizer_of(text, where);
  std::vector<WorkloadRequest> out;
  for (const size_t i : conversation_order(file.conversations.size(), seed)) {
    if (static_cast<int64_t>(out.size()) == total) break;
    const auto& [question, answer] = file.conversations[i].turns.front();
    WorkloadRequest r;
    r.prompt = tok.encode(question, true);
    r.output_len = static_cast<int64_t>(tok.encode(answer, false).size());
    const auto prompt_len = static_cast<int64_t>(r.prompt.size());
    if (prompt_len < kMinTokens || r.output_len < kMinTokens || prompt_len > kMaxPromptTokens ||
        prompt_len + r.output_len > std::min(kMaxTotalTokens, context)) {
      ++summary.filtered;
      continue;
    }
    out.push_back(std::move(r));
  }
  if (static_cast<int64_t>(out.size()) < total)
    throw std::invalid_argument(too_few(where, summary, static_cast<int64_t>(out.size()), total,
                                        "usable first turns (4 to 1024 prompt tokens, 4 or more reply tokens)"));
  summary.used = total;
  return out;
}

std::vector<Conversation> multi_turn_conversations(const ConversationFile& file, uint64_t seed, int64_t min_turns,
                                                   int64_t total, const std::string& where,
                                                   DatasetSummary& summary) {
  std::vector<Conversation> out;
  for (const size_t i : conversation_order(file.conversations.size(), seed)) {
    if (static_cast<int64_t>(out.size()) == total) break;
    if (static_cast<int64_t>(file.conversations[i].turns.size()) < min_turns) {
      ++summary.filtered;
      continue;
    }
    out.push_back(file.conversations[i]);
  }
  if (static_cast<int64_t>(out.size()) < total)
    throw std::invalid_argument(too_few(where, summary, static_cast<int64_t>(out.size()), total,
                                        "conversations of " + std::to_string(min_turns) + " or more turns"));
  summary.used = total;
  return out;
}

DatasetWorkload load_dataset_workload(const JobConfig& job, int64_t context) {
  const WorkloadSection& w = job.workload;
  const std::string where = job.source + ": workload.dataset";
  DatasetWorkload out;
  const ConversationFile file = read_conversations(dataset_path(w.dataset, where));
  out.summary.path = file.path;
  out.summary.conversations = static_cast<int64_t>(file.conversations.size());
  out.summary.skipped = file.skipped;
  out.summary.truncated = file.truncated;
  out.summary.truncated_bytes = file.truncated_bytes;
  try {
    out.text = std::make_unique<ModelText>(job.model.path);
  } catch (const std::exception& e) {
    throw std::invalid_argument(where + ": " + e.what());
  }
  tokenizer_of(*out.text, where + " (" + job.model.path + ")");
  const int64_t total = int64_t{w.requests} + w.warmup;
  if (w.mode == "multi_turn") {
    if (out.text->chat_template() == nullptr)
      throw std::invalid_argument(where + ": multi_turn renders turns through the chat template, and " + job.model.path +
                                  " has none");
    out.conversations = multi_turn_conversations(file, w.seed, w.min_turns, total, where, out.summary);
  } else {
    out.requests = single_turn_requests(file, *out.text, context, w.seed, total, where, out.summary);
  }
  return out;
}

MultiTurnSource::MultiTurnSource(std::vector<Conversation> conversations, const ModelText& text,
                                 MultiTurnOptions options, DatasetSummary& summary)
    : text_(text), options_(std::move(options)), summary_(summary), next_id_(options_.first_id) {
  const Tokenizer& tok = tokenizer_of(text_, "workload.dataset");
  for (Conversation& c : conversations) {
    State s;
    s.conversation = std::move(c);
    for (const auto& turn : s.conversation.turns)
      s.output_len.push_back(std::max<int64_t>(1, static_cast<int64_t>(tok.encode(turn.second, false).size())));
    states_.push_back(std::move(s));
  }
}

int64_t MultiTurnSource::planned_output_tokens() const {
  int64_t total = 0;
  for (const State& s : states_)
    for (const int64_t n : s.output_len) total += n;
  return total;
}

std::vector<int64_t> MultiTurnSource::next_prompt(const ModelText& text, const std::vector<int64_t>& previous_prompt,
                                                  const std::vector<int64_t>& reply,
                                                  std::vector<RequestMessage> history) {
  // The template's text after the reply: rendered with a marker in the reply's place, so that
  // the tokens before it are exactly those already in the cache.
  static const std::string kMarker = "\x1fkvpipe-reply\x1f";
  if (history.size() < 2 || history[history.size() - 2].role != "assistant")
    throw std::logic_error("next_prompt: the history must end with a reply and a user message");
  history[history.size() - 2].content = kMarker;
  const std::string rendered = text.render_chat(history, "workload.dataset");
  const size_t at = rendered.rfind(kMarker);
  if (at == std::string::npos)
    throw std::invalid_argument("workload.dataset: the model's chat template leaves the assistant's reply out of the "
                                "history, so a turn's prompt cannot extend the one before");
  std::vector<int64_t> ids = previous_prompt;
  ids.insert(ids.end(), reply.begin(), reply.end());
  const std::vector<int64_t> rest = text.tokenizer()->encode(rendered.substr(at + kMarker.size()), false);
  ids.insert(ids.end(), rest.begin(), rest.end());
  return ids;
}

bool MultiTurnSource::start_turn(State& s, Engine& engine) {
  const Conversation& c = s.conversation;
  const auto turn = static_cast<size_t>(s.next_turn);
  std::vector<int64_t> prompt;
  if (turn == 0) {
    s.history = c.system;
    s.history.push_back({"user", c.turns[0].first});
    prompt = text_.tokenizer()->encode(text_.render_chat(s.history, "workload.dataset"), false);
  } else {
    prompt = next_prompt(text_, s.prompt, s.reply, s.history);
  }
  const int64_t output_len = s.output_len[turn];
  if (static_cast<int64_t>(prompt.size()) + output_len > options_.context) {
    // The history outgrew the context: the conversation ends here.
    if (turn == 0) ++summary_.filtered;
    summary_.turns_cut += static_cast<int64_t>(c.turns.size() - turn);
    return false;
  }
  Request r;
  r.id = next_id_++;
  r.prompt = prompt;
  r.max_new_tokens = output_len;
  r.sampling = options_.sampling;
  r.processing = options_.processing;
  r.ignore_eos = true;
  r.arrival_time = s.due;  // a turn's latency counts from when it was due
  engine.add(r);
  const auto index = static_cast<size_t>(&s - states_.data());
  turns_[r.id] = {static_cast<int64_t>(index), s.next_turn};
  running_[r.id] = index;
  s.prompt = std::move(prompt);
  s.running = true;
  ++s.next_turn;
  return true;
}

void MultiTurnSource::poll(Engine& engine, Clock::time_point now) {
  // Again while a conversation that ended at once (its turn outgrew the context) left a slot
  // for the next one.
  do {
    for (; active_ < options_.concurrency && next_conversation_ < states_.size(); ++active_)
      states_[next_conversation_++].due = now;
    for (size_t i = 0; i < next_conversation_; ++i) {
      State& s = states_[i];
      if (s.done || s.running || s.due > now) continue;
      if (!start_turn(s, engine)) {
        s.done = true;
        --active_;
      }
    }
  } while (active_ < options_.concurrency && next_conversation_ < states_.size());
}

bool MultiTurnSource::exhausted() const {
  if (next_conversation_ < states_.size()) return false;
  // Every turn added: each conversation ended, or runs its last turn.
  return std::all_of(states_.begin(), states_.end(), [](const State& s) {
    return s.done || (s.running && s.next_turn >= static_cast<int64_t>(s.conversation.turns.size()));
  });
}

std::optional<Clock::time_point> MultiTurnSource::next_arrival() const {
  std::optional<Clock::time_point> next;
  for (size_t i = 0; i < next_conversation_; ++i) {
    const State& s = states_[i];
    if (!s.done && !s.running && (!next || s.due < *next)) next = s.due;
  }
  if (!next && active_ < options_.concurrency && next_conversation_ < states_.size()) next = Clock::now();
  return next;
}

void MultiTurnSource::on_finished(const Sequence& sequence) {
  const auto it = running_.find(sequence.request.id);
  if (it == running_.end()) return;
  State& s = states_[it->second];
  running_.erase(it);
  s.running = false;
  const auto prompt_len = static_cast<std::ptrdiff_t>(sequence.request.prompt.size());
  s.reply.assign(sequence.tokens.begin() + prompt_len, sequence.tokens.end());
  const bool more = s.next_turn < static_cast<int64_t>(s.conversation.turns.size());
  // A turn that failed or was aborted ends its conversation (a stop string does not).
  if (sequence.finish_reason == "error" || sequence.finish_reason == "abort" || !more) {
    s.done = true;
    --active_;
    return;
  }
  s.history.push_back({"assistant", text_.tokenizer()->decode(s.reply)});
  s.history.push_back({"user", s.conversation.turns[static_cast<size_t>(s.next_turn)].first});
  s.due = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.turn_gap_s));
}

}  // namespace kvpipe
