// The byte-level BPE tokenizer `kvpipe init-model` gives its random models, so that they take
// and produce text: special tokens (unk/BOS/EOS at the ids the model config names, plus
// <|im_start|> and <|im_end|> for a ChatML chat template when the vocabulary has room), the
// 256 byte-level characters, then merges learned by a small BPE trainer over a fixed English
// paragraph (the most frequent adjacent pair first, ties to the lexicographically smallest
// pair) until the vocabulary is full or no pair repeats; ids left over hold unique tokens no
// text reaches.
//
// Guarantees: the vocabulary is a pure function of (vocab_size, bos, eos), and the GGUF
// metadata (tokenizer.ggml.model gpt2, pre "gpt-2") and the tokenizer.json written from it
// tokenize every text to the same ids, in kvpipe, in llama.cpp and in `tokenizers`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvpipe {

class GgufWriter;
struct ModelConfig;

struct ByteLevelVocab {
  std::vector<std::string> tokens;  // id -> text (byte-level characters for normal tokens)
  std::vector<int32_t> types;       // llama.cpp token types: 1 normal, 2 unknown, 3 control
  std::vector<std::string> merges;  // "a b", in rank order
  int64_t unk_id = -1, bos_id = -1;
  std::vector<int64_t> eos_ids;
  std::string chat_template;        // ChatML when the vocabulary has <|im_start|>/<|im_end|>
};

// The smallest vocabulary that holds the byte-level alphabet and three special tokens.
constexpr int64_t kMinByteLevelVocab = 3 + 256;

// std::invalid_argument when vocab_size < kMinByteLevelVocab or a special id is out of range.
ByteLevelVocab build_byte_level_vocab(int64_t vocab_size, int64_t bos_id, const std::vector<int64_t>& eos_ids);

// Writes DIR/tokenizer.json and DIR/tokenizer_config.json for `vocab`.
void write_hf_tokenizer(const ByteLevelVocab& vocab, const std::string& dir);

// Adds the tokenizer.* keys of a GGUF file init-model writes for `cfg`: the byte-level
// vocabulary above (GGUF model gpt2, pre "gpt-2"), or below its minimum size a
// SentencePiece-shaped placeholder (<unk>, <s>, </s>, then unique placeholders) that
// llama.cpp loads; prompts to such a model are token ids.
void add_gguf_vocabulary(GgufWriter& writer, const ModelConfig& cfg);

}  // namespace kvpipe
