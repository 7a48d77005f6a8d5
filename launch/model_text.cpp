#include "launch/model_text.h"

#include <stdexcept>

namespace kvpipe {

ModelText::ModelText(const std::string& model_path) : model_path_(model_path) {
  if (model_path.rfind("dummy:", 0) == 0) return;  // random presets carry no vocabulary
  tokenizer_ = Tokenizer::load(model_path);
  if (tokenizer_ && !tokenizer_->chat_template().empty())
    chat_template_ = std::make_unique<ChatTemplate>(tokenizer_->chat_template(),
                                                    tokenizer_->chat_template_source());
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

}  // namespace kvpipe
