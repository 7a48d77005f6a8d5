// Fuzzes the chat-template engine (engine/text/jinja_*): a template from the input, parsed and
// rendered over a fixed conversation with and without the generation prompt.
#include "engine/text/chat_template.h"
#include "tests/fuzz/fuzz_support.h"

#include <cstdint>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpipe;
  static const std::vector<ChatMessage> conversation = {
      {"system", "You are terse."},
      {"user", "What is 2+2? {{ not a template }}"},
      {"assistant", "4"},
      {"user", "And in \xc3\xa9\xe2\x82\xac words?"},
  };
  const std::string source(reinterpret_cast<const char*>(data), size);
  fuzz::accepts([&] {
    const ChatTemplate tmpl(source, "fuzz.jinja");
    fuzz::accepts([&] { (void)tmpl.render_chat(conversation, true, "<s>", "</s>"); });
    fuzz::accepts([&] { (void)tmpl.render_chat({conversation.begin() + 1, conversation.begin() + 2}, false, "", ""); });
  });
  return 0;
}
