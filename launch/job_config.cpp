#include "launch/job_config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <utility>

namespace kvpipe {
namespace {

constexpr int64_t kIntMax = std::numeric_limits<int>::max();
constexpr int64_t kMaxBlockSize = 1024;
constexpr double kInfinity = std::numeric_limits<double>::infinity();

std::string quoted(const std::string& text) {
  return "\"" + text + "\"";
}

std::string trim(const std::string& text) {
  const size_t begin = text.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  const size_t end = text.find_last_not_of(" \t\r\n");
  return text.substr(begin, end - begin + 1);
}

std::string join(const std::vector<std::string>& items, const std::string& separator) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? separator : "") + items[i];
  return out;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The closest candidate within two edits, or "" when nothing is close enough to be a typo.
std::string closest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = 3;
  for (const std::string& candidate : candidates) {
    const size_t distance = edit_distance(word, candidate);
    if (distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

std::string join_path(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}

// True when `path` is `prefix` itself or lies inside it (`cache` contains `cache.window.sinks`
// and `requests[0]`, but not `cache_x`).
bool path_within(const std::string& path, const std::string& prefix) {
  if (path.compare(0, prefix.size(), prefix) != 0) return false;
  return path.size() == prefix.size() || path[prefix.size()] == '.' || path[prefix.size()] == '[';
}

bool parse_int64(const std::string& text, int64_t* out) {
  const char* begin = text.data();
  const char* end = begin + text.size();
  if (begin != end && *begin == '+') ++begin;  // from_chars rejects the '+' YAML allows
  const auto result = std::from_chars(begin, end, *out);
  return begin != end && result.ec == std::errc() && result.ptr == end;
}

bool parse_finite_double(const std::string& text, double* out) {
  const char* begin = text.data();
  const char* end = begin + text.size();
  if (begin != end && *begin == '+') ++begin;
  const auto result = std::from_chars(begin, end, *out);
  return begin != end && result.ec == std::errc() && result.ptr == end && std::isfinite(*out);
}

// Fills `bytes`, or says in `error` what is wrong with `text`. Decimal fractions are applied
// in integer arithmetic so that "0.1KB" is exactly 100 bytes, not 99.
bool parse_size_text(const std::string& raw, int64_t* bytes, std::string* error) {
  const std::string text = trim(raw);
  if (text.empty()) {
    *error = "empty size";
    return false;
  }
  if (text[0] == '-') {
    *error = "size must not be negative, got " + quoted(raw);
    return false;
  }
  const std::string usage =
      "invalid size " + quoted(raw) + " (expected e.g. 4096, 512KiB, 256MiB, 1.5GiB or 100MB)";
  size_t pos = 0;
  std::string whole, fraction;
  while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos])))
    whole += text[pos++];
  if (pos < text.size() && text[pos] == '.') {
    ++pos;
    while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos])))
      fraction += text[pos++];
    if (fraction.empty()) {
      *error = usage;
      return false;
    }
  }
  if (whole.empty() && fraction.empty()) {
    *error = usage;
    return false;
  }
  const std::string unit = trim(text.substr(pos));
  static const std::map<std::string, uint64_t> kUnits = {
      {"", 1},
      {"B", 1},
      {"K", 1ULL << 10},
      {"KiB", 1ULL << 10},
      {"KB", 1000ULL},
      {"M", 1ULL << 20},
      {"MiB", 1ULL << 20},
      {"MB", 1000ULL * 1000},
      {"G", 1ULL << 30},
      {"GiB", 1ULL << 30},
      {"GB", 1000ULL * 1000 * 1000},
      {"T", 1ULL << 40},
      {"TiB", 1ULL << 40},
      {"TB", 1000ULL * 1000 * 1000 * 1000},
  };
  const auto unit_it = kUnits.find(unit);
  if (unit_it == kUnits.end()) {
    *error = usage;
    return false;
  }
  const std::string too_large = "size " + quoted(raw) + " is too large";
  // 19 digits still fit in uint64; more overflow int64 anyway. Fraction digits past 18 are
  // worth less than a millionth of a byte for units up to 2^40, so they are dropped.
  whole.erase(0, std::min(whole.find_first_not_of('0'), whole.size()));
  if (whole.size() > 19) {
    *error = too_large;
    return false;
  }
  fraction.resize(std::min<size_t>(fraction.size(), 18));
  __extension__ using Wide = unsigned __int128;
  const Wide multiplier = unit_it->second;
  Wide total = Wide(whole.empty() ? 0 : std::stoull(whole)) * multiplier;
  if (!fraction.empty()) {
    Wide denominator = 1;
    for (size_t i = 0; i < fraction.size(); ++i) denominator *= 10;
    total += Wide(std::stoull(fraction)) * multiplier / denominator;
  }
  if (total > Wide(std::numeric_limits<int64_t>::max())) {
    *error = too_large;
    return false;
  }
  *bytes = static_cast<int64_t>(total);
  return true;
}

// Where an override put a value: its path in the tree as messages spell it
// (`requests[0].max_new_tokens`) and the key as the user wrote it (`requests.0.max_new_tokens`).
struct OverrideOrigin {
  std::string path;
  std::string key;
};

// Applies one "key.path=yaml-value" to `root` (a mapping), creating intermediate mappings.
void apply_override(YAML::Node& root, const std::string& text,
                    std::vector<OverrideOrigin>* origins) {
  const size_t equals = text.find('=');
  const std::string key = equals == std::string::npos ? "" : trim(text.substr(0, equals));
  if (key.empty()) {
    throw std::invalid_argument(
        "--set " + quoted(text) +
        ": malformed override, expected KEY=VALUE (e.g. cache.memory=64MiB)");
  }
  std::vector<std::string> parts;
  std::stringstream stream(key);
  for (std::string part; std::getline(stream, part, '.');) parts.push_back(trim(part));
  if (key.back() == '.' ||
      std::any_of(parts.begin(), parts.end(), [](const std::string& p) { return p.empty(); })) {
    throw std::invalid_argument("--set " + key + ": malformed key, expected e.g. cache.block_size");
  }
  YAML::Node value;
  try {
    value = YAML::Load(text.substr(equals + 1));
  } catch (const YAML::Exception& e) {
    throw std::invalid_argument("--set " + key + ": malformed value: " + e.msg);
  }

  // Node assignment in yaml-cpp writes through to the referenced node, so walking down uses
  // reset() and only the final assignment changes the tree.
  YAML::Node current = root;
  std::string path;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& part = parts[i];
    const bool last = i + 1 == parts.size();
    YAML::Node child;
    if (current.IsSequence()) {
      int64_t index = -1;
      if (!parse_int64(part, &index) || index < 0 || static_cast<size_t>(index) >= current.size()) {
        throw std::invalid_argument("--set " + key + ": expected a list index below " +
                                    std::to_string(current.size()) + " for " + path + ", got '" +
                                    part + "'");
      }
      path += "[" + std::to_string(index) + "]";
      child.reset(current[static_cast<size_t>(index)]);
    } else {
      path = join_path(path, part);
      child.reset(current[part]);
    }
    if (last) {
      child = value;
    } else {
      if (!child.IsMap() && !child.IsSequence()) child = YAML::Node(YAML::NodeType::Map);
      current.reset(child);
    }
  }
  // A later override of a whole subtree supersedes earlier ones inside it.
  origins->erase(std::remove_if(origins->begin(), origins->end(),
                                [&](const OverrideOrigin& o) { return path_within(o.path, path); }),
                 origins->end());
  origins->push_back({path, key});
}

// Reads a merged YAML tree into a JobConfig. Every reader takes the node and its key path; the
// path decides whether a message points at the file or at a --set override.
class Validator {
 public:
  Validator(std::string source, std::vector<OverrideOrigin> origins)
      : source_(std::move(source)), origins_(std::move(origins)) {}

  JobConfig read(const YAML::Node& root) {
    JobConfig c;
    c.source = source_;
    read_mapping(root, "",
                 {{"model", section(model_fields(c.model))},
                  {"runtime", section(runtime_fields(c.runtime))},
                  {"parallel", section(parallel_fields(c.parallel))},
                  {"cache", section(cache_fields(c.cache))},
                  {"scheduler", section(scheduler_fields(c.scheduler))},
                  {"sampling", section(sampling_fields(c.sampling))},
                  {"requests", request_list(&c.requests)}});
    if (c.model.path.empty()) {
      fail_without_node("model.path",
                        "required key missing (an HF model directory, a .gguf file or "
                        "dummy:<preset>)");
    }
    return c;
  }

 private:
  using Reader = std::function<void(const YAML::Node& value, const std::string& path)>;
  struct Field {
    std::string key;
    Reader read;
  };

  // ---- The schema: one table per section.

  std::vector<Field> model_fields(ModelSection& m) {
    return {{"path", non_empty_string(&m.path)},
            {"dtype", choice(&m.dtype, {"float32", "float16", "bfloat16"})}};
  }

  std::vector<Field> runtime_fields(RuntimeSection& r) {
    return {{"threads", integer(&r.threads, 1, kIntMax)},
            {"memory", size_or_auto(&r.memory_bytes)}};
  }

  std::vector<Field> parallel_fields(ParallelSection& p) {
    return {{"layers", layer_list(&p.layers)},
            {"micro_batches", integer(&p.micro_batches, 1, kIntMax, "auto", 0)},
            {"backend", choice(&p.backend, {"auto", "mpi", "nccl"})}};
  }

  std::vector<Field> cache_fields(CacheSection& c) {
    return {{"block_size", integer(&c.block_size, 1, kMaxBlockSize)},
            {"memory", memory_spec(&c.memory)},
            {"prefix_reuse", boolean(&c.prefix_reuse)},
            {"cached_layers", integer(&c.cached_layers, 0, kIntMax, "all", -1)},
            {"window", section({{"sinks", integer(&c.window_sinks, 0, kIntMax)},
                                {"recent", integer(&c.window_recent, 0, kIntMax)}})}};
  }

  std::vector<Field> scheduler_fields(SchedulerSection& s) {
    return {{"max_batch", integer(&s.max_batch, 1, kIntMax)},
            {"max_tokens_per_step", integer(&s.max_tokens_per_step, 1, kIntMax)}};
  }

  std::vector<Field> sampling_fields(SamplingSection& s) {
    return {{"temperature", real(&s.temperature, 0.0, false, kInfinity, false)},
            {"top_k", integer(&s.top_k, 0, kIntMax)},
            {"top_p", real(&s.top_p, 0.0, true, 1.0, false)},
            {"seed", unsigned_integer(&s.seed)},
            {"ignore_eos", boolean(&s.ignore_eos)}};
  }

  std::vector<Field> request_fields(RequestSpec& r) {
    return {{"prompt_ids", token_list(&r.prompt_ids)},
            {"max_new_tokens", integer(&r.max_new_tokens, 1, kIntMax)},
            {"arrival_step", integer(&r.arrival_step, 0, kIntMax)}};
  }

  // ---- Mappings and lists.

  void read_mapping(const YAML::Node& node, const std::string& path,
                    const std::vector<Field>& fields) {
    if (node.IsNull()) return;  // an empty section (`cache:`) keeps its defaults
    if (!node.IsMap()) fail(node, path, "expected a mapping, got " + describe(node));
    std::vector<std::string> known;
    for (const Field& field : fields) known.push_back(field.key);
    std::set<std::string> seen;
    for (const auto& entry : node) {
      const YAML::Node& key_node = entry.first;
      if (!key_node.IsScalar())
        fail(key_node, path, "expected key names, got " + describe(key_node));
      const std::string key = key_node.Scalar();
      const std::string key_path = join_path(path, key);
      key_marks_[key_path] = key_node.Mark();
      const auto field =
          std::find_if(fields.begin(), fields.end(), [&](const Field& f) { return f.key == key; });
      if (field == fields.end()) {
        const std::string suggestion = closest(key, known);
        const std::string hint = suggestion.empty()
                                     ? " (expected one of: " + join(known, ", ") + ")"
                                     : " (did you mean '" + join_path(path, suggestion) + "'?)";
        raise(key_node, key_path,
              "unknown " + std::string(path.empty() ? "section" : "key") + " '" + key_path + "'" +
                  hint);
      }
      if (!seen.insert(key).second) raise(key_node, key_path, "duplicate key '" + key_path + "'");
      field->read(entry.second, key_path);
    }
  }

  // Calls `read` on each element of a non-empty list.
  void for_each_element(const YAML::Node& node, const std::string& path,
                        const std::string& expected,
                        const std::function<void(const YAML::Node&, const std::string&)>& read) {
    if (!node.IsSequence() || node.size() == 0) {
      fail(node, path, "expected " + expected + ", got " + describe(node));
    }
    for (size_t i = 0; i < node.size(); ++i) read(node[i], path + "[" + std::to_string(i) + "]");
  }

  // ---- Readers that store a value into a member of the config. A `keyword` such as "auto"
  // stands for `keyword_value`.

  Reader section(std::vector<Field> fields) {
    return [this, fields = std::move(fields)](const YAML::Node& n, const std::string& p) {
      read_mapping(n, p, fields);
    };
  }

  Reader integer(int* out, int64_t min, int64_t max, const char* keyword = nullptr,
                 int keyword_value = 0) {
    return
        [this, out, min, max, keyword, keyword_value](const YAML::Node& n, const std::string& p) {
          *out = is_keyword(n, keyword) ? keyword_value
                                        : static_cast<int>(read_int(n, p, min, max, keyword));
        };
  }

  Reader unsigned_integer(uint64_t* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      const std::string text = is_plain_scalar(n) ? n.Scalar() : "";
      const char* end = text.data() + text.size();
      const auto result = std::from_chars(text.data(), end, *out);
      if (text.empty() || result.ec != std::errc() || result.ptr != end) {
        fail(n, p, "expected a non-negative integer below 2^64, got " + describe(n));
      }
    };
  }

  // A number between `min` and `max`, each end open or closed.
  Reader real(double* out, double min, bool min_open, double max, bool max_open) {
    return [this, out, min, min_open, max, max_open](const YAML::Node& n, const std::string& p) {
      const std::string range = std::string(min_open ? "(" : "[") + format_number(min) + ", " +
                                (max == kInfinity ? "inf)" : format_number(max)) +
                                (max == kInfinity ? ""
                                 : max_open       ? ")"
                                                  : "]");
      double value = 0.0;
      if (!is_plain_scalar(n) || !parse_finite_double(n.Scalar(), &value) ||
          (min_open ? value <= min : value < min) || (max_open ? value >= max : value > max)) {
        fail(n, p, "expected a number in " + range + ", got " + describe(n));
      }
      *out = value;
    };
  }

  Reader boolean(bool* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      if (!is_plain_scalar(n) || !YAML::convert<bool>::decode(n, *out)) {
        fail(n, p, "expected true or false, got " + describe(n));
      }
    };
  }

  Reader non_empty_string(std::string* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      if (!n.IsScalar()) fail(n, p, "expected a string, got " + describe(n));
      if (n.Scalar().empty()) fail(n, p, "must not be empty");
      *out = n.Scalar();
    };
  }

  Reader choice(std::string* out, std::vector<std::string> choices) {
    return [this, out, choices = std::move(choices)](const YAML::Node& n, const std::string& p) {
      const std::string text = n.IsScalar() ? n.Scalar() : "";
      if (!n.IsScalar() || std::find(choices.begin(), choices.end(), text) == choices.end()) {
        const std::string suggestion = n.IsScalar() ? closest(text, choices) : "";
        fail(n, p,
             "expected one of " + join(choices, ", ") + ", got " + describe(n) +
                 (suggestion.empty() ? "" : " (did you mean '" + suggestion + "'?)"));
      }
      *out = text;
    };
  }

  Reader size_or_auto(std::optional<int64_t>* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      out->reset();
      if (!is_keyword(n, "auto")) *out = read_size(n, p, "auto or ");
    };
  }

  Reader memory_spec(MemorySpec* out) {
    return [this, out](const YAML::Node& n, const std::string& p) { *out = read_memory(n, p); };
  }

  Reader layer_list(std::vector<int>* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      out->clear();
      if (is_keyword(n, "auto")) return;
      for_each_element(n, p, "auto or a list of positive layer counts",
                       [&](const YAML::Node& e, const std::string& ep) {
                         out->push_back(static_cast<int>(read_int(e, ep, 1, kIntMax)));
                       });
    };
  }

  Reader token_list(std::vector<int64_t>* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      out->clear();
      for_each_element(n, p, "a non-empty list of token ids",
                       [&](const YAML::Node& e, const std::string& ep) {
                         out->push_back(read_int(e, ep, 0, std::numeric_limits<int64_t>::max()));
                       });
    };
  }

  Reader request_list(std::vector<RequestSpec>* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      out->clear();
      // No requests in the file is fine: they may come from the command line.
      if (n.IsNull() || (n.IsSequence() && n.size() == 0)) return;
      for_each_element(n, p, "a list of requests", [&](const YAML::Node& e, const std::string& ep) {
        RequestSpec request;
        read_mapping(e, ep, request_fields(request));
        if (request.prompt_ids.empty()) fail(e, ep, "required key 'prompt_ids' missing");
        out->push_back(std::move(request));
      });
    };
  }

  // ---- Scalar readers.

  int64_t read_int(const YAML::Node& node, const std::string& path, int64_t min, int64_t max,
                   const char* keyword = nullptr) {
    std::string expected =
        min == 1 && max == kIntMax ? "a positive integer"
        : min == 0 && (max == kIntMax || max == INT64_MAX)
            ? "a non-negative integer"
            : "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
    if (keyword) expected = std::string(keyword) + " or " + expected;
    int64_t value = 0;
    if (!is_plain_scalar(node) || !parse_int64(node.Scalar(), &value) || value < min ||
        value > max) {
      fail(node, path, "expected " + expected + ", got " + describe(node));
    }
    return value;
  }

  int64_t read_size(const YAML::Node& node, const std::string& path,
                    const std::string& alternatives = "") {
    if (!node.IsScalar()) {
      fail(node, path, "expected " + alternatives + "a size (e.g. 256MiB), got " + describe(node));
    }
    int64_t bytes = 0;
    std::string error;
    if (!parse_size_text(node.Scalar(), &bytes, &error)) fail(node, path, error);
    // A zero budget cannot hold a single block or tensor; it is always a mistake.
    if (bytes == 0) fail(node, path, "expected a positive size, got " + describe(node));
    return bytes;
  }

  MemorySpec read_memory(const YAML::Node& node, const std::string& path) {
    MemorySpec spec;
    if (node.IsSequence()) {
      spec.kind = MemorySpec::Kind::kPerRank;
      for_each_element(node, path, "a size, a list of sizes (one per rank) or a share like 90%",
                       [&](const YAML::Node& e, const std::string& ep) {
                         spec.per_rank.push_back(read_size(e, ep));
                       });
      return spec;
    }
    const std::string text = node.IsScalar() ? trim(node.Scalar()) : "";
    if (!text.empty() && text.back() == '%') {
      double percent = 0.0;
      if (!parse_finite_double(trim(text.substr(0, text.size() - 1)), &percent) || percent <= 0.0 ||
          percent > 100.0) {
        fail(node, path, "expected a share in (0%, 100%], got " + describe(node));
      }
      spec.kind = MemorySpec::Kind::kShare;
      spec.share = percent / 100.0;
      return spec;
    }
    spec.kind = MemorySpec::Kind::kBytes;
    spec.bytes = read_size(node, path, "a list of sizes, a share like 90% or ");
    return spec;
  }

  // ---- Node inspection.

  static bool is_keyword(const YAML::Node& node, const char* keyword) {
    return keyword && node.IsScalar() && node.Scalar() == keyword;
  }

  // Quoted scalars are strings in YAML: "16" is not a number.
  static bool is_plain_scalar(const YAML::Node& node) {
    return node.IsScalar() && node.Tag() != "!";
  }

  static std::string describe(const YAML::Node& node) {
    if (!node.IsDefined() || node.IsNull()) return "null";
    if (node.IsSequence()) return "a list";
    if (node.IsMap()) return "a mapping";
    const std::string text = node.Scalar();
    return node.Tag() == "!" ? "string " + quoted(text) : quoted(text);
  }

  static std::string format_number(double value) {
    std::ostringstream out;
    out << value;
    return out.str();
  }

  // ---- Messages.

  // "--set KEY" for anything an override wrote, else "file:line", else the file alone.
  std::string location(const YAML::Node& node, const std::string& path) const {
    const OverrideOrigin* origin = nullptr;
    for (const OverrideOrigin& o : origins_) {
      if (path_within(path, o.path) && (!origin || o.path.size() > origin->path.size()))
        origin = &o;
    }
    if (origin) return "--set " + origin->key;
    // A null value is marked where the next token starts; its key's line is the useful one.
    YAML::Mark mark = node.IsDefined() && !node.IsNull() ? node.Mark() : YAML::Mark::null_mark();
    const auto key_mark = key_marks_.find(path);
    if (mark.is_null() && key_mark != key_marks_.end()) mark = key_mark->second;
    if (!mark.is_null()) return source_ + ":" + std::to_string(mark.line + 1);
    // Mappings an override created on the way to its key have no mark.
    for (const OverrideOrigin& o : origins_) {
      if (path_within(o.path, path)) return "--set " + o.key;
    }
    return source_;
  }

  [[noreturn]] void raise(const YAML::Node& node, const std::string& path,
                          const std::string& message) const {
    throw std::invalid_argument(location(node, path) + ": " + message);
  }

  // "LOCATION: PATH: detail", without repeating the path when the location is `--set PATH`.
  [[noreturn]] void fail(const YAML::Node& node, const std::string& path,
                         const std::string& detail) const {
    const std::string where = location(node, path);
    const std::string subject = path.empty() ? "top level" : path;
    if (where == "--set " + path) throw std::invalid_argument(where + ": " + detail);
    throw std::invalid_argument(where + ": " + subject + ": " + detail);
  }

  // For a key that is absent: blame the override that wrote its section, else point at the
  // section in the file, else at the file.
  [[noreturn]] void fail_without_node(const std::string& path, const std::string& detail) const {
    const std::string section = path.substr(0, path.find('.'));
    std::string where = source_;
    const auto mark = key_marks_.find(section);
    if (mark != key_marks_.end() && !mark->second.is_null()) {
      where += ":" + std::to_string(mark->second.line + 1);
    }
    for (const OverrideOrigin& o : origins_) {
      if (path_within(section, o.path)) where = "--set " + o.key;
    }
    throw std::invalid_argument(where + ": " + path + ": " + detail);
  }

  std::string source_;
  std::vector<OverrideOrigin> origins_;
  std::map<std::string, YAML::Mark> key_marks_;
};

}  // namespace

int64_t parse_size(const std::string& text, const std::string& what) {
  int64_t bytes = 0;
  std::string error;
  if (!parse_size_text(text, &bytes, &error)) throw std::invalid_argument(what + ": " + error);
  return bytes;
}

JobConfig parse_job_config(const std::string& yaml_text, const std::string& source,
                           const std::vector<std::string>& overrides) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    const std::string line = e.mark.is_null() ? "" : ":" + std::to_string(e.mark.line + 1);
    throw std::invalid_argument(source + line + ": malformed YAML: " + e.msg);
  }
  if (root.IsNull()) root.reset(YAML::Node(YAML::NodeType::Map));  // empty file: all --set
  if (!root.IsMap()) {
    const std::string line =
        root.Mark().is_null() ? "" : ":" + std::to_string(root.Mark().line + 1);
    throw std::invalid_argument(
        source + line +
        ": expected a mapping of sections (model, runtime, parallel, cache, "
        "scheduler, sampling, requests) at the top level");
  }
  std::vector<OverrideOrigin> origins;
  for (const std::string& override_text : overrides) apply_override(root, override_text, &origins);
  return Validator(source, std::move(origins)).read(root);
}

JobConfig load_job_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ignored;
  std::ifstream in(path);
  if (!in || std::filesystem::is_directory(path, ignored)) {
    throw std::invalid_argument(path + ": cannot open config file");
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw std::invalid_argument(path + ": cannot read config file");
  return parse_job_config(text.str(), path, overrides);
}

}  // namespace kvpipe
