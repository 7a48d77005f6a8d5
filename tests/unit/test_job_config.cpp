#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <ostream>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

#include "launch/job_config.h"

namespace kvpipe {
namespace {

constexpr int64_t kKiB = 1LL << 10;
constexpr int64_t kMiB = 1LL << 20;
constexpr int64_t kGiB = 1LL << 30;

const char kMinimal[] = "model: {path: dummy:tiny}\n";

// The message of the std::invalid_argument that `fn` throws, "" (and a failure) if none.
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << "message spans lines: " << message;
    return message;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than std::invalid_argument: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

// Messages give "file:line:column"; most cases here check the line only.
std::string without_columns(const std::string& message) {
  static const std::regex kPosition(R"(^(\S*?:\d+):\d+: )");
  return std::regex_replace(message, kPosition, "$1: ");
}

std::string parse_error(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  return without_columns(error_of([&] { parse_job_config(yaml, "job.yaml", overrides); }));
}

JobConfig parse(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  return parse_job_config(yaml, "job.yaml", overrides);
}

TEST(JobConfigDefaults, MinimalFileKeepsStructDefaults) {
  const JobConfig config = parse(kMinimal);
  const JobConfig defaults;
  EXPECT_EQ(config.source, "job.yaml");
  EXPECT_EQ(config.model.path, "dummy:tiny");
  EXPECT_EQ(config.model.dtype, "auto");
  EXPECT_EQ(config.runtime.threads, 1);
  EXPECT_FALSE(config.runtime.memory_bytes.has_value());
  EXPECT_TRUE(config.parallel.layers.empty());
  EXPECT_EQ(config.parallel.micro_batches, 0);
  EXPECT_EQ(config.parallel.backend, "auto");
  EXPECT_EQ(config.cache.block_size, 16);
  EXPECT_EQ(config.cache.memory.kind, MemorySpec::Kind::kBytes);
  EXPECT_EQ(config.cache.memory.bytes, 256 * kMiB);
  EXPECT_TRUE(config.cache.prefix_reuse);
  EXPECT_EQ(config.cache.cached_layers, -1);
  EXPECT_EQ(config.cache.window_sinks, 0);
  EXPECT_EQ(config.cache.window_recent, 0);
  EXPECT_EQ(config.scheduler.max_batch, defaults.scheduler.max_batch);
  EXPECT_EQ(config.scheduler.max_tokens_per_step, defaults.scheduler.max_tokens_per_step);
  EXPECT_EQ(config.sampling.temperature, 0.0);
  EXPECT_EQ(config.sampling.top_k, 0);
  EXPECT_EQ(config.sampling.top_p, 1.0);
  EXPECT_EQ(config.sampling.seed, 0u);
  EXPECT_FALSE(config.sampling.ignore_eos);
  EXPECT_TRUE(config.requests.empty());
}

TEST(JobConfigDefaults, EmptySectionsAndEmptyRequestListAreAllowed) {
  const JobConfig config = parse("model: {path: m}\ncache:\nsampling: {}\nrequests: []\n");
  EXPECT_EQ(config.cache.block_size, 16);
  EXPECT_TRUE(config.requests.empty());
}

TEST(JobConfigDefaults, KeywordsMapToSentinels) {
  const JobConfig config = parse(
      "model: {path: m}\n"
      "runtime: {memory: auto}\n"
      "parallel: {layers: auto, micro_batches: auto, backend: auto}\n"
      "cache: {cached_layers: all}\n");
  EXPECT_FALSE(config.runtime.memory_bytes.has_value());
  EXPECT_TRUE(config.parallel.layers.empty());
  EXPECT_EQ(config.parallel.micro_batches, 0);
  EXPECT_EQ(config.cache.cached_layers, -1);
}

TEST(JobConfigParse, FullFile) {
  const JobConfig config = parse(R"(# every key, none at its default
model:
  path: /models/llama-7b
  dtype: bfloat16
runtime:
  threads: 8
  memory: 16GiB
parallel:
  layers: [3, 2, 2]
  micro_batches: 4
  backend: nccl
cache:
  block_size: 32
  memory: [1GiB, 512MiB, 512MiB]
  prefix_reuse: false
  cached_layers: 5
  window: {sinks: 4, recent: 1020}
scheduler:
  max_batch: 8
  max_tokens_per_step: 512
sampling:
  temperature: 0.7
  top_k: 40
  top_p: 0.95
  seed: 18446744073709551615
  ignore_eos: true
requests:
  - prompt_ids: [1, 2, 3]
    max_new_tokens: 16
    arrival_step: 2
  - {prompt_ids: [7]}
)");
  EXPECT_EQ(config.model.path, "/models/llama-7b");
  EXPECT_EQ(config.model.dtype, "bfloat16");
  EXPECT_EQ(config.runtime.threads, 8);
  ASSERT_TRUE(config.runtime.memory_bytes.has_value());
  EXPECT_EQ(*config.runtime.memory_bytes, 16 * kGiB);
  EXPECT_EQ(config.parallel.layers, (std::vector<int>{3, 2, 2}));
  EXPECT_EQ(config.parallel.micro_batches, 4);
  EXPECT_EQ(config.parallel.backend, "nccl");
  EXPECT_EQ(config.cache.block_size, 32);
  EXPECT_EQ(config.cache.memory.kind, MemorySpec::Kind::kPerRank);
  EXPECT_EQ(config.cache.memory.per_rank, (std::vector<int64_t>{kGiB, 512 * kMiB, 512 * kMiB}));
  EXPECT_FALSE(config.cache.prefix_reuse);
  EXPECT_EQ(config.cache.cached_layers, 5);
  EXPECT_EQ(config.cache.window_sinks, 4);
  EXPECT_EQ(config.cache.window_recent, 1020);
  EXPECT_EQ(config.scheduler.max_batch, 8);
  EXPECT_EQ(config.scheduler.max_tokens_per_step, 512);
  EXPECT_DOUBLE_EQ(config.sampling.temperature, 0.7);
  EXPECT_EQ(config.sampling.top_k, 40);
  EXPECT_DOUBLE_EQ(config.sampling.top_p, 0.95);
  EXPECT_EQ(config.sampling.seed, 18446744073709551615ULL);
  EXPECT_TRUE(config.sampling.ignore_eos);
  ASSERT_EQ(config.requests.size(), 2u);
  EXPECT_EQ(config.requests[0].prompt_ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(config.requests[0].max_new_tokens, 16);
  EXPECT_EQ(config.requests[0].arrival_step, 2);
  EXPECT_EQ(config.requests[1].prompt_ids, (std::vector<int64_t>{7}));
  EXPECT_EQ(config.requests[1].max_new_tokens, 32);
  EXPECT_EQ(config.requests[1].arrival_step, 0);
}

TEST(JobConfigParse, SpeculativeSection) {
  const JobConfig defaults = parse(kMinimal);
  EXPECT_EQ(defaults.speculative.method, "off");
  EXPECT_EQ(defaults.speculative.num_tokens, 4);
  const JobConfig c = parse(std::string(kMinimal) +
                            "speculative: {method: ngram, num_tokens: 6, ngram: {min: 2, max: 3}, max_batch: 2}\n");
  EXPECT_EQ(c.speculative.method, "ngram");
  EXPECT_EQ(c.speculative.num_tokens, 6);
  EXPECT_EQ(c.speculative.ngram_min, 2);
  EXPECT_EQ(c.speculative.ngram_max, 3);
  EXPECT_EQ(c.speculative.max_batch, 2);
}

TEST(JobConfigParse, GgufPathAndIntegerTemperature) {
  const JobConfig config =
      parse("model: {path: ./tiny.gguf, dtype: float16}\nsampling: {temperature: 1, top_p: 1}\n");
  EXPECT_EQ(config.model.path, "./tiny.gguf");
  EXPECT_EQ(config.model.dtype, "float16");
  EXPECT_EQ(config.sampling.temperature, 1.0);
}

TEST(JobConfigParse, LoadsFromFile) {
  const std::string path = ::testing::TempDir() + "job_config_test_load.yaml";
  {
    std::ofstream out(path);
    out << "model:\n  path: dummy:tiny\ncache:\n  block_size: 8\n";
  }
  const JobConfig config = load_job_config(path, {"cache.memory=64MiB"});
  EXPECT_EQ(config.source, path);
  EXPECT_EQ(config.cache.block_size, 8);
  EXPECT_EQ(config.cache.memory.bytes, 64 * kMiB);

  const std::string message = error_of([&] { load_job_config(path, {"cache.block_size=0"}); });
  EXPECT_NE(message.find("--set cache.block_size"), std::string::npos) << message;
  std::remove(path.c_str());
}

TEST(JobConfigParse, FileErrorsNameThePathAndLine) {
  const std::string path = ::testing::TempDir() + "job_config_test_bad.yaml";
  {
    std::ofstream out(path);
    out << "model:\n  path: dummy:tiny\nscheduler:\n  max_batch: -3\n";
  }
  const std::string message = error_of([&] { load_job_config(path); });
  EXPECT_EQ(message.rfind(path + ":4:14: scheduler.max_batch: ", 0), 0u) << message;
  std::remove(path.c_str());
}

TEST(JobConfigParse, MissingFile) {
  const std::string message = error_of([] { load_job_config("/nonexistent/job.yaml"); });
  EXPECT_EQ(message, "/nonexistent/job.yaml: cannot open config file");
}

TEST(JobConfigParse, OnlyRegularFilesOfBoundedSizeAreRead) {
  // A device never ends and a FIFO blocks its reader: both are refused before a byte is read.
  EXPECT_EQ(error_of([] { load_job_config("/dev/zero"); }).rfind("/dev/zero: cannot read config file: not a regular file", 0), 0u);
  EXPECT_NE(error_of([] { load_job_config("/tmp"); }).find("/tmp: cannot open config file: it is a directory"),
            std::string::npos);
  const std::string path = ::testing::TempDir() + "job_config_test_huge.yaml";
  {
    std::ofstream out(path);
    out << "model: {path: dummy:tiny}\n" << std::string((16 << 20) + 1, '#') << "\n";
  }
  EXPECT_EQ(error_of([&] { load_job_config(path); }), path + ": larger than 16 MiB (a job's files are read whole)");
  std::remove(path.c_str());
}

TEST(JobConfigSize, Units) {
  EXPECT_EQ(parse_size("4096", "x"), 4096);
  EXPECT_EQ(parse_size("0", "x"), 0);
  EXPECT_EQ(parse_size("4096B", "x"), 4096);
  EXPECT_EQ(parse_size("512KiB", "x"), 512 * kKiB);
  EXPECT_EQ(parse_size("256MiB", "x"), 256 * kMiB);
  EXPECT_EQ(parse_size("1GiB", "x"), kGiB);
  EXPECT_EQ(parse_size("2TiB", "x"), 2048 * kGiB);
  EXPECT_EQ(parse_size("3K", "x"), 3 * kKiB);
  EXPECT_EQ(parse_size("3M", "x"), 3 * kMiB);
  EXPECT_EQ(parse_size("3G", "x"), 3 * kGiB);
  EXPECT_EQ(parse_size("1KB", "x"), 1000);
  EXPECT_EQ(parse_size("100MB", "x"), 100000000);
  EXPECT_EQ(parse_size("1GB", "x"), 1000000000);
  EXPECT_EQ(parse_size("1 GiB", "x"), kGiB);
}

TEST(JobConfigSize, DecimalsRoundDown) {
  EXPECT_EQ(parse_size("1.5GiB", "x"), 3 * kGiB / 2);
  EXPECT_EQ(parse_size("0.5KiB", "x"), 512);
  EXPECT_EQ(parse_size("0.1KB", "x"), 100);
  EXPECT_EQ(parse_size(".25MiB", "x"), kMiB / 4);
  EXPECT_EQ(parse_size("1.9", "x"), 1);
  EXPECT_EQ(parse_size("1.0009KB", "x"), 1000);
  EXPECT_EQ(parse_size("9223372036854775807", "x"), INT64_MAX);
}

TEST(JobConfigSize, ErrorsNameWhat) {
  for (const std::string text :
       {"", "-1", "-1GiB", "abc", "GiB", "1.5.5GiB", "1.GiB", "1gib", "1 GiBs", "1e3", "0x10",
        "99999999999GiB", "9223372036854775808", "100000000000000000000", "+5"}) {
    const std::string message = error_of([&] { parse_size(text, "cache.memory"); });
    EXPECT_EQ(message.rfind("cache.memory: ", 0), 0u) << "'" << text << "': " << message;
  }
  EXPECT_NE(error_of([] { parse_size("-1GiB", "m"); }).find("negative"), std::string::npos);
  EXPECT_NE(error_of([] { parse_size("99999999999GiB", "m"); }).find("too large"),
            std::string::npos);
}

TEST(JobConfigCacheMemory, Bytes) {
  const JobConfig config = parse("model: {path: m}\ncache: {memory: 1.5GiB}\n");
  EXPECT_EQ(config.cache.memory.kind, MemorySpec::Kind::kBytes);
  EXPECT_EQ(config.cache.memory.bytes, 3 * kGiB / 2);
}

TEST(JobConfigCacheMemory, PerRank) {
  const JobConfig config = parse("model: {path: m}\ncache: {memory: [1GiB, 512MiB]}\n");
  EXPECT_EQ(config.cache.memory.kind, MemorySpec::Kind::kPerRank);
  EXPECT_EQ(config.cache.memory.per_rank, (std::vector<int64_t>{kGiB, 512 * kMiB}));
}

TEST(JobConfigCacheMemory, Share) {
  JobConfig config = parse("model: {path: m}\ncache: {memory: 90%}\n");
  EXPECT_EQ(config.cache.memory.kind, MemorySpec::Kind::kShare);
  EXPECT_DOUBLE_EQ(config.cache.memory.share, 0.9);
  config = parse("model: {path: m}\ncache: {memory: \"100%\"}\n");
  EXPECT_DOUBLE_EQ(config.cache.memory.share, 1.0);
  config = parse("model: {path: m}\ncache: {memory: 12.5%}\n");
  EXPECT_DOUBLE_EQ(config.cache.memory.share, 0.125);
}

TEST(JobConfigCacheMemory, BadShares) {
  for (const std::string share : {"0%", "150%", "-5%", "abc%", "%", "1e999%"}) {
    const std::string message =
        parse_error("model: {path: m}\ncache:\n  memory: \"" + share + "\"\n");
    EXPECT_EQ(message.rfind("job.yaml:3: cache.memory: ", 0), 0u) << share << ": " << message;
  }
}

TEST(JobConfigOverrides, Scalars) {
  const JobConfig config =
      parse(kMinimal, {"cache.memory=64MiB", "sampling.temperature=0.7", "cache.block_size=8",
                       "model.dtype=float16", "cache.prefix_reuse=false"});
  EXPECT_EQ(config.cache.memory.kind, MemorySpec::Kind::kBytes);
  EXPECT_EQ(config.cache.memory.bytes, 64 * kMiB);
  EXPECT_DOUBLE_EQ(config.sampling.temperature, 0.7);
  EXPECT_EQ(config.cache.block_size, 8);
  EXPECT_EQ(config.model.dtype, "float16");
  EXPECT_FALSE(config.cache.prefix_reuse);
}

TEST(JobConfigOverrides, ReplaceFileValues) {
  const JobConfig config =
      parse("model: {path: a}\ncache: {block_size: 32, memory: [1GiB, 1GiB]}\n",
            {"model.path=dummy:small", "cache.memory=50%"});
  EXPECT_EQ(config.model.path, "dummy:small");
  EXPECT_EQ(config.cache.block_size, 32);
  EXPECT_EQ(config.cache.memory.kind, MemorySpec::Kind::kShare);
  EXPECT_DOUBLE_EQ(config.cache.memory.share, 0.5);
}

TEST(JobConfigOverrides, Lists) {
  const JobConfig config =
      parse(kMinimal, {"parallel.layers=[3,2,2]", "cache.memory=[1GiB, 2GiB]"});
  EXPECT_EQ(config.parallel.layers, (std::vector<int>{3, 2, 2}));
  EXPECT_EQ(config.cache.memory.kind, MemorySpec::Kind::kPerRank);
  EXPECT_EQ(config.cache.memory.per_rank, (std::vector<int64_t>{kGiB, 2 * kGiB}));
}

TEST(JobConfigOverrides, CreatesNestedSections) {
  const JobConfig config = parse(kMinimal, {"cache.window.sinks=4", "cache.window.recent=60"});
  EXPECT_EQ(config.cache.window_sinks, 4);
  EXPECT_EQ(config.cache.window_recent, 60);

  const JobConfig from_nothing = parse("", {"model.path=dummy:tiny", "runtime.threads=2"});
  EXPECT_EQ(from_nothing.model.path, "dummy:tiny");
  EXPECT_EQ(from_nothing.runtime.threads, 2);
}

TEST(JobConfigOverrides, RequestList) {
  const JobConfig config = parse(
      std::string(kMinimal) + "requests: [{prompt_ids: [9]}]\n",
      {"requests=[{prompt_ids: [1,2], max_new_tokens: 4}, {prompt_ids: [3], arrival_step: 5}]"});
  ASSERT_EQ(config.requests.size(), 2u);
  EXPECT_EQ(config.requests[0].prompt_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(config.requests[0].max_new_tokens, 4);
  EXPECT_EQ(config.requests[1].arrival_step, 5);
}

TEST(JobConfigOverrides, IndexIntoList) {
  const JobConfig config =
      parse(std::string(kMinimal) + "requests: [{prompt_ids: [9]}]\n",
            {"requests.0.max_new_tokens=8", "parallel.layers=[1,1]", "parallel.layers.1=5"});
  EXPECT_EQ(config.requests[0].max_new_tokens, 8);
  EXPECT_EQ(config.parallel.layers, (std::vector<int>{1, 5}));
}

TEST(JobConfigOverrides, AppliedInOrder) {
  EXPECT_EQ(parse(kMinimal, {"cache={block_size: 8}", "cache.block_size=4"}).cache.block_size, 4);
  const JobConfig config = parse(kMinimal, {"cache.block_size=4", "cache={memory: 1GiB}"});
  EXPECT_EQ(config.cache.block_size, 16);
  EXPECT_EQ(config.cache.memory.bytes, kGiB);
  EXPECT_EQ(parse(kMinimal, {" cache.block_size = 64"}).cache.block_size, 64);
}

TEST(JobConfigOverrides, UnknownKeySaysSet) {
  const std::string message = parse_error(kMinimal, {"cache.blok_size=4"});
  EXPECT_EQ(message.rfind("--set cache.blok_size: unknown key 'cache.blok_size'", 0), 0u)
      << message;
  EXPECT_NE(message.find("did you mean 'cache.block_size'"), std::string::npos) << message;
  EXPECT_EQ(message.find("job.yaml"), std::string::npos) << message;
}

TEST(JobConfigOverrides, ErrorsPointAtTheOverride) {
  struct Case {
    std::vector<std::string> overrides;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {{"cache.block_size=abc"}, {"--set cache.block_size: ", "\"abc\""}},
      {{"cache.memory=-1GiB"}, {"--set cache.memory: ", "negative"}},
      {{"requests=[{prompt_ids: [1], max_new_tokenz: 4}]"},
       {"--set requests: ", "unknown key 'requests[0].max_new_tokenz'"}},
      {{"requests=[{max_new_tokens: 4}]"}, {"--set requests: ", "requests[0]", "prompt_ids"}},
      {{"foo.bar=1"}, {"--set foo.bar: ", "unknown section 'foo'"}},
      {{"cache.window.sink=1"}, {"--set cache.window.sink: ", "'cache.window.sink'"}},
      {{"cache.memory"}, {"--set \"cache.memory\"", "KEY=VALUE"}},
      {{"=5"}, {"--set \"=5\"", "KEY=VALUE"}},
      {{"cache..block_size=5"}, {"--set cache..block_size: ", "malformed key"}},
      {{"cache.memory=[1GiB"}, {"--set cache.memory: ", "malformed value"}},
      {{"requests.3.max_new_tokens=1"}, {"--set requests.3.max_new_tokens: ", "requests"}},
      {{"model.path="}, {"--set model.path: ", "expected a string"}},
  };
  for (const Case& c : cases) {
    const std::string message = parse_error(kMinimal, c.overrides);
    for (const std::string& part : c.expected) {
      EXPECT_NE(message.find(part), std::string::npos)
          << c.overrides[0] << ": '" << part << "' not in: " << message;
    }
    EXPECT_EQ(message.find("job.yaml:"), std::string::npos) << message;
  }
}

TEST(JobConfigParse, RequestsAsTextAndMessagesAndStopStrings) {
  const JobConfig c = parse(std::string(kMinimal) +
                            "sampling: {stop: [\"\\n\\n\", \"<|end|>\"]}\n"
                            "requests:\n"
                            "  - {prompt: \"Hello, world\", max_new_tokens: 4}\n"
                            "  - messages: [{role: system, content: Be brief.}, {role: user, content: \"Hi\"}]\n"
                            "  - {prompt_ids: [1, 2]}\n");
  EXPECT_EQ(c.sampling.stop, (std::vector<std::string>{"\n\n", "<|end|>"}));
  ASSERT_EQ(c.requests.size(), 3u);
  EXPECT_EQ(c.requests[0].prompt.value_or(""), "Hello, world");
  EXPECT_TRUE(c.requests[0].prompt_ids.empty());
  ASSERT_EQ(c.requests[1].messages.size(), 2u);
  EXPECT_EQ(c.requests[1].messages[0].role, "system");
  EXPECT_EQ(c.requests[1].messages[0].content, "Be brief.");
  EXPECT_EQ(c.requests[1].messages[1].content, "Hi");
  EXPECT_FALSE(c.requests[2].prompt.has_value());
  EXPECT_EQ(c.requests[2].prompt_ids, (std::vector<int64_t>{1, 2}));
  // One stop string alone, as OpenAI's `stop` allows.
  EXPECT_EQ(parse(std::string(kMinimal) + "sampling: {stop: END}\n").sampling.stop,
            (std::vector<std::string>{"END"}));
}

TEST(JobConfigParse, PenaltiesBiasAndBadWords) {
  const JobConfig c = parse(std::string(kMinimal) +
                            "sampling:\n  min_p: 0.05\n  presence_penalty: -0.5\n  frequency_penalty: 1.5\n"
                            "  repetition_penalty: 1.2\n  min_tokens: 4\n  logit_bias: {17: -100, 3: 2.5}\n"
                            "  bad_words: [Paris, \"New York\"]\n");
  EXPECT_DOUBLE_EQ(c.sampling.min_p, 0.05);
  EXPECT_DOUBLE_EQ(c.sampling.presence_penalty, -0.5);
  EXPECT_DOUBLE_EQ(c.sampling.frequency_penalty, 1.5);
  EXPECT_DOUBLE_EQ(c.sampling.repetition_penalty, 1.2);
  EXPECT_EQ(c.sampling.min_tokens, 4);
  EXPECT_EQ(c.sampling.logit_bias, (std::map<int64_t, double>{{3, 2.5}, {17, -100.0}}));
  EXPECT_EQ(c.sampling.bad_words, (std::vector<std::string>{"Paris", "New York"}));
  const JobConfig defaults = parse(kMinimal);
  EXPECT_EQ(defaults.sampling.repetition_penalty, 1.0);
  EXPECT_TRUE(defaults.sampling.logit_bias.empty());
  for (const auto& [yaml, key] : std::vector<std::pair<std::string, std::string>>{
           {"sampling: {logit_bias: {x: 1}}\n", "sampling.logit_bias"},
           {"sampling: {logit_bias: {-3: 1}}\n", "sampling.logit_bias"},
           {"sampling: {logit_bias: {4: 101}}\n", "sampling.logit_bias.4"},
           {"sampling: {logit_bias: [1, 2]}\n", "sampling.logit_bias"},
           {"sampling: {repetition_penalty: 0}\n", "sampling.repetition_penalty"},
           {"sampling: {presence_penalty: 2.5}\n", "sampling.presence_penalty"},
           {"sampling: {min_p: 1.5}\n", "sampling.min_p"},
           {"sampling: {min_tokens: -1}\n", "sampling.min_tokens"}}) {
    const std::string message = parse_error(std::string(kMinimal) + yaml);
    EXPECT_NE(message.find(key), std::string::npos) << yaml << " -> " << message;
  }
}

TEST(JobConfigOverrides, FileErrorsKeepTheirLine) {
  const std::string message =
      parse_error("model: {path: m}\ncache:\n  block_size: 0\n", {"cache.memory=1GiB"});
  EXPECT_EQ(message.rfind("job.yaml:3: cache.block_size: ", 0), 0u) << message;
}

// One malformed config: what is parsed, and what the message must contain.
struct MalformedCase {
  const char* name;
  std::string yaml;
  std::vector<std::string> expected;
};

void PrintTo(const MalformedCase& c, std::ostream* out) {
  *out << c.name;
}

class JobConfigMalformed : public ::testing::TestWithParam<MalformedCase> {};

TEST_P(JobConfigMalformed, ThrowsNamingKeyAndLine) {
  const MalformedCase& c = GetParam();
  const std::string message = parse_error(c.yaml);
  for (const std::string& part : c.expected) {
    EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
  }
}

const std::string kModel = "model:\n  path: dummy:tiny\n";  // two lines

INSTANTIATE_TEST_SUITE_P(
    Cases, JobConfigMalformed,
    ::testing::Values(
        MalformedCase{"MalformedYaml",
                      "model: {path: m}\ncache: [1,\nx: 2\n",
                      {"job.yaml:", "malformed YAML"}},
        MalformedCase{"TopLevelList", "- 1\n- 2\n", {"job.yaml:1: ", "top level"}},
        MalformedCase{"TopLevelScalar", "hello\n", {"job.yaml:1: ", "mapping"}},
        MalformedCase{"UnknownSection",
                      kModel + "cahce:\n  block_size: 8\n",
                      {"job.yaml:3: ", "unknown section 'cahce'", "did you mean 'cache'"}},
        MalformedCase{"UnknownKey",
                      kModel + "cache:\n  blok_size: 8\n",
                      {"job.yaml:4: unknown key 'cache.blok_size' (did you mean "
                       "'cache.block_size'?)"}},
        MalformedCase{"UnknownKeyNoSuggestion",
                      kModel + "scheduler: {frobnicate: 1}\n",
                      {"job.yaml:3: ", "'scheduler.frobnicate'", "max_batch"}},
        MalformedCase{"UnknownWindowKey",
                      kModel + "cache:\n  window:\n    sink: 4\n",
                      {"job.yaml:5: ", "'cache.window.sink'", "did you mean 'cache.window.sinks'"}},
        MalformedCase{"UnknownRequestKey",
                      kModel + "requests:\n  - prompt_ids: [1]\n    max_tokens: 3\n",
                      {"job.yaml:5: ", "'requests[0].max_tokens'"}},
        MalformedCase{"RequestWithTwoPrompts",
                      kModel + "requests:\n  - {prompt_ids: [1], prompt: hi}\n",
                      {"job.yaml:4: ", "requests[0]", "only one of"}},
        MalformedCase{"RequestPromptEmpty",
                      kModel + "requests:\n  - {prompt: \"\"}\n",
                      {"job.yaml:4: ", "requests[0].prompt", "must not be empty"}},
        MalformedCase{"MessageWithoutContent",
                      kModel + "requests:\n  - messages: [{role: user}]\n",
                      {"job.yaml:4: ", "requests[0].messages[0]", "'content' missing"}},
        MalformedCase{"MessageUnknownKey",
                      kModel + "requests:\n  - messages: [{role: user, content: hi, name: x}]\n",
                      {"job.yaml:4: ", "'requests[0].messages[0].name'"}},
        MalformedCase{"MessagesNotAList",
                      kModel + "requests:\n  - messages: hello\n",
                      {"job.yaml:4: ", "requests[0].messages", "list of messages"}},
        MalformedCase{"SpeculativeDraftMethodWithoutModel",
                      kModel + "speculative: {method: draft}\n",
                      {"job.yaml:3: ", "speculative.method", "draft needs speculative.model"}},
        MalformedCase{"SpeculativeModelWithoutDraftMethod",
                      kModel + "speculative:\n  method: ngram\n  model: small.gguf\n",
                      {"job.yaml:5: ", "speculative.model", "read only by method draft", "ngram"}},
        MalformedCase{"SpeculativeUnknownMethod",
                      kModel + "speculative: {method: medusa}\n",
                      {"job.yaml:3: ", "speculative.method", "ngram"}},
        MalformedCase{"SpeculativeNgramMinAboveMax",
                      kModel + "speculative:\n  method: ngram\n  ngram: {min: 5, max: 2}\n",
                      {"job.yaml:5: ", "speculative.ngram.min", "must not exceed", "(2)"}},
        MalformedCase{"SpeculativeZeroTokens",
                      kModel + "speculative: {method: ngram, num_tokens: 0}\n",
                      {"job.yaml:3: ", "speculative.num_tokens"}},
        MalformedCase{"StopNotStrings",
                      kModel + "sampling: {stop: [[1]]}\n",
                      {"job.yaml:3: ", "sampling.stop[0]", "expected a string"}},
        MalformedCase{"StopEmptyString",
                      kModel + "sampling: {stop: [\"\"]}\n",
                      {"job.yaml:3: ", "sampling.stop[0]", "must not be empty"}},
        MalformedCase{"DuplicateKey",
                      kModel + "cache:\n  block_size: 8\n  block_size: 16\n",
                      {"job.yaml:5: ", "duplicate key 'cache.block_size'"}},
        MalformedCase{
            "SectionNotMapping", kModel + "cache: 5\n", {"job.yaml:3: cache: expected a mapping"}},
        MalformedCase{"BlockSizeString",
                      kModel + "cache:\n  block_size: abc\n",
                      {"job.yaml:4: cache.block_size: expected ", "got \"abc\""}},
        MalformedCase{"BlockSizeFloat",
                      kModel + "cache: {block_size: 1.5}\n",
                      {"job.yaml:3: cache.block_size: ", "\"1.5\""}},
        MalformedCase{"BlockSizeQuoted",
                      kModel + "cache: {block_size: \"16\"}\n",
                      {"job.yaml:3: cache.block_size: ", "string \"16\""}},
        MalformedCase{"BlockSizeList",
                      kModel + "cache: {block_size: [16]}\n",
                      {"job.yaml:3: cache.block_size: ", "got a list"}},
        MalformedCase{"BlockSizeZero",
                      kModel + "cache: {block_size: 0}\n",
                      {"job.yaml:3: cache.block_size: ", "[1, 1024]"}},
        MalformedCase{"BlockSizeTooLarge",
                      kModel + "cache: {block_size: 2048}\n",
                      {"job.yaml:3: cache.block_size: "}},
        MalformedCase{"BlockSizeNull",
                      kModel + "cache:\n  block_size:\n  memory: 1GiB\n",
                      {"job.yaml:4: cache.block_size: ", "got null"}},
        MalformedCase{
            "ModelPathMissing", "model:\n  dtype: float16\n", {"job.yaml:1: model.path: required"}},
        MalformedCase{
            "ModelSectionMissing", "cache: {block_size: 8}\n", {"job.yaml: model.path: required"}},
        MalformedCase{"ModelPathEmpty",
                      "model: {path: \"\"}\n",
                      {"job.yaml:1: model.path: must not be empty"}},
        MalformedCase{"ModelPathList",
                      "model:\n  path: [a, b]\n",
                      {"job.yaml:2: model.path: expected a string"}},
        MalformedCase{"UnknownDtype",
                      kModel + "  dtype: float6\n",
                      {"job.yaml:3: model.dtype: ", "\"float6\"", "did you mean 'float16'"}},
        MalformedCase{"UnknownBackend",
                      kModel + "parallel: {backend: gloo}\n",
                      {"job.yaml:3: parallel.backend: ", "auto, mpi, nccl"}},
        MalformedCase{
            "ThreadsZero", kModel + "runtime: {threads: 0}\n", {"job.yaml:3: runtime.threads: "}},
        MalformedCase{"RuntimeMemoryGarbage",
                      kModel + "runtime: {memory: lots}\n",
                      {"job.yaml:3: runtime.memory: ", "\"lots\""}},
        MalformedCase{"LayersZero",
                      kModel + "parallel:\n  layers:\n    - 3\n    - 0\n",
                      {"job.yaml:6: parallel.layers[1]: ", "positive"}},
        MalformedCase{
            "LayersEmpty", kModel + "parallel: {layers: []}\n", {"job.yaml:3: parallel.layers: "}},
        MalformedCase{"LayersScalar",
                      kModel + "parallel: {layers: 3}\n",
                      {"job.yaml:3: parallel.layers: ", "list"}},
        MalformedCase{"MicroBatchesZero",
                      kModel + "parallel: {micro_batches: 0}\n",
                      {"job.yaml:3: parallel.micro_batches: ", "auto or an integer in [1, 1024]"}},
        MalformedCase{"NegativeCacheMemory",
                      kModel + "cache: {memory: -1GiB}\n",
                      {"job.yaml:3: cache.memory: ", "negative"}},
        MalformedCase{"ZeroCacheMemory",
                      kModel + "cache: {memory: 0}\n",
                      {"job.yaml:3: cache.memory: ", "positive"}},
        MalformedCase{"PerRankBadElement",
                      kModel + "cache:\n  memory:\n    - 1GiB\n    - big\n",
                      {"job.yaml:6: cache.memory[1]: ", "\"big\""}},
        MalformedCase{"CacheMemoryMapping",
                      kModel + "cache: {memory: {a: 1}}\n",
                      {"job.yaml:3: cache.memory: ", "got a mapping"}},
        MalformedCase{"CachedLayersNegative",
                      kModel + "cache: {cached_layers: -1}\n",
                      {"job.yaml:3: cache.cached_layers: ", "all or a non-negative integer"}},
        MalformedCase{"WindowSinksNegative",
                      kModel + "cache: {window: {sinks: -1}}\n",
                      {"job.yaml:3: cache.window.sinks: "}},
        MalformedCase{"PrefixReuseNotBool",
                      kModel + "cache: {prefix_reuse: maybe}\n",
                      {"job.yaml:3: cache.prefix_reuse: ", "true or false"}},
        MalformedCase{"MaxBatchZero",
                      kModel + "scheduler: {max_batch: 0}\n",
                      {"job.yaml:3: scheduler.max_batch: "}},
        MalformedCase{"MaxTokensFloat",
                      kModel + "scheduler: {max_tokens_per_step: 2e3}\n",
                      {"job.yaml:3: scheduler.max_tokens_per_step: "}},
        MalformedCase{"IntOverflow",
                      kModel + "scheduler: {max_batch: 99999999999}\n",
                      {"job.yaml:3: scheduler.max_batch: "}},
        MalformedCase{"NegativeTemperature",
                      kModel + "sampling: {temperature: -0.1}\n",
                      {"job.yaml:3: sampling.temperature: "}},
        MalformedCase{"InfiniteTemperature",
                      kModel + "sampling: {temperature: .inf}\n",
                      {"job.yaml:3: sampling.temperature: "}},
        MalformedCase{"TopPZero",
                      kModel + "sampling: {top_p: 0}\n",
                      {"job.yaml:3: sampling.top_p: ", "(0, 1]"}},
        MalformedCase{
            "TopPAboveOne", kModel + "sampling: {top_p: 1.5}\n", {"job.yaml:3: sampling.top_p: "}},
        MalformedCase{
            "TopKNegative", kModel + "sampling: {top_k: -1}\n", {"job.yaml:3: sampling.top_k: "}},
        MalformedCase{
            "SeedNegative", kModel + "sampling: {seed: -1}\n", {"job.yaml:3: sampling.seed: "}},
        MalformedCase{"RequestsMapping",
                      kModel + "requests: {prompt_ids: [1]}\n",
                      {"job.yaml:3: requests: ", "list"}},
        MalformedCase{"RequestNotMapping",
                      kModel + "requests: [5]\n",
                      {"job.yaml:3: requests[0]: ", "mapping"}},
        MalformedCase{"RequestWithoutPrompt",
                      kModel + "requests:\n  - prompt_ids: [1]\n  - max_new_tokens: 4\n",
                      {"job.yaml:5: requests[1]: ", "'prompt_ids', 'prompt' or 'messages' missing"}},
        MalformedCase{"PromptEmpty",
                      kModel + "requests: [{prompt_ids: []}]\n",
                      {"job.yaml:3: requests[0].prompt_ids: ", "non-empty"}},
        MalformedCase{"PromptNegativeToken",
                      kModel + "requests: [{prompt_ids: [1, -2]}]\n",
                      {"job.yaml:3: requests[0].prompt_ids[1]: "}},
        MalformedCase{"PromptString",
                      kModel + "requests: [{prompt_ids: hello}]\n",
                      {"job.yaml:3: requests[0].prompt_ids: "}},
        MalformedCase{"MaxNewTokensZero",
                      kModel + "requests: [{prompt_ids: [1], max_new_tokens: 0}]\n",
                      {"job.yaml:3: requests[0].max_new_tokens: "}},
        MalformedCase{"ArrivalNegative",
                      kModel + "requests: [{prompt_ids: [1], arrival_step: -1}]\n",
                      {"job.yaml:3: requests[0].arrival_step: "}}),
    [](const ::testing::TestParamInfo<MalformedCase>& info) { return info.param.name; });

}  // namespace
}  // namespace kvpipe
