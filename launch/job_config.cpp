#include "launch/job_config.h"

#include <yaml-cpp/yaml.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cerrno>
#include <cstring>
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
constexpr int64_t kMaxNodes = 100000;
constexpr int64_t kMaxRanksPerNode = 1024;
// Bounds on what the job asks for, before anything is sized by it. Threads are also held to
// the machine's core count by the plan; these are the limits no machine makes sensible.
constexpr int64_t kMaxThreads = 1024;
constexpr int64_t kMaxBatch = 1 << 16;
constexpr int64_t kMaxDraftTokens = 64;
constexpr int64_t kMaxStepTokens = 1 << 20;
constexpr int64_t kMaxMicroBatches = 1024;
constexpr int64_t kMaxWorkloadRequests = 1 << 20;
constexpr int64_t kMaxWorkloadConcurrency = 1 << 16;
// Prompt tokens a bench workload may draw up front (8 GiB of token ids).
constexpr int64_t kMaxWorkloadPromptTokens = int64_t{1} << 30;
constexpr double kInfinity = std::numeric_limits<double>::infinity();
// A job file, or a file of lengths it names, is text a person wrote: far below this.
constexpr int64_t kMaxJobFileBytes = int64_t{16} << 20;

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

// Reads the regular file `path` of at most `max_bytes` into `text`, or says in `error` what
// is wrong ("cannot open ...", "not a regular file ...", "larger than 16 MiB"). O_NONBLOCK
// keeps the open of a FIFO without a writer from blocking; fstat then refuses FIFOs, sockets
// and devices (/dev/zero never ends) before a byte is read. The read stops one byte past the
// limit, so a file that grows meanwhile cannot make it read without bound either.
bool read_bounded_file(const std::string& path, int64_t max_bytes, const std::string& what,
                       std::string* text, std::string* error) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    *error = errno == ENOENT ? "cannot open " + what : "cannot open " + what + ": " + std::strerror(errno);
    return false;
  }
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    *error = "cannot read " + what + ": " + std::strerror(errno);
    return false;
  }
  if (S_ISDIR(st.st_mode)) {
    *error = "cannot open " + what + ": it is a directory";
    return false;
  }
  if (!S_ISREG(st.st_mode)) {
    *error = "cannot read " + what + ": not a regular file (a FIFO, socket or device is refused)";
    return false;
  }
  const std::string limit = std::to_string(max_bytes >> 20) + " MiB";
  if (st.st_size > max_bytes) {
    *error = "larger than " + limit + " (a job's files are read whole)";
    return false;
  }
  text->clear();
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *error = "cannot read " + what + ": " + std::strerror(errno);
      return false;
    }
    if (n == 0) break;
    text->append(buffer, static_cast<size_t>(n));
    if (static_cast<int64_t>(text->size()) > max_bytes) {
      *error = "larger than " + limit + " (a job's files are read whole)";
      return false;
    }
  }
  return true;
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

  // Reads every section, collecting problems (problems()) instead of stopping at the first
  // one; what could not be read keeps its default.
  JobConfig read(const YAML::Node& root) {
    JobConfig c;
    c.source = source_;
    guard([&] {
      read_mapping(root, "",
                   {{"model", section(model_fields(c.model))},
                    {"runtime", section(runtime_fields(c.runtime))},
                    {"parallel", section(parallel_fields(c.parallel))},
                    {"cache", section(cache_fields(c.cache))},
                    {"scheduler", section(scheduler_fields(c.scheduler))},
                    {"sampling", section(sampling_fields(c.sampling))},
                    {"speculative", section(speculative_fields(c.speculative))},
                    {"requests", request_list(&c.requests)},
                    {"workload", section(workload_fields(c.workload))},
                    {"cluster", cluster_section(&c.cluster)}});
    });
    if (c.model.path.empty() && !failed_paths_.count("model.path")) {
      guard([&] {
        fail_without_node("model.path",
                          "required key missing (an HF model directory, a .gguf file or "
                          "dummy:<preset>)");
      });
    }
    check_combinations(c);
    for (const auto& entry : key_marks_) c.where[entry.first] = location(YAML::Node(), entry.first).where;
    return c;
  }

  const std::vector<ConfigProblem>& problems() const { return problems_; }

 private:
  // Thrown after a problem is recorded, to abandon the value being read; the enclosing
  // mapping or list catches it and goes on with the next key or element.
  struct Abandon {};

  // Where a problem lies: the text messages start with, and the 1-based position.
  struct Position {
    std::string where;
    int line = 0;
    int column = 0;
  };

  template <typename F>
  void guard(F&& body) {
    try {
      body();
    } catch (const Abandon&) {
    }
  }

  // Combinations that are each valid alone but not together.
  void check_combinations(const JobConfig& c) {
    if (c.cache.window_sinks > 0 && c.cache.window_recent == 0 &&
        !failed_paths_.count("cache.window.recent")) {
      guard([&] {
        fail_at_key("cache.window.sinks",
                    std::to_string(c.cache.window_sinks) +
                        " sink tokens need a window: set cache.window.recent > 0 (recent 0 "
                        "means no window)");
      });
    }
    if (c.speculative.method == "draft" && c.speculative.model.empty() && !failed_paths_.count("speculative.method") &&
        !failed_paths_.count("speculative.model")) {
      guard([&] {
        fail_at_key("speculative.method", "draft needs speculative.model: the draft model's file (with the "
                                          "vocabulary of model.path)");
      });
    }
    if (!c.speculative.model.empty() && c.speculative.method != "draft" && !failed_paths_.count("speculative.model") &&
        !failed_paths_.count("speculative.method")) {
      guard([&] {
        fail_at_key("speculative.model", "a draft model is read only by method draft (method is " +
                                             c.speculative.method + ")");
      });
    }
    if (c.speculative.ngram_min > c.speculative.ngram_max && !failed_paths_.count("speculative.ngram.min") &&
        !failed_paths_.count("speculative.ngram.max")) {
      guard([&] {
        fail_at_key("speculative.ngram.min", "must not exceed speculative.ngram.max (" +
                                                 std::to_string(c.speculative.ngram_max) + ")");
      });
    }
    const WorkloadSection& w = c.workload;
    const bool dataset = w.dataset != "random";
    auto refuse = [&](const std::string& key, bool wrong, const std::string& why) {
      if (wrong && !failed_paths_.count(key)) guard([&] { fail_at_key(key, why); });
    };
    for (const auto& [key, given] : {std::pair{"prompt_len", w.prompt_len_given}, {"output_len", w.output_len_given}})
      refuse(std::string("workload.") + key, dataset && given,
             "the lengths come from workload.dataset (" + w.dataset + "): remove " + key);
    refuse("workload.shared_prefix", dataset && w.shared_prefix > 0,
           "a dataset's prompts share what their conversations share: remove shared_prefix");
    refuse("workload.mode", w.mode == "multi_turn" && !dataset,
           "multi_turn replays conversations: set workload.dataset to sharegpt or a file of them");
    refuse("workload.rate", w.mode == "multi_turn" && w.rate > 0,
           "multi_turn runs workload.concurrency conversations at once, each turn after the reply before "
           "(turn_gap): an arrival rate is not supported with it");
    refuse("workload.turn_gap", w.mode != "multi_turn" && w.turn_gap > 0, "is read only by mode multi_turn");
    refuse("workload.min_turns", w.mode != "multi_turn" && w.min_turns > 1, "is read only by mode multi_turn");
    // bench draws every prompt before it starts.
    const int64_t requests = int64_t{c.workload.requests} + c.workload.warmup;
    if (requests * c.workload.prompt_len.hi > kMaxWorkloadPromptTokens &&
        !failed_paths_.count("workload.requests")) {
      guard([&] {
        fail_at_key("workload.requests",
                    std::to_string(requests) + " requests (warm-up included) of up to " +
                        std::to_string(c.workload.prompt_len.hi) + " prompt tokens are more than the " +
                        std::to_string(kMaxWorkloadPromptTokens) + " prompt tokens a workload may draw");
      });
    }
  }
  using Reader = std::function<void(const YAML::Node& value, const std::string& path)>;
  struct Field {
    std::string key;
    Reader read;
  };

  // ---- The schema: one table per section.

  std::vector<Field> model_fields(ModelSection& m) {
    return {{"path", non_empty_string(&m.path)},
            {"dtype", choice(&m.dtype, {"auto", "float32", "float16", "bfloat16"})},
            {"repack", boolean(&m.repack)},
            {"huge_pages", boolean(&m.huge_pages)}};
  }

  std::vector<Field> runtime_fields(RuntimeSection& r) {
    return {{"device", choice(&r.device, {"auto", "cpu", "cuda"})},
            {"threads", integer(&r.threads, 1, kMaxThreads)},
            {"memory", runtime_memory(&r)},
            {"share_gpu", boolean(&r.share_gpu)},
            {"pin_threads", boolean(&r.pin_threads)},
            {"cuda_graphs", boolean(&r.cuda_graphs)}};
  }

  std::vector<Field> parallel_fields(ParallelSection& p) {
    return {{"tensor", integer(&p.tensor, 1, kMaxRanksPerNode)},
            {"layers", layer_list(&p.layers)},
            {"micro_batches", integer(&p.micro_batches, 1, kMaxMicroBatches, "auto", 0)},
            {"backend", choice(&p.backend, {"auto", "mpi", "nccl"})},
            {"timeout", real(&p.timeout_s, 0.0, false, kInfinity, false)}};
  }

  std::vector<Field> cache_fields(CacheSection& c) {
    return {{"block_size", integer(&c.block_size, 1, kMaxBlockSize)},
            {"memory", memory_spec(&c.memory)},
            {"prefix_reuse", boolean(&c.prefix_reuse)},
            {"dtype", choice(&c.dtype, {"auto", "float32", "float16", "bfloat16", "q8_0"})},
            {"cached_layers", integer(&c.cached_layers, 0, kIntMax, "all", -1)},
            {"window", section({{"sinks", integer(&c.window_sinks, 0, kIntMax)},
                                {"recent", integer(&c.window_recent, 0, kIntMax)}})}};
  }

  std::vector<Field> scheduler_fields(SchedulerSection& s) {
    return {{"max_batch", integer(&s.max_batch, 1, kMaxBatch)},
            {"max_tokens_per_step", integer(&s.max_tokens_per_step, 1, kMaxStepTokens)},
            {"max_prefill_tokens_per_step", integer(&s.max_prefill_tokens_per_step, 0, kMaxStepTokens)}};
  }

  std::vector<Field> speculative_fields(SpeculativeSection& s) {
    return {{"method", choice(&s.method, {"off", "ngram", "draft"})},
            {"num_tokens", integer(&s.num_tokens, 1, kMaxDraftTokens)},
            {"ngram", section({{"min", integer(&s.ngram_min, 1, kMaxDraftTokens)},
                               {"max", integer(&s.ngram_max, 1, kMaxDraftTokens)}})},
            {"model", non_empty_string(&s.model)},
            {"max_batch", integer(&s.max_batch, 1, kMaxBatch)}};
  }

  std::vector<Field> sampling_fields(SamplingSection& s) {
    return {{"temperature", real(&s.temperature, 0.0, false, kInfinity, false)},
            {"top_k", integer(&s.top_k, 0, kIntMax)},
            {"top_p", real(&s.top_p, 0.0, true, 1.0, false)},
            {"seed", unsigned_integer(&s.seed)},
            {"ignore_eos", boolean(&s.ignore_eos)},
            {"stop", string_list(&s.stop)},
            {"min_p", real(&s.min_p, 0.0, false, 1.0, false)},
            {"presence_penalty", real(&s.presence_penalty, -2.0, false, 2.0, false)},
            {"frequency_penalty", real(&s.frequency_penalty, -2.0, false, 2.0, false)},
            {"repetition_penalty", real(&s.repetition_penalty, 0.0, true, 10.0, false)},
            {"min_tokens", integer(&s.min_tokens, 0, kIntMax)},
            {"logit_bias", token_bias(&s.logit_bias)},
            {"bad_words", string_list(&s.bad_words)}};
  }

  std::vector<Field> workload_fields(WorkloadSection& w) {
    return {{"requests", integer(&w.requests, 1, kMaxWorkloadRequests)},
            {"prompt_len", given(length_range(&w.prompt_len), &w.prompt_len_given)},
            {"output_len", given(length_range(&w.output_len), &w.output_len_given)},
            {"shared_prefix", real(&w.shared_prefix, 0.0, false, 1.0, true)},
            {"concurrency", integer(&w.concurrency, 1, kMaxWorkloadConcurrency)},
            {"rate", real(&w.rate, 0.0, false, kInfinity, false)},
            {"warmup", integer(&w.warmup, 0, kMaxWorkloadRequests)},
            {"seed", unsigned_integer(&w.seed)},
            {"dataset", non_empty_string(&w.dataset)},
            {"mode", choice(&w.mode, {"single", "multi_turn"})},
            {"turn_gap", real(&w.turn_gap, 0.0, false, kInfinity, false)},
            {"min_turns", integer(&w.min_turns, 1, kIntMax)}};
  }

  // `read`, noting in *flag that the key was in the file.
  Reader given(Reader read, bool* flag) {
    return [read = std::move(read), flag](const YAML::Node& n, const std::string& p) {
      read(n, p);
      *flag = true;
    };
  }

  std::vector<Field> cluster_fields(ClusterSection& c) {
    return {{"nodes", integer(&c.nodes, 1, kMaxNodes)},
            {"gpus_per_node", integer(&c.gpus_per_node, 1, kMaxRanksPerNode)},
            {"gpus", boolean(&c.gpus)},
            {"partition", word(&c.partition)},
            {"account", word(&c.account)},
            {"time", slurm_time(&c.time)},
            {"job_name", word(&c.job_name)},
            {"output", word(&c.output)},
            {"env", environment(&c.env)},
            {"modules", module_list(&c.modules)},
            {"launcher", choice(&c.launcher, {"srun", "mpirun"})},
            {"kvpipe", word(&c.kvpipe)}};
  }

  std::vector<Field> request_fields(RequestSpec& r) {
    return {{"prompt_ids", token_list(&r.prompt_ids)},
            {"prompt", optional_text(&r.prompt)},
            {"messages", message_list(&r.messages)},
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
      guard([&] {
        const YAML::Node& key_node = entry.first;
        if (!key_node.IsScalar())
          fail(key_node, path, "expected key names, got " + describe(key_node));
        const std::string key = key_node.Scalar();
        const std::string key_path = join_path(path, key);
        if (!key_marks_.count(key_path)) key_marks_[key_path] = key_node.Mark();
        const auto field = std::find_if(fields.begin(), fields.end(),
                                        [&](const Field& f) { return f.key == key; });
        if (field == fields.end()) {
          const std::string suggestion = closest(key, known);
          const std::string hint = suggestion.empty()
                                       ? " (expected one of: " + join(known, ", ") + ")"
                                       : " (did you mean '" + join_path(path, suggestion) + "'?)";
          raise(key_node, key_path,
                "unknown " + std::string(path.empty() ? "section" : "key") + " '" + key_path +
                    "'" + hint);
        }
        if (!seen.insert(key).second)
          raise(key_node, key_path, "duplicate key '" + key_path + "'");
        field->read(entry.second, key_path);
      });
    }
  }

  // Calls `read` on each element of a non-empty list.
  void for_each_element(const YAML::Node& node, const std::string& path,
                        const std::string& expected,
                        const std::function<void(const YAML::Node&, const std::string&)>& read) {
    if (!node.IsSequence() || node.size() == 0) {
      fail(node, path, "expected " + expected + ", got " + describe(node));
    }
    for (size_t i = 0; i < node.size(); ++i) {
      guard([&] { read(node[i], path + "[" + std::to_string(i) + "]"); });
    }
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

  Reader optional_text(std::optional<std::string>* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      std::string text;
      non_empty_string(&text)(n, p);
      *out = std::move(text);
    };
  }

  // A list of strings (possibly empty); each must be non-empty.
  Reader string_list(std::vector<std::string>* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      out->clear();
      if (n.IsNull() || (n.IsSequence() && n.size() == 0)) return;
      if (n.IsScalar()) {  // `stop: "\n"` as OpenAI's API allows
        if (n.Scalar().empty()) fail(n, p, "must not be empty");
        out->push_back(n.Scalar());
        return;
      }
      for_each_element(n, p, "a string or a list of strings", [&](const YAML::Node& e, const std::string& ep) {
        std::string text;
        non_empty_string(&text)(e, ep);
        out->push_back(std::move(text));
      });
    };
  }

  Reader message_list(std::vector<RequestMessage>* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      out->clear();
      for_each_element(n, p, "a non-empty list of messages {role, content}",
                       [&](const YAML::Node& e, const std::string& ep) {
                         RequestMessage m;
                         bool has_role = false, has_content = false;
                         read_mapping(e, ep, {{"role", [&](const YAML::Node& v, const std::string& vp) {
                                                 if (!v.IsScalar() || v.Scalar().empty())
                                                   fail(v, vp, "expected a role name, got " + describe(v));
                                                 m.role = v.Scalar();
                                                 has_role = true;
                                               }},
                                              {"content", [&](const YAML::Node& v, const std::string& vp) {
                                                 if (!v.IsScalar()) fail(v, vp, "expected a string, got " + describe(v));
                                                 m.content = v.Scalar();
                                                 has_content = true;
                                               }}});
                         if (!has_role) fail(e, ep, "required key 'role' missing");
                         if (!has_content) fail(e, ep, "required key 'content' missing");
                         out->push_back(std::move(m));
                       });
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

  // auto, a size, or a share (`90%`) of the device's memory.
  Reader runtime_memory(RuntimeSection* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      out->memory_bytes.reset();
      out->memory_share.reset();
      if (is_keyword(n, "auto")) return;
      const std::string text = n.IsScalar() ? trim(n.Scalar()) : "";
      if (!text.empty() && text.back() == '%') {
        out->memory_share = read_share(n, p);
        return;
      }
      out->memory_bytes = read_size(n, p, "auto, a share like 90% or ");
    };
  }

  // A string without blanks, quotes or shell characters: it goes into a batch script.
  Reader word(std::string* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      if (!n.IsScalar()) fail(n, p, "expected a string, got " + describe(n));
      const std::string& text = n.Scalar();
      if (text.empty()) fail(n, p, "must not be empty");
      for (const char ch : text) {
        if (std::isspace(static_cast<unsigned char>(ch)) || std::strchr("\"'`$\\;&|<>()", ch)) {
          fail(n, p, "must not contain blanks, quotes or shell characters, got " + describe(n));
        }
      }
      *out = text;
    };
  }

  Reader slurm_time(std::string* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      const std::string text = n.IsScalar() ? trim(n.Scalar()) : "";
      if (!n.IsScalar() || !is_valid_slurm_time(text)) {
        fail(n, p, "expected a time limit HH:MM:SS or D-HH:MM:SS, got " + describe(n));
      }
      *out = text;
    };
  }

  // A mapping of variable names to values, exported in the batch script.
  Reader environment(std::map<std::string, std::string>* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      out->clear();
      if (n.IsNull()) return;
      if (!n.IsMap()) fail(n, p, "expected a mapping of variable names to values, got " + describe(n));
      for (const auto& entry : n) {
        guard([&] {
          const std::string name = entry.first.IsScalar() ? entry.first.Scalar() : "";
          const std::string key_path = join_path(p, name);
          if (!key_marks_.count(key_path)) key_marks_[key_path] = entry.first.Mark();
          const bool identifier =
              !name.empty() && !std::isdigit(static_cast<unsigned char>(name[0])) &&
              std::all_of(name.begin(), name.end(), [](char ch) {
                return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_';
              });
          if (!identifier) {
            fail(entry.first, p,
                 "expected an environment variable name, got " + describe(entry.first));
          }
          if (!entry.second.IsScalar()) {
            fail(entry.second, key_path, "expected a string value, got " + describe(entry.second));
          }
          if (entry.second.Scalar().find('\n') != std::string::npos) {
            fail(entry.second, key_path, "must be one line");
          }
          (*out)[name] = entry.second.Scalar();
        });
      }
    };
  }

  // OpenAI's logit_bias: token ids (checked against the vocabulary once the model is known)
  // to numbers in [-100, 100].
  Reader token_bias(std::map<int64_t, double>* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      out->clear();
      if (n.IsNull()) return;
      if (!n.IsMap()) fail(n, p, "expected a mapping of token ids to biases, got " + describe(n));
      for (const auto& entry : n) {
        guard([&] {
          const std::string id = entry.first.IsScalar() ? entry.first.Scalar() : "";
          const std::string key_path = join_path(p, id);
          if (!key_marks_.count(key_path)) key_marks_[key_path] = entry.first.Mark();
          int64_t token = -1;
          const auto parsed = std::from_chars(id.data(), id.data() + id.size(), token);
          if (id.empty() || parsed.ec != std::errc() || parsed.ptr != id.data() + id.size() || token < 0)
            fail(entry.first, p, "expected a token id (a non-negative integer), got " + describe(entry.first));
          double bias = 0.0;
          real(&bias, -100.0, false, 100.0, false)(entry.second, key_path);
          (*out)[token] = bias;
        });
      }
    };
  }

  Reader module_list(std::vector<std::string>* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      out->clear();
      if (n.IsNull() || (n.IsSequence() && n.size() == 0)) return;
      for_each_element(n, p, "a list of module names", [&](const YAML::Node& e, const std::string& ep) {
        std::string name;
        word(&name)(e, ep);
        out->push_back(name);
      });
    };
  }

  Reader cluster_section(ClusterSection* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      out->present = true;
      read_mapping(n, p, cluster_fields(*out));
    };
  }

  // A token count: an integer >= 1, a range [lo, hi] with 1 <= lo <= hi, or the name of a
  // file of counts (one integer >= 1 per line; blank lines and `#` comments skipped).
  Reader length_range(LengthRange* out) {
    return [this, out](const YAML::Node& n, const std::string& p) {
      if (n.IsSequence()) {
        if (n.size() != 2) {
          fail(n, p, "expected a positive integer or a range [lo, hi], got a list of " +
                         std::to_string(n.size()));
        }
        const int64_t lo = read_int(n[0], p + "[0]", 1, kIntMax);
        const int64_t hi = read_int(n[1], p + "[1]", 1, kIntMax);
        if (lo > hi) {
          fail(n, p, "range [" + std::to_string(lo) + ", " + std::to_string(hi) +
                         "] has lo > hi");
        }
        *out = {static_cast<int>(lo), static_cast<int>(hi), {}, {}};
        return;
      }
      int64_t number = 0;
      if (is_plain_scalar(n) && !n.Scalar().empty() && !parse_int64(n.Scalar(), &number) &&
          n.Scalar().find_first_not_of("+-0123456789.eE") != std::string::npos) {
        *out = read_length_file(n, p);
        return;
      }
      if (!is_plain_scalar(n)) {
        fail(n, p, "expected a positive integer, a range [lo, hi] or a file of lengths, got " +
                       describe(n));
      }
      const int value = static_cast<int>(read_int(n, p, 1, kIntMax));
      *out = {value, value, {}, {}};
    };
  }

  LengthRange read_length_file(const YAML::Node& n, const std::string& p) {
    const std::string file = n.Scalar();
    std::string text, error;
    if (!read_bounded_file(file, kMaxJobFileBytes, "the file of lengths", &text, &error))
      fail(n, p, file + ": " + error);
    std::istringstream in(text);
    LengthRange r;
    r.file = file;
    std::string line;
    for (int line_no = 1; std::getline(in, line); ++line_no) {
      const size_t hash = line.find('#');
      if (hash != std::string::npos) line.erase(hash);
      const size_t b = line.find_first_not_of(" \t\r");
      if (b == std::string::npos) continue;
      const std::string text = line.substr(b, line.find_last_not_of(" \t\r") - b + 1);
      int64_t v = 0;
      if (!parse_int64(text, &v) || v < 1 || v > kIntMax) {
        fail(n, p, file + ":" + std::to_string(line_no) + ": expected a positive integer, got '" +
                       text + "'");
      }
      r.values.push_back(static_cast<int>(v));
    }
    if (r.values.empty()) fail(n, p, "the file of lengths '" + file + "' has no lengths");
    r.lo = *std::min_element(r.values.begin(), r.values.end());
    r.hi = *std::max_element(r.values.begin(), r.values.end());
    return r;
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
        const int given = (e["prompt_ids"] ? 1 : 0) + (e["prompt"] ? 1 : 0) + (e["messages"] ? 1 : 0);
        if (given == 0) fail(e, ep, "required key 'prompt_ids', 'prompt' or 'messages' missing");
        if (given > 1) fail(e, ep, "give only one of 'prompt_ids', 'prompt' and 'messages'");
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

  // "90%" -> 0.9, in (0, 1].
  double read_share(const YAML::Node& node, const std::string& path) {
    const std::string text = trim(node.Scalar());
    double percent = 0.0;
    if (!parse_finite_double(trim(text.substr(0, text.size() - 1)), &percent) || percent <= 0.0 ||
        percent > 100.0) {
      fail(node, path, "expected a share in (0%, 100%], got " + describe(node));
    }
    return percent / 100.0;
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
      spec.kind = MemorySpec::Kind::kShare;
      spec.share = read_share(node, path);
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

  // "--set KEY" for anything an override wrote, else "file:line:column", else the file alone.
  Position location(const YAML::Node& node, const std::string& path) const {
    const OverrideOrigin* origin = nullptr;
    for (const OverrideOrigin& o : origins_) {
      if (path_within(path, o.path) && (!origin || o.path.size() > origin->path.size()))
        origin = &o;
    }
    if (origin) return {"--set " + origin->key};
    // A null value is marked where the next token starts; its key's position is the useful one.
    YAML::Mark mark = node.IsDefined() && !node.IsNull() ? node.Mark() : YAML::Mark::null_mark();
    const auto key_mark = key_marks_.find(path);
    if (mark.is_null() && key_mark != key_marks_.end()) mark = key_mark->second;
    if (!mark.is_null()) return at_mark(mark);
    // Mappings an override created on the way to its key have no mark.
    for (const OverrideOrigin& o : origins_) {
      if (path_within(o.path, path)) return {"--set " + o.key};
    }
    return {source_};
  }

  Position at_mark(const YAML::Mark& mark) const {
    return {source_ + ":" + std::to_string(mark.line + 1) + ":" + std::to_string(mark.column + 1),
            mark.line + 1, mark.column + 1};
  }

  void record(const Position& at, const std::string& path, const std::string& message) {
    problems_.push_back({at.where, path, at.where + ": " + message, at.line, at.column});
    failed_paths_.insert(path);
  }

  // For messages that name the key themselves (unknown or duplicate keys).
  [[noreturn]] void raise(const YAML::Node& node, const std::string& path,
                          const std::string& message) {
    record(location(node, path), path, message);
    throw Abandon{};
  }

  // "LOCATION: PATH: detail", without repeating the path when the location is `--set PATH`.
  [[noreturn]] void fail(const YAML::Node& node, const std::string& path,
                         const std::string& detail) {
    const Position at = location(node, path);
    const std::string subject = path.empty() ? "top level" : path;
    record(at, path, at.where == "--set " + path ? detail : subject + ": " + detail);
    throw Abandon{};
  }

  // A problem of a key that was read fine alone, pointed at by its key.
  [[noreturn]] void fail_at_key(const std::string& path, const std::string& detail) {
    fail(YAML::Node(), path, detail);
  }

  // For a key that is absent: blame the override that wrote its section, else point at the
  // section in the file, else at the file.
  [[noreturn]] void fail_without_node(const std::string& path, const std::string& detail) {
    const std::string section = path.substr(0, path.find('.'));
    Position at{source_};
    const auto mark = key_marks_.find(section);
    if (mark != key_marks_.end() && !mark->second.is_null()) at = at_mark(mark->second);
    for (const OverrideOrigin& o : origins_) {
      if (path_within(section, o.path)) at = {"--set " + o.key};
    }
    record(at, path, path + ": " + detail);
    throw Abandon{};
  }

  std::string source_;
  std::vector<OverrideOrigin> origins_;
  std::map<std::string, YAML::Mark> key_marks_;
  std::vector<ConfigProblem> problems_;
  std::set<std::string> failed_paths_;
};

}  // namespace

JobConfigError::JobConfigError(std::vector<ConfigProblem> problems)
    : std::invalid_argument(problems.empty() ? "invalid job config" : problems.front().message),
      problems_(std::move(problems)) {}

void throw_if_problems(const std::vector<ConfigProblem>& problems) {
  if (!problems.empty()) throw JobConfigError(problems);
}

bool is_valid_slurm_time(const std::string& text) {
  // Each field is one or two digits, except a leading day count or a lone hour count.
  auto field = [](const std::string& f, int max) {
    if (f.empty() || f.size() > 2 ||
        !std::all_of(f.begin(), f.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); }))
      return false;
    return std::stoi(f) <= max;
  };
  std::string rest = text;
  bool has_days = false;
  const size_t dash = text.find('-');
  if (dash != std::string::npos) {
    const std::string days = text.substr(0, dash);
    if (days.empty() || days.size() > 4 ||
        !std::all_of(days.begin(), days.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); }))
      return false;
    rest = text.substr(dash + 1);
    has_days = true;
  }
  std::vector<std::string> parts;
  std::stringstream stream(rest);
  for (std::string part; std::getline(stream, part, ':');) parts.push_back(part);
  if (parts.size() != 3 || rest.back() == ':') return false;
  if (!field(parts[1], 59) || !field(parts[2], 59)) return false;
  if (has_days) return field(parts[0], 23);
  const std::string& hours = parts[0];
  return !hours.empty() && hours.size() <= 5 &&
         std::all_of(hours.begin(), hours.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); });
}

int64_t parse_size(const std::string& text, const std::string& what) {
  int64_t bytes = 0;
  std::string error;
  if (!parse_size_text(text, &bytes, &error)) throw std::invalid_argument(what + ": " + error);
  return bytes;
}

namespace {

// A problem with no key path: the file as a whole, or one override.
ConfigProblem whole_file_problem(const std::string& where, int line, int column,
                                 const std::string& message) {
  return {where, "", where + ": " + message, line, column};
}

}  // namespace

namespace {

// Problems in file order; those of --set overrides (no position) after them.
void sort_problems(std::vector<ConfigProblem>* problems) {
  std::stable_sort(problems->begin(), problems->end(), [](const ConfigProblem& a, const ConfigProblem& b) {
    const auto key = [](const ConfigProblem& p) {
      return std::make_pair(p.line == 0 ? std::numeric_limits<int>::max() : p.line, p.column);
    };
    return key(a) < key(b);
  });
}

// Parses and validates; fills `out` as far as it could be read and returns every problem.
// Problems that stop reading altogether (YAML syntax, a bad override) are thrown.
std::vector<ConfigProblem> parse_collect(const std::string& yaml_text, const std::string& source,
                                         const std::vector<std::string>& overrides, JobConfig* out) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    if (e.mark.is_null()) throw JobConfigError({whole_file_problem(source, 0, 0, "malformed YAML: " + e.msg)});
    const std::string where =
        source + ":" + std::to_string(e.mark.line + 1) + ":" + std::to_string(e.mark.column + 1);
    throw JobConfigError(
        {whole_file_problem(where, e.mark.line + 1, e.mark.column + 1, "malformed YAML: " + e.msg)});
  }
  if (root.IsNull()) root.reset(YAML::Node(YAML::NodeType::Map));  // empty file: all --set
  if (!root.IsMap()) {
    const YAML::Mark mark = root.Mark();
    const std::string where =
        mark.is_null() ? source
                       : source + ":" + std::to_string(mark.line + 1) + ":" + std::to_string(mark.column + 1);
    throw JobConfigError({whole_file_problem(
        where, mark.is_null() ? 0 : mark.line + 1, mark.is_null() ? 0 : mark.column + 1,
        "expected a mapping of sections (model, runtime, parallel, cache, scheduler, sampling, speculative, "
        "requests, workload, cluster) at the top level")});
  }
  std::vector<OverrideOrigin> origins;
  for (const std::string& override_text : overrides) {
    try {
      apply_override(root, override_text, &origins);
    } catch (const std::invalid_argument& e) {
      // The message already starts with `--set KEY`.
      throw JobConfigError({ConfigProblem{"--set", "", e.what(), 0, 0}});
    }
  }
  Validator validator(source, std::move(origins));
  *out = validator.read(root);
  std::vector<ConfigProblem> problems = validator.problems();
  sort_problems(&problems);
  return problems;
}

// Reads the file into `text`; a JobConfigError when it cannot (a FIFO, a device or more than
// kMaxJobFileBytes included).
std::string read_config_file(const std::string& path) {
  std::string text, error;
  if (!read_bounded_file(path, kMaxJobFileBytes, "config file", &text, &error))
    throw JobConfigError({whole_file_problem(path, 0, 0, error)});
  return text;
}

// Adds the rank checks to problems already found: for `ranks` > 0, else for the cluster
// section's rank count when there is one.
std::vector<ConfigProblem> with_rank_checks(std::vector<ConfigProblem> problems, const JobConfig& job,
                                            int ranks) {
  if (ranks <= 0 && job.cluster.present) ranks = job.cluster.ranks();
  if (ranks > 0) {
    for (ConfigProblem& p : check_job_for_ranks(job, ranks)) problems.push_back(std::move(p));
    sort_problems(&problems);
  }
  return problems;
}

}  // namespace

JobConfig parse_job_config(const std::string& yaml_text, const std::string& source,
                           const std::vector<std::string>& overrides) {
  JobConfig job;
  throw_if_problems(parse_collect(yaml_text, source, overrides, &job));
  return job;
}

JobConfig load_job_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_job_config(read_config_file(path), path, overrides);
}

std::string job_yaml_with_overrides(const std::string& path, const std::vector<std::string>& overrides) {
  const std::string text = read_config_file(path);
  JobConfig ignored;
  throw_if_problems(parse_collect(text, path, overrides, &ignored));
  YAML::Node root = YAML::Load(text);
  if (root.IsNull()) root.reset(YAML::Node(YAML::NodeType::Map));
  std::vector<OverrideOrigin> origins;
  for (const std::string& override_text : overrides) apply_override(root, override_text, &origins);
  YAML::Emitter emitter;
  emitter << root;
  return std::string(emitter.c_str()) + "\n";
}

std::vector<ConfigProblem> validate_job_config_text(const std::string& yaml_text,
                                                    const std::string& source,
                                                    const std::vector<std::string>& overrides,
                                                    int ranks) {
  try {
    JobConfig job;
    std::vector<ConfigProblem> problems = parse_collect(yaml_text, source, overrides, &job);
    return with_rank_checks(std::move(problems), job, ranks);
  } catch (const JobConfigError& e) {
    return e.problems();
  }
}

std::vector<ConfigProblem> validate_job_config_file(const std::string& path,
                                                    const std::vector<std::string>& overrides,
                                                    int ranks) {
  try {
    return validate_job_config_text(read_config_file(path), path, overrides, ranks);
  } catch (const JobConfigError& e) {
    return e.problems();
  }
}

std::vector<ConfigProblem> check_job_for_ranks(const JobConfig& job, int ranks) {
  std::vector<ConfigProblem> problems;
  auto add = [&](const std::string& path, const std::string& detail) {
    const auto it = job.where.find(path);
    const std::string where = it == job.where.end() ? job.source : it->second;
    int line = 0, column = 0;
    // "file:LINE:COLUMN" -> the numbers, for callers that want them apart.
    const size_t last = where.rfind(':');
    const size_t middle = last == std::string::npos || last == 0 ? std::string::npos : where.rfind(':', last - 1);
    if (where.rfind("--set ", 0) != 0 && middle != std::string::npos) {
      int64_t l = 0, c = 0;
      if (parse_int64(where.substr(middle + 1, last - middle - 1), &l) && parse_int64(where.substr(last + 1), &c)) {
        line = static_cast<int>(l);
        column = static_cast<int>(c);
      }
    }
    const std::string message = where == "--set " + path ? where + ": " + detail : where + ": " + path + ": " + detail;
    problems.push_back({where, path, message, line, column});
  };
  const std::string rank_text = std::to_string(ranks) + " rank" + (ranks == 1 ? "" : "s");
  const MemorySpec& memory = job.cache.memory;
  if (memory.kind == MemorySpec::Kind::kPerRank && static_cast<int>(memory.per_rank.size()) != ranks) {
    add("cache.memory", "lists " + std::to_string(memory.per_rank.size()) + " sizes for " + rank_text +
                            " (one size per rank, or a single size for all)");
  }
  const int tensor = job.parallel.tensor;
  if (ranks % tensor != 0) {
    add("parallel.tensor", std::to_string(tensor) + " does not divide the job's " + rank_text +
                               " (ranks = stages x parallel.tensor)");
    return problems;
  }
  const int stages = ranks / tensor;
  const std::string stage_text = std::to_string(stages) + " stage" + (stages == 1 ? "" : "s");
  if (!job.parallel.layers.empty() && static_cast<int>(job.parallel.layers.size()) != stages) {
    add("parallel.layers", "pins " + std::to_string(job.parallel.layers.size()) + " stages for " +
                               (tensor == 1 ? rank_text + " (one entry per rank, or auto)"
                                            : stage_text + " (" + rank_text + " / parallel.tensor " +
                                                  std::to_string(tensor) + "; one entry per stage, or auto)"));
  }
  return problems;
}

}  // namespace kvpipe
