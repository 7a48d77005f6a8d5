// `kvpipe bench`: a synthetic workload through the whole job, measured.
//
// Runs the config's `workload:` (warm-up requests first, not measured) on every rank of the
// job and writes, from rank 0, DIR/report.json (config, world size, build, machine and every
// figure), DIR/requests.csv (one row per measured request), DIR/trace.json (Chrome trace,
// one track per rank) and, with `profile`, DIR/profile_rank0.json (LibTorch's operators on
// rank 0 during the measured phase); a one-screen summary goes to stdout. Outputs always
// have the workload's lengths: EOS is ignored, so output token counts are exact.
// With --endpoint the same workload goes to an OpenAI-compatible server instead, and no job
// runs (bench_endpoint.h).
#pragma once

#include "parallel/world.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace kvpipe {

struct BenchOptions {
  std::string config;
  std::vector<std::string> overrides;
  std::string out_dir;
  bool profile = false;
  // --endpoint: send the workload to this OpenAI-compatible server instead (bench_endpoint.h).
  std::string endpoint;
  std::string api_key;
  std::string model;                  // default: the first of the server's /v1/models
  std::vector<std::string> goodput;   // SLOs "ttft:MS", "tpot:MS", "e2el:MS"
};

// Throws std::invalid_argument for bad input (config, workload that cannot run, an output
// directory that cannot be written).
// An --endpoint run is bench_endpoint's (bench_endpoint.h): it starts no job.
void bench(const BenchOptions& options, World& world);

// report.json's "kvpipe" (version, commit, build type, compiler, LibTorch, NCCL, CPU BLAS) and
// "machine" (host, CPU, cores, memory, GPUs) sections.
nlohmann::ordered_json bench_build_json();
nlohmann::ordered_json bench_machine_json();

}  // namespace kvpipe
