#include "engine/text/tokenizer_builder.h"

#include "engine/model/gguf.h"
#include "engine/text/pre_tokenizer.h"
#include "engine/text/unicode_text.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>
#include <unordered_set>

namespace kvpipe {
namespace {

// The training text: plain English, so that frequent words and word pieces become tokens.
constexpr const char* kCorpus = R"(The morning train left the station at seven, and the passengers settled into their seats with coffee and newspapers.
A quiet farmer watched the fields from the window; the wheat was golden, the river was slow, and the hills were green.
In the city, people walk quickly. They talk on their phones, they read the news, and they think about the day ahead.
Learning a language takes time. You listen, you repeat, you make mistakes, and then one day the words come easily.
The teacher said that the best way to understand a problem is to write it down, to draw a picture, and to test every idea.
Computers follow instructions: they read the input, they compute the answer, and they write the output to the screen.
When the weather is good, the children play in the park, and their parents sit on the benches and talk about the week.
She opened the book and started to read the first chapter. It was a story about a small town and the people who lived there.
What is the time? It is half past three. Where are you going? I am going to the market to buy bread, cheese and apples.
The engine turned, the lights came on, and the old machine began to work again after many years of silence.
Good questions lead to good answers. Ask what, ask why, ask how, and then try to find the answer yourself.
Hello! How are you today? I am fine, thank you. The sun is shining and the sky is blue, so let us go for a walk.
There are seven days in a week, twelve months in a year, and one hundred years in a century. Time moves on.
The assistant answered the question with care: it explained the idea, gave an example, and checked the result.)";

constexpr const char* kGpt2Regex = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

constexpr const char* kChatMl =
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

std::vector<std::string> characters(const std::string& s) {
  std::vector<std::string> out;
  for (size_t pos = 0; pos < s.size();) {
    const size_t n = std::min(text::utf8_length(s[pos]), s.size() - pos);
    out.push_back(s.substr(pos, n));
    pos += n;
  }
  return out;
}

}  // namespace

ByteLevelVocab build_byte_level_vocab(int64_t vocab_size, int64_t bos_id, const std::vector<int64_t>& eos_ids) {
  if (vocab_size < kMinByteLevelVocab)
    throw std::invalid_argument("a byte-level vocabulary needs at least " + std::to_string(kMinByteLevelVocab) +
                                " tokens, not " + std::to_string(vocab_size));
  ByteLevelVocab v;
  v.tokens.assign(vocab_size, std::string());
  v.types.assign(vocab_size, 1);
  std::vector<char> used(vocab_size, 0);
  auto set_special = [&](int64_t id, const std::string& text, int32_t type) {
    if (id < 0 || id >= vocab_size)
      throw std::invalid_argument("special token id " + std::to_string(id) + " is outside the vocabulary");
    if (used[id]) return;
    v.tokens[id] = text, v.types[id] = type, used[id] = 1;
  };
  if (bos_id >= 0) set_special(bos_id, "<s>", 3), v.bos_id = bos_id;
  for (size_t i = 0; i < eos_ids.size(); ++i) {
    set_special(eos_ids[i], i == 0 ? "</s>" : "</s" + std::to_string(i) + ">", 3);
    v.eos_ids.push_back(eos_ids[i]);
  }
  auto next_free = [&]() {
    for (int64_t i = 0; i < vocab_size; ++i)
      if (!used[i]) return i;
    return int64_t{-1};
  };
  if (!used[0]) set_special(0, "<unk>", 2), v.unk_id = 0;
  // ChatML markers when they leave room for a useful number of merges.
  const int64_t specials = std::count(used.begin(), used.end(), 1);
  const bool chat = vocab_size >= specials + 2 + 256 + 64;
  if (chat) {
    set_special(next_free(), "<|im_start|>", 3);
    set_special(next_free(), "<|im_end|>", 3);
    v.chat_template = kChatMl;
  }
  std::unordered_set<std::string> known(v.tokens.begin(), v.tokens.end());
  for (const std::string& c : text::byte_level_chars()) {
    const int64_t id = next_free();
    if (id < 0) throw std::invalid_argument("the special tokens leave no room for the byte-level alphabet");
    v.tokens[id] = c, used[id] = 1;
    known.insert(c);
  }

  // Train: words of the corpus as the GPT-2 pre-tokenizer splits them, byte-level encoded.
  const text::Regex split(kGpt2Regex, "byte-level BPE trainer");
  const std::string corpus = kCorpus;
  std::map<std::vector<std::string>, int64_t> word_counts;
  for (const auto& [b, e] : text::split_ranges(corpus, split, text::SplitBehavior::Isolated))
    ++word_counts[characters(text::byte_level_encode(corpus.substr(b, e - b)))];
  std::vector<std::pair<std::vector<std::string>, int64_t>> words(word_counts.begin(), word_counts.end());

  for (int64_t id = next_free(); id >= 0;) {
    std::map<std::pair<std::string, std::string>, int64_t> pairs;
    for (const auto& [w, n] : words)
      for (size_t i = 0; i + 1 < w.size(); ++i) pairs[{w[i], w[i + 1]}] += n;
    // std::map iterates in lexicographic order, so the first pair with the top count wins ties.
    const std::pair<std::string, std::string>* best = nullptr;
    int64_t best_count = 1;
    for (const auto& [p, n] : pairs)
      if (n > best_count) best = &p, best_count = n;
    if (best == nullptr) break;
    const std::string a = best->first, b = best->second, merged = a + b;
    v.merges.push_back(a + " " + b);
    if (!known.count(merged)) {
      v.tokens[id] = merged, used[id] = 1;
      known.insert(merged);
      id = next_free();
    }
    for (auto& [w, n] : words) {
      std::vector<std::string> out;
      for (size_t i = 0; i < w.size(); ++i) {
        if (i + 1 < w.size() && w[i] == a && w[i + 1] == b) out.push_back(merged), ++i;
        else out.push_back(w[i]);
      }
      w = std::move(out);
    }
  }
  // Fill what is left with tokens no merge produces, so no text reaches them.
  for (int64_t i = 0; i < vocab_size; ++i)
    if (!used[i]) v.tokens[i] = "<unused_" + std::to_string(i) + ">", used[i] = 1;
  return v;
}

void write_hf_tokenizer(const ByteLevelVocab& v, const std::string& dir) {
  using nlohmann::json;
  json vocab = json::object();
  for (size_t i = 0; i < v.tokens.size(); ++i)
    if (v.types[i] == 1) vocab[v.tokens[i]] = i;
  json added = json::array();
  for (size_t i = 0; i < v.tokens.size(); ++i) {
    if (v.types[i] == 1) continue;
    vocab[v.tokens[i]] = i;
    added.push_back({{"id", i}, {"content", v.tokens[i]}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  }
  json merges = json::array();
  for (const std::string& m : v.merges) {
    const size_t sp = m.find(' ', 1);
    merges.push_back(json::array({m.substr(0, sp), m.substr(sp + 1)}));
  }
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  const json tokenizer = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", byte_level},
      {"post_processor", byte_level},
      {"decoder", byte_level},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
        {"vocab", vocab}, {"merges", merges}}}};
  json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                 {"add_bos_token", false},
                 {"add_eos_token", false},
                 {"clean_up_tokenization_spaces", false}};
  if (v.bos_id >= 0) config["bos_token"] = v.tokens[v.bos_id];
  if (!v.eos_ids.empty()) config["eos_token"] = v.tokens[v.eos_ids.front()];
  if (v.unk_id >= 0) config["unk_token"] = v.tokens[v.unk_id];
  if (!v.chat_template.empty()) config["chat_template"] = v.chat_template;
  for (const auto& [name, j] : {std::pair<std::string, const json*>{"tokenizer.json", &tokenizer},
                                std::pair<std::string, const json*>{"tokenizer_config.json", &config}}) {
    const std::string path = dir + "/" + name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << j->dump(2, ' ', false) << "\n";
    if (!out) throw std::invalid_argument(path + ": cannot write: " + std::strerror(errno));
  }
}

void add_gguf_vocabulary(GgufWriter& writer, const ModelConfig& cfg) {
  if (cfg.vocab_size >= kMinByteLevelVocab) {
    // The vocabulary init-model gives HF models too (write_hf_tokenizer), so both formats
    // made with the same flags tokenize alike.
    const ByteLevelVocab v = build_byte_level_vocab(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_ids);
    writer.add_string("tokenizer.ggml.model", "gpt2");
    writer.add_string("tokenizer.ggml.pre", "gpt-2");
    writer.add_string_array("tokenizer.ggml.tokens", v.tokens);
    writer.add_i32_array("tokenizer.ggml.token_type", v.types);
    writer.add_string_array("tokenizer.ggml.merges", v.merges);
    if (v.bos_id >= 0) writer.add_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(v.bos_id));
    if (!v.eos_ids.empty()) writer.add_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(v.eos_ids.front()));
    if (v.unk_id >= 0) writer.add_u32("tokenizer.ggml.unknown_token_id", static_cast<uint32_t>(v.unk_id));
    writer.add_bool("tokenizer.ggml.add_bos_token", false);
    writer.add_bool("tokenizer.ggml.add_eos_token", false);
    if (!v.chat_template.empty()) writer.add_string("tokenizer.chat_template", v.chat_template);
  } else {
    // Too small for the 256 byte-level characters: a SentencePiece-shaped placeholder
    // (<unk>, <s>, </s>, then placeholders) that llama.cpp loads; prompts to such a model are
    // token ids, so only its size and special ids matter, but llama.cpp looks tokens up by
    // text and wants them unique.
    std::vector<std::string> tokens;
    std::vector<float> scores;
    std::vector<int32_t> types;  // llama_token_type: 1 normal, 2 unknown, 3 control
    for (int64_t i = 0; i < cfg.vocab_size; ++i) {
      std::string text;
      int32_t type = 1;
      if (i == 0) text = "<unk>", type = 2;
      else if (i == cfg.bos_token_id) text = "<s>", type = 3;
      else if (std::find(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end(), i) != cfg.eos_token_ids.end())
        text = "</s>" + (i == cfg.eos_token_ids.front() ? std::string() : std::to_string(i)), type = 3;
      else text = "tok" + std::to_string(i);
      tokens.push_back(text);
      scores.push_back(type == 1 ? -static_cast<float>(i) : 0.0f);
      types.push_back(type);
    }
    writer.add_string("tokenizer.ggml.model", "llama");
    writer.add_string_array("tokenizer.ggml.tokens", tokens);
    writer.add_f32_array("tokenizer.ggml.scores", scores);
    writer.add_i32_array("tokenizer.ggml.token_type", types);
    if (cfg.bos_token_id >= 0) writer.add_u32("tokenizer.ggml.bos_token_id", cfg.bos_token_id);
    if (!cfg.eos_token_ids.empty()) writer.add_u32("tokenizer.ggml.eos_token_id", cfg.eos_token_ids.front());
    writer.add_u32("tokenizer.ggml.unknown_token_id", 0);
    writer.add_bool("tokenizer.ggml.add_bos_token", false);
    writer.add_bool("tokenizer.ggml.add_eos_token", false);
  }
}

}  // namespace kvpipe
