// kvpipe_chat_template_tool TEMPLATE_FILE CONTEXT_JSON_FILE: renders the chat template with the
// JSON object as its variables and prints the result to stdout unchanged; on a parse or render
// error prints the error's one-line message to stderr and exits 2. The chat-template parity
// test runs it next to Python's jinja2.
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>

#include "engine/text/chat_template.h"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument(path + ": cannot open");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: kvpipe_chat_template_tool TEMPLATE_FILE CONTEXT_JSON_FILE\n";
    return 2;
  }
  try {
    const kvpipe::ChatTemplate tmpl(read_file(argv[1]), argv[1]);
    nlohmann::ordered_json context;
    try {
      context = nlohmann::ordered_json::parse(read_file(argv[2]));
    } catch (const nlohmann::json::exception& e) {
      throw std::invalid_argument(std::string(argv[2]) + ": " + e.what());
    }
    std::cout << tmpl.render(context);
    std::cout.flush();
    return 0;
  } catch (const std::invalid_argument& e) {
    std::cerr << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "internal error: " << e.what() << "\n";
    return 1;
  }
}
