// Fuzzes the HF config.json reader (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM),
// and the sizes the plan derives from a config it accepted.
#include "engine/model/model_config.h"
#include "tests/fuzz/fuzz_support.h"

#include <cstdint>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpipe;
  const std::string& dir = fuzz::scratch_dir();
  fuzz::write_file(dir + "/config.json", data, size);
  ModelConfig cfg;
  if (!fuzz::accepts([&] { cfg = load_hf_config(dir); })) return 0;
  fuzz::accepts([&] {
    cfg.validate(dir + "/config.json");
    (void)cfg.total_params();
    (void)cfg.layer_params();
    (void)cfg.embedding_params();
    (void)cfg.kv_bytes_per_token_layer(4);
  });
  return 0;
}
