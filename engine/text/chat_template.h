// ChatTemplate: renders a list of chat messages into a prompt with the model's own Jinja
// chat template (GGUF `tokenizer.chat_template`, tokenizer_config.json's `chat_template`).
//
// No C++ Jinja engine is packaged for Debian 12, so this is a subset written here: the
// constructs real templates use (Llama 3/3.1, Qwen2/2.5, Mistral, SmolLM2/ChatML): text,
// {{ }}, {% %}, {# #}, whitespace control (-), trim_blocks and lstrip_blocks set as Hugging
// Face sets them, for (with loop.* and else), if/elif/else, set (also into a namespace),
// namespace(), macro-free expressions: literals, lists, dicts, attribute and index access,
// slicing, arithmetic, ~ concatenation, comparisons, and/or/not, in, is (defined, none,
// string, number, mapping, iterable, ...), filters (trim, length, join, tojson, upper,
// lower, default, first, last, ...), string methods (strip, startswith, split, ...), and
// raise_exception(). Objects keep insertion order (as Python's dicts do).
//
// Guarantees: render() gives byte for byte what Python's jinja2 gives for the same template
// and context when rendered as transformers' apply_chat_template renders it; a template that
// does not parse, or fails while rendering (raise_exception included), is an
// std::invalid_argument whose one-line message names the template and the line.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <memory>
#include <string>
#include <vector>

namespace kvpipe {

struct ChatMessage {
  std::string role;
  std::string content;
};

class ChatTemplate {
 public:
  // Parses `source` once; `name` names it in error messages (a file and key, say
  // "model.gguf: tokenizer.chat_template").
  ChatTemplate(const std::string& source, const std::string& name);
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  // Renders with `context` as the template's variables (messages, add_generation_prompt,
  // bos_token, eos_token, tools, ...).
  std::string render(const nlohmann::ordered_json& context) const;

  // The usual context: messages, add_generation_prompt, bos_token and eos_token.
  std::string render_chat(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                          const std::string& bos_token, const std::string& eos_token) const;

  const std::string& name() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvpipe
