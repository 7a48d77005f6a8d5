// Fuzzes the safetensors reader: the length-prefixed JSON header a SafetensorsFile validates up
// front (dtypes, shapes, byte ranges, overlaps), then a float32 copy of every tensor it
// accepted.
#include "engine/model/safetensors.h"
#include "tests/fuzz/fuzz_support.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpipe;
  const std::string path = fuzz::scratch_dir() + "/model.safetensors";
  fuzz::write_file(path, data, size);
  std::unique_ptr<SafetensorsFile> file;
  if (!fuzz::accepts([&] { file = std::make_unique<SafetensorsFile>(path); })) return 0;
  for (const std::string& name : file->names()) {
    fuzz::accepts([&] { (void)file->load(name, at::kFloat).sum(); });
    fuzz::accepts([&] { (void)file->load(name, at::kBFloat16); });
  }
  return 0;
}
