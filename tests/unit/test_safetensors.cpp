#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/model/safetensors.h"

namespace kvpipe {
namespace {

namespace fs = std::filesystem;

using TensorList = std::vector<std::pair<std::string, at::Tensor>>;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string le64(uint64_t value) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  return out;
}

// A hand-made file: the length prefix (the header's own size unless overridden), the header
// text and the data section, so tests control every byte a writer would get right.
void write_raw(const std::string& path, const std::string& header, const std::string& data = "",
               std::optional<uint64_t> length = std::nullopt) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << le64(length.value_or(header.size())) << header << data;
  ASSERT_TRUE(out.good()) << path;
}

std::string float_bytes(const std::vector<float>& values) {
  std::string out(values.size() * sizeof(float), '\0');
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

// Calls `fn` and returns the message of the std::invalid_argument it throws.
template <typename Fn>
std::string invalid_argument_message(Fn&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected std::invalid_argument, got: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected std::invalid_argument, nothing was thrown";
  return {};
}

::testing::AssertionResult mentions(const std::string& message,
                                    std::initializer_list<std::string> words) {
  if (message.find('\n') != std::string::npos) {
    return ::testing::AssertionFailure() << "message spans several lines: " << message;
  }
  for (const std::string& word : words) {
    if (message.find(word) == std::string::npos) {
      return ::testing::AssertionFailure() << "\"" << message << "\" lacks \"" << word << "\"";
    }
  }
  return ::testing::AssertionSuccess();
}

class SafetensorsTempDir : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::path(::testing::TempDir()) / "kvpipe_safetensors_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr) << pattern;
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  // Writes bad.safetensors from the given pieces and returns the message opening it produces.
  std::string open_error(const std::string& header, const std::string& data = "",
                         std::optional<uint64_t> length = std::nullopt) {
    const std::string file = path("bad.safetensors");
    write_raw(file, header, data, length);
    return invalid_argument_message([&] { SafetensorsFile f(file); });
  }

  std::string dir_;
};

class SafetensorsRoundTrip : public SafetensorsTempDir {};
class SafetensorsWrite : public SafetensorsTempDir {};
class SafetensorsMalformed : public SafetensorsTempDir {};
class SafetensorsModelDir : public SafetensorsTempDir {};

TEST_F(SafetensorsRoundTrip, Float32) {
  const at::Tensor weight = at::randn({3, 5});
  const at::Tensor bias = at::randn({5});
  write_safetensors(path("a.safetensors"), {{"weight", weight}, {"bias", bias}});

  SafetensorsFile file(path("a.safetensors"));
  EXPECT_EQ(file.names(), (std::vector<std::string>{"bias", "weight"}));
  EXPECT_TRUE(file.contains("weight"));
  EXPECT_FALSE(file.contains("missing"));
  EXPECT_EQ(file.entry("weight").dtype, "F32");
  EXPECT_EQ(file.entry("weight").shape, (std::vector<int64_t>{3, 5}));
  // Tensors are laid out in the order given, back to back.
  EXPECT_EQ(file.entry("weight").begin, 0u);
  EXPECT_EQ(file.entry("weight").end, 60u);
  EXPECT_EQ(file.entry("bias").begin, 60u);
  EXPECT_EQ(file.entry("bias").end, 80u);

  const at::Tensor loaded = file.load("weight", at::kFloat);
  EXPECT_EQ(loaded.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(loaded, weight));
  EXPECT_TRUE(at::equal(file.load("bias", at::kFloat), bias));
  EXPECT_TRUE(at::equal(file.load("weight", at::kHalf), weight.to(at::kHalf)));
  EXPECT_TRUE(at::equal(file.load("weight", at::kBFloat16), weight.to(at::kBFloat16)));
}

TEST_F(SafetensorsRoundTrip, Float16) {
  const at::Tensor original = at::randn({4, 3}).to(at::kHalf);
  write_safetensors(path("h.safetensors"), {{"w", original}});

  SafetensorsFile file(path("h.safetensors"));
  EXPECT_EQ(file.entry("w").dtype, "F16");
  const at::Tensor same = file.load("w", at::kHalf);
  EXPECT_EQ(same.scalar_type(), at::kHalf);
  EXPECT_TRUE(at::equal(same, original));
  const at::Tensor widened = file.load("w", at::kFloat);
  EXPECT_EQ(widened.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(widened, original.to(at::kFloat)));
}

TEST_F(SafetensorsRoundTrip, BFloat16) {
  const at::Tensor original = at::randn({2, 7}).to(at::kBFloat16);
  write_safetensors(path("b.safetensors"), {{"w", original}});

  SafetensorsFile file(path("b.safetensors"));
  EXPECT_EQ(file.entry("w").dtype, "BF16");
  EXPECT_TRUE(at::equal(file.load("w", at::kBFloat16), original));
  EXPECT_TRUE(at::equal(file.load("w", at::kFloat), original.to(at::kFloat)));
}

TEST_F(SafetensorsRoundTrip, MixedDtypesScalarsAndEmptyTensors) {
  const at::Tensor half = at::randn({3}).to(at::kHalf);  // 6 bytes: leaves the next one odd
  const at::Tensor scalar = at::scalar_tensor(2.5f);
  const at::Tensor empty = at::empty({0, 4});
  const at::Tensor brain = at::randn({2, 2}).to(at::kBFloat16);
  write_safetensors(path("m.safetensors"),
                    {{"half", half}, {"scalar", scalar}, {"empty", empty}, {"brain", brain}});

  SafetensorsFile file(path("m.safetensors"));
  EXPECT_TRUE(at::equal(file.load("half", at::kHalf), half));
  const at::Tensor loaded_scalar = file.load("scalar", at::kFloat);
  EXPECT_EQ(loaded_scalar.dim(), 0);
  EXPECT_EQ(loaded_scalar.item<float>(), 2.5f);
  const at::Tensor loaded_empty = file.load("empty", at::kHalf);
  EXPECT_EQ(loaded_empty.sizes(), empty.sizes());
  EXPECT_EQ(loaded_empty.scalar_type(), at::kHalf);
  EXPECT_TRUE(at::equal(file.load("brain", at::kBFloat16), brain));
}

TEST_F(SafetensorsRoundTrip, LoadedTensorOutlivesTheFileAndIsWritable) {
  const at::Tensor original = at::arange(6, at::kFloat).reshape({2, 3});
  write_safetensors(path("o.safetensors"), {{"x", original}});
  at::Tensor loaded;
  {
    SafetensorsFile file(path("o.safetensors"));
    loaded = file.load("x", at::kFloat);
  }
  // Writing through an alias of the read-only mapping would crash.
  loaded.add_(1);
  EXPECT_TRUE(at::equal(loaded, original + 1));
}

TEST_F(SafetensorsRoundTrip, UnalignedDataSection) {
  // A header of 3 (mod 8) bytes puts the data section at an odd offset into the page-aligned
  // mapping: misaligned for every 2- and 4-byte type.
  const std::string header = R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})";
  const std::string padded = header + std::string((11 - header.size() % 8 + 8) % 8, ' ');
  ASSERT_EQ((8 + padded.size()) % 4, 3u);
  write_raw(path("u.safetensors"), padded, float_bytes({1.5f, -2.0f, 3.25f}));

  SafetensorsFile file(path("u.safetensors"));
  const at::Tensor expected = at::tensor(std::vector<float>{1.5f, -2.0f, 3.25f});
  EXPECT_TRUE(at::equal(file.load("x", at::kFloat), expected));
  EXPECT_TRUE(at::equal(file.load("x", at::kHalf), expected.to(at::kHalf)));
}

TEST_F(SafetensorsRoundTrip, TrailingSpacesAndOtherDtypesInHeaderAreAccepted) {
  const std::string header = R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},)"
                             R"("mask":{"dtype":"BOOL","shape":[2],"data_offsets":[16,18]},)"
                             R"("x":{"dtype":"F32","shape":[1],"data_offsets":[18,22]}})"
                             "      ";
  write_raw(path("o.safetensors"), header, std::string(18, '\0') + float_bytes({7.0f}));

  SafetensorsFile file(path("o.safetensors"));
  EXPECT_EQ(file.entry("ids").dtype, "I64");
  EXPECT_EQ(file.entry("mask").dtype, "BOOL");
  EXPECT_EQ(file.load("x", at::kFloat).item<float>(), 7.0f);
}

TEST_F(SafetensorsRoundTrip, Metadata) {
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "a b\tc"}};
  write_safetensors(path("meta.safetensors"), {{"w", at::ones({2})}}, metadata);
  SafetensorsFile file(path("meta.safetensors"));
  EXPECT_EQ(file.metadata(), metadata);
  EXPECT_EQ(file.names(), std::vector<std::string>{"w"});

  write_safetensors(path("plain.safetensors"), {{"w", at::ones({2})}});
  EXPECT_TRUE(SafetensorsFile(path("plain.safetensors")).metadata().empty());
}

TEST_F(SafetensorsWrite, DeterministicAndAligned) {
  const TensorList tensors = {{"z.last", at::randn({5, 3})},
                              {"a.first", at::randn({7}).to(at::kHalf)},
                              {"m.mid", at::randn({2, 2}).to(at::kBFloat16)}};
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  write_safetensors(path("one.safetensors"), tensors, metadata);
  write_safetensors(path("two.safetensors"), tensors, metadata);

  const std::string one = read_bytes(path("one.safetensors"));
  const std::string two = read_bytes(path("two.safetensors"));
  ASSERT_FALSE(one.empty());
  EXPECT_EQ(one, two);

  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | static_cast<uint8_t>(one[i]);
  EXPECT_EQ((8 + header_size) % 8, 0u);
  EXPECT_EQ(one.size(), 8 + header_size + 5 * 3 * 4 + 7 * 2 + 2 * 2 * 2);
  const std::string header = one.substr(8, header_size);
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));
}

TEST_F(SafetensorsWrite, NonContiguousInputIsWrittenInLogicalOrder) {
  const at::Tensor base = at::arange(12, at::kFloat).reshape({3, 4});
  const at::Tensor transposed = base.t();
  ASSERT_FALSE(transposed.is_contiguous());
  write_safetensors(path("t.safetensors"), {{"t", transposed}});
  SafetensorsFile file(path("t.safetensors"));
  EXPECT_EQ(file.entry("t").shape, (std::vector<int64_t>{4, 3}));
  EXPECT_TRUE(at::equal(file.load("t", at::kFloat), transposed));
}

TEST_F(SafetensorsWrite, RejectsUnsupportedDtype) {
  const std::string file = path("ids.safetensors");
  const std::string message = invalid_argument_message([&] {
    write_safetensors(file, {{"ids", at::arange(4, at::kLong)}});
  });
  EXPECT_TRUE(mentions(message, {"ids.safetensors", "'ids'", "dtype", "Long"}));
}

TEST_F(SafetensorsWrite, RejectsDuplicateAndReservedNames) {
  const std::string file = path("dup.safetensors");
  EXPECT_TRUE(mentions(invalid_argument_message([&] {
                         write_safetensors(file, {{"w", at::ones({1})}, {"w", at::ones({1})}});
                       }),
                       {"dup.safetensors", "'w'", "twice"}));
  EXPECT_TRUE(mentions(invalid_argument_message([&] {
                         write_safetensors(file, {{"__metadata__", at::ones({1})}});
                       }),
                       {"dup.safetensors", "'__metadata__'", "reserved"}));
}

TEST_F(SafetensorsWrite, ReportsUnwritablePath) {
  const std::string file = path("no_such_dir/w.safetensors");
  EXPECT_TRUE(mentions(invalid_argument_message([&] {
                         write_safetensors(file, {{"w", at::ones({1})}});
                       }),
                       {"w.safetensors", "cannot open for writing"}));
}

TEST_F(SafetensorsMalformed, MissingFile) {
  const std::string file = path("absent.safetensors");
  EXPECT_TRUE(mentions(invalid_argument_message([&] { SafetensorsFile f(file); }),
                       {"absent.safetensors", "cannot open"}));
}

TEST_F(SafetensorsMalformed, FileShorterThanLengthPrefix) {
  const std::string file = path("short.safetensors");
  std::ofstream(file, std::ios::binary) << "abc";
  EXPECT_TRUE(mentions(invalid_argument_message([&] { SafetensorsFile f(file); }),
                       {"short.safetensors", "3 bytes", "shorter"}));
}

TEST_F(SafetensorsMalformed, HeaderLengthPastEndOfFile) {
  EXPECT_TRUE(mentions(open_error("{}", "", 999999),
                       {"bad.safetensors", "header length 999999", "past the end of the file"}));
}

TEST_F(SafetensorsMalformed, HeaderNotJson) {
  EXPECT_TRUE(mentions(open_error(R"({"x": {"dtype": )"), {"bad.safetensors", "not valid JSON"}));
}

TEST_F(SafetensorsMalformed, HeaderNotJsonObject) {
  EXPECT_TRUE(mentions(open_error("[1, 2]"), {"bad.safetensors", "not a JSON object"}));
}

TEST_F(SafetensorsMalformed, EntryNotObject) {
  EXPECT_TRUE(mentions(open_error(R"({"w": 3})"), {"bad.safetensors", "'w'", "not a JSON object"}));
}

TEST_F(SafetensorsMalformed, MissingDtype) {
  EXPECT_TRUE(
      mentions(open_error(R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", float_bytes({1})),
               {"bad.safetensors", "'w'", "missing \"dtype\""}));
}

TEST_F(SafetensorsMalformed, MissingShape) {
  EXPECT_TRUE(
      mentions(open_error(R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", float_bytes({1})),
               {"bad.safetensors", "'w'", "missing \"shape\""}));
}

TEST_F(SafetensorsMalformed, MissingDataOffsets) {
  EXPECT_TRUE(mentions(open_error(R"({"w": {"dtype": "F32", "shape": [1]}})", float_bytes({1})),
                       {"bad.safetensors", "'w'", "missing \"data_offsets\""}));
}

TEST_F(SafetensorsMalformed, FieldsOfWrongJsonType) {
  EXPECT_TRUE(mentions(
      open_error(R"({"w": {"dtype": 32, "shape": [1], "data_offsets": [0, 4]}})", float_bytes({1})),
      {"bad.safetensors", "'w'", "\"dtype\" is not a string"}));
  EXPECT_TRUE(
      mentions(open_error(R"({"w": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}})",
                          float_bytes({1})),
               {"bad.safetensors", "'w'", "\"shape\" is not an array"}));
  EXPECT_TRUE(
      mentions(open_error(R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})",
                          float_bytes({1})),
               {"bad.safetensors", "'w'", "\"shape\" is not an array of integers"}));
  EXPECT_TRUE(
      mentions(open_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}})",
                          float_bytes({1, 2})),
               {"bad.safetensors", "'w'", "\"data_offsets\" is not a pair"}));
  EXPECT_TRUE(mentions(
      open_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 4]}})",
                 float_bytes({1})),
      {"bad.safetensors", "'w'", "\"data_offsets\" is not a pair of non-negative integers"}));
}

TEST_F(SafetensorsMalformed, UnknownDtype) {
  EXPECT_TRUE(mentions(open_error(R"({"w": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}})",
                                  float_bytes({1})),
                       {"bad.safetensors", "'w'", "unknown dtype 'Q4'"}));
}

TEST_F(SafetensorsMalformed, NegativeDimension) {
  EXPECT_TRUE(
      mentions(open_error(R"({"w": {"dtype": "F32", "shape": [2, -3], "data_offsets": [0, 4]}})",
                          float_bytes({1})),
               {"bad.safetensors", "'w'", "negative dimension -3"}));
}

TEST_F(SafetensorsMalformed, OffsetsBeginAfterEnd) {
  EXPECT_TRUE(
      mentions(open_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})",
                          float_bytes({1, 2, 3})),
               {"bad.safetensors", "'w'", "begin 8 is after end 4"}));
}

TEST_F(SafetensorsMalformed, OffsetsPastDataSection) {
  EXPECT_TRUE(
      mentions(open_error(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                          float_bytes({1, 2})),
               {"bad.safetensors", "'w'", "end 12", "past the end of the data section (8 bytes)"}));
}

TEST_F(SafetensorsMalformed, OverlappingTensors) {
  const std::string message =
      open_error(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                 R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                 float_bytes({1, 2, 3}));
  EXPECT_TRUE(mentions(message, {"bad.safetensors", "'a'", "'b'", "overlap"}));
}

// The tensors tile the data section exactly, as the `safetensors` crate requires: a header
// length a few bytes off (found by tests/tools/hostile_probe.py) would otherwise shift every
// tensor by those bytes, silently.
TEST_F(SafetensorsMalformed, DataSectionNotTiledByTheTensors) {
  EXPECT_TRUE(mentions(open_error(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                                  R"( "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
                                  float_bytes({1, 2, 3})),
                       {"bad.safetensors", "bytes [4, 8) of the data section belong to no tensor"}));
  EXPECT_TRUE(mentions(open_error(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                                  float_bytes({1, 2})),
                       {"bad.safetensors", "bytes [0, 4) of the data section belong to no tensor"}));
  EXPECT_TRUE(mentions(open_error(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
                                  float_bytes({1, 2})),
                       {"bad.safetensors", "the data section holds 8 bytes but its tensors end at 4"}));
  // The header length one short: its last (padding) byte becomes the data section's first.
  const std::string header = R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} )";
  write_raw(path("short.safetensors"), header, float_bytes({7.0f}), header.size() - 1);
  EXPECT_TRUE(mentions(invalid_argument_message([&] { SafetensorsFile f(path("short.safetensors")); }),
                       {"short.safetensors", "the data section holds 5 bytes but its tensors end at 4"}));
}

TEST_F(SafetensorsMalformed, ByteCountMismatch) {
  EXPECT_TRUE(
      mentions(open_error(R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}})",
                          float_bytes({1, 2, 3})),
               {"bad.safetensors", "'w'", "byte count 12", "(16 bytes)"}));
}

TEST_F(SafetensorsMalformed, MetadataNotStrings) {
  EXPECT_TRUE(mentions(open_error(R"({"__metadata__": {"layers": 3}})"),
                       {"bad.safetensors", "__metadata__", "'layers'", "not a string"}));
}

TEST_F(SafetensorsMalformed, LoadOfUnsupportedDtype) {
  const std::string file = path("ints.safetensors");
  write_raw(file, R"({"ids": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}})",
            std::string(8, '\0'));
  SafetensorsFile opened(file);
  EXPECT_TRUE(mentions(invalid_argument_message([&] { opened.load("ids", at::kFloat); }),
                       {"ints.safetensors", "'ids'", "I32"}));
}

TEST_F(SafetensorsMalformed, MissingTensorInFile) {
  write_safetensors(path("w.safetensors"), {{"w", at::ones({1})}});
  SafetensorsFile file(path("w.safetensors"));
  EXPECT_TRUE(mentions(invalid_argument_message([&] { file.load("nope", at::kFloat); }),
                       {"w.safetensors", "missing", "'nope'"}));
  EXPECT_TRUE(
      mentions(invalid_argument_message([&] { file.entry("nope"); }), {"w.safetensors", "'nope'"}));
}

TEST_F(SafetensorsModelDir, SingleFile) {
  const at::Tensor embed = at::randn({10, 4});
  write_safetensors(path("model.safetensors"), {{"model.embed_tokens.weight", embed}});

  SafetensorsModel model(dir_);
  EXPECT_TRUE(model.contains("model.embed_tokens.weight"));
  EXPECT_FALSE(model.contains("lm_head.weight"));
  EXPECT_EQ(model.shape("model.embed_tokens.weight"), (std::vector<int64_t>{10, 4}));
  EXPECT_TRUE(at::equal(model.load("model.embed_tokens.weight", at::kFloat), embed));
}

TEST_F(SafetensorsModelDir, ShardedWithIndex) {
  const at::Tensor a = at::randn({3, 2}).to(at::kBFloat16);
  const at::Tensor b = at::randn({4});
  const at::Tensor c = at::randn({2, 2}).to(at::kHalf);
  write_safetensors(path("model-00001-of-00002.safetensors"), {{"a", a}, {"b", b}});
  write_safetensors(path("model-00002-of-00002.safetensors"), {{"c", c}});
  std::ofstream(path("model.safetensors.index.json"))
      << R"({"metadata": {"total_size": 48}, "weight_map": {)"
      << R"("a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",)"
      << R"("c": "model-00002-of-00002.safetensors"}})";

  SafetensorsModel model(dir_);
  EXPECT_TRUE(model.contains("a"));
  EXPECT_TRUE(model.contains("c"));
  EXPECT_EQ(model.shape("a"), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(model.shape("c"), (std::vector<int64_t>{2, 2}));
  EXPECT_TRUE(at::equal(model.load("a", at::kFloat), a.to(at::kFloat)));
  EXPECT_TRUE(at::equal(model.load("b", at::kFloat), b));
  EXPECT_TRUE(at::equal(model.load("c", at::kHalf), c));
}

TEST_F(SafetensorsModelDir, MissingTensorNamesTensorAndDirectory) {
  write_safetensors(path("model.safetensors"), {{"model.embed_tokens.weight", at::ones({2})}});
  SafetensorsModel model(dir_);
  const std::string name = "model.layers.3.mlp.up_proj.weight";
  EXPECT_TRUE(mentions(invalid_argument_message([&] { model.load(name, at::kFloat); }),
                       {dir_, "missing tensor '" + name + "'"}));
  EXPECT_TRUE(mentions(invalid_argument_message([&] { model.shape(name); }),
                       {dir_, "missing tensor '" + name + "'"}));
}

TEST_F(SafetensorsModelDir, NoModelFiles) {
  EXPECT_TRUE(mentions(invalid_argument_message([&] { SafetensorsModel m(dir_); }),
                       {dir_, "no model.safetensors or model.safetensors.index.json"}));
}

TEST_F(SafetensorsModelDir, MalformedIndex) {
  const std::string index = path("model.safetensors.index.json");
  std::ofstream(index) << R"({"weight_map": )";
  EXPECT_TRUE(mentions(invalid_argument_message([&] { SafetensorsModel m(dir_); }),
                       {index, "not valid JSON"}));

  std::ofstream(index) << R"({"metadata": {}})";
  EXPECT_TRUE(mentions(invalid_argument_message([&] { SafetensorsModel m(dir_); }),
                       {index, "missing \"weight_map\""}));

  std::ofstream(index) << R"({"weight_map": {"a": 1}})";
  EXPECT_TRUE(mentions(invalid_argument_message([&] { SafetensorsModel m(dir_); }),
                       {index, "'a'", "not a file name"}));
}

TEST_F(SafetensorsModelDir, MissingShard) {
  write_safetensors(path("one.safetensors"), {{"a", at::ones({1})}});
  std::ofstream(path("model.safetensors.index.json"))
      << R"({"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}})";
  EXPECT_TRUE(mentions(invalid_argument_message([&] { SafetensorsModel m(dir_); }),
                       {"model.safetensors.index.json", "'two.safetensors'", "does not exist"}));
}

// The index is authoritative (as in HF loaders): a stray copy of a tensor in another shard
// is never read.
TEST_F(SafetensorsModelDir, IndexDecidesWhichShardHoldsATensor) {
  write_safetensors(path("one.safetensors"), {{"a", at::ones({1})}, {"b", at::ones({1})}});
  write_safetensors(path("two.safetensors"), {{"b", at::full({1}, 2.0)}});
  std::ofstream(path("model.safetensors.index.json"))
      << R"({"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}})";
  SafetensorsModel m(dir_);
  EXPECT_EQ(m.load("b", at::kFloat).item<float>(), 2.0f);
  EXPECT_EQ(m.load("a", at::kFloat).item<float>(), 1.0f);
}

TEST_F(SafetensorsModelDir, IndexPointsAtShardWithoutTheTensor) {
  write_safetensors(path("one.safetensors"), {{"a", at::ones({1})}});
  write_safetensors(path("two.safetensors"), {{"b", at::ones({1})}});
  std::ofstream(path("model.safetensors.index.json"))
      << R"({"weight_map": {"a": "two.safetensors", "b": "two.safetensors"}})";
  SafetensorsModel m(dir_);
  EXPECT_TRUE(mentions(invalid_argument_message([&] { m.load("a", at::kFloat); }),
                       {"model.safetensors.index.json", "'a'", "'two.safetensors'"}));
}

TEST_F(SafetensorsModelDir, MalformedShardNamesShardFile) {
  write_raw(path("one.safetensors"), "not json");
  std::ofstream(path("model.safetensors.index.json"))
      << R"({"weight_map": {"a": "one.safetensors"}})";
  // Shards are opened when first used: a malformed one fails the load that needs it.
  SafetensorsModel m(dir_);
  EXPECT_TRUE(mentions(invalid_argument_message([&] { m.load("a", at::kFloat); }),
                       {"one.safetensors", "not valid JSON"}));
}

}  // namespace
}  // namespace kvpipe
