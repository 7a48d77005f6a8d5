#include "engine/text/tokenizer.h"

#include "engine/model/gguf.h"
#include "engine/text/tokenizer_gguf.h"
#include "engine/text/tokenizer_json.h"

#include <filesystem>
#include <stdexcept>

namespace kvpipe {

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& model_path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(model_path, ec)) return load_hf_tokenizer(model_path);
  if (!fs::exists(model_path, ec)) throw std::invalid_argument(model_path + ": no such file or directory");
  return load_gguf_tokenizer(GgufFile(model_path));
}

int64_t Tokenizer::checked_id(int64_t id) const {
  if (id < 0 || id >= vocab_size())
    throw std::out_of_range("token id " + std::to_string(id) + " is outside the vocabulary (" +
                            std::to_string(vocab_size()) + " tokens)");
  return id;
}

}  // namespace kvpipe
