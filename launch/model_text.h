// ModelText: the text side of a job on rank 0 — the model's tokenizer and chat template —
// and the prompt ids of requests given as text or chat messages.
//
// Loaded once from the job's model (a GGUF file's metadata, or tokenizer.json and
// tokenizer_config.json beside config.json). A model without a tokenizer (a `dummy:` preset,
// an HF folder without tokenizer.json) still runs requests given as token ids; text or
// messages for it, a chat for a model without a template, or a template that fails are
// std::invalid_argument naming the request and the file.
#pragma once

#include "engine/text/chat_template.h"
#include "engine/text/tokenizer.h"
#include "launch/job_config.h"

#include <memory>
#include <string>
#include <vector>

namespace kvpipe {

class ModelText {
 public:
  explicit ModelText(const std::string& model_path);

  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  const ChatTemplate* chat_template() const { return chat_template_.get(); }

  // The prompt of `spec`: its ids, or its text tokenised (BOS as the model says), or its
  // messages rendered through the chat template (with the generation prompt) and tokenised
  // without adding BOS again, as transformers' apply_chat_template(tokenize=True) does.
  // `who` names the request in errors ("request 3", "--chat").
  std::vector<int64_t> prompt_ids(const RequestSpec& spec, const std::string& who) const;

  // The rendered chat prompt (text) of `messages`.
  std::string render_chat(const std::vector<RequestMessage>& messages, const std::string& who) const;

 private:
  const Tokenizer& need_tokenizer(const std::string& who) const;

  std::string model_path_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<ChatTemplate> chat_template_;
};

}  // namespace kvpipe
