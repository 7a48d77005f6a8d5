// Two hosts on one machine: two network namespaces joined by a veth pair, each with its own
// hostname, stand for two machines on a network. mpirun starts 4 ranks, 2 in each, over TCP
// alone (no shared memory between them, only the veth subnet for both the MPI traffic and
// Open MPI's own), with parallel.tensor=2: each host holds one pipeline stage of 2 tensor
// ranks, so the all-reduces stay inside a host and the activations cross between hosts.
// Greedy tokens are identical to the one-rank run of the same job, and log-probabilities of
// the whole vocabulary within 1e-4. Each rank reports the namespace it runs in, so a run that
// quietly started every rank on one host fails. The namespaces and the veth are this test's
// own, made and removed by it whatever the outcome; where the machine refuses them (not root,
// no `ip`), the test is skipped with the reason. Speed is printed, never asserted.
#include "tests/support/command.h"
#include "tests/support/job_run.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace kvpipe {
namespace {

namespace fs = std::filesystem;
using kvpipe::testing::CommandResult;

using kvpipe::testing::JobRun;

// The two hosts: a namespace each, one end of the veth each, on a /24 of their own. Removed
// on destruction even when the test fails half-way, and before the next run can trip on them.
class TwoHostNetwork {
 public:
  explicit TwoHostNetwork(const fs::path& dir) : dir_(dir) {
    const std::string id = std::to_string(::getpid());
    // The namespaces keep concurrent runs apart; a subnet per process only tells their logs apart.
    const int subnet = 1 + ::getpid() % 250;
    prefix_ = "10.213." + std::to_string(subnet) + ".";
    names_[0] = "kvpipe" + id + "a";
    names_[1] = "kvpipe" + id + "b";
    veths_[0] = "kvpv" + id + "a";
    veths_[1] = "kvpv" + id + "b";
  }
  TwoHostNetwork(const TwoHostNetwork&) = delete;
  TwoHostNetwork& operator=(const TwoHostNetwork&) = delete;
  ~TwoHostNetwork() { remove(); }

  // Empty when both hosts are up; else the step the machine refused, and why.
  std::string create() {
    if (::geteuid() != 0) return "not root";
    remove();  // a namespace left by a killed run of the same process id
    const std::string a = names_[0], b = names_[1], va = veths_[0], vb = veths_[1];
    for (const std::string& step :
         {"ip netns add " + a, "ip netns add " + b,
          "ip link add " + va + " type veth peer name " + vb, "ip link set " + va + " netns " + a,
          "ip link set " + vb + " netns " + b,
          "ip -n " + a + " addr add " + address(0) + "/24 dev " + va,
          "ip -n " + b + " addr add " + address(1) + "/24 dev " + vb,
          "ip -n " + a + " link set lo up", "ip -n " + b + " link set lo up",
          "ip -n " + a + " link set " + va + " up", "ip -n " + b + " link set " + vb + " up",
          // Each host runs under its own hostname, as real hosts do: Open MPI tells nodes apart
          // by name, and ranks that share one across namespaces disagree on which of them share
          // a node (MPI_Comm_split_type hangs or crashes).
          "ip netns exec " + b + " unshare --uts /bin/sh -c 'hostname " + b + " && hostname'"}) {
      const CommandResult r = kvpipe::testing::run_command("timeout 5 " + step, dir_);
      if (r.code != 0) return "`" + step + "`: " + r.status() + ": " + r.err;
    }
    return "";
  }

  void remove() {
    for (const std::string& ns : names_) {
      // Nothing may outlive the test in its hosts (a rank of a run that timed out, say).
      quiet("for p in $(ip netns pids " + ns + "); do kill -9 $p; done");
      quiet("ip -n " + ns + " link del " + veths_[0]);
      quiet("ip netns del " + ns);
    }
    quiet("ip link del " + veths_[0]);  // still in the root namespace when a move failed
  }

  const std::string& name(int host) const { return names_[host]; }
  const std::string& veth(int host) const { return veths_[host]; }
  std::string address(int host) const { return prefix_ + std::to_string(host + 1); }
  std::string subnet() const { return prefix_ + "0/24"; }

  // As /proc/<pid>/ns/net reads for a process inside the host's namespace.
  std::string net_namespace_id(int host) const {
    struct stat st {};
    if (::stat(("/run/netns/" + names_[host]).c_str(), &st) != 0) return "?";
    return "net:[" + std::to_string(st.st_ino) + "]";
  }

 private:
  static void quiet(const std::string& cmd) {
    const std::string line = "timeout 5 /bin/sh -c '" + cmd + "' >/dev/null 2>&1";
    (void)std::system(line.c_str());
  }

  fs::path dir_;
  std::string prefix_;
  std::string names_[2], veths_[2];
};

std::string read_tokens_per_second(const std::string& err) {
  std::smatch m;
  static const std::regex timing(R"(\(([0-9.]+) tokens/s generated\))");
  return std::regex_search(err, m, timing) ? m[1].str() : "?";
}

void write_executable(const fs::path& path, const std::string& text) {
  std::ofstream(path) << text;
  fs::permissions(path, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                            fs::perms::others_read | fs::perms::others_exec);
}

// Every command of the test gets what is left of its time, at most its own cap: setup, runs
// and cleanup together stay well inside ctest's limit, even when each command hangs.
class Deadline {
 public:
  explicit Deadline(int seconds)
      : end_(std::chrono::steady_clock::now() + std::chrono::seconds(seconds)) {}
  std::string timeout(int cap_seconds) const {
    const double left =
        std::chrono::duration<double>(end_ - std::chrono::steady_clock::now()).count();
    const int seconds = std::max(1, std::min(cap_seconds, static_cast<int>(std::ceil(left))));
    return "timeout -k 5 " + std::to_string(seconds) + " ";
  }

 private:
  std::chrono::steady_clock::time_point end_;
};

struct ScratchDir {
  fs::path path = kvpipe::testing::make_scratch_dir();
  ~ScratchDir() { fs::remove_all(path); }
};

TEST(TwoHosts, TensorRanksInsideEachHostPipelineAcrossMatchOneRank) {
  const Deadline deadline(150);
  const ScratchDir scratch;
  const fs::path& dir = scratch.path;
  TwoHostNetwork network(dir);
  if (const std::string reason = network.create(); !reason.empty())
    GTEST_SKIP() << "network namespaces are refused here: " << reason;

  // std 0.1 keeps greedy choices away from the near-ties of flatter random models.
  CommandResult r = kvpipe::testing::run_command(
      deadline.timeout(30) + KVPIPE_BINARY + " init-model --out " + (dir / "model").string() +
          " --hidden 64 --layers 4 --heads 4 --kv-heads 2 --intermediate 96 --vocab 128"
          " --max-position 256 --std 0.1 --seed 3",
      dir);
  ASSERT_EQ(r.code, 0) << r.err;
  {
    std::ofstream job(dir / "job.yaml");
    job << "model: {path: " << (dir / "model").string() << "}\n"
        << "cache: {block_size: 4, memory: 1MiB}\n"
        << "scheduler: {max_batch: 4, max_tokens_per_step: 24}\n"
        << "sampling: {ignore_eos: true}\n"
        << "requests:\n"
        << "  - {prompt_ids: [1, 5, 9, 33], max_new_tokens: 12}\n"
        << "  - {prompt_ids: [7, 2, 100, 64, 3, 3, 90, 17, 45, 12, 8, 61], max_new_tokens: 10}\n"
        << "  - {prompt_ids: [11], max_new_tokens: 8}\n"
        << "  - {prompt_ids: [40, 41, 42, 43, 44, 45, 46], max_new_tokens: 14, arrival_step: 3}\n";
  }
  const std::string job_args =
      " generate --config " + (dir / "job.yaml").string() + " --logprobs-out ";

  const fs::path one_lp = dir / "logprobs_one.jsonl";
  const JobRun one =
      kvpipe::testing::parse_job_run(kvpipe::testing::run_command(
                    deadline.timeout(30) + KVPIPE_BINARY + job_args + one_lp.string(), dir),
                one_lp);
  ASSERT_EQ(one.result.code, 0) << one.result.err;
  ASSERT_EQ(one.outputs.size(), 4u);

  // Open MPI starts a daemon on every host but its own through this agent, as it would
  // through ssh: argument 1 is the host, the rest a command line for the host's shell (the
  // environment mpirun's own directory implies, then the daemon), quoted for that shell.
  const fs::path agent = dir / "agent.sh", agent_log = dir / "agent.log";
  std::ostringstream agent_script;
  agent_script << "#!/bin/sh\n"
               << "case \"$1\" in\n"
               << "  " << network.address(0) << ") ns=" << network.name(0) << " ;;\n"
               << "  " << network.address(1) << ") ns=" << network.name(1) << " ;;\n"
               << "  *) echo \"agent: no host $1\" >&2; exit 1 ;;\n"
               << "esac\n"
               << "shift\n"
               << "echo \"$ns\" >> " << agent_log.string() << "\n"
               << "exec ip netns exec \"$ns\" unshare --uts /bin/sh -c \"hostname $ns && $*\"\n";
  write_executable(agent, agent_script.str());
  // Every rank reports where it really runs before it becomes kvpipe.
  const fs::path rank_wrapper = dir / "rank.sh", rank_log = dir / "ranks.log";
  std::ostringstream rank_script;
  rank_script << "#!/bin/sh\n"
              << "echo \"$OMPI_COMM_WORLD_RANK $(readlink /proc/self/ns/net) $(hostname)\" >> "
              << rank_log.string() << "\n"
              << "exec \"$@\"\n";
  write_executable(rank_wrapper, rank_script.str());
  std::ofstream(dir / "hostfile") << network.address(0) << " slots=2\n"
                                  << network.address(1) << " slots=2\n";

  // Slots in hostfile order put ranks 0, 1 on host A and 2, 3 on host B. Both hosts share
  // this machine's cores, so no rank is bound to one.
  const fs::path two_lp = dir / "logprobs_two_hosts.jsonl";
  const std::string mpirun = deadline.timeout(90) + "ip netns exec " + network.name(0) +
                             " unshare --uts /bin/sh -c 'hostname " + network.name(0) +
                             " && exec \"$0\" \"$@\"' " + KVPIPE_MPIRUN + " -np 4 --hostfile " +
                             (dir / "hostfile").string() + " --bind-to none --mca plm_rsh_agent " +
                             agent.string() + " --mca btl tcp,self --mca btl_tcp_if_include " +
                             network.subnet() + " --mca oob_tcp_if_include " + network.subnet() +
                             " -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS " +
                             rank_wrapper.string() + " " + KVPIPE_BINARY + job_args +
                             two_lp.string() + " --set parallel.tensor=2";
  std::printf("[ two hosts ] %s\n", mpirun.c_str());
  const JobRun two = kvpipe::testing::parse_job_run(kvpipe::testing::run_command(mpirun, dir), two_lp);
  ASSERT_EQ(two.result.code, 0) << two.result.status() << "\n" << two.result.err;

  const std::string& err = two.result.err;
  EXPECT_NE(err.find("4 rank(s) = 2 stage(s) x 2 tensor ranks"), std::string::npos) << err;
  EXPECT_NE(err.find("rank 3 (stage 1, tensor rank 1"), std::string::npos) << err;

  // The daemon of host B started in B, and each rank ran in the host the grid gives it.
  EXPECT_NE(kvpipe::testing::slurp(agent_log).find(network.name(1)), std::string::npos)
      << "Open MPI launched no daemon on host B";
  std::map<int, std::string> rank_host;
  {
    std::istringstream lines(kvpipe::testing::slurp(rank_log));
    int rank;
    std::string ns, host;
    while (lines >> rank >> ns >> host) {
      rank_host[rank] = host;
      EXPECT_EQ(ns, network.net_namespace_id(rank < 2 ? 0 : 1)) << "rank " << rank;
    }
  }
  EXPECT_EQ(
      rank_host,
      (std::map<int, std::string>{
          {0, network.name(0)}, {1, network.name(0)}, {2, network.name(1)}, {3, network.name(1)}}));

  EXPECT_EQ(two.outputs, one.outputs);
  // The whole vocabulary at every step, gathered from both hosts.
  const double worst = kvpipe::testing::max_logprob_difference(two, one);
  EXPECT_LE(worst, 1e-4);

  const CommandResult veth = kvpipe::testing::run_command(
      "timeout 5 ip netns exec " + network.name(0) + " cat /sys/class/net/" + network.veth(0) +
          "/statistics/tx_bytes /sys/class/net/" + network.veth(0) + "/statistics/rx_bytes",
      dir);
  std::istringstream bytes(veth.out);
  long long tx = 0, rx = 0;
  bytes >> tx >> rx;
  std::printf(
      "[ two hosts ] one rank %s tokens/s, 2 hosts x 2 tensor ranks over TCP %s tokens/s"
      " (%.1f s, %lld + %lld bytes across the veth), max |log-probability difference| %.3g"
      " over %zu steps\n",
      read_tokens_per_second(one.result.err).c_str(), read_tokens_per_second(err).c_str(),
      two.result.seconds, tx, rx, worst, one.logprobs.size());
}

}  // namespace
}  // namespace kvpipe
