// Which device and which CPU cores each rank of a job uses.
//
// Pure functions of the counts they are given (so tests can fake any machine), plus thin
// wrappers that read this process's environment and affinity. Guarantees: rank r on a node
// with GPUs gets `cuda:<local rank mod visible GPUs>` (CUDA_VISIBLE_DEVICES already shapes
// the visible count), and two ranks on one GPU is an error unless the job says it is
// intended (runtime.share_gpu); with runtime.pin_threads, the ranks of one node get
// disjoint core sets taken from the process's allowed CPUs.
#pragma once

#include <string>
#include <vector>

namespace kvpipe {

// "cpu" when no GPU is visible, else "cuda:<index>". Throws std::invalid_argument naming
// runtime.share_gpu when `local_ranks` ranks would share fewer GPUs and that is not intended.
std::string choose_device(int local_rank, int local_ranks, int visible_gpu_count, bool share_gpu);

// Devices listed in a CUDA_VISIBLE_DEVICES value ("0,1,3" -> 3, "" -> 0, unset -> -1: no limit).
int count_visible_devices(const char* cuda_visible_devices);

// The ranks of this node, from the launcher's environment (Open MPI, MPICH/PMI, SLURM), or
// 1 when none says.
int local_rank_count_from_env();

// The world size a launcher announces (OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_NTASKS), or 0.
int world_size_from_env();

// Core set of `local_rank` when every rank of the node takes `threads` cores in turn from
// `allowed` (the process's affinity). Empty when `allowed` has too few cores for all ranks.
std::vector<int> cores_for_rank(const std::vector<int>& allowed, int local_rank, int local_ranks,
                                int threads);

// The CPUs this process may run on (sched_getaffinity), in increasing order.
std::vector<int> allowed_cpus();

// Pins the calling thread (and the threads it starts later) to `cores`; false on failure.
bool pin_to_cores(const std::vector<int>& cores);

}  // namespace kvpipe
