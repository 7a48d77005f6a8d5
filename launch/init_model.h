// `kvpipe init-model`: writes a random-weight model to disk.
//
// The weights are a pure function of (shape, seed, std): each tensor is drawn from its own
// name-seeded generator (random_tensor), so the same flags give the same bytes, and a
// `dummy:<preset>` job sees exactly the weights `init-model --preset <preset>` writes. Both
// formats carry the same byte-level BPE tokenizer (engine/text/tokenizer_builder.h) when the
// vocabulary holds at least its 259 base tokens.
#pragma once

#include "engine/model/model_config.h"

#include <ATen/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace kvpipe {

struct InitModelOptions {
  std::string out;
  std::string format = "hf";   // hf | gguf
  ModelConfig config;
  std::string dtype = "float32";
  uint64_t seed = 0;
  double std = 0.02;
};

// Throws std::invalid_argument on bad options or an unwritable path.
void init_model(const InitModelOptions& options);

// The GGUF file init-model writes for HF-named float tensors (hf_tensor_layout order):
// write_gguf_file (engine/model/gguf.h) with init-model's vocabulary (add_gguf_vocabulary,
// engine/text/tokenizer_builder.h), so that llama.cpp loads it and, from 259 tokens up,
// tokenizes text as the HF layout's tokenizer.json does.
void write_gguf_model(const std::string& path, const ModelConfig& cfg,
                      const std::vector<std::pair<std::string, at::Tensor>>& hf_tensors, at::ScalarType dtype);

}  // namespace kvpipe
