// Fuzzes encoding and decoding of arbitrary text (any bytes, not only UTF-8) with a fixed
// tokenizer: the byte-level BPE tokenizer.json that `kvpipe init-model` writes (split regex
// pre-tokenizer, special tokens, ChatML markers). Byte-level BPE covers every byte, so
// decoding what encoding gave must return valid UTF-8 text itself (invalid UTF-8 is read with
// U+FFFD in its place, as `tokenizers`, whose strings are UTF-8, reads it).
#include "engine/text/tokenizer.h"
#include "engine/text/tokenizer_builder.h"
#include "engine/text/tokenizer_json.h"
#include "tests/fuzz/fuzz_support.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

namespace {

const kvpipe::Tokenizer& fixed_tokenizer() {
  static const std::unique_ptr<kvpipe::Tokenizer> tok = [] {
    const std::string dir = kvpipe::fuzz::scratch_dir() + "/tokenizer";
    std::filesystem::create_directories(dir);
    kvpipe::write_hf_tokenizer(kvpipe::build_byte_level_vocab(512, 1, {2}), dir);
    return kvpipe::load_hf_tokenizer(dir);
  }();
  return *tok;
}

// Strict UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF.
bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0, min = 0;
    if (c < 0x80) { ++i; continue; }
    if ((c & 0xE0) == 0xC0) { n = 1; cp = c & 0x1F; min = 0x80; }
    else if ((c & 0xF0) == 0xE0) { n = 2; cp = c & 0x0F; min = 0x800; }
    else if ((c & 0xF8) == 0xF0) { n = 3; cp = c & 0x07; min = 0x10000; }
    else return false;
    if (i + n >= s.size()) return false;
    for (size_t k = 1; k <= n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpipe;
  const Tokenizer& tok = fixed_tokenizer();
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<int64_t> ids;
  if (!fuzz::accepts([&] { ids = tok.encode(text, false); })) return 0;
  std::string joined;
  for (int64_t id : ids) joined += tok.token_bytes(id);
  const std::string decoded = tok.decode(ids);
  if (valid_utf8(text) && (decoded != text || joined != text)) {
    std::fprintf(stderr, "byte-level round trip lost the text: %zu bytes in, %zu decoded, %zu joined\n",
                 text.size(), decoded.size(), joined.size());
    std::abort();
  }
  (void)tok.decode(tok.encode(text, true), true);
  return 0;
}
