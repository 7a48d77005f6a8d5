// Fuzzes the Hugging Face tokenizer.json reader (normalizers, pre-tokenizers with their
// regular expressions, BPE model, added tokens, post-processors, decoders), then encodes and
// decodes fixed texts with any tokenizer it accepted.
#include "engine/text/tokenizer.h"
#include "engine/text/tokenizer_json.h"
#include "tests/fuzz/fuzz_support.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpipe;
  static const std::vector<std::string> texts = {
      "Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "123 4567 a1b2",
      "<s>special</s><unk>", "\xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\x98\x80 caf\xc3\xa9 cafe\xcc\x81", "",
  };
  const std::string& dir = fuzz::scratch_dir();
  fuzz::write_file(dir + "/tokenizer.json", data, size);
  std::unique_ptr<Tokenizer> tok;
  if (!fuzz::accepts([&] { tok = load_hf_tokenizer(dir); }) || !tok) return 0;
  for (const std::string& text : texts) {
    fuzz::accepts([&] {
      const std::vector<int64_t> ids = tok->encode(text, true);
      (void)tok->decode(ids);
      (void)tok->decode(ids, true);
      for (int64_t id : ids) (void)tok->piece(id);
    });
  }
  (void)tok->bos_token();
  (void)tok->eos_token();
  return 0;
}
