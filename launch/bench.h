// `kvpipe bench`: a synthetic workload through the whole job, measured.
//
// Runs the config's `workload:` (warm-up requests first, not measured) on every rank of the
// job and writes, from rank 0, DIR/report.json (config, world size, build, machine and every
// figure), DIR/requests.csv (one row per measured request), DIR/trace.json (Chrome trace,
// one track per rank) and, with `profile`, DIR/profile_rank0.json (LibTorch's operators on
// rank 0 during the measured phase); a one-screen summary goes to stdout. Outputs always
// have the workload's lengths: EOS is ignored, so output token counts are exact.
#pragma once

#include "parallel/world.h"

#include <string>
#include <vector>

namespace kvpipe {

struct BenchOptions {
  std::string config;
  std::vector<std::string> overrides;
  std::string out_dir;
  bool profile = false;
};

// Throws std::invalid_argument for bad input (config, workload that cannot run, an output
// directory that cannot be written).
void bench(const BenchOptions& options, World& world);

}  // namespace kvpipe
