// JobConfig: the YAML job file of `kvpipe generate|validate|bench`, parsed and validated.
//
// Owns the schema of ARCHITECTURE.md section 4. Every problem found in a file or a --set
// override is reported as std::invalid_argument whose one-line message names the file, the
// key path (e.g. `cache.block_size`) and, for a file, its line. Nothing here touches a model
// or a rank: sizes that depend on the device (`auto`, percentages) stay symbolic.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kvpipe {

// A byte budget: a fixed size, one size per rank, or a share of what is left of
// runtime.memory after the rank's weights.
struct MemorySpec {
  enum class Kind { kBytes, kPerRank, kShare };
  Kind kind = Kind::kBytes;
  int64_t bytes = 256LL << 20;      // kBytes
  std::vector<int64_t> per_rank;    // kPerRank
  double share = 0.0;               // kShare, in (0, 1]
};

struct ModelSection {
  std::string path;                 // HF directory, a .gguf file, or `dummy:<preset>`
  std::string dtype = "float32";    // float32 | float16 | bfloat16
};

struct RuntimeSection {
  int threads = 1;
  std::optional<int64_t> memory_bytes;  // nullopt = auto (the device's memory)
};

struct ParallelSection {
  std::vector<int> layers;          // empty = auto
  int micro_batches = 0;            // 0 = auto (number of stages)
  std::string backend = "auto";     // auto | mpi | nccl
};

struct CacheSection {
  int block_size = 16;
  MemorySpec memory;
  bool prefix_reuse = true;
  int cached_layers = -1;           // -1 = all
  int window_sinks = 0;
  int window_recent = 0;            // 0 = no window
};

struct SchedulerSection {
  int max_batch = 32;
  int max_tokens_per_step = 2048;
};

struct SamplingSection {
  double temperature = 0.0;
  int top_k = 0;                    // 0 = off
  double top_p = 1.0;
  uint64_t seed = 0;
  bool ignore_eos = false;
};

struct RequestSpec {
  std::vector<int64_t> prompt_ids;
  int max_new_tokens = 32;
  int arrival_step = 0;             // engine step at which the request arrives
};

struct JobConfig {
  std::string source;               // file name, for messages
  ModelSection model;
  RuntimeSection runtime;
  ParallelSection parallel;
  CacheSection cache;
  SchedulerSection scheduler;
  SamplingSection sampling;
  std::vector<RequestSpec> requests;
};

// Parses "256MiB", "1GiB", "512KiB", "1.5GiB", "100MB" (decimal), "4096" (bytes).
// Throws std::invalid_argument naming `what` on anything else or a negative size.
int64_t parse_size(const std::string& text, const std::string& what);

// Loads a job file and applies `overrides` ("key.path=yaml-value") in order.
JobConfig load_job_config(const std::string& path, const std::vector<std::string>& overrides = {});

// Same, from YAML text (tests); `source` names it in messages.
JobConfig parse_job_config(const std::string& yaml_text, const std::string& source,
                           const std::vector<std::string>& overrides = {});

}  // namespace kvpipe
