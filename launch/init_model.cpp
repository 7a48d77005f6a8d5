#include "launch/init_model.h"

#include "engine/model_weights.h"
#include "engine/safetensors.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <stdexcept>

namespace kvpipe {

void init_model(const InitModelOptions& o) {
  if (o.out.empty()) throw std::invalid_argument("--out: a path is required");
  if (o.format != "hf")
    throw std::invalid_argument("--format " + o.format + ": only 'hf' is implemented");
  if (!(o.std > 0)) throw std::invalid_argument("--std: must be positive");
  const at::ScalarType dtype = parse_dtype(o.dtype, "--dtype");
  o.config.validate("init-model");

  std::error_code ec;
  std::filesystem::create_directories(o.out, ec);
  if (ec) throw std::invalid_argument(o.out + ": cannot create directory: " + ec.message());
  write_hf_config(o.config, o.out, o.dtype);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, shape] : hf_tensor_layout(o.config))
    tensors.emplace_back(name, random_tensor(name, shape, o.seed, o.std).to(dtype));
  write_safetensors(o.out + "/model.safetensors", tensors, {{"format", "pt"}});
}

}  // namespace kvpipe
