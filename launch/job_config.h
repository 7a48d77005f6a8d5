// JobConfig: the YAML job file of `kvpipe generate|validate|bench`, parsed and validated.
//
// Owns the schema of ARCHITECTURE.md section 4 plus the `workload:` and `cluster:` sections
// (docs/config.md documents every key). Validation does not stop at the first problem: every
// problem found in a file or a --set override is collected, each naming the key path (e.g.
// `cache.block_size`) and, for a file, its line and column. They are thrown together as a
// JobConfigError, a std::invalid_argument whose what() is the first problem on one line.
// Every size the job asks for has an upper bound here (threads, batch, step tokens,
// micro-batches, workload counts), and the job file and a file of lengths must be regular
// files of at most 16 MiB (a FIFO or a device is refused before a byte is read), so nothing
// is started or sized by an absurd value. Nothing here touches a model or a device: sizes
// that depend on the device (`auto`, percentages) stay symbolic; checks that need the rank
// count run in check_job_for_ranks, those that need the model or the machine in plan_job.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
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
  std::string dtype = "auto";       // auto (bfloat16 on a GPU, float32 on the CPU) | float32 | float16 | bfloat16
  bool repack = true;               // CPU: Q4_0/Q8_0/Q4_K/Q6_K projections in groups of 8 rows at load (interleave_weights)
  bool huge_pages = true;           // CPU: the loaded matrices moved onto 2 MiB pages (back_weights_with_huge_pages)
};

struct RuntimeSection {
  std::string device = "auto";          // auto | cpu | cuda
  int threads = 1;
  std::optional<int64_t> memory_bytes;  // nullopt = auto (the device's memory) or a share
  std::optional<double> memory_share;   // `90%`: that share of the device's memory
  bool share_gpu = false;               // two ranks on one GPU is intended
  bool pin_threads = false;             // pin each rank's threads to its own cores
  bool cuda_graphs = false;             // replay decode steps on a GPU from CUDA graphs
};

struct ParallelSection {
  int tensor = 1;                   // tensor ranks per pipeline stage (ranks = stages x tensor)
  std::vector<int> layers;          // empty = auto; one entry per stage
  int micro_batches = 0;            // 0 = auto (number of stages)
  std::string backend = "auto";     // auto | mpi | nccl
  double timeout_s = 300.0;         // silence (s) after which every rank stops; 0 = never
};

struct CacheSection {
  int block_size = 16;
  MemorySpec memory;
  bool prefix_reuse = true;
  std::string dtype = "auto";       // auto (the compute dtype) | float32 | float16 | bfloat16 | q8_0
  int cached_layers = -1;           // -1 = all
  int window_sinks = 0;
  int window_recent = 0;            // 0 = no window
};

struct SchedulerSection {
  int max_batch = 32;
  int max_tokens_per_step = 2048;
  int max_prefill_tokens_per_step = 0;  // 0: no separate limit while requests decode
};

// Speculative decoding: prompt lookup (ngram, engine/speculative/ngram_proposer.h) or a draft
// model with the target's vocabulary on the coordinator's rank (draft, engine/speculative/draft_model.h).
struct SpeculativeSection {
  std::string method = "off";       // off | ngram | draft
  int num_tokens = 4;               // K: draft tokens verified per step at most
  int ngram_min = 1;
  int ngram_max = 4;
  std::string model;                // a draft model (method draft)
  int max_batch = 8;                // no drafts while more sequences than this run
};

struct SamplingSection {
  double temperature = 0.0;
  int top_k = 0;                    // 0 = off
  double top_p = 1.0;
  uint64_t seed = 0;
  bool ignore_eos = false;
  std::vector<std::string> stop;    // the text ends where the first of these begins
  // As OpenAI's and vLLM's request fields of the same names (engine/logits_processor.h).
  double min_p = 0.0;
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  double repetition_penalty = 1.0;
  int min_tokens = 0;
  std::map<int64_t, double> logit_bias;  // token id -> bias in [-100, 100]
  std::vector<std::string> bad_words;
};

struct RequestMessage {
  std::string role;
  std::string content;
};

// A request's prompt is exactly one of: token ids, text (tokenised as `kvpipe tokenize`
// does), or chat messages (rendered through the model's chat template, then tokenised).
struct RequestSpec {
  std::vector<int64_t> prompt_ids;
  std::optional<std::string> prompt;
  std::vector<RequestMessage> messages;
  int max_new_tokens = 32;
  int arrival_step = 0;             // engine step at which the request arrives
};

// A token count per request: fixed (lo == hi), drawn uniformly from [lo, hi], or, when
// `values` is not empty, read from a file (request i takes values[i % size]; lo and hi are
// then their minimum and maximum).
struct LengthRange {
  int lo = 128;
  int hi = 128;
  std::vector<int> values;
  std::string file;                 // where `values` came from
};

// The synthetic load of `kvpipe bench`.
struct WorkloadSection {
  int requests = 64;
  LengthRange prompt_len;
  LengthRange output_len;
  double shared_prefix = 0.0;       // share of each prompt common to all requests, [0, 1)
  int concurrency = 8;              // requests in flight at most
  double rate = 0.0;                // arrivals per second; 0 = all at once
  int warmup = 2;                   // requests run first and not measured
  uint64_t seed = 0;
  // Real conversations instead of random tokens (launch/bench/conversations.h): "random",
  // "sharegpt", or a ShareGPT JSON / conversations JSONL path. The lengths then come from
  // the data, so prompt_len, output_len and shared_prefix may not be given with one.
  std::string dataset = "random";
  std::string mode = "single";      // single | multi_turn (conversations replayed turn by turn)
  double turn_gap = 0.0;            // multi_turn: seconds between a reply and the next turn
  int min_turns = 1;                // multi_turn: conversations with fewer turns are left out
  bool prompt_len_given = false;    // the key was in the file
  bool output_len_given = false;
};

// A batch job: how `kvpipe slurm` writes its sbatch script.
struct ClusterSection {
  bool present = false;             // the file has a `cluster:` section
  int nodes = 1;
  int gpus_per_node = 1;            // ranks per node (one GPU each when `gpus`)
  bool gpus = true;                 // ask SLURM for gpus_per_node GPUs per node
  std::string partition;
  std::string account;
  std::string time;                 // HH:MM:SS or D-HH:MM:SS; empty = the partition's default
  std::string job_name = "kvpipe";
  std::string output = "%x-%j.out";
  std::map<std::string, std::string> env;
  std::vector<std::string> modules;
  std::string launcher = "srun";    // srun | mpirun
  std::string kvpipe;               // the binary; empty = the running executable

  int ranks() const { return nodes * gpus_per_node; }
};

// One problem of a job file: where (`job.yaml:3:5` or `--set cache.memory`), the key path,
// and what is wrong. `line` and `column` are 1-based, 0 when the problem has no position.
struct ConfigProblem {
  std::string where;
  std::string path;
  std::string message;              // the whole one-line message, `where` included
  int line = 0;
  int column = 0;
};

// Every problem of a job; what() is the first problem's message.
class JobConfigError : public std::invalid_argument {
 public:
  explicit JobConfigError(std::vector<ConfigProblem> problems);
  const std::vector<ConfigProblem>& problems() const { return problems_; }

 private:
  std::vector<ConfigProblem> problems_;
};

struct JobConfig {
  std::string source;               // file name, for messages
  ModelSection model;
  RuntimeSection runtime;
  ParallelSection parallel;
  CacheSection cache;
  SchedulerSection scheduler;
  SamplingSection sampling;
  SpeculativeSection speculative;
  std::vector<RequestSpec> requests;
  WorkloadSection workload;
  ClusterSection cluster;
  // Where each key present came from (`job.yaml:3:5` or `--set cache.memory`), by key path,
  // for checks made after parsing (e.g. against the rank count).
  std::map<std::string, std::string> where;
};

// Parses "256MiB", "1GiB", "512KiB", "1.5GiB", "100MB" (decimal), "4096" (bytes).
// Throws std::invalid_argument naming `what` on anything else or a negative size.
int64_t parse_size(const std::string& text, const std::string& what);

// Loads a job file and applies `overrides` ("key.path=yaml-value") in order.
JobConfig load_job_config(const std::string& path, const std::vector<std::string>& overrides = {});

// The job file's YAML with `overrides` applied, as one document (comments are not kept);
// std::invalid_argument as load_job_config for a job that is not valid.
std::string job_yaml_with_overrides(const std::string& path, const std::vector<std::string>& overrides);

// Same, from YAML text (tests); `source` names it in messages.
JobConfig parse_job_config(const std::string& yaml_text, const std::string& source,
                           const std::vector<std::string>& overrides = {});

// Every problem of a job file and its overrides, in file order (those of --set last); empty
// when it is valid. With `ranks` > 0 (else with the cluster section's rank count, when there
// is one) the checks of check_job_for_ranks are included.
std::vector<ConfigProblem> validate_job_config_text(const std::string& yaml_text,
                                                    const std::string& source,
                                                    const std::vector<std::string>& overrides = {},
                                                    int ranks = 0);
std::vector<ConfigProblem> validate_job_config_file(const std::string& path,
                                                    const std::vector<std::string>& overrides = {},
                                                    int ranks = 0);

// Problems that appear once the number of ranks is known: a cache.memory list or a pinned
// parallel.layers split of another length, a cluster section planning another rank count.
std::vector<ConfigProblem> check_job_for_ranks(const JobConfig& job, int ranks);

// Throws a JobConfigError when `problems` is not empty.
void throw_if_problems(const std::vector<ConfigProblem>& problems);

// A SLURM time limit as the schema takes it: HH:MM:SS or D-HH:MM:SS (minutes and seconds
// below 60, hours below 24 after a day count).
bool is_valid_slurm_time(const std::string& text);

}  // namespace kvpipe
