// Fuzzes the GGUF reader: the header, metadata and tensor index a GgufFile validates up front,
// then what a rank does with a file that passed: the model config, every tensor (as float32
// and in its stored type) and the vocabulary (tokenizer.ggml.*), which encodes and decodes a
// fixed text.
#include "engine/model/gguf.h"
#include "engine/text/tokenizer.h"
#include "engine/text/tokenizer_gguf.h"
#include "tests/fuzz/fuzz_support.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpipe;
  const std::string path = fuzz::scratch_dir() + "/model.gguf";
  fuzz::write_file(path, data, size);
  std::unique_ptr<GgufFile> file;
  if (!fuzz::accepts([&] { file = std::make_unique<GgufFile>(path); })) return 0;
  fuzz::accepts([&] { gguf_config(*file).validate(path); });
  for (const std::string& name : file->tensor_names()) {
    fuzz::accepts([&] { (void)file->load(name).sum(); });
    if (file->tensor(name).ne.size() == 2) fuzz::accepts([&] { (void)file->load_matrix(name).bytes(); });
  }
  for (const auto& [key, value] : file->metadata()) {
    if (value.type != GgufValueType::ARRAY) continue;
    fuzz::accepts([&, key = key] { (void)file->get_string_array(key); });
    fuzz::accepts([&, key = key] { (void)file->get_int_array(key); });
    fuzz::accepts([&, key = key] { (void)file->get_float_array(key); });
  }
  fuzz::accepts([&] {
    const std::unique_ptr<Tokenizer> tok = load_gguf_tokenizer(*file);
    if (!tok) return;
    const auto ids = tok->encode("Hello, world! <s> \xe4\xbd\xa0\xe5\xa5\xbd 123");
    (void)tok->decode(ids);
    (void)tok->decode(ids, true);
  });
  return 0;
}
