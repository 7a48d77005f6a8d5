// The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, behaving as
// llama.cpp's llama_vocab does (src/llama-vocab.cpp): `model` llama (SentencePiece-style
// merging by score) and gpt2 (byte-level BPE pre-split by the regexes `pre` names).
#pragma once

#include "engine/text/tokenizer.h"

#include <memory>
#include <string>

namespace kvpipe {

class GgufFile;

// nullptr when the file has no `tokenizer.ggml.tokens`; std::invalid_argument naming the
// file and key for metadata it cannot use.
std::unique_ptr<Tokenizer> load_gguf_tokenizer(const GgufFile& file);

// The `tokenizer.ggml.pre` names this code accepts for gpt2 vocabularies.
const std::vector<std::string>& supported_gguf_pre_tokenizers();

}  // namespace kvpipe
