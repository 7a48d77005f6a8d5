// `kvpipe init-model`: writes a random-weight model to disk.
//
// The weights are a pure function of (shape, seed, std): each tensor is drawn from its own
// name-seeded generator (random_tensor), so the same flags give the same bytes, and a
// `dummy:<preset>` job sees exactly the weights `init-model --preset <preset>` writes. Both
// formats carry the same byte-level BPE tokenizer (engine/text/tokenizer_builder.h) when the
// vocabulary holds at least its 259 base tokens.
#pragma once

#include "engine/model_config.h"

#include <string>

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

}  // namespace kvpipe
