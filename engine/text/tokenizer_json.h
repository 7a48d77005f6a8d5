// The tokenizer a Hugging Face model directory describes in tokenizer.json (+
// tokenizer_config.json, chat_template.jinja), behaving as the `tokenizers` library does:
// added tokens split out first (leftmost-longest, with lstrip / rstrip / single_word /
// normalized), then normaliser, pre-tokenizer, BPE model and post-processor; decoding through
// the decoder chain.
//
// Supported components: model BPE (merges as "a b" or ["a", "b"], byte_fallback, unk_token,
// fuse_unk, ignore_merges); normalizers NFC/NFD/NFKC/NFKD, Lowercase, Prepend, Replace, Strip,
// Sequence; pre-tokenizers ByteLevel, Metaspace, Split, Digits, Whitespace, WhitespaceSplit,
// Sequence; post-processors TemplateProcessing, RobertaProcessing, BertProcessing, ByteLevel,
// Sequence; decoders ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace, Sequence. Any
// other type is an std::invalid_argument naming the file and the JSON path.
#pragma once

#include "engine/text/tokenizer.h"

#include <memory>
#include <string>

namespace kvpipe {

// nullptr when `dir` holds no tokenizer.json.
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& dir);

}  // namespace kvpipe
