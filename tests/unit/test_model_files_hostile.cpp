// Model files as a hostile user hands them over: a GGUF whose header is off by one tensor,
// overlapping or unaccounted tensor data, byte counts that overflow, non-finite or absurd
// hyper-parameters, config.json keys of the wrong type, FIFOs and directories where a file
// belongs, shard paths that leave the model's folder, numbers JSON cannot hold, and a file
// truncated while mapped. Each is refused with one line naming the file and the key or
// tensor, quickly, both by the loaders and through the `kvpipe` binary (exit code 2).
#include <ATen/ATen.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/model/gguf.h"
#include "engine/model/mapped_file.h"
#include "engine/model/model_config.h"
#include "engine/model/model_weights.h"
#include "engine/model/safetensors.h"
#include "launch/init_model.h"
#include "tests/support/command.h"

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;

ModelConfig small_config() {
  ModelConfig c = preset_config("tiny");
  c.vocab_size = 300;
  c.hidden_size = 64;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.intermediate_size = 96;
  c.max_position = 128;
  return c;
}

// The message of the std::invalid_argument `f` throws; a failure when it throws nothing,
// something else, or a message of more than one line.
std::string refusal(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    return what;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected std::invalid_argument, got: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected std::invalid_argument, nothing was thrown";
  return {};
}

::testing::AssertionResult mentions(const std::string& message, const std::vector<std::string>& parts) {
  for (const std::string& p : parts)
    if (message.find(p) == std::string::npos)
      return ::testing::AssertionFailure() << "\"" << message << "\" lacks \"" << p << "\"";
  return ::testing::AssertionSuccess();
}

template <typename T>
void patch(std::string& bytes, size_t at, T value) {
  ASSERT_LE(at + sizeof(T), bytes.size());
  std::memcpy(&bytes[at], &value, sizeof(T));
}

// Offset of tensor `name`'s info fields (after its name) in a serialized GGUF file.
size_t tensor_info_at(const std::string& bytes, const std::string& name) {
  std::string key(8, '\0');
  const uint64_t n = name.size();
  std::memcpy(&key[0], &n, 8);
  key += name;
  const size_t at = bytes.find(key);
  EXPECT_NE(at, std::string::npos) << name;
  return at + key.size();
}

// Offset of the value of metadata `key` (after its type id) in a serialized GGUF file.
size_t metadata_value_at(const std::string& bytes, const std::string& key) {
  return tensor_info_at(bytes, key) + 4;
}

class ModelFilesHostile : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = kvpipe::testing::make_scratch_dir(); }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  void write_bytes(const std::string& name, const std::string& bytes) {
    fs::create_directories(fs::path(path(name)).parent_path());
    std::ofstream(path(name), std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size());
  }

  // A valid GGUF model (init-model's writer), as bytes.
  std::string gguf_model(const ModelConfig& c = small_config()) {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& [n, shape] : hf_tensor_layout(c)) tensors.emplace_back(n, random_tensor(n, shape, 3, 0.05));
    write_gguf_model(path("valid.gguf"), c, tensors, at::kFloat);
    return kvpipe::testing::slurp(path("valid.gguf"));
  }

  // A model folder with a config.json of `config` (small_config's keys merged over) and no
  // weights: enough for the config loader.
  std::string hf_model(const std::string& name, const std::string& extra_keys) {
    const std::string dir = path(name);
    fs::create_directories(dir);
    std::ofstream(dir + "/config.json")
        << "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 300, \"hidden_size\": 64, "
           "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, "
           "\"intermediate_size\": 96, \"max_position_embeddings\": 128"
        << (extra_keys.empty() ? "" : ", ") << extra_keys << "}";
    return dir;
  }

  fs::path dir_;
};

// ---------------------------------------------------------------------------------------------
// GGUF: the data section is accounted for

// A header whose tensor count is one short used to drop output.weight (then taken as tied)
// and read every tensor 64 bytes off.
TEST_F(ModelFilesHostile, GgufTensorCountOneShortIsRefused) {
  std::string b = gguf_model();
  uint64_t count = 0;
  std::memcpy(&count, &b[8], 8);
  patch<uint64_t>(b, 8, count - 1);
  write_bytes("short.gguf", b);
  EXPECT_TRUE(mentions(refusal([&] { load_model_config(path("short.gguf")); }),
                       {path("short.gguf"), "belong to no tensor", "tensor count"}));
  // One more than there are: the reader runs into the data section.
  patch<uint64_t>(b, 8, count + 1);
  write_bytes("long.gguf", b);
  EXPECT_TRUE(mentions(refusal([&] { GgufFile f(path("long.gguf")); }), {path("long.gguf")}));
  // The unpatched file loads.
  EXPECT_TRUE(GgufFile(path("valid.gguf")).contains("output.weight"));
}

TEST_F(ModelFilesHostile, GgufTrailingBytesAreRefused) {
  const std::string b = gguf_model();
  write_bytes("tail.gguf", b + std::string(64, '\0'));
  EXPECT_TRUE(mentions(refusal([&] { GgufFile f(path("tail.gguf")); }),
                       {path("tail.gguf"), "64 bytes at the end of the data section belong to no tensor"}));
}

TEST_F(ModelFilesHostile, GgufOverlappingTensorsAreRefused) {
  std::string b = gguf_model();
  // Point the final norm at the embedding's bytes (offset 0, aligned, inside the file).
  const size_t at = tensor_info_at(b, "output_norm.weight");
  patch<uint64_t>(b, at + 4 + 8 + 4, 0);  // one dimension, then the type, then the offset
  write_bytes("overlap.gguf", b);
  EXPECT_TRUE(mentions(refusal([&] { GgufFile f(path("overlap.gguf")); }),
                       {path("overlap.gguf"), "tensor 'token_embd.weight'", "tensor 'output_norm.weight'", "overlap"}));
}

TEST_F(ModelFilesHostile, GgufGapInTheDataSectionIsRefused) {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_tensor("a", at::zeros({8}, at::kFloat));
  w.add_tensor("b", at::zeros({8}, at::kFloat));
  std::string b = w.serialize();
  patch<uint64_t>(b, tensor_info_at(b, "b") + 4 + 8 + 4, 64);  // 32 was its place
  b += std::string(32, '\0');  // keep it inside the file
  write_bytes("gap.gguf", b);
  EXPECT_TRUE(mentions(refusal([&] { GgufFile f(path("gap.gguf")); }),
                       {path("gap.gguf"), "data bytes [32, 64) before tensor 'b'", "belong to no tensor"}));
}

TEST_F(ModelFilesHostile, GgufByteCountOverflowIsRefused) {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_tensor("huge", 0, {int64_t{1} << 40, int64_t{1} << 23}, std::string(32, '\0'));  // 2^63 F32 values
  write_bytes("huge.gguf", w.serialize());
  EXPECT_TRUE(mentions(refusal([&] { GgufFile f(path("huge.gguf")); }), {path("huge.gguf"), "tensor 'huge'", "overflow"}));
}

TEST_F(ModelFilesHostile, GgufUnloadableTypesAreSizedToo) {
  // An IQ2_XXS row must be whole blocks even though IQ2_XXS is never loaded.
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_tensor("iq2", 16, {100}, std::string(66, '\0'));
  write_bytes("iq2.gguf", w.serialize());
  EXPECT_TRUE(mentions(refusal([&] { GgufFile f(path("iq2.gguf")); }),
                       {path("iq2.gguf"), "tensor 'iq2'", "IQ2_XXS row of 100 values is not a multiple of 256"}));
}

// ---------------------------------------------------------------------------------------------
// Hyper-parameters, from GGUF metadata and from config.json

TEST_F(ModelFilesHostile, GgufNonFiniteHyperparametersAreRefusedByKey) {
  const std::string valid = gguf_model();
  const struct {
    std::string key;
    float value;
    std::string says;
  } cases[] = {
      {"llama.rope.freq_base", std::nanf(""), "nan"},
      {"llama.rope.freq_base", std::numeric_limits<float>::infinity(), "inf"},
      {"llama.rope.freq_base", -1.0f, "-1"},
      {"llama.attention.layer_norm_rms_epsilon", std::nanf(""), "nan"},
      {"llama.attention.layer_norm_rms_epsilon", -std::numeric_limits<float>::infinity(), "-inf"},
      {"llama.attention.layer_norm_rms_epsilon", 0.0f, "0"},
  };
  for (const auto& c : cases) {
    std::string b = valid;
    patch<float>(b, metadata_value_at(b, c.key), c.value);
    write_bytes("h.gguf", b);
    EXPECT_TRUE(mentions(refusal([&] { load_model_config(path("h.gguf")); }),
                         {path("h.gguf"), "'" + c.key + "'", "finite positive", c.says}))
        << c.key << " = " << c.value;
  }
}

TEST_F(ModelFilesHostile, GgufAbsurdSizesAreRefusedByKeyWithinASecond) {
  const std::string valid = gguf_model();
  const struct {
    std::string key;
    uint32_t value;
    std::string says;
  } cases[] = {
      {"llama.block_count", 1000000000u, "is 1000000000, more than the 4096 supported"},
      {"llama.context_length", 1000000000u, "more than the 16777216 supported"},
      {"llama.vocab_size", 0x7fffffffu, "more than the 16777216 supported"},
      {"llama.embedding_length", 1u << 30, "more than the 131072 supported"},
      {"llama.feed_forward_length", 0u, "must be positive"},
      {"llama.attention.head_count_kv", 3u, "is not a multiple of 'llama.attention.head_count_kv'"},
  };
  for (const auto& c : cases) {
    std::string b = valid;
    patch<uint32_t>(b, metadata_value_at(b, c.key), c.value);
    write_bytes("h.gguf", b);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_TRUE(mentions(refusal([&] { load_model_config(path("h.gguf")); }), {path("h.gguf"), "'" + c.key + "'", c.says}))
        << c.key;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0) << c.key;
  }
}

TEST_F(ModelFilesHostile, ParameterCountCannotOverflow) {
  // Each size within its bound, the product far beyond 2^48 (and, in int64_t, beyond 2^63).
  ModelConfig c = small_config();
  c.num_layers = kMaxModelLayers;
  c.hidden_size = kMaxModelHidden;
  c.intermediate_size = kMaxModelIntermediate;
  c.num_heads = c.num_kv_heads = 1024;
  c.head_dim = 4096;
  EXPECT_TRUE(mentions(refusal([&] { c.validate("wide"); }), {"wide", "more than 2^48 parameters"}));
  // The 2^40-wide model a wrapped product once let through.
  const std::string dir = hf_model("wide", "");
  std::ofstream(dir + "/config.json")
      << R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 1099511627776,
             "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96, "head_dim": 16})";
  EXPECT_TRUE(mentions(refusal([&] { load_hf_config(dir); }),
                       {dir + "/config.json", "'hidden_size' is 1099511627776, more than the 131072 supported"}));
}

TEST_F(ModelFilesHostile, ConfigJsonKeysOfTheWrongTypeNameFileAndKey) {
  const struct {
    std::string keys;
    std::vector<std::string> says;
  } cases[] = {
      {R"("hidden_act": 5)", {"'hidden_act': expected a string, got number 5"}},
      {R"("tie_word_embeddings": "yes")", {"'tie_word_embeddings': expected true or false, got string \"yes\""}},
      {R"("rope_scaling": 5)", {"'rope_scaling': expected an object or null, got number 5"}},
      {R"("rope_scaling": {"rope_type": 7})", {"'rope_scaling': 'rope_type': expected a string, got number 7"}},
      {R"("rope_theta": "big")", {"'rope_theta': expected a number, got string \"big\""}},
      {R"("head_dim": 16.5)", {"'head_dim': expected an integer, got number 16.5"}},
      {R"("attention_bias": "no")", {"'attention_bias': expected true or false"}},
      {R"("eos_token_id": [2, "x"])", {"'eos_token_id': expected an integer, got string \"x\""}},
      {R"("bos_token_id": {})", {"'bos_token_id': expected an integer, got object {}"}},
      {R"("num_key_value_heads": 18446744073709551615)", {"'num_key_value_heads': expected an integer"}},
      {R"("max_position_embeddings": 1e9)", {"'max_position_embeddings': expected an integer"}},
      {R"("max_position_embeddings": 1000000000)", {"'max_position_embeddings' is 1000000000, more than"}},
      {R"("num_hidden_layers": 1000000000)", {"'num_hidden_layers' is 1000000000, more than the 4096"}},
      {R"("rope_theta": 1e999)", {"not valid JSON", "number overflow"}},
  };
  for (const auto& c : cases) {
    // A later duplicate key would not be taken by every parser: rewrite the file instead.
    const std::string dir = hf_model("m", "");
    std::string text = kvpipe::testing::slurp(dir + "/config.json");
    const std::string key = c.keys.substr(0, c.keys.find(':'));
    const size_t at = text.find(key + ":");
    if (at != std::string::npos) {
      const size_t end = text.find_first_of(",}", at);
      text.replace(at, end - at, c.keys);
    } else {
      text.insert(text.size() - 1, ", " + c.keys);
    }
    std::ofstream(dir + "/config.json", std::ios::trunc) << text;
    std::vector<std::string> parts = c.says;
    parts.push_back(dir + "/config.json: ");
    EXPECT_TRUE(mentions(refusal([&] { load_hf_config(dir); }), parts)) << text;
  }
  // The unchanged file loads.
  EXPECT_EQ(load_hf_config(hf_model("ok", "")).num_layers, 2);
}

// ---------------------------------------------------------------------------------------------
// Paths that are not regular files, and bounded reads

// Runs `load` on another thread and returns its refusal. A load that blocks on the FIFO
// `fifo` is released by opening the FIFO for writing, and the test fails.
std::string refusal_without_blocking(const std::function<void()>& load, const std::string& fifo) {
  auto pending = std::async(std::launch::async, [&] { return refusal(load); });
  if (pending.wait_for(std::chrono::seconds(5)) == std::future_status::timeout) {
    ADD_FAILURE() << "blocked on " << fifo;
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) ::close(fd);
  }
  return pending.get();
}

TEST_F(ModelFilesHostile, FifosAreRefusedWithoutBlocking) {
  ASSERT_EQ(::mkfifo(path("m.gguf").c_str(), 0600), 0);
  EXPECT_TRUE(mentions(refusal_without_blocking([&] { load_model_config(path("m.gguf")); }, path("m.gguf")),
                       {path("m.gguf"), "is a FIFO, not a regular file"}));

  fs::create_directories(path("hf"));
  ASSERT_EQ(::mkfifo(path("hf/config.json").c_str(), 0600), 0);
  EXPECT_TRUE(mentions(refusal_without_blocking([&] { load_hf_config(path("hf")); }, path("hf/config.json")),
                       {path("hf/config.json"), "is a FIFO"}));

  fs::create_directories(path("st"));
  ASSERT_EQ(::mkfifo(path("st/model.safetensors").c_str(), 0600), 0);
  EXPECT_TRUE(mentions(
      refusal_without_blocking([&] { SafetensorsModel m(path("st")); }, path("st/model.safetensors")),
      {path("st/model.safetensors"), "is a FIFO"}));

  fs::create_directories(path("idx"));
  ASSERT_EQ(::mkfifo(path("idx/model.safetensors.index.json").c_str(), 0600), 0);
  EXPECT_TRUE(mentions(refusal_without_blocking([&] { SafetensorsModel m(path("idx")); },
                                                path("idx/model.safetensors.index.json")),
                       {path("idx/model.safetensors.index.json"), "is a FIFO"}));
}

TEST_F(ModelFilesHostile, DirectoriesAndDevicesAreRefused) {
  fs::create_directories(path("hf/config.json"));
  EXPECT_TRUE(mentions(refusal([&] { load_hf_config(path("hf")); }), {path("hf/config.json"), "is a directory"}));
  fs::create_directories(path("dir.gguf"));
  EXPECT_TRUE(mentions(refusal([&] { load_model_config(path("dir.gguf")); }), {path("dir.gguf"), "is a directory"}));
  EXPECT_TRUE(mentions(refusal([&] { GgufFile f("/dev/zero"); }), {"/dev/zero", "is a character device"}));
  EXPECT_TRUE(mentions(refusal([&] { read_regular_file("/dev/zero", 1024); }), {"/dev/zero", "character device"}));
}

TEST_F(ModelFilesHostile, ConfigJsonReadIsBounded) {
  const std::string dir = hf_model("big", "");
  // A sparse file: the bound is checked before anything is read.
  ASSERT_EQ(::truncate((dir + "/config.json").c_str(), static_cast<off_t>(kMaxConfigJsonBytes) + 1), 0);
  EXPECT_TRUE(mentions(refusal([&] { load_hf_config(dir); }), {dir + "/config.json", "more than the 16777216"}));
  write_bytes("small.txt", "0123456789");
  EXPECT_TRUE(mentions(refusal([&] { read_regular_file(path("small.txt"), 9); }), {path("small.txt"), "more than the 9"}));
  EXPECT_EQ(read_regular_file(path("small.txt"), 10), "0123456789");
}

// ---------------------------------------------------------------------------------------------
// Safetensors

void write_safetensors_raw(const std::string& path, const std::string& header, const std::string& data) {
  std::string length(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(&length[0], &n, 8);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << length << header << data;
}

TEST_F(ModelFilesHostile, SafetensorsNumbersJsonCannotHoldAreRefused) {
  write_safetensors_raw(path("big.safetensors"), R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 1e999]}})",
                        std::string(4, '\0'));
  EXPECT_TRUE(mentions(refusal([&] { SafetensorsFile f(path("big.safetensors")); }),
                       {path("big.safetensors"), "not valid JSON", "number overflow"}));
  write_safetensors_raw(path("wide.safetensors"),
                        R"({"x": {"dtype": "F32", "shape": [99999999999999999999], "data_offsets": [0, 4]}})",
                        std::string(4, '\0'));
  EXPECT_TRUE(mentions(refusal([&] { SafetensorsFile f(path("wide.safetensors")); }),
                       {path("wide.safetensors"), "tensor 'x'", "shape"}));
  fs::create_directories(path("idx"));
  std::ofstream(path("idx/model.safetensors.index.json")) << R"({"metadata": {"total_size": 1e999}, "weight_map": {}})";
  EXPECT_TRUE(mentions(refusal([&] { SafetensorsModel m(path("idx")); }),
                       {path("idx/model.safetensors.index.json"), "not valid JSON"}));
}

TEST_F(ModelFilesHostile, ShardsOutsideTheModelFolderAreRefused) {
  write_safetensors(path("outside.safetensors"), {{"x", at::ones({2})}});
  fs::create_directories(path("m"));
  for (const std::string& shard : std::vector<std::string>{"../outside.safetensors", path("outside.safetensors"),
                                                           "./../outside.safetensors", "sub/../../outside.safetensors", ""}) {
    std::ofstream(path("m/model.safetensors.index.json"), std::ios::trunc)
        << R"({"weight_map": {"x": ")" << shard << R"("}})";
    EXPECT_TRUE(mentions(refusal([&] { SafetensorsModel m(path("m")); }),
                         {path("m/model.safetensors.index.json"), "tensor 'x'", "not a file inside the model's folder"}))
        << shard;
  }
  // A shard in the folder itself loads.
  write_safetensors(path("m/model-00001-of-00001.safetensors"), {{"x", at::ones({2})}});
  std::ofstream(path("m/model.safetensors.index.json"), std::ios::trunc)
      << R"({"weight_map": {"x": "model-00001-of-00001.safetensors"}})";
  EXPECT_TRUE(at::equal(SafetensorsModel(path("m")).load("x", at::kFloat), at::ones({2})));
}

// ---------------------------------------------------------------------------------------------
// A file truncated while mapped

// The child of a "fast" death test is a fork: it shares this mapping and this file name.
TEST(MappedFileDeathTest, TruncatedFileIsOneLineNamingItAndExitCode2) {
  GTEST_FLAG_SET(death_test_style, "fast");
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  const std::string file = (dir / "model.gguf").string();
  std::ofstream(file, std::ios::binary) << std::string(1 << 16, 'x');
  const MappedFile mapped(file);
  ASSERT_EQ(mapped.size(), size_t{1} << 16);
  EXPECT_EQ(mapped.data()[40000], 'x');
  ASSERT_EQ(::truncate(file.c_str(), 0), 0);
  volatile const uint8_t* page = mapped.data() + 40000;
  EXPECT_EXIT((void)*page, ::testing::ExitedWithCode(2),
              "^kvpipe: error: " + file + ": the file was truncated or changed while mapped\n$");
  fs::remove_all(dir);
}

TEST(MappedFileDeathTest, OtherBusErrorsKeepTheirDefaultAction) {
  GTEST_FLAG_SET(death_test_style, "fast");
  const fs::path dir = kvpipe::testing::make_scratch_dir();
  std::ofstream(dir / "f", std::ios::binary) << "bytes";
  const MappedFile mapped((dir / "f").string());  // installs the handler
  EXPECT_EXIT(::raise(SIGBUS), ::testing::KilledBySignal(SIGBUS), "");
  fs::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// Through the binary: exit code 2, one line naming the file, quickly

class ModelFilesHostileCli : public ModelFilesHostile {
 protected:
  CommandResult kvpipe(const std::string& subcommand, const std::string& model) {
    std::ofstream(path("job.yaml"), std::ios::trunc)
        << "model: {path: " << model << ", dtype: float32}\n"
        << "runtime: {threads: 1}\n"
        << "cache: {block_size: 16, memory: 8MiB}\n"
        << "requests:\n  - {prompt_ids: [1, 2, 3], max_new_tokens: 4}\n";
    fs::create_directories(dir_ / "out");
    // timeout: a hang fails the test instead of stopping the suite.
    return kvpipe::testing::run_command("env -u OMPI_COMM_WORLD_SIZE -u PMI_SIZE -u SLURM_NTASKS timeout 30 " +
                                            std::string(KVPIPE_BINARY) + " " + subcommand + " --config " +
                                            path("job.yaml"),
                                        dir_ / "out");
  }

  void expect_refused(const CommandResult& r, const std::vector<std::string>& parts) {
    EXPECT_EQ(r.code, 2) << r.err;
    // Generous: starting the binary alone takes seconds on a loaded machine; the hangs this
    // guards against took minutes or forever.
    EXPECT_LT(r.seconds, 10.0);
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_TRUE(mentions(r.err, parts));
    EXPECT_EQ(r.out, "");
  }
};

TEST_F(ModelFilesHostileCli, GgufWithATensorCountOneShort) {
  std::string b = gguf_model();
  uint64_t count = 0;
  std::memcpy(&count, &b[8], 8);
  patch<uint64_t>(b, 8, count - 1);
  write_bytes("short.gguf", b);
  expect_refused(kvpipe("validate", path("short.gguf")), {"kvpipe: error: ", path("short.gguf"), "belong to no tensor"});
  expect_refused(kvpipe("generate", path("short.gguf")), {"kvpipe: error: ", path("short.gguf"), "belong to no tensor"});
}

TEST_F(ModelFilesHostileCli, GgufWithANanRopeTheta) {
  std::string b = gguf_model();
  patch<float>(b, metadata_value_at(b, "llama.rope.freq_base"), std::nanf(""));
  write_bytes("nan.gguf", b);
  expect_refused(kvpipe("generate", path("nan.gguf")), {path("nan.gguf"), "'llama.rope.freq_base'", "finite"});
}

TEST_F(ModelFilesHostileCli, ConfigJsonWithABillionLayers) {
  const std::string dir = hf_model("m", "");
  std::string text = kvpipe::testing::slurp(dir + "/config.json");
  text.replace(text.find("\"num_hidden_layers\": 2"), 22, "\"num_hidden_layers\": 1000000000");
  std::ofstream(dir + "/config.json", std::ios::trunc) << text;
  expect_refused(kvpipe("validate", dir), {dir + "/config.json", "'num_hidden_layers' is 1000000000"});
}

TEST_F(ModelFilesHostileCli, ConfigJsonKeyOfTheWrongType) {
  const std::string dir = hf_model("m", R"("tie_word_embeddings": "yes")");
  expect_refused(kvpipe("validate", dir), {dir + "/config.json", "'tie_word_embeddings': expected true or false"});
}

TEST_F(ModelFilesHostileCli, ModelThatIsAFifo) {
  ASSERT_EQ(::mkfifo(path("fifo.gguf").c_str(), 0600), 0);
  expect_refused(kvpipe("validate", path("fifo.gguf")), {path("fifo.gguf"), "FIFO"});
  const std::string dir = hf_model("m", "");
  fs::remove(dir + "/config.json");
  ASSERT_EQ(::mkfifo((dir + "/config.json").c_str(), 0600), 0);
  expect_refused(kvpipe("generate", dir), {dir + "/config.json", "FIFO"});
}

// The tokenizer is read after the plan is printed, so only the last line is the error.
TEST_F(ModelFilesHostileCli, TokenizerJsonThatIsAFifo) {
  const CommandResult made = kvpipe::testing::run_command(
      std::string(KVPIPE_BINARY) + " init-model --out " + path("hf") + " --preset tiny", dir_);
  ASSERT_EQ(made.code, 0) << made.err;
  ASSERT_TRUE(fs::remove(path("hf/tokenizer.json")));
  ASSERT_EQ(::mkfifo(path("hf/tokenizer.json").c_str(), 0600), 0);
  const CommandResult r = kvpipe("generate", path("hf"));
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_TRUE(mentions(r.err, {"kvpipe: error: " + path("hf/tokenizer.json") + ": is a FIFO, not a regular file\n"}));
  EXPECT_EQ(r.out, "");
}

}  // namespace
}  // namespace kvpipe
