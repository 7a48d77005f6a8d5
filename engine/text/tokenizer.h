// Tokenizer: text <-> token ids for the model being served, built from the model's own files.
//
// Sources: a GGUF file's `tokenizer.ggml.*` metadata (`model` llama: SentencePiece-style,
// scores, U+2581 for spaces, byte fallback <0xXX>; `model` gpt2: byte-level BPE with
// `tokenizer.ggml.merges`, pre-tokenized by the regexes `tokenizer.ggml.pre` names), or a
// Hugging Face `tokenizer.json` beside config.json (BPE with merges as "a b" or ["a", "b"],
// ByteLevel / Metaspace / Split pre-tokenizers, NFC normaliser, byte fallback, added tokens),
// with `tokenizer_config.json` for BOS/EOS handling and the chat template.
//
// Guarantees: encode() gives the ids the reference implementation gives (llama.cpp for GGUF
// vocabularies, Hugging Face `tokenizers` for tokenizer.json) — special and added tokens are
// split out of the text before any pre-tokenizer regex runs; token_bytes() of every id
// concatenated is the decoded text as bytes (which may split a UTF-8 character between
// tokens); loading a malformed or unsupported tokenizer is an std::invalid_argument whose
// one-line message names the file and the key (an unknown `tokenizer.ggml.pre` names it).
// A Tokenizer is immutable after loading and safe to use from several threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvpipe {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // The tokenizer of the model at `model_path` (a .gguf file, or a directory holding
  // config.json): GGUF metadata, or tokenizer.json (+ tokenizer_config.json) in the
  // directory. nullptr when the model carries no tokenizer (no `tokenizer.ggml.tokens`, no
  // tokenizer.json).
  static std::unique_ptr<Tokenizer> load(const std::string& model_path);

  // The ids of `text`. Special and added tokens written in the text are recognised as such;
  // with `add_special`, BOS (and EOS) are added as the model's metadata says
  // (add_bos_token / add_eos_token, or the tokenizer.json post-processor).
  virtual std::vector<int64_t> encode(const std::string& text, bool add_special = true) const = 0;

  // The bytes token `id` stands for in decoded text (U+2581 -> space, <0xXX> -> that byte,
  // byte-level characters -> their bytes; a control/special token -> its text). May be an
  // incomplete UTF-8 sequence. std::out_of_range for an id outside the vocabulary.
  virtual std::string token_bytes(int64_t id) const = 0;

  // The decoded text of `ids`, as the reference decodes it (including the removal of the
  // space a SentencePiece tokenizer put before the first word). With `skip_special`,
  // control/special tokens are left out.
  virtual std::string decode(const std::vector<int64_t>& ids, bool skip_special = false) const = 0;

  // True when decoding drops the leading space of the first token (SentencePiece with
  // add_space_prefix, Metaspace with prepend_scheme "first"/"always"): streaming decoders
  // apply it to the first generated token of a sequence that starts with it.
  virtual bool strips_leading_space() const = 0;

  // The vocabulary entry as stored (for `kvpipe tokenize`'s "pieces").
  virtual std::string piece(int64_t id) const = 0;
  virtual bool is_special(int64_t id) const = 0;  // control / added special token
  virtual int64_t vocab_size() const = 0;

  virtual int64_t bos_id() const = 0;   // -1 when none
  virtual std::vector<int64_t> eos_ids() const = 0;  // may be empty
  virtual bool add_bos() const = 0;
  std::string bos_token() const { return bos_id() >= 0 ? piece(bos_id()) : std::string(); }
  std::string eos_token() const { return eos_ids().empty() ? std::string() : piece(eos_ids().front()); }

  // The Jinja chat template that came with the model (GGUF `tokenizer.chat_template`, or
  // tokenizer_config.json's `chat_template`), "" when none; and where it came from (a file
  // name and key, for error messages).
  virtual const std::string& chat_template() const = 0;
  virtual const std::string& chat_template_source() const = 0;

 protected:
  // `id`, or std::out_of_range naming it when it is outside the vocabulary.
  int64_t checked_id(int64_t id) const;
};

}  // namespace kvpipe
