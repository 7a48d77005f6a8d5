// ModelText: the text side of a job on rank 0 — the model's tokenizer and chat template —
// and the prompt ids of requests given as text or chat messages.
//
// Loaded once from the job's model (a GGUF file's metadata, or tokenizer.json and
// tokenizer_config.json beside config.json). A model without a tokenizer (a `dummy:` preset,
// an HF folder without tokenizer.json) still runs requests given as token ids; text or
// messages for it, a chat for a model without a template, or a template that fails are
// std::invalid_argument naming the request and the file.
#pragma once

#include "engine/logits_processor.h"
#include "engine/step_batch.h"
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

  // A chat API's messages (objects as the template reads them: role, content, tool_calls,
  // tool_call_id, ...) and `tools` (null: none) rendered with the generation prompt and
  // tokenised, as prompt_ids does for a job's messages.
  std::vector<int64_t> chat_prompt_ids(const nlohmann::ordered_json& messages, const nlohmann::ordered_json* tools,
                                       const std::string& who) const;

  // Replaces the model's chat template (`kvpipe serve --chat-template FILE`): `source` is
  // parsed now (std::invalid_argument naming `name` and the line when it does not).
  void set_chat_template(const std::string& source, const std::string& name);
  // The template's Jinja source ("" without one).
  const std::string& chat_template_source() const { return chat_template_source_; }

  // The token sequences that write each of `words` at the start of a text and after a
  // space (vLLM's bad_words: both, as tokenizers spell a word differently after a space).
  std::vector<std::vector<int64_t>> bad_word_ids(const std::vector<std::string>& words, const std::string& who) const;

 private:
  const Tokenizer& need_tokenizer(const std::string& who) const;

  std::string model_path_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<ChatTemplate> chat_template_;
  std::string chat_template_source_;
};

// A job file's `sampling:` section as the engine takes it: the sampler's settings, and the
// logits processing (bias ids checked against `vocab_size`, bad words tokenised by `text`,
// which may be null when there are none), std::invalid_argument naming the key.
SamplingParams request_sampling(const SamplingSection& s);
LogitsProcessing request_processing(const SamplingSection& s, const ModelText* text, int64_t vocab_size);

}  // namespace kvpipe
