// ChatTemplate on the jinja_* interpreter of this folder. The interpreter is written here
// because no C++ Jinja engine is packaged for Debian 12; it covers the subset real chat
// templates use and mimics the environment transformers' apply_chat_template renders in.
#include "engine/text/chat_template.h"

#include <nlohmann/json.hpp>

#include <stdexcept>

#include "engine/text/jinja_eval.h"
#include "engine/text/jinja_lexer.h"
#include "engine/text/jinja_parser.h"

namespace kvpipe {

struct ChatTemplate::Impl {
  std::string name;
  jinja::Body body;

  [[noreturn]] void fail(const jinja::TemplateError& e) const {
    throw std::invalid_argument(name + ":" + std::to_string(e.line > 0 ? e.line : 1) + ": " + e.what());
  }
};

ChatTemplate::ChatTemplate(const std::string& source, const std::string& name) : impl_(std::make_unique<Impl>()) {
  impl_->name = name;
  try {
    impl_->body = jinja::parse(jinja::lex(source));
  } catch (const jinja::TemplateError& e) {
    impl_->fail(e);
  }
}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

std::string ChatTemplate::render(const nlohmann::ordered_json& context) const {
  if (!context.is_object()) throw std::invalid_argument(impl_->name + ": the context must be a JSON object");
  const jinja::Value variables = jinja::from_json(context);
  try {
    return jinja::render(impl_->body, variables);
  } catch (const jinja::TemplateError& e) {
    impl_->fail(e);
  } catch (const jinja::RenderError& e) {
    impl_->fail(jinja::TemplateError(e.what(), 0));
  }
}

std::string ChatTemplate::render_chat(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                      const std::string& bos_token, const std::string& eos_token) const {
  nlohmann::ordered_json context;
  context["messages"] = nlohmann::ordered_json::array();
  for (const auto& m : messages) context["messages"].push_back({{"role", m.role}, {"content", m.content}});
  context["add_generation_prompt"] = add_generation_prompt;
  context["bos_token"] = bos_token;
  context["eos_token"] = eos_token;
  return render(context);
}

const std::string& ChatTemplate::name() const { return impl_->name; }

}  // namespace kvpipe
