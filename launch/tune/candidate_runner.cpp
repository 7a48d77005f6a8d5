#include "launch/tune/candidate_runner.h"

#include "launch/signals.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <spawn.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

extern char** environ;

namespace kvpipe {
namespace {

using Seconds = std::chrono::duration<double>;

// The child's exit code, or 128 + the signal that ended it.
int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// Waits up to `seconds` for `pid`; true once it has exited.
bool wait_for(pid_t pid, double seconds, int* status) {
  const auto until = std::chrono::steady_clock::now() + Seconds(seconds);
  while (true) {
    const pid_t r = waitpid(pid, status, WNOHANG);
    if (r == pid || (r < 0 && errno != EINTR)) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string last_error_line(const std::string& path) {
  std::ifstream in(path);
  std::string line, last, error;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    last = line;
    if (line.find("error") != std::string::npos && error.empty()) error = line;
  }
  return error.empty() ? last : error;
}

double number_at(const nlohmann::json& j, std::initializer_list<const char*> path) {
  const nlohmann::json* node = &j;
  std::string where;
  for (const char* key : path) {
    where += where.empty() ? key : std::string(".") + key;
    if (!node->is_object() || !node->contains(key))
      throw std::invalid_argument("report.json: no " + where);
    node = &(*node)[key];
  }
  if (!node->is_number()) throw std::invalid_argument("report.json: " + where + " is not a number");
  return node->get<double>();
}

}  // namespace

ProcessOutcome run_process(const std::vector<std::string>& argv, const std::string& stdout_path,
                           const std::string& stderr_path, double timeout_s) {
  ProcessOutcome out;
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attr);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, 2, stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  // Its own process group: the deadline stops mpirun and every rank it started at once.
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const auto start = std::chrono::steady_clock::now();
  const int rc = posix_spawnp(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    out.error = "cannot run " + argv[0] + ": " + std::strerror(rc);
    return out;
  }
  out.started = true;
  int status = 0;
  const auto until = start + Seconds(std::max(0.0, timeout_s));
  while (true) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) break;
    if (stop_requested() || std::chrono::steady_clock::now() >= until) {
      out.killed = true;
      kill(-pid, SIGTERM);
      if (!wait_for(pid, 10.0, &status)) {
        kill(-pid, SIGKILL);
        wait_for(pid, 1e9, &status);
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Ranks mpirun left behind in the group go with it.
  kill(-pid, SIGKILL);
  out.exit_code = exit_code_of(status);
  out.wall_s = Seconds(std::chrono::steady_clock::now() - start).count();
  return out;
}

TuneFigures tune_figures_from_report(const nlohmann::json& report) {
  TuneFigures f;
  f.ttft_p99_ms = number_at(report, {"latency_ms", "ttft", "p99"});
  f.e2e_mean_ms = number_at(report, {"latency_ms", "e2e", "mean"});
  f.e2e_p99_ms = number_at(report, {"latency_ms", "e2e", "p99"});
  // A workload of one-token replies has no TPOT samples: 0 then.
  f.tpot_p99_ms = number_at(report, {"latency_ms", "tpot", "count"}) > 0
                      ? number_at(report, {"latency_ms", "tpot", "p99"})
                      : 0.0;
  f.output_tokens_per_s = number_at(report, {"throughput", "output_tokens_per_s"});
  const double tensor = report.contains("tensor_parallel") && report["tensor_parallel"].is_number()
                            ? report["tensor_parallel"].get<double>()
                            : 1.0;
  f.kv_peak_mib = number_at(report, {"kv_cache", "peak_blocks_used"}) *
                  number_at(report, {"kv_cache", "block_size"}) * number_at(report, {"kv_bytes_per_token"}) *
                  tensor / (1024.0 * 1024.0);
  return f;
}

std::vector<std::string> CandidateRunner::overrides(const TuneCandidate& candidate) const {
  std::vector<std::string> sets = o_.overrides;
  for (const auto& [key, value] : candidate.settings) sets.push_back(key + "=" + value);
  const int requests = candidate.phase == "screen" ? o_.screen_requests : o_.full_requests;
  if (requests > 0) sets.push_back("workload.requests=" + std::to_string(requests));
  return sets;
}

std::vector<std::string> CandidateRunner::command(const TuneCandidate& candidate, const std::string& dir) const {
  std::vector<std::string> cmd;
  if (o_.ranks > 1) {
    // --oversubscribe: a tune on a small machine may plan more ranks than it has cores.
    cmd = {o_.mpirun, "--oversubscribe"};
    if (geteuid() == 0) cmd.push_back("--allow-run-as-root");
    cmd.insert(cmd.end(), {"-np", std::to_string(o_.ranks)});
  }
  cmd.insert(cmd.end(), {o_.kvpipe, "bench", "--config", o_.config});
  for (const std::string& s : overrides(candidate)) cmd.insert(cmd.end(), {"--set", s});
  cmd.insert(cmd.end(), {"--out", dir, "--log-level", "warn"});
  return cmd;
}

TuneRunResult CandidateRunner::run(const TuneCandidate& candidate, double deadline_s) {
  TuneRunResult r;
  char name[16];
  std::snprintf(name, sizeof name, "%03d", next_++);
  const std::filesystem::path dir = std::filesystem::path(o_.out_dir) / "runs" / name;
  std::filesystem::create_directories(dir);
  r.dir = (std::filesystem::path("runs") / name).string();
  std::filesystem::remove(dir / "report.json");
  const ProcessOutcome p = run_process(command(candidate, dir.string()), (dir / "stdout.txt").string(),
                                       (dir / "stderr.txt").string(), deadline_s);
  if (!p.started) {
    r.error = p.error;
    return r;
  }
  if (p.killed) {
    r.stopped = stop_requested();
    r.timed_out = !r.stopped;
    r.error = r.stopped ? "stopped by a signal" : "past its deadline";
    return r;
  }
  if (p.exit_code != 0) {
    r.error = "exit " + std::to_string(p.exit_code) + ": " + last_error_line((dir / "stderr.txt").string());
    return r;
  }
  try {
    std::ifstream in(dir / "report.json");
    if (!in) throw std::invalid_argument("no report.json");
    const nlohmann::json report = nlohmann::json::parse(in);
    r.figures = tune_figures_from_report(report);
    r.figures.wall_s = p.wall_s;
    r.ok = true;
  } catch (const std::exception& e) {
    r.error = std::string(e.what()).substr(0, 200);
  }
  return r;
}

}  // namespace kvpipe
