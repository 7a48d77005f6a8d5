#include "engine/text/tokenizer_json.h"

#include "engine/model/mapped_file.h"
#include "engine/model/model_config.h"

#include "engine/text/bpe_model.h"
#include "engine/text/pre_tokenizer.h"
#include "engine/text/unicode_text.h"

#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <tuple>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace kvpipe {
namespace {

using nlohmann::json;
using text::BpeModel;
using text::BpeSymbol;
using text::Regex;
using text::SplitBehavior;

const std::string kSpace = " ";

// Error reporting: `file: path.to.key what`.
struct Where {
  std::string file;
  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw std::invalid_argument(file + ": " + path + " " + what);
  }
};

// Ids index dense tables: bounded by the vocabulary a model config may declare.
const std::string kNotATokenId =
    "is not a token id (an integer in [0, " + std::to_string(kMaxModelVocab - 1) + "])";
bool is_token_id(const nlohmann::json& id) {
  return id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < kMaxModelVocab;
}

const json& member(const json& j, const char* key, const Where& w, const std::string& path) {
  if (!j.is_object() || !j.contains(key)) w.fail(path + "." + key, "is missing");
  return j.at(key);
}

std::string string_member(const json& j, const char* key, const Where& w, const std::string& path) {
  const json& v = member(j, key, w, path);
  if (!v.is_string()) w.fail(path + "." + key, "is not a string");
  return v.get<std::string>();
}

bool bool_member(const json& j, const char* key, bool def) {
  if (!j.is_object() || !j.contains(key) || !j.at(key).is_boolean()) return def;
  return j.at(key).get<bool>();
}

std::string type_of(const json& j, const Where& w, const std::string& path) {
  return string_member(j, "type", w, path);
}

[[noreturn]] void unsupported(const Where& w, const std::string& path, const std::string& type) {
  w.fail(path + ".type", "'" + type + "' is not supported");
}

bool is_word_char(uint32_t cp) {
  if (cp == '_') return true;
  const utf8proc_category_t c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) ||
         (c >= UTF8PROC_CATEGORY_ND && c <= UTF8PROC_CATEGORY_NO);
}

uint32_t last_codepoint(std::string_view s, size_t end, size_t* start_out) {
  size_t b = end;
  while (b > 0 && (static_cast<uint8_t>(s[b - 1]) & 0xC0) == 0x80) --b;
  if (b > 0) --b;
  size_t p = b;
  const uint32_t cp = text::next_codepoint(s, p);
  if (start_out) *start_out = b;
  return cp;
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  std::string out;
  size_t i = 0;
  for (size_t m; (m = s.find(from, i)) != std::string::npos; i = m + from.size()) out.append(s, i, m - i) += to;
  out.append(s, i, std::string::npos);
  return out;
}

// A Replace pattern: {"String": s} or {"Regex": r}.
struct Pattern {
  std::string literal;
  std::optional<Regex> regex;
  std::string apply(const std::string& s, const std::string& content) const {
    if (!regex) return replace_all(s, literal, content);
    std::string out;
    size_t prev = 0;
    for (const auto& [b, e] : regex->find_all(s)) out.append(s, prev, b - prev) += content, prev = e;
    return out.append(s, prev, std::string::npos);
  }
};

Pattern read_pattern(const json& j, const Where& w, const std::string& path) {
  const json& p = member(j, "pattern", w, path);
  Pattern out;
  if (p.is_object() && p.contains("String") && p.at("String").is_string()) {
    out.literal = p.at("String").get<std::string>();
  } else if (p.is_object() && p.contains("Regex") && p.at("Regex").is_string()) {
    out.regex.emplace(p.at("Regex").get<std::string>(), w.file + ": " + path + ".pattern");
  } else {
    w.fail(path + ".pattern", "must be {\"String\": ...} or {\"Regex\": ...}");
  }
  return out;
}

// ----- normalizers -----------------------------------------------------------------------------

struct Normalizer {
  enum Kind { Form, Lowercase, Prepend, Replace, Strip } kind;
  std::string a, b;  // form / prepend text / replacement
  Pattern pattern;
  bool left = false, right = false;

  std::string apply(const std::string& s) const {
    switch (kind) {
      case Form: return text::normalize(s, a);
      case Lowercase: {
        std::string out;
        for (size_t pos = 0; pos < s.size();)
          out += text::codepoint_to_utf8(
              static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(text::next_codepoint(s, pos)))));
        return out;
      }
      case Prepend: return s.empty() ? s : a + s;
      case Replace: return pattern.apply(s, b);
      case Strip: {
        size_t begin = 0, end = s.size();
        if (left)
          while (begin < end) {
            size_t p = begin;
            if (!text::is_white_space(text::next_codepoint(s, p))) break;
            begin = p;
          }
        if (right)
          while (end > begin) {
            size_t st;
            if (!text::is_white_space(last_codepoint(s, end, &st))) break;
            end = st;
          }
        return s.substr(begin, end - begin);
      }
    }
    return s;
  }
};

void read_normalizer(const json& j, const Where& w, const std::string& path, std::vector<Normalizer>& out) {
  if (j.is_null()) return;
  const std::string type = type_of(j, w, path);
  if (type == "Sequence") {
    const json& list = member(j, "normalizers", w, path);
    if (!list.is_array()) w.fail(path + ".normalizers", "is not a list");
    for (size_t i = 0; i < list.size(); ++i)
      read_normalizer(list[i], w, path + ".normalizers[" + std::to_string(i) + "]", out);
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    out.push_back({Normalizer::Form, type, "", {}});
  } else if (type == "Lowercase") {
    out.push_back({Normalizer::Lowercase, "", "", {}});
  } else if (type == "Prepend") {
    out.push_back({Normalizer::Prepend, string_member(j, "prepend", w, path), "", {}});
  } else if (type == "Replace") {
    out.push_back({Normalizer::Replace, "", string_member(j, "content", w, path), read_pattern(j, w, path)});
  } else if (type == "Strip") {
    Normalizer n{Normalizer::Strip, "", "", {}};
    n.left = bool_member(j, "strip_left", true);
    n.right = bool_member(j, "strip_right", true);
    out.push_back(std::move(n));
  } else {
    unsupported(w, path, type);
  }
}

// ----- pre-tokenizers --------------------------------------------------------------------------

struct Piece {
  std::string text;
  bool at_start;  // begins at offset 0 of the original text
};

enum class Prepend { Always, First, Never };

struct PreTokenizer {
  enum Kind { ByteLevel, Metaspace, Split, Digits, WhitespaceSplit } kind;
  bool add_prefix_space = false, use_regex = true, split = true, invert = false, individual = false;
  std::string replacement;
  Prepend prepend = Prepend::Always;
  std::optional<Regex> regex;
  SplitBehavior behavior = SplitBehavior::Isolated;

  void apply(std::vector<Piece>& pieces) const {
    std::vector<Piece> out;
    for (Piece& p : pieces) {
      auto emit = [&](const std::string& t, const std::vector<std::pair<size_t, size_t>>& ranges) {
        for (const auto& [b, e] : ranges) out.push_back({t.substr(b, e - b), p.at_start && b == 0});
      };
      switch (kind) {
        case ByteLevel: {
          std::string t = p.text;
          if (add_prefix_space && t.compare(0, 1, " ") != 0) t.insert(0, " ");
          std::vector<std::pair<size_t, size_t>> ranges = {{0, t.size()}};
          if (use_regex) ranges = text::split_ranges(t, *regex, SplitBehavior::Isolated);
          for (const auto& [b, e] : ranges)
            out.push_back({text::byte_level_encode(std::string_view(t).substr(b, e - b)), p.at_start && b == 0});
          break;
        }
        case Metaspace: {
          std::string t = replace_all(p.text, " ", replacement);
          const bool starts = t.compare(0, replacement.size(), replacement) == 0;
          if (!starts && (prepend == Prepend::Always || (prepend == Prepend::First && p.at_start)))
            t.insert(0, replacement);
          if (split) emit(t, text::split_ranges(t, *regex, SplitBehavior::MergedWithNext));
          else out.push_back({t, p.at_start});
          break;
        }
        case Split:
          emit(p.text, text::split_ranges(p.text, *regex, behavior, invert));
          break;
        case Digits:
          emit(p.text, text::split_ranges(p.text, *regex, individual ? SplitBehavior::Isolated : SplitBehavior::Contiguous));
          break;
        case WhitespaceSplit:
          emit(p.text, text::split_ranges(p.text, *regex, SplitBehavior::Removed));
          break;
      }
    }
    pieces = std::move(out);
  }
};

const char* kGpt2Regex = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

Prepend read_prepend(const json& j, const Where& w, const std::string& path) {
  if (j.contains("prepend_scheme") && j.at("prepend_scheme").is_string()) {
    const std::string s = j.at("prepend_scheme").get<std::string>();
    if (s == "always") return Prepend::Always;
    if (s == "first") return Prepend::First;
    if (s == "never") return Prepend::Never;
    w.fail(path + ".prepend_scheme", "'" + s + "' is not one of always, first, never");
  }
  return bool_member(j, "add_prefix_space", true) ? Prepend::Always : Prepend::Never;
}

void read_pre_tokenizer(const json& j, const Where& w, const std::string& path, std::vector<PreTokenizer>& out) {
  if (j.is_null()) return;
  const std::string type = type_of(j, w, path);
  const std::string where = w.file + ": " + path;
  PreTokenizer p{};
  if (type == "Sequence") {
    const json& list = member(j, "pretokenizers", w, path);
    if (!list.is_array()) w.fail(path + ".pretokenizers", "is not a list");
    for (size_t i = 0; i < list.size(); ++i)
      read_pre_tokenizer(list[i], w, path + ".pretokenizers[" + std::to_string(i) + "]", out);
    return;
  } else if (type == "ByteLevel") {
    p.kind = PreTokenizer::ByteLevel;
    p.add_prefix_space = bool_member(j, "add_prefix_space", true);
    p.use_regex = bool_member(j, "use_regex", true);
    if (p.use_regex) p.regex.emplace(kGpt2Regex, where);
  } else if (type == "Metaspace") {
    p.kind = PreTokenizer::Metaspace;
    p.replacement = string_member(j, "replacement", w, path);
    p.prepend = read_prepend(j, w, path);
    p.split = bool_member(j, "split", true);
    p.regex.emplace(text::regex_escape(p.replacement), where);
  } else if (type == "Split") {
    p.kind = PreTokenizer::Split;
    const Pattern pattern = read_pattern(j, w, path);
    p.regex = pattern.regex ? *pattern.regex : Regex::literal(pattern.literal, where);
    const std::string b = string_member(j, "behavior", w, path);
    static const std::map<std::string, SplitBehavior> behaviors = {
        {"Removed", SplitBehavior::Removed},
        {"Isolated", SplitBehavior::Isolated},
        {"MergedWithPrevious", SplitBehavior::MergedWithPrevious},
        {"MergedWithNext", SplitBehavior::MergedWithNext},
        {"Contiguous", SplitBehavior::Contiguous}};
    const auto it = behaviors.find(b);
    if (it == behaviors.end()) w.fail(path + ".behavior", "'" + b + "' is not supported");
    p.behavior = it->second;
    p.invert = bool_member(j, "invert", false);
  } else if (type == "Digits") {
    p.kind = PreTokenizer::Digits;
    p.individual = bool_member(j, "individual_digits", false);
    p.regex.emplace("\\p{Nd}", where);
  } else if (type == "Whitespace") {
    // Keeps the matches of \w+|[^\w\s]+ and drops what lies between them (the spaces).
    p.regex.emplace("\\w+|[^\\w\\s]+", where);
    p.kind = PreTokenizer::Split;
    p.behavior = SplitBehavior::Removed;
    p.invert = true;
  } else if (type == "WhitespaceSplit") {
    p.kind = PreTokenizer::WhitespaceSplit;
    p.regex.emplace("\\s+", where);
  } else {
    unsupported(w, path, type);
  }
  out.push_back(std::move(p));
}

// ----- decoders --------------------------------------------------------------------------------

struct Decoder {
  enum Kind { ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace } kind;
  std::string content;  // Strip content / Replace content / Metaspace replacement
  size_t start = 0, stop = 0;
  Prepend prepend = Prepend::Always;
  Pattern pattern;

  // `raw`: one token for streaming: bytes as they are, no first-token stripping.
  void apply(std::vector<std::string>& tokens, bool raw) const {
    switch (kind) {
      case ByteLevel:
        if (raw) {
          for (auto& t : tokens) {
            std::string bytes;
            if (text::byte_level_decode(t, bytes)) t = bytes;
          }
        } else {
          std::string bytes;
          for (const auto& t : tokens) {
            std::string b;
            bytes += text::byte_level_decode(t, b) ? b : t;
          }
          tokens = {text::utf8_sanitize(bytes)};
        }
        break;
      case Metaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          tokens[i] = replace_all(tokens[i], content, " ");
          if (!raw && i == 0 && prepend != Prepend::Never && tokens[i].compare(0, 1, " ") == 0) tokens[i].erase(0, 1);
        }
        break;
      case ByteFallback: {
        std::vector<std::string> out;
        std::string pending;
        size_t pending_count = 0;
        auto flush = [&] {
          if (pending_count == 0) return;
          if (raw || text::utf8_valid(pending)) out.push_back(pending);
          else
            for (size_t i = 0; i < pending_count; ++i) out.push_back("\xEF\xBF\xBD");
          pending.clear();
          pending_count = 0;
        };
        for (const auto& t : tokens) {
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && std::isxdigit(static_cast<unsigned char>(t[3])) &&
              std::isxdigit(static_cast<unsigned char>(t[4]))) {
            pending += static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16));
            ++pending_count;
          } else {
            flush();
            out.push_back(t);
          }
        }
        flush();
        tokens = std::move(out);
        break;
      }
      case Fuse: {
        std::string all;
        for (const auto& t : tokens) all += t;
        tokens = {all};
        break;
      }
      case Strip:
        if (raw) break;
        for (auto& t : tokens) {
          size_t b = 0, e = t.size();
          for (size_t i = 0; i < start && t.compare(b, content.size(), content) == 0 && b < e; ++i) b += content.size();
          for (size_t i = 0; i < stop && e >= b + content.size() && t.compare(e - content.size(), content.size(), content) == 0; ++i)
            e -= content.size();
          t = t.substr(b, e - b);
        }
        break;
      case Replace:
        for (auto& t : tokens) t = pattern.apply(t, content);
        break;
    }
  }
};

void read_decoder(const json& j, const Where& w, const std::string& path, std::vector<Decoder>& out) {
  if (j.is_null()) return;
  const std::string type = type_of(j, w, path);
  Decoder d{};
  if (type == "Sequence") {
    const json& list = member(j, "decoders", w, path);
    if (!list.is_array()) w.fail(path + ".decoders", "is not a list");
    for (size_t i = 0; i < list.size(); ++i) read_decoder(list[i], w, path + ".decoders[" + std::to_string(i) + "]", out);
    return;
  } else if (type == "ByteLevel") {
    d.kind = Decoder::ByteLevel;
  } else if (type == "Metaspace") {
    d.kind = Decoder::Metaspace;
    d.content = string_member(j, "replacement", w, path);
    d.prepend = read_prepend(j, w, path);
  } else if (type == "ByteFallback") {
    d.kind = Decoder::ByteFallback;
  } else if (type == "Fuse") {
    d.kind = Decoder::Fuse;
  } else if (type == "Strip") {
    d.kind = Decoder::Strip;
    d.content = string_member(j, "content", w, path);
    d.start = member(j, "start", w, path).get<size_t>();
    d.stop = member(j, "stop", w, path).get<size_t>();
  } else if (type == "Replace") {
    d.kind = Decoder::Replace;
    d.content = string_member(j, "content", w, path);
    d.pattern = read_pattern(j, w, path);
  } else {
    unsupported(w, path, type);
  }
  out.push_back(std::move(d));
}

// ----- added tokens ----------------------------------------------------------------------------

struct AddedToken {
  int64_t id;
  std::string content;
  bool single_word, lstrip, rstrip, normalized, special;
};

// Leftmost-longest matching of added tokens (what `tokenizers` builds with aho-corasick).
class Trie {
 public:
  void insert(const std::string& s, size_t token) {
    if (s.empty()) return;
    int node = 0;
    for (char c : s) {
      auto& children = nodes_[node].children;
      const auto it = children.find(c);
      if (it != children.end()) {
        node = it->second;
      } else {
        children.emplace(c, static_cast<int>(nodes_.size()));
        node = static_cast<int>(nodes_.size());
        nodes_.emplace_back();
      }
    }
    if (nodes_[node].token < 0) nodes_[node].token = static_cast<int64_t>(token);
    first_[static_cast<uint8_t>(s[0])] = true;
  }
  bool empty() const { return nodes_.size() == 1; }
  // The first match at or after `from`: (begin, end, token), or begin == npos.
  std::tuple<size_t, size_t, int64_t> find(std::string_view s, size_t from) const {
    for (size_t i = from; i < s.size(); ++i) {
      if (!first_[static_cast<uint8_t>(s[i])]) continue;
      int node = 0;
      size_t best_end = 0;
      int64_t best = -1;
      for (size_t k = i; k < s.size(); ++k) {
        const auto& children = nodes_[node].children;
        const auto it = children.find(s[k]);
        if (it == children.end()) break;
        node = it->second;
        if (nodes_[node].token >= 0) best = nodes_[node].token, best_end = k + 1;
      }
      if (best >= 0) return {i, best_end, best};
    }
    return {std::string_view::npos, 0, -1};
  }

 private:
  struct Node {
    std::map<char, int> children;
    int64_t token = -1;
  };
  std::vector<Node> nodes_ = std::vector<Node>(1);
  bool first_[256] = {};
};

// ----- the tokenizer ---------------------------------------------------------------------------

// A FIFO or device in the model folder is refused instead of blocking or never ending; the
// largest tokenizer.json files (250k-token vocabularies) are some tens of megabytes.
std::string read_file(const std::string& path) { return read_regular_file(path, uint64_t{1} << 30); }

json parse_json(const std::string& path) {
  try {
    return json::parse(read_file(path));
  } catch (const json::exception& e) {
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    throw std::invalid_argument(path + ": not valid JSON (" + what + ")");
  }
}

// A token written as a string or as {"content": ...} in tokenizer_config.json.
std::string token_text(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j.at("content").is_string()) return j.at("content").get<std::string>();
  return "";
}

class HfTokenizer final : public Tokenizer {
 public:
  HfTokenizer(const std::string& dir);

  std::vector<int64_t> encode(const std::string& text, bool add_special) const override;
  std::string token_bytes(int64_t id) const override;
  std::string decode(const std::vector<int64_t>& ids, bool skip_special) const override;
  bool strips_leading_space() const override { return strips_leading_space_; }
  std::string piece(int64_t id) const override { return pieces_.at(checked_id(id)); }
  bool is_special(int64_t id) const override { return special_.at(checked_id(id)) != 0; }
  int64_t vocab_size() const override { return static_cast<int64_t>(pieces_.size()); }
  int64_t bos_id() const override { return bos_; }
  std::vector<int64_t> eos_ids() const override { return eos_; }
  bool add_bos() const override { return !prefix_.empty() && prefix_.front() == bos_; }
  const std::string& chat_template() const override { return chat_template_; }
  const std::string& chat_template_source() const override { return chat_template_source_; }

 private:
  std::string normalize(const std::string& s) const {
    std::string out = s;
    for (const auto& n : normalizers_) out = n.apply(out);
    return out;
  }
  // Splits `s` around the added tokens of `trie`: (text, -1) and (token text, id) pieces.
  void split_added(const std::string& s, const Trie& trie, std::vector<std::pair<std::string, int64_t>>& out,
                   std::vector<size_t>* starts) const;
  void encode_word(const std::string& word, std::vector<int64_t>& out) const;

  std::string file_;
  BpeModel bpe_;
  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> pieces_;
  std::vector<char> special_;
  int64_t unk_ = -1;
  bool byte_fallback_ = false, fuse_unk_ = false, ignore_merges_ = false;
  std::vector<int64_t> byte_ids_ = std::vector<int64_t>(256, -1);
  std::vector<AddedToken> added_;
  Trie raw_trie_, normalized_trie_;
  std::vector<Normalizer> normalizers_;
  std::vector<PreTokenizer> pre_tokenizers_;
  std::vector<Decoder> decoders_;
  bool has_decoder_ = false;
  std::vector<int64_t> prefix_, suffix_;
  int64_t bos_ = -1;
  std::vector<int64_t> eos_;
  bool strips_leading_space_ = false;
  std::string chat_template_, chat_template_source_;
};

HfTokenizer::HfTokenizer(const std::string& dir) {
  file_ = (std::filesystem::path(dir) / "tokenizer.json").string();
  const Where w{file_};
  const json root = parse_json(file_);
  if (!root.is_object()) w.fail("(root)", "is not an object");

  // Model.
  const json& model = member(root, "model", w, "(root)");
  const std::string model_type = model.contains("type") ? string_member(model, "type", w, "model") : "BPE";
  if (model_type != "BPE") w.fail("model.type", "'" + model_type + "' is not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(key) && model.at(key).is_string() && !model.at(key).get<std::string>().empty())
      w.fail(std::string("model.") + key, "is not supported");
  const json& vocab = member(model, "vocab", w, "model");
  if (!vocab.is_object()) w.fail("model.vocab", "is not an object");
  int64_t n = 0;
  std::unordered_map<int64_t, std::string> text_of_id;
  for (const auto& [text, id] : vocab.items()) {
    if (!is_token_id(id)) w.fail("model.vocab." + text, kNotATokenId);
    const auto [other, fresh] = text_of_id.emplace(id.get<int64_t>(), text);
    if (!fresh) w.fail("model.vocab." + text, "has the id of model.vocab." + other->second);
    vocab_[text] = id.get<int64_t>();
    n = std::max(n, id.get<int64_t>() + 1);
  }
  std::vector<std::string> model_tokens(n);
  for (const auto& [text, id] : vocab_) model_tokens[id] = text;

  std::vector<std::pair<std::string, std::string>> merges;
  if (model.contains("merges")) {
    const json& list = model.at("merges");
    if (!list.is_array()) w.fail("model.merges", "is not a list");
    merges.reserve(list.size());
    for (size_t i = 0; i < list.size(); ++i) {
      const json& m = list[i];
      const std::string path = "model.merges[" + std::to_string(i) + "]";
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos) w.fail(path, "is not \"a b\"");
        merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
      } else {
        w.fail(path, "is neither \"a b\" nor [\"a\", \"b\"]");
      }
      const auto& [a, b] = merges.back();
      if (!vocab_.count(a) || !vocab_.count(b) || !vocab_.count(a + b))
        w.fail(path, "names a token that is not in model.vocab");
    }
  }
  bpe_ = BpeModel(model_tokens, merges);
  byte_fallback_ = bool_member(model, "byte_fallback", false);
  fuse_unk_ = bool_member(model, "fuse_unk", false);
  ignore_merges_ = bool_member(model, "ignore_merges", false);
  if (model.contains("unk_token") && model.at("unk_token").is_string()) {
    const auto it = vocab_.find(model.at("unk_token").get<std::string>());
    if (it != vocab_.end()) unk_ = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "<0x%02X>", b);
    const auto it = vocab_.find(hex);
    if (it != vocab_.end()) byte_ids_[b] = it->second;
  }

  // Normaliser first: normalized added tokens are matched in normalised text.
  if (root.contains("normalizer")) read_normalizer(root.at("normalizer"), w, "normalizer", normalizers_);
  if (root.contains("pre_tokenizer")) read_pre_tokenizer(root.at("pre_tokenizer"), w, "pre_tokenizer", pre_tokenizers_);
  if (root.contains("decoder") && !root.at("decoder").is_null()) {
    has_decoder_ = true;
    read_decoder(root.at("decoder"), w, "decoder", decoders_);
  }

  // Added tokens.
  pieces_ = model_tokens;
  if (root.contains("added_tokens")) {
    const json& list = root.at("added_tokens");
    if (!list.is_array()) w.fail("added_tokens", "is not a list");
    for (size_t i = 0; i < list.size(); ++i) {
      const json& t = list[i];
      const std::string path = "added_tokens[" + std::to_string(i) + "]";
      const json& id = member(t, "id", w, path);
      if (!is_token_id(id)) w.fail(path + ".id", kNotATokenId);
      AddedToken a{id.get<int64_t>(), string_member(t, "content", w, path), bool_member(t, "single_word", false),
                   bool_member(t, "lstrip", false), bool_member(t, "rstrip", false), false,
                   bool_member(t, "special", false)};
      a.normalized = bool_member(t, "normalized", !a.special);
      added_.push_back(a);
    }
  }
  int64_t size = n;
  for (const auto& a : added_) size = std::max(size, a.id + 1);
  pieces_.resize(size);
  special_.assign(size, 0);
  for (size_t i = 0; i < added_.size(); ++i) {
    const AddedToken& a = added_[i];
    pieces_[a.id] = a.content;
    special_[a.id] = a.special;
    if (a.normalized) normalized_trie_.insert(normalize(a.content), i);
    else raw_trie_.insert(a.content, i);
  }

  // Post-processor.
  auto id_of = [&](const std::string& t) -> int64_t {
    for (const auto& a : added_)
      if (a.content == t) return a.id;
    const auto it = vocab_.find(t);
    return it == vocab_.end() ? -1 : it->second;
  };
  std::function<void(const json&, const std::string&)> read_post = [&](const json& j, const std::string& path) {
    if (j.is_null()) return;
    const std::string type = type_of(j, w, path);
    if (type == "Sequence") {
      const json& list = member(j, "processors", w, path);
      for (size_t i = 0; i < list.size(); ++i) read_post(list[i], path + ".processors[" + std::to_string(i) + "]");
    } else if (type == "ByteLevel") {
    } else if (type == "TemplateProcessing") {
      const json& single = member(j, "single", w, path);
      const json& specials = j.contains("special_tokens") ? j.at("special_tokens") : json::object();
      bool after = false;
      prefix_.clear(), suffix_.clear();
      for (size_t i = 0; i < single.size(); ++i) {
        const json& item = single[i];
        if (item.contains("Sequence")) {
          after = true;
        } else if (item.contains("SpecialToken")) {
          const std::string name = string_member(item.at("SpecialToken"), "id", w, path + ".single[" + std::to_string(i) + "].SpecialToken");
          if (!specials.contains(name)) w.fail(path + ".special_tokens", "has no '" + name + "'");
          const json& ids = member(specials.at(name), "ids", w, path + ".special_tokens." + name);
          if (!ids.is_array()) w.fail(path + ".special_tokens." + name + ".ids", "is not a list");
          for (const json& id : ids) {
            if (!id.is_number_integer()) w.fail(path + ".special_tokens." + name + ".ids", "holds a non-integer");
            (after ? suffix_ : prefix_).push_back(id.get<int64_t>());
          }
        } else {
          w.fail(path + ".single[" + std::to_string(i) + "]", "is neither Sequence nor SpecialToken");
        }
      }
    } else if (type == "RobertaProcessing" || type == "BertProcessing") {
      const json& cls = member(j, "cls", w, path);
      const json& sep = member(j, "sep", w, path);
      prefix_ = {cls.at(1).get<int64_t>()};
      suffix_ = {sep.at(1).get<int64_t>()};
    } else {
      unsupported(w, path, type);
    }
  };
  if (root.contains("post_processor")) read_post(root.at("post_processor"), "post_processor");
  for (const std::vector<int64_t>* ids : {&prefix_, &suffix_})
    for (const int64_t id : *ids)
      if (id < 0 || id >= size)
        w.fail("post_processor", "adds token id " + std::to_string(id) + ", outside the vocabulary of " +
                                     std::to_string(size) + " tokens");

  // tokenizer_config.json: BOS/EOS, their switches, the chat template.
  const std::string config_path = (std::filesystem::path(dir) / "tokenizer_config.json").string();
  json config = json::object();
  if (std::filesystem::exists(config_path)) config = parse_json(config_path);
  if (!prefix_.empty()) bos_ = prefix_.front();
  if (config.contains("bos_token")) {
    const int64_t id = id_of(token_text(config.at("bos_token")));
    if (id >= 0) bos_ = id;
  }
  if (config.contains("eos_token")) {
    const int64_t id = id_of(token_text(config.at("eos_token")));
    if (id >= 0) eos_.push_back(id);
  }
  // Explicit add_bos_token / add_eos_token rebuild the template, as transformers does.
  if (config.contains("add_bos_token") && config.at("add_bos_token").is_boolean() && bos_ >= 0) {
    prefix_.erase(std::remove(prefix_.begin(), prefix_.end(), bos_), prefix_.end());
    if (config.at("add_bos_token").get<bool>()) prefix_.insert(prefix_.begin(), bos_);
  }
  if (config.contains("add_eos_token") && config.at("add_eos_token").is_boolean() && !eos_.empty()) {
    suffix_.erase(std::remove(suffix_.begin(), suffix_.end(), eos_.front()), suffix_.end());
    if (config.at("add_eos_token").get<bool>()) suffix_.push_back(eos_.front());
  }
  if (config.contains("chat_template")) {
    const json& t = config.at("chat_template");
    if (t.is_string()) {
      chat_template_ = t.get<std::string>();
    } else if (t.is_array()) {
      for (const json& e : t)
        if (e.is_object() && e.value("name", "") == "default") chat_template_ = e.value("template", "");
      if (chat_template_.empty() && !t.empty() && t[0].is_object()) chat_template_ = t[0].value("template", "");
    }
    if (!chat_template_.empty()) chat_template_source_ = config_path + ": chat_template";
  }
  const std::string jinja = (std::filesystem::path(dir) / "chat_template.jinja").string();
  if (chat_template_.empty() && std::filesystem::exists(jinja)) {
    chat_template_ = read_file(jinja);
    chat_template_source_ = jinja;
  }

  for (const auto& d : decoders_)
    if ((d.kind == Decoder::Metaspace && d.prepend != Prepend::Never) ||
        (d.kind == Decoder::Strip && d.content == kSpace && d.start > 0))
      strips_leading_space_ = true;
}

void HfTokenizer::split_added(const std::string& s, const Trie& trie, std::vector<std::pair<std::string, int64_t>>& out,
                              std::vector<size_t>* starts) const {
  size_t start_offset = 0, from = 0;
  while (!trie.empty()) {
    auto [b, e, index] = trie.find(s, from);
    if (b == std::string_view::npos) break;
    const AddedToken& a = added_[static_cast<size_t>(index)];
    from = b + 1;
    if (a.single_word) {
      const bool start_space = b == 0 || !is_word_char(last_codepoint(s, b, nullptr));
      size_t p = e;
      const bool stop_space = e == s.size() || !is_word_char(text::next_codepoint(s, p));
      if (!start_space || !stop_space) continue;
    }
    size_t start = b, stop = e;
    if (a.lstrip) {
      size_t ns = b;
      while (ns > 0) {
        size_t st;
        if (!text::is_white_space(last_codepoint(s, ns, &st))) break;
        ns = st;
      }
      start = std::max(ns, start_offset);
    }
    if (a.rstrip)
      while (stop < s.size()) {
        size_t p = stop;
        if (!text::is_white_space(text::next_codepoint(s, p))) break;
        stop = p;
      }
    if (start_offset < start) {
      out.emplace_back(s.substr(start_offset, start - start_offset), -1);
      if (starts) starts->push_back(start_offset);
    }
    out.emplace_back(s.substr(start, stop - start), a.id);
    if (starts) starts->push_back(start);
    start_offset = stop;
    from = stop;
  }
  if (start_offset < s.size()) {
    out.emplace_back(s.substr(start_offset), -1);
    if (starts) starts->push_back(start_offset);
  }
}

void HfTokenizer::encode_word(const std::string& word, std::vector<int64_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    const auto it = vocab_.find(word);
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  std::vector<BpeSymbol> symbols;
  bool last_unk = false;
  for (size_t pos = 0; pos < word.size();) {
    const size_t len = std::min(text::utf8_length(word[pos]), word.size() - pos);
    const std::string ch = word.substr(pos, len);
    const auto b = static_cast<uint32_t>(pos), e = static_cast<uint32_t>(pos + len);
    pos += len;
    const auto it = vocab_.find(ch);
    if (it != vocab_.end()) {
      symbols.push_back({static_cast<int32_t>(it->second), b, e});
      last_unk = false;
      continue;
    }
    if (byte_fallback_ &&
        std::all_of(ch.begin(), ch.end(), [&](char c) { return byte_ids_[static_cast<uint8_t>(c)] >= 0; })) {
      for (char c : ch) symbols.push_back({static_cast<int32_t>(byte_ids_[static_cast<uint8_t>(c)]), b, e});
      last_unk = false;
      continue;
    }
    if (unk_ >= 0) {
      if (fuse_unk_ && last_unk) symbols.back().end = e;
      else symbols.push_back({static_cast<int32_t>(unk_), b, e});
      last_unk = true;
    }
  }
  bpe_.merge(symbols);
  for (const BpeSymbol& s : symbols) out.push_back(s.id);
}

std::vector<int64_t> HfTokenizer::encode(const std::string& raw, bool add_special) const {
  const std::string input = text::utf8_sanitize(raw);
  std::vector<std::pair<std::string, int64_t>> splits;
  std::vector<size_t> starts;
  split_added(input, raw_trie_, splits, &starts);
  std::vector<int64_t> out = add_special ? prefix_ : std::vector<int64_t>();
  for (size_t i = 0; i < splits.size(); ++i) {
    if (splits[i].second >= 0) {
      out.push_back(splits[i].second);
      continue;
    }
    std::vector<std::pair<std::string, int64_t>> sub;
    std::vector<size_t> sub_starts;
    split_added(normalize(splits[i].first), normalized_trie_, sub, &sub_starts);
    for (size_t k = 0; k < sub.size(); ++k) {
      if (sub[k].second >= 0) {
        out.push_back(sub[k].second);
        continue;
      }
      std::vector<Piece> pieces = {{sub[k].first, starts[i] == 0 && sub_starts[k] == 0}};
      for (const auto& p : pre_tokenizers_) p.apply(pieces);
      for (const auto& p : pieces) encode_word(p.text, out);
    }
  }
  if (add_special) out.insert(out.end(), suffix_.begin(), suffix_.end());
  return out;
}

std::string HfTokenizer::token_bytes(int64_t id) const {
  std::vector<std::string> tokens = {pieces_.at(checked_id(id))};
  if (!has_decoder_) return tokens.front();
  for (const auto& d : decoders_) d.apply(tokens, true);
  std::string out;
  for (const auto& t : tokens) out += t;
  return out;
}

std::string HfTokenizer::decode(const std::vector<int64_t>& ids, bool skip_special) const {
  std::vector<std::string> tokens;
  for (int64_t id : ids) {
    checked_id(id);
    if (skip_special && special_[id]) continue;
    tokens.push_back(pieces_[id]);
  }
  if (!has_decoder_) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  for (const auto& d : decoders_) d.apply(tokens, false);
  std::string out;
  for (const auto& t : tokens) out += t;
  return out;
}

}  // namespace

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& dir) {
  const std::filesystem::path file = std::filesystem::path(dir) / "tokenizer.json";
  if (!std::filesystem::exists(file)) return nullptr;
  try {
    return std::make_unique<HfTokenizer>(dir);
  } catch (const nlohmann::json::exception& e) {
    // The reader names the key for the shapes it expects; a value of another JSON type met
    // deeper (a string where a token id belongs, say) is still the file's fault, not ours.
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    throw std::invalid_argument(file.string() + " (or tokenizer_config.json beside it): unexpected JSON shape (" +
                                what + ")");
  }
}

}  // namespace kvpipe
