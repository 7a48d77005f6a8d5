// kvpipe_tokenizer_tool MODEL STRINGS.json: loads MODEL's tokenizer (a .gguf file or an HF
// directory) and prints one JSON object: for each string of the JSON list in STRINGS.json, the
// ids without and with the model's special tokens, the decoded text of both (the second with
// special tokens skipped), and the encoding time. A test tool: the parity tests compare its
// output with llama.cpp and Hugging Face `tokenizers`. Exit 2 when the tokenizer does not
// load (the message on stderr), 1 on other failures.
#include "engine/text/tokenizer.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <iostream>
#include <stdexcept>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: kvpipe_tokenizer_tool MODEL STRINGS.json\n";
    return 2;
  }
  std::unique_ptr<kvpipe::Tokenizer> tok;
  try {
    tok = kvpipe::Tokenizer::load(argv[1]);
  } catch (const std::invalid_argument& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  if (!tok) {
    std::cerr << argv[1] << ": no tokenizer\n";
    return 2;
  }
  try {
    std::ifstream in(argv[2]);
    const nlohmann::json strings = nlohmann::json::parse(in);
    nlohmann::json results = nlohmann::json::array();
    for (const auto& s : strings) {
      const std::string text = s.get<std::string>();
      const auto t0 = std::chrono::steady_clock::now();
      const std::vector<int64_t> ids = tok->encode(text, false);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      const std::vector<int64_t> with = tok->encode(text, true);
      std::string bytes;
      for (int64_t id : ids) bytes += tok->token_bytes(id);
      results.push_back({{"ids", ids},
                         {"ids_special", with},
                         {"decoded", tok->decode(ids)},
                         {"decoded_skip", tok->decode(with, true)},
                         {"token_bytes_equal_text", bytes == text},
                         {"encode_ms", ms}});
    }
    std::vector<int64_t> eos = tok->eos_ids();
    const nlohmann::json out = {{"vocab_size", tok->vocab_size()},
                                {"bos_id", tok->bos_id()},
                                {"eos_ids", eos},
                                {"add_bos", tok->add_bos()},
                                {"strips_leading_space", tok->strips_leading_space()},
                                {"chat_template_source", tok->chat_template_source()},
                                {"results", results}};
    std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
