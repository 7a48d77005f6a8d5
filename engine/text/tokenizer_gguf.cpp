#include "engine/text/tokenizer_gguf.h"

#include "engine/model/gguf.h"
#include "engine/text/bpe_model.h"
#include "engine/text/pre_tokenizer.h"
#include "engine/text/spm_model.h"
#include "engine/text/unicode_text.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <stdexcept>
#include <unordered_map>

namespace kvpipe {
namespace {

using text::BpeModel;
using text::BpeSymbol;
using text::Regex;

// llama_token_attr bits.
enum Attr : uint32_t {
  kUndefined = 0,
  kUnknown = 1 << 0,
  kUnused = 1 << 1,
  kNormal = 1 << 2,
  kControl = 1 << 3,
  kUserDefined = 1 << 4,
  kByte = 1 << 5,
  kLstrip = 1 << 7,
  kRstrip = 1 << 8,
};

uint32_t attr_of_type(int64_t type) {
  switch (type) {
    case 1: return kNormal;
    case 2: return kUnknown;
    case 3: return kControl;
    case 4: return kUserDefined;
    case 5: return kUnused;
    case 6: return kByte;
    default: return kUndefined;
  }
}

// The pre-tokenizer regexes of llama.cpp's llm_tokenizer_bpe and the flags llama_vocab::load
// sets, by `tokenizer.ggml.pre`.
struct PreTokenizerSpec {
  std::vector<std::string> names;
  std::vector<std::string> regexes;
  bool clean_spaces = true;
  bool ignore_merges = false;
  bool add_bos = false;
};

const std::vector<PreTokenizerSpec>& pre_tokenizer_specs() {
  static const std::string gpt2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)";
  static const std::string llama3 =
      "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
      "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
  static const std::string qwen2 =
      "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
      "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
  static const std::vector<PreTokenizerSpec> specs = {
      {{"default"}, {"[\\p{P}\\$\\+<=>\\^~\\|]+", gpt2, "\\p{N}+", "[0-9][0-9][0-9]"}},
      {{"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"},
       {llama3}, true, true, true},
      {{"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan"}, {qwen2}, false},
      {{"megrez", "stablelm2"}, {qwen2}},
      {{"smollm", "command-r"}, {"\\p{N}", gpt2}, false},
      {{"starcoder", "refact", "codeshell", "exaone", "minerva-7b"}, {"\\p{N}", gpt2}},
      {{"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
        "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo", "jais"},
       {gpt2}},
      {{"trillion", "granite-docling"}, {gpt2}, false},
      {{"falcon"}, {"[\\p{P}\\$\\+<=>\\^~\\|`]+", gpt2, "[0-9][0-9][0-9]"}},
  };
  return specs;
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::invalid_argument(path + ": " + what);
}

class GgufTokenizer final : public Tokenizer {
 public:
  explicit GgufTokenizer(const GgufFile& f);

  std::vector<int64_t> encode(const std::string& text, bool add_special) const override;
  std::string token_bytes(int64_t id) const override;
  std::string decode(const std::vector<int64_t>& ids, bool skip_special) const override;
  bool strips_leading_space() const override { return add_space_prefix_; }
  std::string piece(int64_t id) const override { return tokens_.at(checked_id(id)); }
  bool is_special(int64_t id) const override { return (attrs_.at(checked_id(id)) & (kControl | kUnknown)) != 0; }
  int64_t vocab_size() const override { return static_cast<int64_t>(tokens_.size()); }
  int64_t bos_id() const override { return bos_; }
  std::vector<int64_t> eos_ids() const override { return eos_; }
  bool add_bos() const override { return add_bos_; }
  const std::string& chat_template() const override { return chat_template_; }
  const std::string& chat_template_source() const override { return chat_template_source_; }

 private:
  // llama.cpp's token_to_piece(special = true) without lstrip.
  std::string piece_text(int64_t id) const;
  void encode_bpe(const std::string& fragment, std::vector<int64_t>& out) const;

  bool spm_ = true;
  std::vector<std::string> tokens_;
  std::vector<uint32_t> attrs_;
  std::unordered_map<std::string, int64_t> token_ids_;
  text::SpmModel spm_model_;
  BpeModel bpe_;
  std::vector<Regex> regexes_;
  std::vector<int64_t> specials_;  // longest text first
  int64_t bos_ = -1, eos_id_ = -1;
  std::vector<int64_t> eos_;
  bool add_bos_ = false, add_eos_ = false, add_space_prefix_ = false, clean_spaces_ = false, ignore_merges_ = false;
  std::string chat_template_, chat_template_source_;
};

GgufTokenizer::GgufTokenizer(const GgufFile& f) {
  const std::string& path = f.path();
  const std::string model = f.get_string("tokenizer.ggml.model");
  std::string pre = f.has("tokenizer.ggml.pre") ? f.get_string("tokenizer.ggml.pre") : "";
  int64_t bos = -1, eos = -1;
  if (model == "llama") {
    spm_ = true;
    bos = 1, eos = 2;
    add_space_prefix_ = true;
    add_bos_ = true;
  } else if (model == "gpt2") {
    spm_ = false;
    bos = 11, eos = 11;
    if (pre.empty()) pre = "default";
    const PreTokenizerSpec* spec = nullptr;
    for (const auto& s : pre_tokenizer_specs())
      if (std::find(s.names.begin(), s.names.end(), pre) != s.names.end()) spec = &s;
    if (spec == nullptr) {
      std::string names;
      for (const auto& n : supported_gguf_pre_tokenizers()) names += (names.empty() ? "" : ", ") + n;
      fail(path, "tokenizer.ggml.pre '" + pre + "' is not supported (supported: " + names + ")");
    }
    for (const auto& r : spec->regexes) regexes_.emplace_back(r, path + ": tokenizer.ggml.pre '" + pre + "'");
    clean_spaces_ = spec->clean_spaces;
    ignore_merges_ = spec->ignore_merges;
    add_bos_ = spec->add_bos;
  } else {
    fail(path, "tokenizer.ggml.model '" + model + "' is not supported (supported: llama, gpt2)");
  }
  if (f.has("tokenizer.ggml.add_space_prefix")) add_space_prefix_ = f.get_int("tokenizer.ggml.add_space_prefix") != 0;

  tokens_ = f.get_string_array("tokenizer.ggml.tokens");
  const size_t n = tokens_.size();
  if (n == 0) fail(path, "tokenizer.ggml.tokens is empty");
  std::vector<float> scores(n, 0.0f);
  if (f.has("tokenizer.ggml.scores")) {
    scores = f.get_float_array("tokenizer.ggml.scores");
    if (scores.size() < n) fail(path, "tokenizer.ggml.scores has fewer entries than tokenizer.ggml.tokens");
  }
  attrs_.assign(n, kNormal);
  if (f.has("tokenizer.ggml.token_type")) {
    const std::vector<int64_t> types = f.get_int_array("tokenizer.ggml.token_type");
    if (types.size() < n) fail(path, "tokenizer.ggml.token_type has fewer entries than tokenizer.ggml.tokens");
    for (size_t i = 0; i < n; ++i) attrs_[i] = attr_of_type(types[i]);
  }
  token_ids_.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (tokens_[i].empty()) tokens_[i] = "[EMPTY_" + std::to_string(i) + "]";
    token_ids_[tokens_[i]] = static_cast<int64_t>(i);  // a repeated text maps to its last id, as in llama.cpp
  }

  if (spm_) {
    std::vector<int64_t> byte_ids(256, -1);
    for (int b = 0; b < 256; ++b) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "<0x%02X>", b);
      auto it = token_ids_.find(hex);
      if (it == token_ids_.end()) it = token_ids_.find(std::string(1, static_cast<char>(b)));
      if (it != token_ids_.end()) byte_ids[b] = it->second;
    }
    spm_model_ = text::SpmModel(&token_ids_, scores, std::move(byte_ids));
  } else {
    if (!f.has("tokenizer.ggml.merges")) fail(path, "gpt2 tokenizer without tokenizer.ggml.merges");
    std::vector<std::pair<std::string, std::string>> merges;
    for (const std::string& m : f.get_string_array("tokenizer.ggml.merges")) {
      const size_t pos = m.find(' ', 1);
      if (pos == std::string::npos) merges.emplace_back("", "");  // keeps the ranks aligned
      else merges.emplace_back(m.substr(0, pos), m.substr(pos + 1));
    }
    bpe_ = BpeModel(tokens_, merges);
  }

  // Special ids from metadata; defaults out of range are dropped, bad ids keep the default.
  auto special = [&](const std::string& key, int64_t def) -> int64_t {
    if (def >= static_cast<int64_t>(n)) def = -1;
    if (!f.has(key)) return def;
    const int64_t id = f.get_int(key);
    return id >= 0 && id < static_cast<int64_t>(n) ? id : def;
  };
  bos_ = special("tokenizer.ggml.bos_token_id", bos);
  eos_id_ = special("tokenizer.ggml.eos_token_id", eos);
  const int64_t eot = special("tokenizer.ggml.eot_token_id", -1);
  const int64_t eom = special("tokenizer.ggml.eom_token_id", -1);
  if (f.has("tokenizer.ggml.add_bos_token")) add_bos_ = f.get_int("tokenizer.ggml.add_bos_token") != 0;
  if (f.has("tokenizer.ggml.add_eos_token")) add_eos_ = f.get_int("tokenizer.ggml.add_eos_token") != 0;

  // Tokens llama.cpp recognises by their text and treats as control tokens whatever the
  // file says (end of generation, end of turn, fill-in-the-middle markers).
  static const char* const kControlByText[] = {
      "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
      "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
      "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~["};
  static const char* const kFimByText[] = {
      "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
      "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
      "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
      "▁<MID>", "<|code_middle|>", "<|middle|>", "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
      "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>"};
  std::vector<int64_t> eog;
  for (const char* t : kControlByText) {
    const auto it = token_ids_.find(t);
    if (it == token_ids_.end()) continue;
    attrs_[it->second] |= kControl;
    eog.push_back(it->second);
  }
  for (const char* t : kFimByText) {
    const auto it = token_ids_.find(t);
    if (it != token_ids_.end()) attrs_[it->second] |= kControl;
  }
  for (const char* t : {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}) {
    const auto it = token_ids_.find(t);
    if (it != token_ids_.end()) attrs_[it->second] = kUserDefined;
  }
  for (int64_t id : {eot, eom})
    if (id >= 0) eog.push_back(id);
  if (eos_id_ >= 0) eos_.push_back(eos_id_);
  std::sort(eog.begin(), eog.end());
  for (int64_t id : eog)
    if (std::find(eos_.begin(), eos_.end(), id) == eos_.end()) eos_.push_back(id);

  for (size_t i = 0; i < n; ++i)
    if (attrs_[i] & (kControl | kUserDefined | kUnknown)) specials_.push_back(static_cast<int64_t>(i));
  std::stable_sort(specials_.begin(), specials_.end(),
                   [&](int64_t a, int64_t b) { return tokens_[a].size() > tokens_[b].size(); });

  // Per-model attributes llama.cpp sets by name (Phi-3 strips spaces after its markers).
  std::string name = f.has("general.name") ? f.get_string("general.name") : "";
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  if (name.find("phi-3") != std::string::npos || name.find("phi3") != std::string::npos) {
    for (int64_t id : specials_) attrs_[id] |= kRstrip;
    auto set = [&](const char* t, bool on) {
      const auto it = token_ids_.find(t);
      if (it == token_ids_.end()) return;
      attrs_[it->second] = on ? (attrs_[it->second] | kRstrip) : (attrs_[it->second] & ~kRstrip);
    };
    set("</s>", true);
    for (const char* t : {"<unk>", "<s>", "<|endoftext|>"}) set(t, false);
  }

  if (f.has("tokenizer.chat_template")) {
    chat_template_ = f.get_string("tokenizer.chat_template");
    chat_template_source_ = path + ": tokenizer.chat_template";
  }
}

std::vector<int64_t> GgufTokenizer::encode(const std::string& raw, bool add_special) const {
  // Fragments: raw text ranges (id -1) and special tokens, as tokenizer_st_partition leaves them.
  struct Fragment {
    int64_t id;
    size_t begin, end;
  };
  const std::string input = text::utf8_sanitize(raw);
  std::vector<Fragment> fragments;
  if (!input.empty()) fragments.push_back({-1, 0, input.size()});
  for (int64_t special : specials_) {
    const std::string& t = tokens_[special];
    const uint32_t attr = attrs_[special];
    std::vector<Fragment> next;
    next.reserve(fragments.size());
    for (const Fragment& fr : fragments) {
      if (fr.id >= 0) {
        next.push_back(fr);
        continue;
      }
      size_t begin = fr.begin;
      const size_t end = fr.end;
      while (begin < end) {
        const size_t match = std::string_view(input.data(), end).find(t, begin);
        if (match == std::string_view::npos) break;
        size_t left_end = match;
        if (attr & kLstrip)
          while (left_end > begin && std::isspace(static_cast<unsigned char>(input[left_end - 1]))) --left_end;
        if (left_end > begin) next.push_back({-1, begin, left_end});
        next.push_back({special, match, match + t.size()});
        begin = match + t.size();
        if (attr & kRstrip)
          while (begin < end && std::isspace(static_cast<unsigned char>(input[begin]))) ++begin;
      }
      if (begin < end) next.push_back({-1, begin, end});
    }
    fragments = std::move(next);
  }

  std::vector<int64_t> out;
  if (add_special && add_bos_ && bos_ >= 0) out.push_back(bos_);
  bool prev_special = true;
  for (const Fragment& fr : fragments) {
    if (fr.id >= 0) {
      out.push_back(fr.id);
      prev_special = true;
      continue;
    }
    std::string piece = input.substr(fr.begin, fr.end - fr.begin);
    if (spm_) {
      // A space before the text, and before text that follows a special token.
      if (add_space_prefix_ && prev_special) piece.insert(0, " ");
      std::string escaped;
      escaped.reserve(piece.size() * 2);
      for (char c : piece) escaped += c == ' ' ? std::string("\xE2\x96\x81") : std::string(1, c);
      spm_model_.encode(escaped, out);
    } else {
      encode_bpe(piece, out);
    }
    prev_special = false;
  }
  if (add_special && add_eos_ && eos_id_ >= 0) out.push_back(eos_id_);
  return out;
}

void GgufTokenizer::encode_bpe(const std::string& fragment, std::vector<int64_t>& out) const {
  // Each regex splits the pieces the previous ones left, keeping matches and gaps.
  std::vector<std::pair<size_t, size_t>> pieces = {{0, fragment.size()}};
  for (const Regex& re : regexes_) {
    std::vector<std::pair<size_t, size_t>> next;
    for (const auto& [b, e] : pieces) {
      const std::string_view sub(fragment.data() + b, e - b);
      for (const auto& [sb, se] : text::split_ranges(sub, re, text::SplitBehavior::Isolated))
        next.emplace_back(b + sb, b + se);
    }
    pieces = std::move(next);
  }
  std::vector<BpeSymbol> symbols;
  for (const auto& [b, e] : pieces) {
    const std::string word = text::byte_level_encode(std::string_view(fragment.data() + b, e - b));
    if (ignore_merges_) {
      const auto it = token_ids_.find(word);
      if (it != token_ids_.end()) {
        out.push_back(it->second);
        continue;
      }
    }
    symbols.clear();
    for (size_t pos = 0; pos < word.size();) {
      const size_t len = std::min(text::utf8_length(word[pos]), word.size() - pos);
      symbols.push_back({bpe_.symbol_id(std::string_view(word.data() + pos, len)), static_cast<uint32_t>(pos),
                         static_cast<uint32_t>(pos + len)});
      pos += len;
    }
    bpe_.merge(symbols);
    for (const BpeSymbol& s : symbols) {
      const std::string_view t(word.data() + s.begin, s.end - s.begin);
      const auto it = token_ids_.find(std::string(t));
      if (it != token_ids_.end()) {
        out.push_back(it->second);
        continue;
      }
      for (char c : t) {
        const auto b = token_ids_.find(std::string(1, c));
        if (b != token_ids_.end()) out.push_back(b->second);
      }
    }
  }
}

std::string GgufTokenizer::piece_text(int64_t id) const {
  const uint32_t attr = attrs_[id];
  const std::string& t = tokens_[id];
  if (attr & (kControl | kUnknown | kUserDefined)) return t;
  if (attr & kNormal) {
    if (spm_) {
      std::string out;
      for (size_t i = 0; i < t.size();) {
        if (t.compare(i, 3, "\xE2\x96\x81") == 0) out += ' ', i += 3;
        else out += t[i++];
      }
      return out;
    }
    std::string bytes;
    if (text::byte_level_decode(t, bytes)) return bytes;
    // llama.cpp's llama_decode_text marks code points outside the byte alphabet.
    std::string out;
    for (size_t pos = 0; pos < t.size();) {
      const size_t start = pos;
      const int b = text::byte_level_byte(text::next_codepoint(t, pos));
      if (b >= 0) {
        out += static_cast<char>(b);
        continue;
      }
      out += "[UNK_BYTE_0x";
      for (size_t i = start; i < pos; ++i) {
        char hex[4];
        std::snprintf(hex, sizeof hex, "%02x", static_cast<unsigned>(static_cast<uint8_t>(t[i])));
        out += hex;
      }
      out += t + "]";
    }
    return out;
  }
  if (attr & kByte) {
    // <0xXX> (or a 1-byte text in some vocabularies)
    if (t.size() == 6 && t.compare(0, 3, "<0x") == 0) return std::string(1, static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16)));
    return t;
  }
  return "";
}

std::string GgufTokenizer::token_bytes(int64_t id) const { return piece_text(checked_id(id)); }

std::string GgufTokenizer::decode(const std::vector<int64_t>& ids, bool skip_special) const {
  std::string text;
  bool remove_space = add_space_prefix_;
  for (int64_t id : ids) {
    checked_id(id);
    std::string p = (skip_special && (attrs_[id] & (kControl | kUnknown))) ? std::string() : piece_text(id);
    if (remove_space && !p.empty() && p[0] == ' ') p.erase(0, 1);
    remove_space = false;
    text += p;
  }
  if (!clean_spaces_ || text.empty()) return text;
  // llama.cpp's clean-up of tokenization spaces for BPE vocabularies, ported as written
  // (in place, three passes) so that its corner cases match too.
  int64_t total = static_cast<int64_t>(text.size());
  const int64_t total1 = total;
  total = 1;
  for (int64_t i = 1; i < total1; ++i) {
    const char x = text[i];
    if (text[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ',')) --total;
    text[total++] = x;
  }
  const int64_t total2 = total;
  total = 1;
  for (int64_t i = 1; i < total2; ++i) {
    const char x = text[i];
    if (x == '\'' && i + 1 < total2 && text[i - 1] == ' ' && text[i + 1] == ' ') {
      --total;
      text[++i] = '\0';
    }
    text[total++] = x;
  }
  const int64_t total3 = total;
  total = 1;
  for (int64_t i = 1; i < total3; ++i) {
    const char x = text[i];
    if (text[i - 1] == ' ' && x == '\'' && i + 1 < total3) {
      const char x1 = text[i + 1];
      if (x1 == 's' || x1 == 'm') {
        --total;
      } else if (i + 2 < total3) {
        const char x2 = text[i + 2];
        if ((x1 == 'r' && x2 == 'e') || (x1 == 'v' && x2 == 'e')) --total;
      }
    }
    text[total++] = x;
  }
  text.resize(static_cast<size_t>(total));
  return text;
}

}  // namespace

const std::vector<std::string>& supported_gguf_pre_tokenizers() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto& s : pre_tokenizer_specs()) out.insert(out.end(), s.names.begin(), s.names.end());
    return out;
  }();
  return names;
}

std::unique_ptr<Tokenizer> load_gguf_tokenizer(const GgufFile& file) {
  if (!file.has("tokenizer.ggml.tokens") || !file.has("tokenizer.ggml.model")) return nullptr;
  return std::make_unique<GgufTokenizer>(file);
}

}  // namespace kvpipe
