// `kvpipe slurm`: the sbatch script of a job's `cluster:` section.
//
// Owns the translation of ClusterSection into #SBATCH directives, module loads, exports
// and one launch line that runs `kvpipe generate` with the same config file (by absolute
// path) and --set overrides on nodes * gpus_per_node ranks, through `srun --mpi=pmix` or
// through mpirun with a hostfile built from $SLURM_JOB_NODELIST. Every value that reaches
// the shell is quoted, so the script passes `bash -n` whatever the config holds.
#pragma once

#include "launch/job_config.h"

#include <string>
#include <vector>

namespace kvpipe {

struct SlurmScriptInputs {
  std::string config_path;              // absolute path of the job file
  std::vector<std::string> overrides;   // --set values, passed on to generate
  std::string kvpipe_binary;            // used when cluster.kvpipe is empty
};

// The whole script. Throws std::invalid_argument naming `cluster` when the job has none.
std::string make_slurm_script(const JobConfig& job, const SlurmScriptInputs& inputs);

// `text` as one shell word ('...' with embedded quotes escaped).
std::string shell_quote(const std::string& text);

// The absolute path of the running executable (/proc/self/exe), or "kvpipe" if unknown.
std::string current_executable();

}  // namespace kvpipe
