#include "launch/init_model.h"

#include "engine/model/gguf.h"
#include "engine/model/model_weights.h"
#include "engine/model/safetensors.h"
#include "engine/text/tokenizer_builder.h"
#include "launch/output.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace kvpipe {
namespace {

// The JSON writers leave their last bytes to the stream's destructor, which cannot report a
// failed write: reading the files back turns a full disk into an error, not a broken model.
void check_written_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  bool whole = static_cast<bool>(in);
  if (whole) {
    try {
      (void)nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception&) {
      whole = false;
    }
  }
  if (!whole) throw JobFailure("cannot write the model: " + path + " was not written whole (is the disk full?)");
}

}  // namespace

void write_gguf_model(const std::string& path, const ModelConfig& cfg,
                      const std::vector<std::pair<std::string, at::Tensor>>& hf_tensors, at::ScalarType dtype) {
  write_gguf_file(path, cfg, hf_tensors, dtype, [&](GgufWriter& w) { add_gguf_vocabulary(w, cfg); });
}

void init_model(const InitModelOptions& o) {
  if (o.out.empty()) throw std::invalid_argument("--out: a path is required");
  if (o.format != "hf" && o.format != "gguf")
    throw std::invalid_argument("--format " + o.format + ": expected 'hf' or 'gguf'");
  if (!(o.std > 0)) throw std::invalid_argument("--std: must be positive");
  const at::ScalarType dtype = parse_dtype(o.dtype, "--dtype");
  o.config.validate("init-model");

  if (o.format == "gguf") {
    // Same tensors as the HF layout for the same flags: drawn under their HF names, then
    // renamed and (q/k) permuted by the writer.
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& [name, shape] : hf_tensor_layout(o.config))
      tensors.emplace_back(name, random_tensor(name, shape, o.seed, o.std));
    const std::filesystem::path parent = std::filesystem::path(o.out).parent_path();
    std::error_code ec;
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    if (ec) throw std::invalid_argument(parent.string() + ": cannot create directory: " + ec.message());
    write_gguf_model(o.out, o.config, tensors, dtype);
    return;
  }

  std::error_code ec;
  std::filesystem::create_directories(o.out, ec);
  if (ec) throw std::invalid_argument(o.out + ": cannot create directory: " + ec.message());
  write_hf_config(o.config, o.out, o.dtype);
  // The same tokenizer the GGUF format gets; a vocabulary too small for the byte-level
  // alphabet gets none (prompts to such a model are token ids).
  if (o.config.vocab_size >= kMinByteLevelVocab)
    write_hf_tokenizer(build_byte_level_vocab(o.config.vocab_size, o.config.bos_token_id, o.config.eos_token_ids),
                       o.out);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, shape] : hf_tensor_layout(o.config))
    tensors.emplace_back(name, random_tensor(name, shape, o.seed, o.std).to(dtype));
  write_safetensors(o.out + "/model.safetensors", tensors, {{"format", "pt"}});
  check_written_json(o.out + "/config.json");
  if (o.config.vocab_size >= kMinByteLevelVocab) {
    check_written_json(o.out + "/tokenizer.json");
    check_written_json(o.out + "/tokenizer_config.json");
  }
}

}  // namespace kvpipe
