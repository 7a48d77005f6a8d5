#include "launch/device_plan.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace kvpipe {

std::string choose_device(int local_rank, int local_ranks, int visible_gpu_count, bool share_gpu) {
  if (local_rank < 0) throw std::invalid_argument("device: negative local rank");
  if (visible_gpu_count <= 0) return "cpu";
  const int ranks = std::max(local_ranks, local_rank + 1);
  if (ranks > visible_gpu_count && !share_gpu) {
    throw std::invalid_argument(
        "runtime.share_gpu: " + std::to_string(ranks) + " ranks on this node but only " +
        std::to_string(visible_gpu_count) + " visible GPU(s) (CUDA_VISIBLE_DEVICES); rank " +
        std::to_string(local_rank) + " would share cuda:" +
        std::to_string(local_rank % visible_gpu_count) +
        " with another rank (set runtime.share_gpu: true if that is intended)");
  }
  return "cuda:" + std::to_string(local_rank % visible_gpu_count);
}

int count_visible_devices(const char* value) {
  if (!value) return -1;
  std::stringstream in(value);
  int count = 0;
  for (std::string item; std::getline(in, item, ',');) {
    // CUDA stops at the first invalid entry; "-1" hides every device.
    if (item.empty() || item[0] == '-') break;
    ++count;
  }
  return count;
}

namespace {

int positive_env(const char* name) {
  const char* value = std::getenv(name);
  if (!value || !*value) return 0;
  char* end = nullptr;
  const long n = std::strtol(value, &end, 10);
  return *end == '\0' && n > 0 && n < (1L << 24) ? static_cast<int>(n) : 0;
}

}  // namespace

int local_rank_count_from_env() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
    if (const int n = positive_env(name)) return n;
  }
  return 1;
}

int world_size_from_env() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}) {
    if (const int n = positive_env(name)) return n;
  }
  return 0;
}

std::vector<int> cores_for_rank(const std::vector<int>& allowed, int local_rank, int local_ranks,
                                int threads) {
  if (threads < 1 || local_rank < 0 || local_ranks < 1 || local_rank >= local_ranks) return {};
  const size_t need = static_cast<size_t>(local_ranks) * static_cast<size_t>(threads);
  if (allowed.size() < need) return {};
  const auto first = allowed.begin() + static_cast<long>(local_rank) * threads;
  return std::vector<int>(first, first + threads);
}

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

bool pin_to_cores(const std::vector<int>& cores) {
  if (cores.empty()) return false;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (const int cpu : cores) {
    if (cpu < 0 || cpu >= CPU_SETSIZE) return false;
    CPU_SET(cpu, &set);
  }
  return sched_setaffinity(0, sizeof set, &set) == 0;
}

}  // namespace kvpipe
