#include "launch/model_text.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <stdexcept>

namespace kvpipe {

ModelText::ModelText(const std::string& model_path) : model_path_(model_path) {
  if (model_path.rfind("dummy:", 0) == 0) return;  // random presets carry no vocabulary
  tokenizer_ = Tokenizer::load(model_path);
  if (tokenizer_ && !tokenizer_->chat_template().empty())
    set_chat_template(tokenizer_->chat_template(), tokenizer_->chat_template_source());
}

void ModelText::set_chat_template(const std::string& source, const std::string& name) {
  chat_template_ = std::make_unique<ChatTemplate>(source, name);
  chat_template_source_ = source;
}

std::vector<int64_t> ModelText::chat_prompt_ids(const nlohmann::ordered_json& messages,
                                                const nlohmann::ordered_json* tools, const std::string& who) const {
  const Tokenizer& tok = need_tokenizer(who);
  if (!chat_template_)
    throw std::invalid_argument(who + ": the model " + model_path_ +
                                " has no chat template (give the prompt as text instead)");
  nlohmann::ordered_json context;
  context["messages"] = messages;
  // transformers passes tools only when the caller gives them; templates test `tools`.
  if (tools) context["tools"] = *tools;
  context["add_generation_prompt"] = true;
  context["bos_token"] = tok.bos_token();
  context["eos_token"] = tok.eos_token();
  return tok.encode(chat_template_->render(context), false);
}

const Tokenizer& ModelText::need_tokenizer(const std::string& who) const {
  if (!tokenizer_)
    throw std::invalid_argument(who + ": the model " + model_path_ +
                                " has no tokenizer (give prompt_ids, or use a model with "
                                "tokenizer.json or a GGUF vocabulary)");
  return *tokenizer_;
}

std::string ModelText::render_chat(const std::vector<RequestMessage>& messages,
                                   const std::string& who) const {
  const Tokenizer& tok = need_tokenizer(who);
  if (!chat_template_)
    throw std::invalid_argument(who + ": the model " + model_path_ +
                                " has no chat template (give the prompt as text instead)");
  std::vector<ChatMessage> chat;
  for (const RequestMessage& m : messages) chat.push_back({m.role, m.content});
  return chat_template_->render_chat(chat, true, tok.bos_token(), tok.eos_token());
}

std::vector<int64_t> ModelText::prompt_ids(const RequestSpec& spec, const std::string& who) const {
  if (spec.prompt) return need_tokenizer(who).encode(*spec.prompt, true);
  if (!spec.messages.empty()) return need_tokenizer(who).encode(render_chat(spec.messages, who), false);
  return spec.prompt_ids;
}

std::vector<std::vector<int64_t>> ModelText::bad_word_ids(const std::vector<std::string>& words,
                                                          const std::string& who) const {
  const Tokenizer& tok = need_tokenizer(who);
  std::vector<std::vector<int64_t>> out;
  for (const std::string& word : words) {
    const size_t first = word.find_first_not_of(' ');
    if (first == std::string::npos) throw std::invalid_argument(who + ": a bad word must not be empty or only spaces");
    const std::string bare = word.substr(first);
    for (const std::string& text : {bare, " " + bare}) {
      std::vector<int64_t> ids = tok.encode(text, false);
      if (!ids.empty() && std::find(out.begin(), out.end(), ids) == out.end()) out.push_back(std::move(ids));
    }
  }
  return out;
}

SamplingParams request_sampling(const SamplingSection& s) {
  SamplingParams p;
  p.temperature = s.temperature;
  p.top_k = s.top_k;
  p.top_p = s.top_p;
  p.seed = s.seed;
  p.min_p = s.min_p;
  return p;
}

LogitsProcessing request_processing(const SamplingSection& s, const ModelText* text, int64_t vocab_size) {
  LogitsProcessing p;
  p.presence_penalty = s.presence_penalty;
  p.frequency_penalty = s.frequency_penalty;
  p.repetition_penalty = s.repetition_penalty;
  p.min_tokens = s.min_tokens;
  for (const auto& [id, bias] : s.logit_bias) {
    if (id >= vocab_size)
      throw std::invalid_argument("sampling.logit_bias." + std::to_string(id) + ": token id outside the vocabulary (0.." +
                                  std::to_string(vocab_size - 1) + ")");
    p.logit_bias.emplace_back(id, static_cast<float>(bias));
  }
  if (!s.bad_words.empty()) {
    if (!text) throw std::invalid_argument("sampling.bad_words: needs the model's tokenizer");
    p.bad_words = text->bad_word_ids(s.bad_words, "sampling.bad_words");
  }
  return p;
}

}  // namespace kvpipe
